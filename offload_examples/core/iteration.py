"""The engine's iterations: when one begins, how a failed one is abandoned, how a layer changes state.

:class:`~offload_examples.core.engine.OffloadEngine` derives from :class:`EngineIterations`. An
iteration is one training step: each layer enters the context once in forward and, later, its
backward runs. The engine cannot see a step's edges, so it infers them here from the order of
entries and backwards; a failed step is abandoned at once, so that nothing half-done survives
into the next one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import too_many_entries_error
from .layer_state import ALLOWED_FROM, LayerState

if TYPE_CHECKING:
    from .engine import _StorageRecord

__all__ = ["EngineIterations"]


class EngineIterations:
    """Iteration bookkeeping of the engine: the per-iteration maps, and the one state transition."""

    def reset(self) -> None:
        """Abandon the current iteration: give back its GPU copies and host buffers at once.

        Call it when a step failed outside the context (between layers, in the loss, in the
        optimizer) and the next step should start afresh. A backward of the abandoned step
        raises a clear error instead of computing with freed memory.
        """
        if self._in_layer:
            raise RuntimeError("reset() was called inside the offload context; call it between steps")
        self._passthrough.depth = 0  # an entry made under no_grad in this thread and never left
        self._passthrough.last = False
        self._abort()

    def _new_iteration(self) -> None:
        """Forget the last iteration; its records that autograd still holds live on the host."""
        with self._lock:
            capturing = self.capturing()
            for records in getattr(self, "_records", []):
                for rec in records:
                    if rec.host is not None:  # never-offloaded records keep their only copy
                        rec.drop_device(capturing)
            if self.iteration >= 0:  # a capture starting now takes its buffers from the free lists
                self.pool.end_iteration(keep_free=capturing or self.pool.frozen)
            self.iteration += 1
            n = self.model_layers
            self._records: list[list[_StorageRecord]] = [[] for _ in range(n)]
            self._by_storage: list[dict[int, _StorageRecord]] = [{} for _ in range(n)]
            self._seen: list[set[int]] = [set() for _ in range(n)]
            self._by_impl: dict[int, list[_StorageRecord]] = {}  # StorageImpl (kept by the weak refs) -> records
            self._saves = 0  # tensors handed to records so far: their order sets the order of reloads
            self.layer_state = [LayerState.NOT_RUN] * n
            self.stats = self.counts.new_iteration(getattr(self, "stats", []), getattr(self, "_entered", 0),
                                                   [self.schedule.is_offloaded(j) for j in range(n)])
            self.events, self.resident_trace, self.memory_trace = [], [], []  # the read-outs (EngineReadouts)
            self.resident_bytes = 0
            self.live_views = 0
            self._entered = 0
            self._backward_seen = False
            self._backwards: set[int] = set()

    def _abort(self) -> None:
        """A step failed: give back every buffer and start afresh."""
        if self.selection is not None:
            self.selection.reset()
        with self._lock:
            capturing = self.capturing()
            for records in self._records:
                for rec in records:
                    rec.aborted = True
                    rec.free(capturing)
            self._new_iteration()

    def _iteration_over(self) -> bool:
        """Whether the next entry of the context starts a new iteration."""
        n = self.model_layers
        if not self.schedule.interleaved:  # N forwards, then the backward: any backward ends the forwards
            return self._backward_seen or self._entered == n
        if self._entered < n:
            return False
        if len(self._backwards) == n:
            return True
        # Everything offloaded this iteration was dropped: the step ended without its backward, or
        # its backward failed. (An iteration that offloaded nothing cannot tell that from a stray
        # extra forward, which would shift every entry: it raises below.)
        if self.live_views == 0 and (not self._backward_seen or any(self._records)):
            return True
        raise too_many_entries_error(n, sorted(set(range(n)) - self._backwards))

    def _move(self, layer: int, to: LayerState, why: str) -> None:
        """The one place a layer changes state; an illegal move raises with the schedule's words."""
        state = self.layer_state[layer]
        if state not in ALLOWED_FROM[to]:
            raise RuntimeError(f"{self.schedule.describe(layer)}: {why}, but layer {layer} {state.value}")
        self.layer_state[layer] = to
