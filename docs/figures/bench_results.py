"""The benchmarks page's figures, drawn from the stored run when the site is built.

Each function draws one figure with the package's own plots
(:mod:`offload_examples.instruments.plots`), for the two models the page shows: A-torch (PyTorch's
layers) and A (Transformer Engine's layers of the same shapes). ``docs/benchmarks.md`` calls them
by name (``.. plot:: docs/figures/bench_results.py saving``).
"""

from __future__ import annotations

import json
from pathlib import Path

from offload_examples.instruments import plots

#: The stored run (the plot directive runs this file from its own folder).
RESULTS = json.loads((Path("..") / "evidence" / "h200-bench" / "bench.json").read_text())
MODELS = ("A-torch", "A")


def saving() -> None:
    """What each strategy frees, as a share of what the engine's schedule predicts."""
    plots.plot_bench_saving(RESULTS, MODELS, ("engine", "transformer_engine", "checkpoint", "torchtune"))


def cost() -> None:
    """What offloading costs, against the copy bound of the engine's schedule."""
    plots.plot_bench_overhead(RESULTS, MODELS, ("engine",))


def recompute() -> None:
    """Memory freed against time added: offloading and recomputing the same layers."""
    plots.plot_bench_memory_time(RESULTS, MODELS, ("engine", "checkpoint"))


def tools() -> None:
    """Time added by each offload."""
    plots.plot_bench_overhead(RESULTS, MODELS, ("engine", "transformer_engine", "torchtune", "save_on_cpu"),
                              bound=False)
