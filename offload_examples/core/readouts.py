"""What the engine tells about an iteration: statistics, the schedule's theory, timing marks, warnings.

:class:`~offload_examples.core.engine.OffloadEngine` derives from :class:`EngineReadouts`. Nothing
here changes a copy, a release or a reload: these are the engine's observers, kept out of the
file that tells the life of an offloaded tensor.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .errors import OffloadWarning
from .layer_state import LayerState, LayerStats
from .schedule import ResidentTrace

__all__ = ["EngineReadouts"]


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

        Its ``saving`` is the peak-memory saving to expect in theory; its ``points`` say how many
        offloaded bytes should be on the device at each phase (compare :attr:`resident_trace`).
        A ``synchronization_dict`` without an order is walked along the order the phases ran in;
        manual synchronization along the actions as they were called.
        """
        offloaded = [s.offloaded_bytes for s in self.stats]
        kept = [s.candidate_bytes - s.offloaded_bytes for s in self.stats]
        return self.schedule.predict(offloaded, kept, self.events)

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
            self.recorder.add_phase(phase, layer, ready, self._mark())

    def _check_iteration_shape(self) -> None:
        """At the first backward: warn (once) when the forward did not look like the schedule."""
        n, entered = self.model_layers, self._entered
        if not self.schedule.interleaved and entered != n:
            self._warn_once("entries", f"the offload context was entered {entered} times before the backward, "
                            f"but model_layers={n}: layers are offloaded and released by their position, so "
                            "set model_layers to the number of layers run inside the context")
        elif self.schedule.releases_before_backward and not any(kind == "release" for kind, _ in self.events):
            self._warn_once("no release", "no layer was released before the backward, so offloading saved no "
                            "GPU memory in this iteration (check num_layers and model_layers)")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, OffloadWarning, stacklevel=3)
