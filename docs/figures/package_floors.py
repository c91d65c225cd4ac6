"""The package's four floors and the modules on each, drawn from the files when the site is built.

Each module is a box as wide as it is long (its lines); a subpackage's modules sit together in a
frame named after it. A floor imports only from the floors below it (``tests/test_layout.py``).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

import offload_examples

PACKAGE = Path(offload_examples.__file__).parent
#: Top to bottom, with what each floor holds.
FLOORS = [
    ("scenarios", "the loops to copy,\nrun and measured"),
    ("instruments", "measuring, reports,\nplots, the benchmark"),
    ("features", "built on the engine"),
    ("core", "the engine:\nthe life of a tensor"),
]
#: Drawn in bold: where the life of a tensor is told (the engine, and its entries and steps).
TOLD = {("core", "engine"), ("core", "entries")}
COLOURS = {"scenarios": "#dbe8f6", "instruments": "#e3f0dc", "features": "#fbe7d9", "core": "#ececec"}
WIDTH = 100.0  # the width the boxes of a floor fill, row by row
LINES_PER_UNIT = 16.0
MIN_BOX = 3.4
GAP = 0.45
BOX = 1.0  # a box's height
FRAME = 0.5  # what a subpackage's frame adds above its boxes, for its name
SPACE = 0.3  # between rows


def _box(lines: int) -> float:
    return max(lines / LINES_PER_UNIT, MIN_BOX)


def _items(floor: str) -> list[tuple[str, list[tuple[str, int]]]]:
    """The floor's modules, ``("", [(name, lines)])`` each, then each subpackage, ``(folder, modules)``;
    packages' faces (``__init__.py``) left out."""
    root = PACKAGE / floor
    lines = {p.relative_to(root): len(p.read_text().splitlines()) for p in root.rglob("*.py") if p.name != "__init__.py"}
    alone = [("", [(p.stem, n)]) for p, n in sorted(lines.items()) if len(p.parts) == 1]
    folders = sorted({p.parts[0] for p in lines if len(p.parts) > 1})
    return alone + [(f, [(p.stem, n) for p, n in sorted(lines.items()) if p.parts[0] == f]) for f in folders]


def _layout(items):
    """``(row heights, placed)``: each item's left edge and row, filling the width left to right; a row
    holding a subpackage is taller by its frame's name."""
    placed, x, row = [], 0.0, 0
    for folder, modules in items:
        width = sum(_box(n) for _, n in modules) + GAP * (len(modules) - 1) + (0.6 if folder else 0)
        if x + width > WIDTH and x > 0:
            row, x = row + 1, 0.0
        placed.append((folder, modules, x, row, width))
        x += width + GAP * 2
    framed = {row for folder, _, _, row, _ in placed if folder}
    return [BOX + SPACE + (FRAME if r in framed else 0) for r in range(row + 1)], placed


def draw() -> plt.Figure:
    laid = [(floor, says, *_layout(_items(floor))) for floor, says in FLOORS]
    heights = [max(sum(rows) + 0.45, 2.3) for _, _, rows, _ in laid]
    total = sum(heights) + 0.5 * (len(laid) - 1)
    fig, ax = plt.subplots(figsize=(12, 0.5 * total + 0.4))
    top = total
    for (floor, says, rows, placed), height in zip(laid, heights):
        bottom = top - height
        ax.add_patch(Rectangle((-17, bottom), WIDTH + 18, height, color=COLOURS[floor], zorder=0, linewidth=0))
        ax.text(-16.3, top - 0.35, f"{floor}/", fontsize=12, weight="bold", va="top")
        ax.text(-16.3, top - 1.05, says, fontsize=8, va="top", linespacing=1.3)
        for folder, modules, x, row, width in placed:
            y = top - 0.2 - sum(rows[:row + 1]) + SPACE
            if folder:  # the subpackage's frame, its name on top
                ax.add_patch(Rectangle((x, y - 0.12), width, BOX + FRAME + 0.05, facecolor="none",
                                       edgecolor="#555555", linewidth=0.9, linestyle=(0, (3, 2))))
                ax.text(x + 0.3, y + BOX + FRAME - 0.12, f"{folder}/", fontsize=7.5, weight="bold", va="top")
                x += 0.3
            for name, lines in modules:
                w = _box(lines)
                told = (floor, name) in TOLD
                ax.add_patch(Rectangle((x, y), w, BOX, facecolor="white", edgecolor="#333333",
                                       linewidth=1.8 if told else 0.7))
                ax.text(x + w / 2, y + BOX / 2, f"{name}\n{lines}", ha="center", va="center", linespacing=1.15,
                        fontsize=min(6.2, max(4.4, 10.5 * w / len(name))), weight="bold" if told else "normal")
                x += w + GAP
        top = bottom - 0.5
        if top > 0:  # the next floor down: what this one may import
            ax.add_patch(FancyArrowPatch((-8, bottom + 0.3), (-8, top - 0.3), arrowstyle="-|>",
                                         mutation_scale=14, color="#333333", linewidth=1.4, zorder=3))
    ax.text(WIDTH + 1, -0.12, "a box per module, as wide as its lines; bold: the life of a tensor; a dashed frame: a "
            "subpackage; an arrow: the floor below, which the floor above may import", fontsize=7.5, ha="right",
            va="top")
    ax.set_xlim(-17.5, WIDTH + 1.5)
    ax.set_ylim(-0.7, total + 0.1)
    ax.axis("off")
    fig.subplots_adjust(0.005, 0.005, 0.995, 0.995)
    return fig


draw()
