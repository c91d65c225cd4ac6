"""Small measurements behind the concepts notebook: copy bandwidth, pinning cost, overlap.

Every function needs CUDA and times work with CUDA events (device time) or ``perf_counter``
(host time, which is what "does this call block?" is about).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

__all__ = [
    "CopyTiming", "bidirectional_gb_per_s", "copy_bandwidth", "link_bandwidth", "non_blocking_host_time",
    "overlap_timeline", "pinning_seconds",
]


@dataclass
class CopyTiming:
    """One copy: its size, direction, host memory kind, device time and bandwidth."""

    nbytes: int
    direction: str  # "h2d" or "d2h"
    pinned: bool
    ms: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.ms / 1e6


def _time_on_stream(fn, repeats: int) -> float:
    """Median device milliseconds of ``fn`` on the current stream."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(nbytes: int, direction: str, pinned: bool, repeats: int = 5) -> CopyTiming:
    """Time one host<->device copy of ``nbytes`` bytes."""
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    dst.copy_(src, non_blocking=True)  # warm up
    ms = _time_on_stream(lambda: dst.copy_(src, non_blocking=True), repeats)
    return CopyTiming(nbytes, direction, pinned, ms)


def bidirectional_gb_per_s(nbytes: int, repeats: int = 5) -> float:
    """Total GB/s of one pinned device-to-host and one host-to-device copy of ``nbytes`` each, at once.

    The two copies run on their own streams, as the engine's do; the time is from the start of
    both to the end of the later one.
    """
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def both() -> None:
        for stream, (dst, src) in zip(streams, ((host_out, dev_out), (dev_in, host_in))):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        for stream in streams:
            main.wait_stream(stream)

    both()  # warm up
    return 2 * nbytes / _time_on_stream(both, repeats) / 1e6


def link_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5, rounds: int = 3) -> dict[str, float]:
    """Pinned copy bandwidth in GB/s: ``"h2d"``, ``"d2h"`` and ``"both"`` directions at once (total).

    The three are timed in ``rounds`` rounds taken in turn (each a median of ``repeats`` copies), and
    each keeps its fastest round: the speed of the link when nothing else holds it back, which is
    what the engine's copies reach in a run. A single round can read well below that, and a planner
    given the slow figure overpredicts every plan that offloads.
    """
    if rounds < 1 or repeats < 1:
        raise ValueError(f"need rounds >= 1 and repeats >= 1, got rounds={rounds}, repeats={repeats}")
    best = {"h2d": 0.0, "d2h": 0.0, "both": 0.0}
    for _ in range(rounds):
        best["h2d"] = max(best["h2d"], copy_bandwidth(nbytes, "h2d", pinned=True, repeats=repeats).gb_per_s)
        best["d2h"] = max(best["d2h"], copy_bandwidth(nbytes, "d2h", pinned=True, repeats=repeats).gb_per_s)
        best["both"] = max(best["both"], bidirectional_gb_per_s(nbytes, repeats))
    return best


def pinning_seconds(nbytes: int) -> dict[str, float]:
    """Host seconds to get ``nbytes`` of pinned memory, the two ways it is done.

    Returns
    -------
    dict
        ``"allocate"``: a fresh ``torch.empty(..., pin_memory=True)`` (what the engine's pool does
        on its first step: allocate, page-lock and map new memory); ``"register"``: page-locking
        memory that is already allocated and touched (``cudaHostRegister``), which isolates the
        cost of the locking itself.
    """
    torch.cuda.synchronize()
    start = time.perf_counter()
    fresh = torch.empty(nbytes + 4096, dtype=torch.uint8, pin_memory=True)  # odd size: not a cached block
    allocate = time.perf_counter() - start
    del fresh
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(0)  # touch the pages first, so only the locking is timed
    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    register = time.perf_counter() - start
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed with error {int(err)}")
    cudart.cudaHostUnregister(t.data_ptr())
    return {"allocate": allocate, "register": register}


def non_blocking_host_time(nbytes: int, pinned: bool) -> tuple[float, float]:
    """How long ``copy_(non_blocking=True)`` keeps the *host* busy, and the copy's device time (ms).

    With pinned memory the call only queues the copy and returns; with pageable memory the
    driver stages it through a pinned bounce buffer and the host waits for (most of) it.
    """
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    start = time.perf_counter()
    host.copy_(dev, non_blocking=True)
    host_ms = (time.perf_counter() - start) * 1e3
    end_ev.record()
    torch.cuda.synchronize()
    return host_ms, start_ev.elapsed_time(end_ev)


def overlap_timeline(nbytes: int = 512 * 2**20, matmul: int = 8192, separate_streams: bool = True) -> dict:
    """Run a matmul, a device-to-host and a host-to-device copy, on one stream or on three.

    Returns ``{"compute"|"d2h"|"h2d": (start_ms, end_ms), "total_ms": ...}``, measured with
    events, so the result can be drawn as a timeline.
    """
    a = torch.randn(matmul, matmul, device="cuda", dtype=torch.bfloat16)
    src_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    compute = torch.cuda.current_stream()
    d2h = torch.cuda.Stream() if separate_streams else compute
    h2d = torch.cuda.Stream() if separate_streams else compute
    work = {
        "compute": (compute, lambda: [a @ a for _ in range(8)]),
        "d2h": (d2h, lambda: host_out.copy_(src_dev, non_blocking=True)),
        "h2d": (h2d, lambda: dst_dev.copy_(host_in, non_blocking=True)),
    }
    for _ in range(2):  # the second round is measured
        torch.cuda.synchronize()
        origin = torch.cuda.Event(enable_timing=True)
        origin.record(compute)
        marks = {}
        for name, (stream, fn) in work.items():
            stream.wait_event(origin)
            with torch.cuda.stream(stream):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
            marks[name] = (begin, end)
        torch.cuda.synchronize()
    spans = {name: (origin.elapsed_time(b), origin.elapsed_time(e)) for name, (b, e) in marks.items()}
    spans["total_ms"] = max(e for _, e in spans.values())
    return spans
