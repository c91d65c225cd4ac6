"""``python -m offload_examples <scenario> [options]``: run a scenario and print its report;
``python -m offload_examples bench [options]``: run the benchmark."""

from __future__ import annotations

import importlib
import sys

from offload_examples.instruments.cli import one_line
from offload_examples.instruments.models import import_transformer_engine
from offload_examples.scenarios import SCENARIOS

#: Commands other than the scenarios: name -> module whose ``main(argv)`` runs it.
COMMANDS = {**SCENARIOS, "bench": "offload_examples.instruments.bench"}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    names = ", ".join(SCENARIOS)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m offload_examples {{{names}}} [options]   (--help after a name for its options)")
        print("       python -m offload_examples bench [options]   (every offloading strategy side by side)")
        return
    if argv[0] not in COMMANDS:
        print(f"offload_examples: error: {one_line(f'unknown scenario {argv[0]!r}')}; choose from: {names}, bench",
              file=sys.stderr)
        sys.exit(2)
    import_transformer_engine()  # when installed: before the scenario starts CUDA
    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
