"""What ran when on the GPU during one step: compute and copies, from a ``torch.profiler`` trace.

There is no Nsight Systems on every GPU machine, but the CUDA profiler that PyTorch ships
(CUPTI, through Kineto) records every kernel and every copy with its start and end. This module
runs a function under it, reads the trace, and sorts the activity into three lanes: compute
(kernels), device-to-host copies and host-to-device copies. Overlap is then a plain interval
computation, and :func:`offload_examples.plots.plot_timeline` draws it.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["LANES", "Span", "overlap_ms", "record_timeline", "spans_from_trace"]

#: The lanes, in drawing order.
LANES = ("compute", "device-to-host", "host-to-device")


@dataclass(frozen=True)
class Span:
    """One kernel or copy: its lane, start and end in ms from the first GPU activity, and name."""

    lane: str
    start: float
    end: float
    name: str = ""


def _lane(event: dict) -> str | None:
    cat, name = event.get("cat", ""), event.get("name", "")
    if cat == "kernel":
        return "compute"
    if cat == "gpu_memcpy":
        if "DtoH" in name:
            return "device-to-host"
        if "HtoD" in name:
            return "host-to-device"
    return None  # memsets, device-to-device copies, CPU-side events


def spans_from_trace(trace: dict) -> list[Span]:
    """GPU spans of a Chrome trace written by ``torch.profiler`` (``export_chrome_trace``)."""
    raw = [(lane, e["ts"], e["ts"] + e.get("dur", 0), e.get("name", ""))
           for e in trace.get("traceEvents", []) if (lane := _lane(e)) is not None]
    if not raw:
        return []
    t0 = min(start for _, start, _, _ in raw)
    return sorted((Span(lane, (s - t0) / 1e3, (e - t0) / 1e3, n) for lane, s, e, n in raw), key=lambda s: s.start)


def record_timeline(fn: Callable[[], object]) -> list[Span]:
    """Run ``fn`` once under the CUDA profiler and return its GPU spans (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")  # one cycle is all we read
        # GPU activity only: recording CPU ops slows the host enough to starve the GPU of work
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return spans_from_trace(json.load(f))
    finally:
        os.unlink(path)


def _merge(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def overlap_ms(spans: Sequence[Span], lane: str, other: str = "compute") -> tuple[float, float]:
    """``(busy, overlapped)``: ms during which ``lane`` was busy, and how much of it ``other`` was too."""
    a = _merge([(s.start, s.end) for s in spans if s.lane == lane])
    b = _merge([(s.start, s.end) for s in spans if s.lane == other])
    busy = sum(e - s for s, e in a)
    both, j = 0.0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            both += min(e, b[k][1]) - max(s, b[k][0])
            k += 1
    return busy, both
