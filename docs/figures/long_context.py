"""The long-context page's figure, drawn from the stored run when the site is built.

``docs/long_context.md`` calls it by name (``.. plot:: docs/figures/long_context.py speeds``).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt

from offload_examples.instruments import plots

#: The stored search (the plot directive runs this file from its own folder).
RESULTS = json.loads((Path("..") / "evidence" / "h200-long-context" / "long_context.json").read_text())


#: The searches on the whole GPU: every strategy's, the planner's in three (uncapped, and capped at the
#: lengths around its longest).
WHOLE_GPU = [json.loads((Path("..") / "evidence" / "h200-long-context-full" / name).read_text())
             for name in ("checkpoint_no_offload.json", "engine_checkpoint_offload.json", "planner_search.json",
                          "planner_405504.json", "planner_409600.json")]


def whole_gpu() -> None:
    """Peak GPU memory against the length on the whole GPU: each step that ran, its prediction, the failures."""
    strategies: dict = {}
    for each in WHOLE_GPU:  # one strategy's steps from every search that ran it
        for name, r in each["strategies"].items():
            strategies.setdefault(name, {"probes": []})["probes"].extend(r["probes"])
    report = {"memory_limit_bytes": WHOLE_GPU[-1]["memory_limit_bytes"], "strategies": strategies}
    _, ax = plt.subplots(figsize=(plots.COLUMN_INCHES, 3.6))
    plots.plot_peaks_by_length(report, ax=ax)
    _small_text(ax)


def _small_text(ax) -> None:
    ax.set_title("")
    for text in [ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels(),
                 *ax.get_legend().get_texts()]:
        text.set_fontsize(plots.BENCH_FONT)
    ax.figure.tight_layout()


def speeds() -> None:
    """Tokens per second against the sequence length, each strategy's line ending at its longest."""
    _, ax = plt.subplots(figsize=(plots.COLUMN_INCHES, 3.6))
    plots.plot_longest_sequence(RESULTS, ax=ax)
    _small_text(ax)
