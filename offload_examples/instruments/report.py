"""Turn scenario results into a readable table or a JSON file."""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

import torch

__all__ = [
    "CPU_TIMING_NOTE", "ProgressBar", "cpu_timing_note", "format_bytes", "format_markdown_table", "format_table",
    "report_header", "write_json",
]


def report_header(scenario: str, device: torch.device, config: Any) -> dict[str, Any]:
    """The first entries of every scenario's report: what ran, where, with which torch and sizes
    (``config``, the scenario's sizes: a dataclass)."""
    return {
        "scenario": scenario,
        "device_type": device.type,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "config": dataclasses.asdict(config),
    }

#: The line a report run on a CPU adds under its step times.
CPU_TIMING_NOTE = ("(CPU run: the step times only show that the code runs; they measure nothing about "
                   "offloading, which frees GPU memory and hides its copies behind GPU compute)")


def cpu_timing_note(report: dict[str, Any]) -> list[str]:
    """``[CPU_TIMING_NOTE]`` for a report whose ``device_type`` is ``"cpu"``, else ``[]``."""
    return [CPU_TIMING_NOTE] if report.get("device_type") == "cpu" else []


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
    """Write ``data`` as indented JSON, creating parent folders; a failure part-way leaves the old file."""
    from offload_examples.instruments.cli import write_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def format_markdown_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A GitHub/MyST Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


class ProgressBar:
    """A one-line progress bar with an estimate of the time left (one line per update off a terminal).

    Parameters
    ----------
    total:
        How many units of work there are.
    stream:
        Where to write; standard error by default, so piped results stay clean.
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24):
        self.total, self.done, self.width = max(total, 1), 0, width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.began = time.perf_counter()

    def show(self, label: str) -> None:
        """Show ``label`` as the work now running."""
        elapsed = time.perf_counter() - self.began
        left = f", ~{_duration(elapsed / self.done * (self.total - self.done))} left" if self.done else ""
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {self.done}/{self.total} {label} ({_duration(elapsed)}{left})"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def advance(self) -> None:
        self.done += 1

    def close(self) -> None:
        self.show("done")
        if self.tty:
            self.stream.write("\n")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 60 else f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
