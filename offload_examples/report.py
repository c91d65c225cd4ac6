"""Turn scenario results into a readable table or a JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

__all__ = ["format_bytes", "format_table", "write_json"]


def format_bytes(n: int | float | None) -> str:
    """``1.23 GiB`` style, or ``n/a`` for ``None``."""
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_table(rows: Sequence[Sequence[Any]], header: Sequence[str] | None = None) -> str:
    """Left-aligned plain-text table (readable in a terminal, a log and a notebook)."""
    cells = [[str(c) for c in r] for r in ([header] if header else []) + list(rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    if header:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as indented JSON, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path
