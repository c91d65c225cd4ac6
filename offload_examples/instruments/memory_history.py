"""GPU memory over one step, from the CUDA caching allocator's own history.

PyTorch's allocator can log every allocation and free with a timestamp
(``torch.cuda.memory._record_memory_history``). Summing those events gives the bytes
allocated at every moment of the step: the same quantity as ``torch.cuda.memory_allocated()``,
but as a curve rather than a peak, so two runs drawn together show the offloading saving as the
area between them (:func:`offload_examples.instruments.plots.plot_memory_curves`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

__all__ = ["MemoryCurve", "curve_from_snapshot", "record_memory_curve"]


@dataclass
class MemoryCurve:
    """Bytes allocated on the device over time.

    Attributes
    ----------
    ms:
        Host time of each allocator event, in ms from the first one.
    allocated:
        Bytes allocated right after that event (including what was allocated before recording
        began: weights, inputs).
    """

    ms: list[float]
    allocated: list[int]

    @property
    def peak(self) -> int:
        return max(self.allocated, default=0)


def curve_from_snapshot(snapshot: Mapping[str, Any], base_bytes: int = 0, device: int = 0) -> MemoryCurve:
    """Turn an allocator snapshot (``torch.cuda.memory._snapshot()``) into a :class:`MemoryCurve`.

    An ``alloc`` adds its size and a ``free_requested`` subtracts it: the allocator counts a
    block as no longer allocated at that point (it may be reused later, once the streams that
    used it are done). ``base_bytes`` is what was allocated before the history started.
    """
    return _curve(_trace(snapshot, device), base_bytes)


def _curve(trace: list, base_bytes: int) -> MemoryCurve:
    ms, allocated, now, t0 = [], [], base_bytes, None
    for entry in trace:
        action = entry.get("action")
        if action == "alloc":
            now += entry["size"]
        elif action == "free_requested":
            now -= entry["size"]
        else:
            continue
        t0 = entry["time_us"] if t0 is None else t0
        ms.append((entry["time_us"] - t0) / 1e3)
        allocated.append(now)
    return MemoryCurve(ms, allocated)


def record_memory_curve(fn: Callable[[], object]) -> MemoryCurve:
    """Run ``fn`` with the allocator's history on and return its memory curve (empty on the CPU).

    Run it on a step after a warm-up step: the history costs a little host time per allocation,
    so read memory from it, not step time.
    """
    if not torch.cuda.is_available():
        return MemoryCurve([], [])
    from torch.cuda import memory

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    device = torch.cuda.current_device()
    options: dict[str, Any] = dict(context=None, stacks="python", max_entries=2_000_000)
    clears = "clear_history" in inspect.signature(memory._record_memory_history).parameters
    if clears:
        options["clear_history"] = True  # start from an empty log
    memory._record_memory_history("all", **options)
    try:
        # older releases cannot clear the log: skip the entries it already holds
        skip = 0 if clears else len(_trace(memory._snapshot(), device))
        fn()
        torch.cuda.synchronize()
        snapshot = memory._snapshot()
    finally:
        memory._record_memory_history(None)
    return _curve(_trace(snapshot, device)[skip:], base)


def _trace(snapshot: Mapping[str, Any], device: int) -> list:
    traces = snapshot.get("device_traces", [])
    return list(traces[device]) if device < len(traces) else []
