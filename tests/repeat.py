"""Run a pytest selection several times in one process: ``python tests/repeat.py N [pytest args]``.

``make test-gpu REPEAT=3`` uses it. A leak, a pinned block never returned, a stream left waiting
or a CUDA context poisoned by one test shows up only when the same process runs the tests again,
so the GPU suite is run this way on the GPU node. Exits non-zero when any run fails.

Transformer Engine, when installed, is imported before CUDA starts (as the package does).
"""

from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: python tests/repeat.py N [pytest args]  (N >= 1 runs in one process)", file=sys.stderr)
        return 2
    n, args = int(argv[0]), argv[1:]
    from offload_examples.instruments.models import has_transformer_engine, import_transformer_engine

    if has_transformer_engine():
        import_transformer_engine()
    import pytest

    codes = []
    for i in range(n):
        start = time.monotonic()
        codes.append(int(pytest.main(["-p", "no:cacheprovider", *args])))
        print(f"=== run {i + 1} of {n}: exit {codes[-1]} in {time.monotonic() - start:.0f} s", flush=True)
    print(f"exit codes of the {n} runs: {codes}", flush=True)
    return max(codes)


# The guard matters: ranks started with the "spawn" method import this file again as their main
# module; without it every rank would run the whole suite once more (and the test waiting for it hangs).
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
