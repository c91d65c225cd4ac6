"""What ran when during one step: compute and copies, per layer, on their streams.

Two recorders, one kind of result (a list of :class:`Span`):

- :func:`record_layer_timeline` asks the engine to put timing marks on its own streams: at the
  start of every layer's forward and backward on the compute stream (before and after the
  schedule's waits, so a stall shows as its own span), and around every copy on the
  device-to-host and host-to-device streams. Each span knows its layer. On the GPU the marks are
  CUDA events; on the CPU, where copies are synchronous, they are readings of the host clock, so
  the same code runs and can be tested anywhere.
- :func:`record_timeline` runs a function under the CUDA profiler that PyTorch ships (CUPTI,
  through Kineto) and sorts every kernel and copy into the same three lanes, for any code, with
  or without the engine. There is no Nsight Systems on every GPU machine; this needs none.

Overlap is then a plain interval computation (:func:`overlap_ms`), and
:func:`offload_examples.instruments.plots.plot_timeline` draws either kind.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence, Union

import torch

if TYPE_CHECKING:
    from ..core.engine import OffloadEngine

__all__ = [
    "LANES", "Span", "StepRecorder", "achieved_gb_per_s", "overlap_ms", "per_layer_ms", "record_layer_timeline",
    "record_timeline", "spans_from_trace",
]

#: The lanes, in drawing order.
LANES = ("compute", "device-to-host", "host-to-device")


@dataclass(frozen=True)
class Span:
    """One stretch of work on one lane, in ms from the start of the recording.

    Attributes
    ----------
    lane:
        One of :data:`LANES`.
    start:
        Milliseconds from the first recorded activity to the start of the work.
    end:
        Milliseconds from the first recorded activity to the end of the work.
    name:
        The kernel or copy (profiler), or ``"F3"``/``"B3"`` for a layer's forward/backward and
        ``"wait"`` for the time the compute stream waited for copies before a phase
        (:func:`record_layer_timeline`).
    layer:
        The layer the work belongs to, when known.
    nbytes:
        Bytes moved, for copies recorded by :func:`record_layer_timeline`.
    """

    lane: str
    start: float
    end: float
    name: str = ""
    layer: int | None = None
    nbytes: int = 0


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


# ---------------------------------------------------------------------- marks on the engine's streams
Mark = Union[torch.cuda.Event, float]


class StepRecorder:
    """Timing marks that :class:`~offload_examples.core.engine.OffloadEngine` puts on its streams.

    The engine calls :meth:`mark` and the two ``add_*`` methods while :attr:`OffloadEngine.recorder`
    is set; :func:`record_layer_timeline` sets it for one step and turns the marks into spans.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self._phases: list[tuple[str, int, Mark, Mark]] = []
        self._copies: list[tuple[str, int, Mark, Mark, int]] = []
        self.origin = self.mark(torch.cuda.current_stream(device) if self.cuda else None)

    def mark(self, stream: torch.cuda.Stream | None) -> Mark:
        """A timestamp of the point ``stream`` has reached (the host clock on the CPU)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def add_phase(self, phase: str, layer: int, ready: Mark, start: Mark) -> None:
        """A layer's forward or backward: ``ready`` before the schedule's waits, ``start`` after."""
        self._phases.append((phase, layer, ready, start))

    def add_copy(self, lane: str, layer: int, start: Mark, end: Mark, nbytes: int) -> None:
        self._copies.append((lane, layer, start, end, nbytes))

    def _ms(self, mark: Mark) -> float:
        if self.cuda:
            return self.origin.elapsed_time(mark)
        return (mark - self.origin) * 1e3

    def spans(self, end: Mark) -> list[Span]:
        """Compute, stall and copy spans; ``end`` marks the end of the step on the compute stream."""
        if self.cuda:
            end.synchronize()
        out: list[Span] = []
        phases = sorted(((self._ms(r), self._ms(s), p, j) for p, j, r, s in self._phases))
        ends = [ready for ready, *_ in phases[1:]] + [self._ms(end)]
        for (ready, start, phase, j), stop in zip(phases, ends):
            if start > ready:
                out.append(Span("compute", ready, start, "wait", j))
            out.append(Span("compute", start, max(start, stop), f"{phase[0].upper()}{j}", j))
        for lane, j, a, b, nbytes in self._copies:
            out.append(Span(lane, self._ms(a), self._ms(b), f"layer {j}", j, nbytes))
        return sorted(out, key=lambda s: (s.start, s.lane))


def record_layer_timeline(fn: Callable[[], object], engine: OffloadEngine) -> list[Span]:
    """Run ``fn`` (one training step through ``engine``) and return its per-layer spans.

    Forward and backward spans come from marks on the compute stream at the start of each
    layer's phase; the time the compute stream spent waiting for copies before a phase (a
    release in the forward) is a separate ``"wait"`` span; every device-to-host and
    host-to-device copy is a span of its own with its layer and size. For a run without
    offloading, give an engine with ``num_layers=0``: the same hooks, no copies.
    """
    recorder = StepRecorder(engine.device)
    engine.recorder = recorder
    try:
        fn()
        end = recorder.mark(torch.cuda.current_stream(engine.device) if recorder.cuda else None)
    finally:
        engine.recorder = None
    return recorder.spans(end)


def achieved_gb_per_s(spans: Sequence[Span], lane: str) -> float | None:
    """Bytes moved on ``lane`` divided by the time that lane was busy (GB/s), or ``None``."""
    busy = sum(e - s for s, e in _merge([(s.start, s.end) for s in spans if s.lane == lane]))
    nbytes = sum(s.nbytes for s in spans if s.lane == lane)
    return nbytes / busy / 1e6 if busy > 0 and nbytes else None


def per_layer_ms(spans: Sequence[Span], n: int) -> tuple[list[float], list[float]]:
    """Each of ``n`` layers' forward and backward ms on the compute stream, from :func:`record_layer_timeline`."""
    fwd, bwd = [0.0] * n, [0.0] * n
    for s in spans:
        if s.lane == "compute" and s.name[:1] in "FB" and s.layer is not None:
            (fwd if s.name[0] == "F" else bwd)[s.layer] += s.end - s.start
    return fwd, bwd
