"""What the engine tells about an iteration: statistics, the schedule's theory, timing marks, warnings.

:class:`~offload_examples.core.engine.OffloadEngine` derives from :class:`EngineReadouts`. Nothing
here changes a copy, a release or a reload: these are the engine's observers, kept out of the
file that tells the life of an offloaded tensor.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import torch

from .errors import GraphCaptureError, OffloadWarning
from .layer_state import LayerState, LayerStats
from .policy import outer_hooks
from .schedule import ResidentTrace

__all__ = ["EngineReadouts", "LayerCounts"]


class EngineReadouts:
    """The engine's read-outs for the current (or last) iteration; reset when the next one begins."""

    #: Where each layer is in its life this iteration (see :class:`~offload_examples.LayerState`).
    layer_state: list[LayerState]
    #: What happened to each layer's saved tensors (see :class:`~offload_examples.LayerStats`).
    stats: list[LayerStats]
    #: ``(kind, layer)`` in the order the engine acted: ``forward``, ``backward``, ``offload_start``,
    #: ``offload_finished``, ``release``, ``reload_start``.
    events: list[tuple[str, int]]
    #: ``(phase, layer, bytes)``: offloadable bytes on the device at the end of each forward and at
    #: the start of each backward, as :meth:`~offload_examples.DefaultSchedule.simulate` counts them.
    resident_trace: list[tuple[str, int, int]]
    #: ``(phase, layer, bytes allocated on the device)`` when :attr:`record_memory` is set.
    memory_trace: list[tuple[str, int, int]]
    #: Set to ``True`` to log ``torch.cuda.memory_allocated()`` at each phase in :attr:`memory_trace`.
    record_memory: bool

    @property
    def recorder(self) -> Any:
        """Timing marks for one step (:func:`offload_examples.instruments.timeline.record_layer_timeline` sets it)."""
        return self.streams.observer

    @recorder.setter
    def recorder(self, value: Any) -> None:
        self.streams.observer = value

    @property
    def offloaded_bytes(self) -> int:
        """Bytes copied to host memory in the current (or last) iteration."""
        return sum(s.offloaded_bytes for s in self.stats)

    def theoretical(self) -> ResidentTrace:
        """The schedule's prediction for the bytes this iteration saved and offloaded.

        Its ``saving`` is the peak-memory saving to expect in theory (bytes that something else still
        held at their release, :attr:`LayerStats.held_bytes`, count as staying on the device); its
        ``points`` say how many offloaded bytes the engine should hold on the device at each phase
        (compare :attr:`resident_trace`).
        A ``synchronization_dict`` without an order is walked along the order the phases ran in;
        manual synchronization along the actions as they were called.
        """
        ran = [state is not LayerState.NOT_RUN for state in self.layer_state]  # carried counts of layers that ran
        offloaded = [s.offloaded_bytes if r else 0 for s, r in zip(self.stats, ran)]
        kept = [s.candidate_bytes - s.offloaded_bytes if r else 0 for s, r in zip(self.stats, ran)]
        trace = self.schedule.predict(offloaded, kept, self.events)
        held = [s.held_bytes if r else 0 for s, r in zip(self.stats, ran)]
        if not any(held):
            return trace
        # Bytes something else held at release left the engine's count (the points) but stayed on
        # the device: the peak counts them as kept.
        freed = self.schedule.predict([o - h for o, h in zip(offloaded, held)],
                                      [k + h for k, h in zip(kept, held)], self.events)
        return dataclasses.replace(trace, peak_with=freed.peak_with)

    def phase_order(self) -> list[tuple[str, int]]:
        """The order in which layer phases started in the current (or last) iteration."""
        return [(kind, j) for kind, j in self.events if kind in ("forward", "backward")]

    # ------------------------------------------------------------------ observers, called by the engine
    def _mark(self) -> Any:
        return self.recorder.mark(self.streams.current()) if self.recorder else None

    def _note_phase(self, phase: str, layer: int, ready: Any) -> None:
        """Log a phase that has started (its actions queued) for the memory and timing read-outs."""
        if self.record_memory and self.streams.is_cuda:
            self.memory_trace.append((phase, layer, torch.cuda.memory_allocated(self.device)))
        if self.recorder:
            # ``ready`` is None when the phase made the compute stream wait for nothing: the time
            # between two marks is host work, not a stall, and no "wait" span is drawn
            start = self._mark()
            self.recorder.add_phase(phase, layer, start if ready is None else ready, start)

    def _check_iteration_shape(self) -> None:
        """At the first backward: warn (once) when the forward did not look like the schedule."""
        n, entered = self.model_layers, self._entered
        if not self.schedule.interleaved and entered != n:
            self._warn_once("entries", f"the offload context was entered {self._entries_since_backward} times before "
                            f"this backward, but model_layers={n}: layers are offloaded and released by their "
                            "position, so set model_layers to the number of layers run inside the context")
        elif self.schedule.releases_before_backward and not any(kind == "release" for kind, _ in self.events):
            self._warn_once("no release", "no layer was released before the backward, so offloading saved no "
                            "GPU memory in this iteration (check num_layers and model_layers)")

    def _count_offloaded(self, layer: int, nbytes: int, views: int, sign: int = 1) -> None:
        """A storage of ``layer`` was copied out: it counts as offloaded, and as resident until released
        (``sign=-1``: one counted so stays on the device after all, and the count is taken back)."""
        stats = self.stats[layer]
        stats.offloaded_storages += sign
        stats.offloaded_bytes += sign * nbytes
        stats.offloaded_tensors += sign * views
        self.resident_bytes += sign * nbytes

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, OffloadWarning, stacklevel=3)

    def _or_warn(self, layer: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or ``None`` with a warning when host memory could not be had (the tensors stay
        on the device). A :class:`~offload_examples.GraphCaptureError` is raised: a capture must fail."""
        try:
            return fn(*args)
        except GraphCaptureError:
            raise
        except RuntimeError as err:  # HostMemoryLimitError, the allocator's, or the copy's own
            self._warn_once("host", f"keeping saved tensors of layer {layer} on the device: {err}")
            return None


def _shape(x: torch.Tensor) -> tuple:
    """``x``'s shape; for a nested tensor (which has none) its components' sizes, read on the host."""
    if not x.is_nested:
        return tuple(x.shape)
    if x.layout == torch.jagged:  # its offsets live on the device: reading them would synchronize
        return ("jagged", x.size(0), tuple(x.values().shape))
    return ("nested", tuple(map(tuple, x._nested_tensor_size().tolist())))


def _copy(stats: LayerStats) -> LayerStats:
    """A carried copy that shares no list with the iteration it came from."""
    return dataclasses.replace(stats, candidate_sizes=list(stats.candidate_sizes))


class LayerCounts:
    """Which layers the engine hooks, and the counts it carries over for those it does not.

    Saved-tensor hooks cost Python work per saved tensor, on the host's critical path when a step is
    launch bound (Transformer Engine layers: a step's host time was about its GPU time). So once an
    iteration has counted what every layer saves, layers the schedule does not offload run without
    hooks, and their :class:`~offload_examples.LayerStats` are carried over from that iteration
    (the theory needs them). They are counted again when a layer's output changes shape or dtype
    (the next layers at once, all of them from the next iteration). Every layer is hooked while
    another saved-tensor hook is active (``save_on_cpu`` around the model: the engine's hooks, the
    innermost, decide for every layer's tensors, counted or not), and always when ``every_iteration`` is set (a probe engine).
    """

    def __init__(self, every_iteration: bool):
        #: Hook and count every layer in every iteration.
        self.every_iteration = every_iteration
        self._counted: list[LayerStats] | None = None  # a full iteration's counts
        self._outputs: list[tuple | None] = []  # each layer's output (shape, dtype) when they were counted
        self._seen_outputs: list[tuple | None] = []
        self._carried: set[int] = set()  # layers whose stats this iteration are copies
        self._all_hooked = True

    def new_iteration(self, last_stats: list[LayerStats], entered: int, offloaded: list[bool]) -> list[LayerStats]:
        """The stats the next iteration starts from (after ``entered`` entries of the last one)."""
        n = len(offloaded)
        if entered == n and self._all_hooked and not self.every_iteration:
            self._counted, self._outputs = last_stats, self._seen_outputs
        carry = self._counted is not None and not self.every_iteration
        self._carried = {j for j in range(n) if carry and not offloaded[j]}
        self._seen_outputs, self._all_hooked = [None] * n, True
        return [_copy(self._counted[j]) if j in self._carried else LayerStats() for j in range(n)]

    def counted_bytes(self, layer: int) -> int:
        """What ``layer`` offloaded in the last iteration that counted every layer (0 before one did)."""
        return self._counted[layer].offloaded_bytes if self._counted is not None else 0

    def hooked(self, layer: int, offloaded: bool, stats: list[LayerStats]) -> bool:
        """Whether ``layer``'s entry installs the hooks; its carried stats are dropped if it does."""
        if offloaded or self._counted is None or self.every_iteration or outer_hooks() is not None:
            if layer in self._carried:
                self._carried.discard(layer)
                stats[layer] = LayerStats()  # counted afresh, not on top of the carried counts
            return True
        self._all_hooked = False
        return False

    def output(self, layer: int, x: torch.Tensor) -> None:
        """``layer`` returned ``x``: a new shape or dtype means the counts are out of date."""
        seen = (_shape(x), x.dtype)
        if 0 <= layer < len(self._seen_outputs):
            self._seen_outputs[layer] = seen
        if self._counted is not None and layer < len(self._outputs) and self._outputs[layer] != seen:
            self._counted = None
