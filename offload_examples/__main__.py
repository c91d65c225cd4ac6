"""``python -m offload_examples <scenario> [options]``: run a scenario and print its report."""

from __future__ import annotations

import importlib
import sys

from offload_examples.cli import one_line
from offload_examples.models import import_transformer_engine
from offload_examples.scenarios import SCENARIOS


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    names = ", ".join(SCENARIOS)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m offload_examples {{{names}}} [options]   (--help after a name for its options)")
        return
    if argv[0] not in SCENARIOS:
        print(f"offload_examples: error: {one_line(f'unknown scenario {argv[0]!r}')}; choose from: {names}",
              file=sys.stderr)
        sys.exit(2)
    import_transformer_engine()  # when installed: before the scenario starts CUDA
    importlib.import_module(SCENARIOS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
