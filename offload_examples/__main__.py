"""``python -m offload_examples <scenario> [options]``: run a scenario and print its report."""

from __future__ import annotations

import importlib
import sys

from offload_examples.models import import_transformer_engine
from offload_examples.scenarios import SCENARIOS


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SCENARIOS:
        names = ", ".join(SCENARIOS)
        print(f"usage: python -m offload_examples {{{names}}} [options]   (--help after a name for its options)")
        if argv and argv[0] not in ("-h", "--help"):
            sys.exit(f"unknown scenario {argv[0]!r}; choose from: {names}")
        return
    import_transformer_engine()  # when installed: before the scenario starts CUDA
    importlib.import_module(SCENARIOS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
