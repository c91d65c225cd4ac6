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

:func:`stream_spans_from_trace` keeps every CUDA stream of a profiler trace as a lane of its own
and names what it is for (compute, FSDP's all-gather and reduce-scatter, the engine's two copy
directions); :func:`prefetch_summary` measures from those lanes how long compute waited for
FSDP's all-gathers.

Overlap is then a plain interval computation (:func:`overlap_ms`), and
:func:`offload_examples.instruments.plots.plot_timeline` draws either kind.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence, Union

import torch

if TYPE_CHECKING:
    from ..core.engine import OffloadEngine

__all__ = [
    "LANES", "STREAM_ROLES", "Span", "StepRecorder", "StreamLane", "achieved_gb_per_s", "overlap_ms", "per_layer_ms",
    "prefetch_summary", "record_layer_timeline", "record_timeline", "spans_from_trace", "stream_spans_from_trace",
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
    host-to-device copy is a span of its own with its layer and size (the copies a layer queues
    together at the end of its forward make one span, of their total size). For a run without
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


# ---------------------------------------------------------------------- one lane per CUDA stream
#: What a CUDA stream is used for, in drawing order (:func:`stream_spans_from_trace`).
STREAM_ROLES = ("compute", "fsdp all-gather", "fsdp reduce-scatter", "all-reduce", "engine device-to-host",
                "engine host-to-device", "other")


@dataclass(frozen=True)
class StreamLane:
    """Everything one CUDA stream ran during a profiled step.

    Attributes
    ----------
    stream:
        The stream's id in the trace (CUPTI's, the ``args.stream`` of each event).
    role:
        One of :data:`STREAM_ROLES`, inferred by :func:`stream_spans_from_trace`.
    spans:
        Its kernels and copies, in ms from the first GPU activity of the trace; each span's
        ``lane`` is the role, so :func:`overlap_ms` works on the spans of several lanes together.
    """

    stream: int
    role: str
    spans: tuple[Span, ...]

    @property
    def label(self) -> str:
        return f"stream {self.stream}: {self.role}"


def _gpu_event(event: dict) -> str | None:
    """``"kernel"``, ``"DtoH"``, ``"HtoD"`` or ``"DtoD"`` for GPU work; ``None`` for the rest (memsets, CPU)."""
    cat, name = event.get("cat", ""), event.get("name", "")
    if cat == "kernel":
        return "kernel"
    if cat == "gpu_memcpy":
        return next((d for d in ("DtoH", "HtoD", "DtoD") if d in name), None)
    return None


def _collective(name: str) -> str | None:
    squashed = name.lower().replace("_", "")
    if "nccl" not in squashed:
        return None
    for key, role in (("allgather", "fsdp all-gather"), ("reducescatter", "fsdp reduce-scatter"),
                      ("allreduce", "all-reduce")):
        if key in squashed:
            return role
    return "other"


def _infer_roles(work: dict[int, list[tuple[str, float, float, str]]], fsdp: bool = True) -> dict[int, str]:
    """Each stream's role from its events, ``(kind, start, end, name)``; see :func:`stream_spans_from_trace`."""
    roles: dict[int, str] = {}
    for sid, events in work.items():
        named = {r for kind, *_, name in events if kind == "kernel" and (r := _collective(name))}
        if named:  # NCCL names its kernels: AllGather, ReduceScatter, AllReduce
            roles[sid] = min(named, key=STREAM_ROLES.index)
    plain = {sid: sum(e - s for kind, s, e, name in events if kind == "kernel" and not _collective(name))
             for sid, events in work.items() if sid not in roles}
    compute = max(plain, key=plain.__getitem__, default=None)
    if compute is None or plain[compute] == 0:
        return {**roles, **{sid: "other" for sid in work if sid not in roles}}
    roles[compute] = "compute"
    first_compute = min(s for kind, s, _, name in work[compute] if kind == "kernel" and not _collective(name))
    for sid, events in work.items():
        if sid in roles:
            continue
        kinds = {kind for kind, *_ in events}
        if kinds == {"DtoH"}:  # the engine's streams run copies and nothing else
            roles[sid] = "engine device-to-host"
        elif kinds == {"HtoD"}:
            roles[sid] = "engine host-to-device"
        elif not fsdp:
            roles[sid] = "other"
        else:
            # FSDP's own streams without a collective kernel (one rank: NCCL launches none for an
            # in-place all-gather, and FSDP copies the gradient instead of reduce-scattering it).
            # The all-gather copy-in of the first layer is the first GPU work of a step, before any
            # compute kernel; the reduce-scatter stream starts only once backward has begun.
            start = min(s for _, s, _, _ in events)
            roles[sid] = "fsdp all-gather" if start < first_compute else "fsdp reduce-scatter"
    return roles


def stream_spans_from_trace(trace: dict, fsdp: bool = True) -> list[StreamLane]:
    """One lane per CUDA stream of a ``torch.profiler`` Chrome trace, each with its inferred role.

    The roles, for a step of FSDP2 or DDP with the offload engine:

    - a stream that ran NCCL kernels is named after them (``AllGather``: ``fsdp all-gather``,
      ``ReduceScatter``: ``fsdp reduce-scatter``, ``AllReduce``: ``all-reduce``);
    - of the others, the stream with the most busy time in ordinary kernels is ``compute``;
    - a stream that ran only device-to-host (host-to-device) copies is the engine's
      ``engine device-to-host`` (``engine host-to-device``) stream;
    - with ``fsdp=True``, any other stream with work is FSDP's: ``fsdp all-gather`` if its first
      work precedes the compute stream's first kernel (the first layer's copy-in opens the step),
      else ``fsdp reduce-scatter``. This is what one rank shows, where FSDP2 runs its copy-in on
      the all-gather copy-in stream and, instead of a reduce-scatter, a copy on the
      reduce-scatter stream. With ``fsdp=False`` (DDP, or no data parallelism) they are ``other``.

    Memsets and host-side events are left out. Lanes come in the order of :data:`STREAM_ROLES`,
    then by stream id.
    """
    work: dict[int, list[tuple[str, float, float, str]]] = {}
    for e in trace.get("traceEvents", []):
        if (kind := _gpu_event(e)) is not None:
            sid = int(e.get("args", {}).get("stream", -1))
            work.setdefault(sid, []).append((kind, e["ts"], e["ts"] + e.get("dur", 0), e.get("name", "")))
    if not work:
        return []
    roles = _infer_roles(work, fsdp)
    t0 = min(s for events in work.values() for _, s, _, _ in events)
    lanes = [StreamLane(sid, roles[sid], tuple(sorted((Span(roles[sid], (s - t0) / 1e3, (e - t0) / 1e3, n)
                                                         for _, s, e, n in events), key=lambda sp: sp.start)))
             for sid, events in work.items()]
    return sorted(lanes, key=lambda lane: (STREAM_ROLES.index(lane.role), lane.stream))


def _bursts(spans: Sequence[Span], gap_ms: float) -> list[tuple[float, float]]:
    """Intervals of ``spans`` merged where less than ``gap_ms`` separates them."""
    out: list[tuple[float, float]] = []
    for s, e in _merge([(sp.start, sp.end) for sp in spans]):
        if out and s - out[-1][1] < gap_ms:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _compute_waited(burst: tuple[float, float], compute: Sequence[tuple[float, float]], resume_ms: float) -> float:
    """How long the compute stream sat idle waiting for ``burst``: 0 unless it resumed right after it."""
    start, end = burst
    before = [c for c in compute if c[0] < end]
    if before and before[-1][1] >= end:
        return 0.0  # compute was busy when the all-gather ended: it did not wait for it
    after = next((c for c in compute if c[0] >= end), None)
    if after is None or after[0] - end > resume_ms:
        return 0.0  # compute resumed later, for another reason (a copy, the host)
    idle_from = before[-1][1] if before else start
    return end - max(idle_from, start)


def prefetch_summary(lanes: Sequence[StreamLane], gap_ms: float = 0.005,
                     resume_ms: float = 0.05) -> dict[str, float | int | None]:
    """How FSDP's all-gathers ran in one profiled step, from :func:`stream_spans_from_trace`.

    The work of every ``fsdp all-gather`` stream is merged into bursts: intervals less than
    ``gap_ms`` apart are one burst. The default is a few microseconds, the gap between kernels
    queued back to back: one unit's copy-in kernels form one burst, while the next unit's
    copy-in, which FSDP2 starts only after this unit's copy-out on the compute stream, is a
    burst of its own. On several GPUs a unit's copy-in and its NCCL kernel may count as two
    bursts; both runs of a comparison are counted alike.

    Returns
    -------
    dict
        ``bursts``: how many; ``median_ms``: the median burst duration (``None`` without bursts);
        ``busy_ms``: the all-gather streams' busy time; ``exposed_ms``: the part of it during
        which no compute kernel ran; ``compute_waited_ms``: over every burst after which the
        compute stream resumed within ``resume_ms``, the time it had sat idle before the burst
        ended (from its last kernel, or from the burst's start if later). That is the time
        compute waited for all-gathers: a prefetch that finishes in time adds nothing.
        ``local_copy_ms``: device-to-device copies on the compute stream. With one rank FSDP2
        launches no all-gather stream work at all (torch 2.11): it gathers
        with a copy in GPU memory on the compute stream, and this is that copy's time.
    """
    spans = [sp for lane in lanes for sp in lane.spans]
    gathers = [sp for sp in spans if sp.lane == "fsdp all-gather"]
    bursts = _bursts(gathers, gap_ms)
    compute = _merge([(sp.start, sp.end) for sp in spans if sp.lane == "compute"])
    busy, hidden = overlap_ms(spans, "fsdp all-gather")
    durations = sorted(e - s for s, e in bursts)
    return {
        "bursts": len(bursts),
        "median_ms": round(statistics.median(durations), 4) if durations else None,
        "busy_ms": round(busy, 4),
        "exposed_ms": round(busy - hidden, 4),
        "compute_waited_ms": round(sum(_compute_waited(b, compute, resume_ms) for b in bursts), 4),
        "local_copy_ms": round(sum(sp.end - sp.start for sp in spans if sp.lane == "compute" and _is_dtod(sp.name)), 4),
    }


def _is_dtod(name: str) -> bool:
    return "DtoD" in name or "Device -> Device" in name
