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


def speeds() -> None:
    """Tokens per second against the sequence length, each strategy's line ending at its longest."""
    _, ax = plt.subplots(figsize=(plots.COLUMN_INCHES, 3.6))
    plots.plot_longest_sequence(RESULTS, ax=ax)
    ax.set_title("")
    for text in [ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels(),
                 *ax.get_legend().get_texts()]:
        text.set_fontsize(plots.BENCH_FONT)
    ax.figure.tight_layout()
