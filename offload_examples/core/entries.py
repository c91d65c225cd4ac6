"""How a step enters and leaves the offload context, and how its backward is seen: ``with ctx:`` and ``sync``.

:class:`~offload_examples.core.engine.OffloadEngine` derives from :class:`EngineEntries`. Every
``with ctx:`` is one of two kinds:

- a **pass-through**, which saves nothing for this step and counts for nothing: an entry under
  ``no_grad`` or ``inference_mode`` (evaluation, or another thread's inference on a shared engine),
  or an entry while autograd runs a backward (a checkpoint recomputing the layer: what it saves
  belongs to the checkpoint, and the layer's forward already counted);
- a **layer**: the next entry of the step, numbered in order. Its saved tensors go through the
  engine's hooks, except inside a region that ``torch.utils.checkpoint`` already took over: there
  the checkpoint keeps only its inputs and recomputes the rest, so the entry counts but hooks
  nothing.

One thread at a time may be inside a layer (a training step is one thread's work); pass-throughs
may come from any thread meanwhile. Leaving is the mirror image, and it always happens, whatever
the exception (``KeyboardInterrupt`` included): nothing of a layer stays open after its ``with``
block.

``sync`` hangs a :class:`_BackwardTrigger` on each layer's output. Its call is when the layer's
backward starts (the schedule's reload trigger); its death without a call means the step's graph
was dropped without that backward, which is how the engine notices that a step failed between two
layers (outside its context) and that the next entry begins a new step.
"""

from __future__ import annotations

import threading
import weakref
from types import TracebackType

import torch

from . import te_path
from .errors import hooks_refused_error, nested_error, timing_in_capture_error
from .layer_state import ALLOWED_FROM, LayerState
from .policy import outer_hooks

#: Per-layer graphs copy a storage in pieces no smaller than this (but for its last one), so that each
#: layer's graph copies about its share of the bytes without a copy of its own for a few bytes.
MIN_PIECE_BYTES = 8 << 20

__all__ = ["EngineEntries"]

_active = threading.local()  # the engine whose layer is open in this thread, if any
_in_backward = getattr(torch._C, "_current_autograd_node", lambda: None)


class _BackwardTrigger:
    """The hook ``sync`` hangs on a layer's output: called when the layer's backward starts.

    Autograd keeps it with the output's graph. If it dies uncalled, that graph was dropped without
    the layer's backward (the step failed, or its output was discarded): it tells the engine so.
    """

    __slots__ = ("engine_ref", "iteration", "layer", "fired", "__weakref__")

    def __init__(self, engine_ref: weakref.ref, iteration: int, layer: int):
        self.engine_ref, self.iteration, self.layer, self.fired = engine_ref, iteration, layer, False

    def __call__(self, grad: torch.Tensor) -> None:
        self.fired = True
        engine = self.engine_ref()
        if engine is not None:
            engine._backward_started(self.iteration, self.layer)

    def __del__(self) -> None:
        try:
            engine = self.engine_ref()
            if not self.fired and engine is not None and engine.iteration == self.iteration:
                engine._graph_dropped = True  # one assignment: safe from any thread, no lock taken
        except Exception:  # interpreter shutdown: nothing left to tell
            pass


def _disabled_for_dynamo(fn):
    """Run ``fn`` eagerly even inside a ``torch.compile``\\ d model: the engine's bookkeeping (hooks,
    version counters, streams) must run as written, never be traced into a graph. The layer's own
    forward, called between ``__enter__`` and ``__exit__``, is still compiled."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


class EngineEntries:
    """Entering and leaving the context, one layer at a time, and ``sync``."""

    def _init_entries(self) -> None:
        self._local = threading.local()  # per thread: pass-through entries open, and whether the last was one
        self._inside: int | None = None  # the thread inside a layer now
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._layer = 0  # the entry open now (read by _pack)
        self._trainer: int | None = None  # the thread whose step is under way
        self._offloading = False  # the schedule offloads the layer being entered (read by _pack)
        self._entries_since_backward = 0  # layers entered since the last step's backward began (warnings)
        #: Whether the step now running began while the last one's graph was still waiting for its
        #: backward (a forward whose output is kept, or more entries than ``model_layers`` in one step).
        self.continued_without_backward = False
        #: Per-layer graphs with ``copies_out="between"``: each layer's records to copy out between replays.
        self._between: dict[int, list] = {}

    @property
    def open_entry(self) -> tuple[int, int] | None:
        """``(iteration, layer)`` of the layer this thread is inside now, or ``None`` (outside the
        context, or inside a pass-through entry)."""
        return (self.iteration, self._layer) if self._inside == threading.get_ident() else None

    def _thread(self) -> threading.local:
        local = self._local
        if not hasattr(local, "depth"):
            local.depth, local.last = 0, False  # pass-throughs open; whether the last entry was one
        return local

    @_disabled_for_dynamo
    def __enter__(self):
        me, local = threading.get_ident(), self._thread()
        if self._inside == me:
            raise RuntimeError("the offload context is already active: it cannot be nested")
        passthrough = not torch.is_grad_enabled() or _in_backward() is not None
        if local.depth and not passthrough:
            raise RuntimeError("the offload context is already active (entered under no_grad): it cannot be nested")
        if passthrough:  # nothing is saved for this step's backward: not an entry of the step
            te_path.switch_on()  # a recomputation (or a no_grad forward) takes the path a layer's forward takes
            local.depth += 1
            local.last = True  # its output's sync hooks nothing (see sync)
            return self
        if getattr(_active, "engine", None) is not None:
            raise nested_error()
        if self.recorder is not None and self.capturing():
            raise timing_in_capture_error()
        j = self._begin_layer(me)  # from here on, a failure abandons the step
        try:
            outer = outer_hooks()
            if outer == "checkpoint":
                self._warn_once("checkpoint", "the offload context was entered inside a torch.utils.checkpoint "
                                "region: the checkpoint keeps the layer's inputs, saved before the context began, and "
                                "recomputes the rest, so nothing of this layer is offloaded. Enter the context around "
                                "the checkpoint instead (offload_layers does) to offload what the checkpoint keeps")
            self._offloading = self.schedule.is_offloaded(j) and outer != "checkpoint"
            if outer != "checkpoint" and self.counts.hooked(j, self._offloading, self.stats):
                hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                try:
                    hooks.__enter__()
                except RuntimeError as err:  # torch.func transforms, disable_saved_tensors_hooks
                    raise hooks_refused_error(err) from err
                self._hooks = hooks
            # last, so that a failed entry leaves it off: TE's layers take the path they take under TE's offload
            te_path.switch_on()
        except BaseException:
            if self._hooks is not None:
                self._hooks.__exit__(None, None, None)
            self._hooks, self._inside = None, None
            self._abort()  # the layer began: abandon the step, as for any failure inside
            raise
        _active.engine = self
        local.last = False
        return self

    def _begin_layer(self, me: int) -> int:
        """Claim the context for thread ``me`` and number the entry (a new step begins when the last one
        is over); run its forward's actions. All under the lock: two threads cannot both get in."""
        with self._lock:
            if self._inside is not None:
                raise RuntimeError("another thread is inside a layer of this offload context: one thread at a "
                                   "time may train through it (no_grad passes may share it from any thread)")
            over = self._iteration_over()
            if not over and self._entered and self._trainer != me:
                raise RuntimeError("another thread is in the middle of a step through this offload context: one "
                                   "thread at a time may train through it (no_grad passes may share it)")
            self._inside, self._trainer = me, me
            try:
                if over:
                    # model_layers entries, and nothing since says the step ended: a new step, or more
                    # entries than model_layers in one (offload_layers tells the two apart by the layer)
                    self.continued_without_backward = not self._backward_seen and not self._step_abandoned()
                    self._new_iteration()
                j = self._entered
                self._move(j, LayerState.RUNNING, f"the forward of entry {j} started")
                self._start_deferred_offloads()  # before the actions: a release waits for these copies
                ready = self._mark()
                waited = self._run_actions("forward", j)
                self.events.append(("forward", j))
                self._note_phase("forward", j, ready if waited else None)
            except BaseException:
                self._inside = None
                self._abort()  # no half-updated layer state survives a failed entry
                raise
            self._layer = j
        self._entries_since_backward += 1
        return j

    @_disabled_for_dynamo
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        local = self._thread()
        if local.depth:
            local.depth -= 1
            te_path.switch_off()
            return
        if self._inside != threading.get_ident():  # a stray second exit, or one from another thread
            raise RuntimeError("the offload context was left without being entered in this thread "
                               "(a second __exit__, or one from another thread)")
        try:
            te_path.switch_off()
            if self._hooks is not None:
                self._hooks.__exit__(exc_type, exc, tb)
        finally:  # whatever happens above, the layer is closed
            self._hooks, self._inside, _active.engine = None, None, None
        if exc_type is not None:
            self._abort()
            return
        with self._lock:
            j = self._layer
            try:
                offloading = self.schedule.is_offloaded(j) and self.schedule.offload_at_exit
                self._move(j, LayerState.OFFLOADING if offloading else LayerState.SAVED, "its forward ended")
                per_layer = self._per_layer_capture()
                if offloading and per_layer and self.copies_out == "between":
                    self._plan_copies_between(j)  # queued by the replays, between the graphs
                elif offloading and per_layer and j + 1 < self.model_layers:
                    self._deferred_offloads.append((j, self._release_entry(j), False))  # later layers' graphs copy it
                elif offloading:
                    self._start_offload(j)
                if per_layer:  # this layer's graph may end here: no copy forked in it may outlive it
                    self.streams.join()
            except BaseException:
                self._abort()
                raise
            self.resident_trace.append(("forward", j, self.resident_bytes + self._waiting_bytes()))
            self._entered += 1

    def _run_actions(self, phase: str, layer: int) -> bool:
        """What the schedule asks for when ``phase`` of ``layer`` starts. Returns whether the compute
        stream was made to wait: a release that drops memory waits for its copies out; a reload makes
        the backward wait only when it unpacks, inside the phase."""
        waited = False
        for action, i in self.schedule.actions(phase, layer):
            why = f"the {action} came at the {phase} of layer {layer}"
            target = LayerState.RELEASED if action == "release" else LayerState.RELOADING
            if not self.schedule.strict and self.layer_state[i] not in ALLOWED_FROM[target]:
                continue  # the step did not run as many layers as the schedule counts: warned at backward
            if action == "release":
                if i in self._between:
                    self._keep_resized_between(i)
                waited = self._release(i, why) or waited
            else:
                self._reload_layer(i, why)
        return waited

    def _release_entry(self, layer: int) -> int:
        """The entry whose forward releases ``layer``: its copies must be queued by then (the last entry
        where none does)."""
        n = self.model_layers
        return next((e for e in range(layer + 1, n) if ("release", layer) in self.schedule.actions("forward", e)),
                    n - 1)

    def _start_deferred_offloads(self) -> None:
        """Per-layer graphs: queue copies of the layers whose forward ended in an earlier graph, spread over
        the entries before each one's release (:func:`_even_rate`: all of a layer's bytes by the last, and
        room left for the layers still to run, which copy in these graphs too), the earliest release first,
        whole storages in the order they were saved and a piece of the next one where a whole one would
        exceed the graph's share. They run beside this layer's forward, in its graph, which joins them at
        its exit; replays run the graphs in the order they were captured, so the copies read what the
        earlier graphs wrote."""
        if not self._deferred_offloads:  # an eager step, or nothing waiting
            return
        entry, jobs, pending = self._entered, [], []
        for layer, deadline, started in self._deferred_offloads:
            if not started:
                self.events.append(("offload_start", layer))
            # looked up again at every entry: a storage freed or resized since is no longer copied
            records = self._half_copied(layer) + self._offload_candidates(layer)
            jobs.append((deadline - entry, layer, deadline, records, sum(r.nbytes - r.queued for r in records)))
        # the layers still to run that will copy in these graphs too, as much as in the last step counted
        coming = [(self._release_entry(j) - entry, self.counts.counted_bytes(j))
                  for j in range(entry, self.model_layers - 1) if self.schedule.is_offloaded(j)]
        budget = _even_rate([(job[0], job[-1]) for job in jobs] + coming)
        for _, layer, deadline, records, left in sorted(jobs, key=lambda job: job[:2]):
            self._copy_share(layer, records, min(budget, left))
            budget -= left - sum(r.nbytes - r.queued for r in records)
            if any(r.queued < r.nbytes and r.device is not None for r in records):
                pending.append((layer, deadline, True))
        self._deferred_offloads = pending

    def _copy_share(self, layer: int, records: list, share: float) -> None:
        """Queue about ``share`` bytes of ``records``: whole storages in one batch, the rest in pieces."""
        whole = []
        for rec, stop in _paced(records, share, [r.queued for r in records]):
            if rec.queued == 0 and stop == rec.nbytes:
                whole.append(rec)
                continue
            host = rec.host or self._or_warn(layer, rec.borrow_host)
            if host is not None and rec.copy_piece(host, stop):
                self._count_offloaded(layer, rec.nbytes, rec.views)
        self._copy_out(whole)

    def _plan_copies_between(self, layer: int) -> None:
        """Per-layer graphs, copies between them: give each storage of ``layer`` its host buffer and note where
        its bytes lie in the graphs' memory, so that the replays can copy them out after the layer's forward
        graph. The capture queues nothing: the storage counts as copied, and the release drops it as usual,
        from the graph that releases it on (whose replay waits for the copies: :meth:`_take_copies_between`)."""
        planned = []
        for rec in self._offload_candidates(layer):
            if (host := self._or_warn(layer, rec.borrow_host)) is None:
                continue
            rec.host, rec.queued = host, rec.nbytes
            # the buffer itself: the record gives it back once the captured backward is done with it, and the
            # pool keeps it for the graphs, which reload from it in every replay
            planned.append((rec, host.data))
            self._count_offloaded(layer, rec.nbytes, rec.views)
        self._between[layer] = planned
        self.events.append(("offload_start", layer))

    def _keep_resized_between(self, layer: int) -> None:
        """Before the release of a layer whose copies the replays make: a storage resized since its layer ended
        (``resize_``, as FSDP frees and gathers again) is not what the replays would copy; it stays on the
        device, as one resized before its copy began does in any step, and its host buffer goes back."""
        for rec, data in [(r, d) for r, d in self._between[layer] if r.device is not None and r.resized()]:
            self._warn_once("resized", f"a storage saved in layer {layer} was resized before its copy to the host "
                                       "began (resize_): it stays on the device")
            rec.host.for_graph = False  # no graph copies into it or reloads from it: back to the free buffers
            rec.detach_host()
            self._between[layer].remove((rec, data))
            self.stats[layer].candidate_bytes -= rec.nbytes  # counted as planned: no longer offloaded, nor resident
            self._count_offloaded(layer, rec.nbytes, rec.views, sign=-1)

    def _half_copied(self, layer: int) -> list:
        """The storage of ``layer`` copied out in part (at most one): still on the device and unresized,
        else its buffer goes back and it stays where it is."""
        half = [r for r in self._records[layer] if r.host is not None and r.queued < r.nbytes]
        for rec in half:
            if rec.device is not None and rec.resized():
                self._warn_once("resized", f"a storage saved in layer {layer} was resized before its copy to the "
                                           "host ended (resize_): it stays on the device")
                rec.detach_host()
                self.stats[layer].candidate_bytes -= rec.nbytes  # as for one resized before its copy began
        return [r for r in half if r.host is not None and r.device is not None]

    def _start_deferred_reloads(self, entry: int) -> None:
        """Per-layer graphs: copy back, in the graph of the backward of ``entry``, a share of the reloading
        layers' bytes, spread over the backwards left before each layer's own (:func:`_even_rate`: all of
        it by the last, and room left for the reloads still to start), the layer whose backward comes first
        first, whole storages and pieces of large ones as the copies out are. A layer's reload takes longer
        than one layer's backward, and a copy forked in a graph must end in it: spread evenly, the copies
        hide behind the backwards between the reload's start and the layer's own, as in an eager step,
        where a whole large storage would stretch the one graph that copies it. The tensors a backward
        reads first come first."""
        if not self._deferred_reloads:  # an eager step, or nothing left to reload
            return
        capturing, jobs, pending = self.capturing(), [], []
        for layer, records in self._deferred_reloads:
            left = [r for r in records if r.device is None and r.host is not None and not r.aborted]
            jobs.append((entry - layer, layer, left, sum(r.nbytes - r.loaded for r in left)))
        # the layers whose reloads start at a later backward copy in these graphs too
        coming = [(entry - j, sum(r.nbytes for r in self._records[j] if r.device is None and r.host is not None))
                  for j in range(entry) if self.layer_state[j] == LayerState.RELEASED]
        budget = _even_rate([(job[0], job[-1]) for job in jobs] + coming)
        try:
            for _, layer, left, nbytes in sorted(jobs, key=lambda job: job[:2]):
                for rec, stop in _paced(left, min(budget, nbytes), [r.loaded for r in left]):
                    rec.check_capture("reloaded", capturing)
                    budget -= stop - rec.loaded
                    self._load(rec, stop)
                if any(r.device is None for r in left):
                    pending.append((layer, left))
        except BaseException:
            self._deferred_reloads = []  # what is still on the host reloads on demand
            raise
        self._deferred_reloads = pending

    def _per_layer_capture(self) -> bool:
        """Whether a graph being captured holds one layer's forward or backward, not the whole step."""
        return self.capture_scope == "layer" and self.capturing()

    def _waiting_bytes(self) -> int:
        """Bytes of the deferred layers' storages whose copies are not all queued yet: still on the device."""
        return sum(r.nbytes for layer, _, _ in self._deferred_offloads for r in self._records[layer]
                   if r.device is not None and (not r.tried or (r.host is not None and r.queued < r.nbytes)))

    @_disabled_for_dynamo
    def sync(self, x: torch.Tensor) -> torch.Tensor:
        """Mark ``x`` as the output of the layer that just ran; returns ``x``.

        The gradient of ``x`` arrives exactly when that layer's backward starts, so a hook on it
        is where the schedule starts reloads.
        """
        if self._inside == threading.get_ident():
            raise RuntimeError("sync must be called after leaving the offload context, not inside it")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"sync expects the layer's output tensor, got {type(x).__name__}")
        if not x.requires_grad or _in_backward() is not None:  # no backward of this step will come for it
            return x
        if x.grad_fn is None and self._thread().last:
            # The layer ran under no_grad and handed back a leaf that requires grad (its input, through
            # an Identity or an eval-mode Dropout): no layer of the step made it, so there is nothing to
            # mark. (An output with a grad_fn was made with grad enabled: a real layer's.)
            return x
        if self._entered == 0:
            raise RuntimeError("sync was called before any layer ran inside the offload context")
        layer = self._entered - 1
        self.counts.output(layer, x)
        trigger = _BackwardTrigger(self._ref, self.iteration, layer)
        handle = x.register_hook(trigger)
        with self._lock:
            if x.grad_fn is not None:  # it lives as long as the step's graph: what _step_abandoned asks
                self._triggers.append(weakref.ref(trigger))
            else:  # a leaf the caller keeps (the layer returned its input): the hook would stay on it
                self._leaf_hooks.append(handle)  # for good, so it is taken off when the step ends
        return x

    def _backward_started(self, iteration: int, layer: int) -> None:
        with self._lock:
            if iteration != self.iteration:
                if iteration == self.iteration - 1 and self.schedule.interleaved and self._entered and not self._backward_seen:
                    self._warn_once("late backward", f"the backward of entry {layer} of the previous step ran after "
                                    f"this step's forwards began, so its reloads were not scheduled: if one step enters "
                                    f"the context more than model_layers={self.model_layers} times, raise model_layers "
                                    "to the entries per step (layers x micro-batches)")
                return  # a graph kept from an older iteration (its views reload on demand)
            if layer in self._backwards:
                return  # a second backward through the same graph
            if self.schedule.expects_reload(layer) and self.layer_state[layer] != LayerState.RELOADING:
                error = RuntimeError(f"{self.schedule.describe(layer)}: the backward of layer {layer} started, "
                                     f"but the layer {self.layer_state[layer].value}{self._misaligned_hint()}")
                self._abort()  # the backward fails: nothing of this step is any good
                raise error
            if not self._backward_seen:
                self._check_iteration_shape()
                self._entries_since_backward = 0
            self._backward_seen = True
            self._backwards.add(layer)
            self.events.append(("backward", layer))
            ready = self._mark()
            waited = self._run_actions("backward", layer)
            self._start_deferred_reloads(layer)
            if self.capturing():  # the reloads forked here must be joined before this backward's capture ends
                torch.autograd.Variable._execution_engine.queue_callback(self.streams.join)
            self.resident_trace.append(("backward", layer, self.resident_bytes))
            self._note_phase("backward", layer, ready if waited else None)

    def _step_begins_again(self) -> None:
        """The caller knows that a new step begins (``offload_layers``: the layer that began the last
        step is called again), so a step still under way failed part-way, its graph perhaps held
        (a kept exception): it ends here, and what it offloaded stays readable on the host."""
        with self._lock:
            if self._inside is None and 0 < self._entered < self.model_layers and not self._backward_seen:
                self._new_iteration()

    def _step_abandoned(self) -> bool:
        """Whether the current step's graph was dropped before its backward (a layer's output, or a saved
        tensor, died unused) and nothing of it waits for a backward any more: the step failed between
        two layers. (A graph someone still holds, a kept exception's frames say, is not over yet.)"""
        if not self._graph_dropped or self.live_views:
            return False
        return not any((t := ref()) is not None and not t.fired for ref in self._triggers)

    def _misaligned_hint(self) -> str:
        if not self.continued_without_backward:
            return ""
        return (f" (this step began while the last one still waited for its backward: if one step enters the "
                f"context more than model_layers={self.model_layers} times, raise model_layers to the entries per "
                "step; if the last step failed and its graph is still held, reset() ends it)")

    def _remove_leaf_hooks(self) -> None:
        for handle in getattr(self, "_leaf_hooks", ()):
            handle.remove()
        self._leaf_hooks: list[torch.utils.hooks.RemovableHandle] = []


def _even_rate(jobs: list[tuple[int, int]]) -> float:
    """Per-layer graphs: the fewest bytes this graph must copy for every job, ``(graphs left to its
    deadline, this one included; bytes left)``, to be met at an even rate from here on: the largest, over
    the deadlines, of the bytes due by one over the graphs left to it. Each graph then copies about as much
    as the next, where shares taken layer by layer would crowd the graphs in which several layers copy."""
    rate, due = 0.0, 0
    for graphs, nbytes in sorted(jobs):
        due += nbytes
        rate = max(rate, due / max(graphs, 1))
    return rate


def _paced(records: list, share: float, done: list[int]) -> list[tuple[object, int]]:
    """Per-layer graphs: the copies to queue in one graph so that about ``share`` bytes of ``records`` move
    (``done``: each one's bytes queued already), as ``(record, stop)``: whole storages in order, and a
    piece of the next one where a whole one would exceed the share, never smaller than ``MIN_PIECE_BYTES``
    (too small a piece to be worth a copy of its own: a later graph takes it). At least one."""
    out, left = [], share
    for rec, start in zip(records, done):
        rest = rec.nbytes - start
        if left <= 0 or (left < min(rest, MIN_PIECE_BYTES) and left < share):
            break
        piece = rest if rest <= left else min(rest, max(int(left), MIN_PIECE_BYTES))
        out.append((rec, start + piece))
        left -= piece
    return out
