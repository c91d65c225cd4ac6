"""The engine's iterations: when one begins, how a failed one is abandoned, how a layer changes state.

:class:`~offload_examples.core.engine.OffloadEngine` derives from :class:`EngineIterations`. An
iteration is one training step: each layer enters the context once in forward and, later, its
backward runs. The engine cannot see a step's edges, so it infers them here from the order of
entries and backwards; a failed step is abandoned at once, so that nothing half-done survives
into the next one.
"""

from __future__ import annotations

from . import te_path
from .layer_state import ALLOWED_FROM, LayerState

__all__ = ["EngineIterations"]


class EngineIterations:
    """Iteration bookkeeping of the engine: the per-iteration maps, and the one state transition."""

    def reset(self) -> None:
        """Abandon the current iteration: give back its GPU copies and host buffers at once.

        The engine notices a failed step by itself: a failure inside the context abandons the step
        at once, and one between layers (or in the loss) drops the step's graph, which the hooks
        ``sync`` placed and the offloaded tensors see. Call it to start afresh when the step's graph
        is still held after it failed (a kept exception holds its frames, and so its tensors), or when
        nothing of the failed step was offloaded or synced. A backward of the abandoned step raises a
        clear error instead of computing with freed memory.
        """
        if self._inside is not None:
            raise RuntimeError("reset() was called inside the offload context; call it between steps")
        local = self._thread()
        for _ in range(local.depth):  # entries made under no_grad in this thread and never left
            te_path.switch_off()
        local.depth, local.last = 0, False
        self._abort()

    def _new_iteration(self) -> None:
        """Forget the last iteration; its records that autograd still holds live on the host."""
        with self._lock:
            capturing = self.capturing()
            if capturing:  # this capture may end after the step: nothing forked in it may stay open
                self.streams.join()
            else:
                self.streams.forget_forks()
            for records in getattr(self, "_records", []):
                for rec in records:
                    if rec.host is not None and rec.queued < rec.nbytes:  # half copied: it stays
                        rec.detach_host()
                    if rec.host is not None:  # never-offloaded records keep their only copy
                        rec.drop_device(capturing)
            if self.iteration >= 0:  # a capture starting now takes its buffers from the free lists
                self.pool.end_iteration(keep_free=capturing or self.pool.frozen)
            self.iteration += 1
            n = self.model_layers
            self._records: list[list] = [[] for _ in range(n)]  # per layer, its storages' records (engine.py)
            self._by_storage: list[dict] = [{} for _ in range(n)]  # per layer, data pointer -> record
            self._seen: list[set[int]] = [set() for _ in range(n)]
            self._by_impl: dict[int, list] = {}  # StorageImpl (kept by the weak refs) -> records
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
            self._remove_leaf_hooks()  # sync's hooks on leaves the caller keeps (see entries.py)
            self._triggers, self._graph_dropped = [], False
            # per-layer graphs: (layer, the entry that releases it, whether its copies have begun)
            self._deferred_offloads: list[tuple[int, int, bool]] = []
            # and (layer, its records still on the host) for the reloads spread over the backwards
            self._deferred_reloads: list[tuple[int, list]] = []

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
        """Whether the next entry of the context starts a new iteration.

        After ``model_layers`` entries, always (an iteration has that many). Before: in the default
        schedule once its backward began (all forwards come first); in any schedule once the step
        was abandoned, its graph dropped before the backwards (a failure between two layers).
        """
        n = self.model_layers
        if self._entered >= n:
            return True
        if not self.schedule.interleaved and self._backward_seen:
            return True
        return self._entered > 0 and self._step_abandoned()

    def _move(self, layer: int, to: LayerState, why: str) -> None:
        """The one place a layer changes state; an illegal move raises with the schedule's words."""
        state = self.layer_state[layer]
        if state not in ALLOWED_FROM[to]:
            hint = self._misaligned_hint() or " (if a step failed part-way and its graph is still held, reset() ends it)"
            raise RuntimeError(f"{self.schedule.describe(layer)}: {why}, but layer {layer} {state.value}{hint}")
        self.layer_state[layer] = to
