"""What a run leaves in its folder: ``bench.json``, ``bench.md`` and the plots."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from offload_examples.instruments.bench.tables import markdown
from offload_examples.instruments.cli import json_text, write_atomic
from offload_examples.instruments.memory_history import MemoryCurve
from offload_examples.instruments.timeline import Span

__all__ = ["PLOTS_MISSING", "write_outputs"]


#: The error when the plots extra (matplotlib) is missing.
PLOTS_MISSING = "install offload_examples[plots] (matplotlib) to draw the benchmark's plots, or pass --no-plots"


def write_outputs(results: dict[str, Any], out: str | Path, plots: bool = True) -> list[Path]:
    """Write ``bench.json``, ``bench.md`` and (with ``plots``) the plots into ``out``; returns the paths.

    The plots need matplotlib (the ``plots`` extra); without it an ``ImportError`` says so.
    """
    if plots and importlib.util.find_spec("matplotlib") is None:
        raise ImportError(PLOTS_MISSING)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [write_atomic(out / "bench.json", json_text(results)),
             write_atomic(out / "bench.md", markdown(results))]
    if plots:
        paths += _write_plots(results, out)
    return paths


def _write_plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from offload_examples.instruments.plots import (
        plot_bench_memory_time, plot_bench_overhead, plot_bench_pareto, plot_bench_saving, plot_memory_curves,
        plot_timeline,
    )

    paths = []
    figures: dict[str, Any] = {"memory_vs_time.png": plot_bench_memory_time(results),
                               "overhead_vs_k.png": plot_bench_overhead(results),
                               "saving_vs_k.png": plot_bench_saving(results)}
    if any(r["strategy"] == "planner" for m in results["models"] for r in m["runs"]):
        figures["planner_pareto.png"] = plot_bench_pareto(results)
    first = results["models"][0]
    for label, spans in first.get("timelines", {}).items():
        if label != "no offload":
            ax = plot_timeline([Span(**s) for s in spans], title=f"model {first['model']}, one step, {label}")
            figures[f"timeline_{label.replace(' ', '_').replace('=', '')}.png"] = ax.figure
    curves = {label: MemoryCurve(c["ms"], c["allocated"]) for label, c in first.get("memory_curves", {}).items()}
    if any(c.ms for c in curves.values()):
        figures["memory_over_step.png"] = plot_memory_curves(
            curves, title=f"model {first['model']}: memory over one step").figure
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths
