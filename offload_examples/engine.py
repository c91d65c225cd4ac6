"""The offload engine: the whole life of an offloaded tensor, in the order it happens.

1. **Saved.** Inside ``with ctx:`` autograd hands every tensor it saves for backward to
   :meth:`OffloadEngine._pack`. Weights, small tensors and tensors of layers that are not
   offloaded are returned unchanged. Any other tensor is looked up by its *storage*: the first
   tensor of a storage creates a :class:`_StorageRecord`, later tensors of the same storage
   (views, the same tensor saved again) reuse it, so each storage is copied once and views come
   back sharing memory. Autograd keeps a small :class:`_SavedView` instead of the tensor.
2. **Copied out.** The record copies the storage's bytes into a pinned host buffer on the
   device-to-host stream right away, after that stream has waited for the compute stream (the
   tensor has only just been written). An event marks the end of the copy.
3. **Released.** When the forward of layer ``N - k + i`` starts, layer ``i``'s records are
   released: the compute stream waits for each copy's event (on the device) and the engine drops
   its reference to the GPU memory, so the caching allocator can hand it to the next layer.
4. **Reloaded.** When the backward of layer ``i + max(1, N - 2 - k)`` starts (the gradient hook placed by
   ``sync``), new GPU memory is allocated on the compute stream and filled on the host-to-device
   stream; each record gets its own event.
5. **Used.** When autograd unpacks a :class:`_SavedView`, the compute stream waits for *that
   record's* reload event only, and the view is rebuilt with its dtype, shape, strides and offset.
6. **Freed.** When autograd drops the last :class:`_SavedView` of a record (after the layer's
   backward), the GPU memory is dropped and the host buffer goes back to the pool, tagged with the
   event of the last copy that touched it so its next user can wait for it.

Without a GPU the same code runs with CPU tensors: copies are synchronous and land in separate
host buffers, and the originals are released exactly when they would be on the GPU.

**Inside a CUDA graph capture** the same six steps are recorded instead of run: every copy, event
record and event wait above is a stream operation, so it becomes a node of the graph, and each
replay repeats them with no Python involved. Three things differ while capturing. Host buffers
must already exist (the engine never pins during a capture: it fails on many PyTorch releases,
and such a buffer would belong to that graph alone), so step 2 takes them from
the pool's free lists, filled by an eager warm-up step, and the pool keeps them for the graph from
then on. Step 2 does not wait for the buffer's last eager copy (``torch.cuda.graph`` synchronizes
the device before capture begins, and a capture may not wait on an event recorded outside it).
And a record may only be released, reloaded and used inside the capture that made it, so the
forward and backward of offloaded layers must be captured together (a whole training step).
Whatever cannot be captured raises :class:`GraphCaptureError` during the capture, so a graph
never replays with copies missing.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from dataclasses import dataclass
from types import TracebackType

import torch

from .host_pool import HostBuffer, HostBufferPool, HostMemoryLimitError, NoFreeBufferError
from .schedule import DefaultSchedule, RecordedSchedule, ResidentTrace, SyncDictSchedule
from .streams import Streams
from .timeline import StepRecorder

__all__ = [
    "GraphCaptureError", "LayerStats", "OffloadEngine", "OffloadSynchronizer", "OffloadWarning", "mark_not_offload",
]

_KEEP_ATTR = "_offload_examples_keep"
_active = threading.local()  # the engine whose context is open in this thread, if any


class OffloadWarning(UserWarning):
    """Something was not offloaded as asked, or was brought back later than planned."""


class GraphCaptureError(RuntimeError):
    """The engine was used in a way a CUDA graph cannot capture (raised during the capture).

    Also raised by eager steps after :meth:`OffloadEngine.freeze_host_buffers`, which follow
    the capture's rules without a GPU.
    """


def mark_not_offload(*tensors: torch.Tensor) -> None:
    """Keep these tensors on the device even when they are saved inside an offloaded layer.

    Use it for tensors that stay alive anyway (a cache the caller holds), where copying them
    out would cost bandwidth and save no memory.
    """
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mark_not_offload expects tensors, got {type(t).__name__}")
        setattr(t, _KEEP_ATTR, True)


@dataclass
class LayerStats:
    """What the engine did with one layer's saved tensors in the current iteration."""

    saved_tensors: int = 0
    #: Bytes of the distinct storages that could be offloaded (whether or not this layer is).
    candidate_bytes: int = 0
    offloaded_tensors: int = 0
    offloaded_storages: int = 0
    offloaded_bytes: int = 0
    kept_tensors: int = 0


def _is_weight_like(t: torch.Tensor) -> bool:
    """Parameters, leaves that require grad, their views, and autocast's casts of them."""
    for x in (t, t._base):
        if x is None:
            continue
        if isinstance(x, torch.nn.Parameter) or (x.requires_grad and x.grad_fn is None):
            return True
        fn = x.grad_fn
        # autocast saves `weight.to(bf16)`: a copy whose only input is a leaf's AccumulateGrad
        if fn is not None and type(fn).__name__ == "ToCopyBackward0":
            inputs = [f for f, _ in fn.next_functions if f is not None]
            if inputs and all(type(f).__name__ == "AccumulateGrad" for f in inputs):
                return True
    return False


def _in_place_error(layer: int) -> RuntimeError:
    return RuntimeError(
        f"a tensor saved for backward in layer {layer} was modified in place after it was saved, "
        "so its gradient would be wrong. Clone it before modifying it (autograd reports the same "
        "misuse without offloading)."
    )


class _Kept:
    """A saved tensor that stays on the device, with the version it was saved at.

    While saved-tensor hooks are active autograd no longer checks for in-place changes itself,
    so the engine does. The tensor is held detached: an output that held its own ``grad_fn``
    through this object would form a reference cycle (autograd restores the link on unpack).
    """

    __slots__ = ("tensor", "version", "layer")

    def __init__(self, t: torch.Tensor, layer: int):
        self.tensor = t.detach()
        self.version = t._version
        self.layer = layer

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise _in_place_error(self.layer)
        return self.tensor


class _StorageRecord:
    """One offloaded storage: its GPU bytes, its host copy, and the events that order them."""

    __slots__ = (
        "engine", "layer", "iteration", "nbytes", "original", "version", "original_ref",
        "device", "alloc_stream", "host", "offloaded", "reloaded", "views", "aborted", "captured",
    )

    def __init__(self, engine: OffloadEngine, layer: int, t: torch.Tensor):
        storage = t.untyped_storage()
        self.engine = engine
        self.layer = layer
        self.iteration = engine.iteration
        self.nbytes = storage.nbytes()
        # Held until release so an in-place change can be detected, then only weakly.
        self.original: torch.Tensor | None = t
        self.version = t._version
        self.original_ref = weakref.ref(t)
        #: Flat uint8 view of the whole storage on the device, or None while it lives on the host.
        self.device: torch.Tensor | None = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        self.alloc_stream = engine.streams.current()
        self.host: HostBuffer | None = None  # lent by the pool when the copy is queued
        self.offloaded: torch.cuda.Event | None = None
        self.reloaded: torch.cuda.Event | None = None
        self.views = 0
        self.aborted = False
        #: Made while a CUDA graph was being captured: it lives only inside that graph.
        self.captured = engine.capturing()

    def copy_out(self) -> None:
        """Borrow a host buffer and queue the device-to-host copy (step 2).

        Raises :class:`HostMemoryLimitError` (or the allocator's ``RuntimeError``) when no host
        buffer can be had; the storage then simply stays on the device. During a capture, or
        with frozen buffers, a missing buffer raises :class:`GraphCaptureError` instead: a graph
        that silently kept the tensor on the device would not be the step that was asked for.
        """
        try:
            self.host = self.engine.pool.acquire(self.nbytes, for_graph=self.captured)
        except NoFreeBufferError as err:
            raise _no_buffer_error(self.layer, self.captured, err) from None
        s = self.engine.streams
        s.wait_stream(s.d2h, self.alloc_stream)  # the tensor was just written on the compute stream
        if not self.captured:  # see the module docstring: the device was synchronized before capture
            s.wait(s.d2h, self.host.ready)  # the buffer's previous reload may still be reading it
        recorder = self.engine.recorder
        start = recorder.mark(s.d2h) if recorder else None  # after the waits: when the copy can begin
        with s.on(s.d2h), torch.no_grad():
            self.host.data.copy_(self.device, non_blocking=True)
        self.offloaded = s.record(s.d2h)
        if recorder:
            recorder.add_copy("device-to-host", self.layer, start, recorder.mark(s.d2h), self.nbytes)

    def check_capture(self, what: str) -> None:
        """Refuse to mix a capture's records with work outside that capture (and vice versa)."""
        now = self.engine.capturing()
        if self.captured == now:
            return
        if self.captured:
            raise GraphCaptureError(
                f"layer {self.layer}'s saved tensors were offloaded inside a CUDA graph capture but are "
                f"{what} outside it. Capture the forward and the backward of the offloaded layers in one "
                "graph (torch.cuda.graph around the whole training step)."
            )
        raise GraphCaptureError(
            f"layer {self.layer}'s saved tensors were offloaded before the CUDA graph capture began but are "
            f"{what} inside it. Begin the capture before the first layer's forward (capture whole steps)."
        )

    def check_version(self) -> None:
        t = self.original if self.original is not None else self.original_ref()
        if t is not None and t._version != self.version:
            raise _in_place_error(self.layer)

    def drop_device(self) -> None:
        """Forget the GPU bytes (step 3 and 6).

        The stream that allocated them first waits for the copies that read or wrote them, so
        the caching allocator can reuse the memory on that stream without racing a side stream.
        """
        if self.device is None:
            return
        s = self.engine.streams
        if self.captured == self.engine.capturing():
            s.wait(self.alloc_stream, self.offloaded)
            s.wait(self.alloc_stream, self.reloaded)
        # else the waits would cross a capture's edge, which CUDA forbids; they are not needed:
        # the device was synchronized before the capture, and a graph's copies finish inside it.
        self.device = None
        self.original = None

    def copy_in(self, compute: torch.cuda.Stream | None) -> None:
        """Allocate GPU bytes and queue the host-to-device copy (step 4).

        The caller has made the host-to-device stream wait for ``compute``, on which the new
        memory was allocated (it may be memory the compute stream used until just now).
        """
        s = self.engine.streams
        s.wait(s.h2d, self.offloaded)
        recorder = self.engine.recorder
        start = recorder.mark(s.h2d) if recorder else None
        with s.on(s.h2d), torch.no_grad():
            self.device.copy_(self.host.data, non_blocking=True)
        self.reloaded = s.record(s.h2d)
        if recorder:
            recorder.add_copy("host-to-device", self.layer, start, recorder.mark(s.h2d), self.nbytes)

    def free(self) -> None:
        """Give everything back once autograd no longer needs the storage (step 6)."""
        self.drop_device()
        if self.host is not None:
            last_copy = self.reloaded or self.offloaded
            self.engine.pool.give_back(self.host, last_copy)
            self.host = None


class _SavedView:
    """What autograd keeps instead of an offloaded tensor: how to rebuild it from its record."""

    __slots__ = ("record", "dtype", "size", "stride", "offset", "__weakref__")

    def __init__(self, record: _StorageRecord, t: torch.Tensor):
        self.record = record
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        record.views += 1

    def __del__(self) -> None:
        engine = self.record.engine
        try:
            engine._view_dropped(self.record)
        except Exception:  # never raise from a finaliser (interpreter shutdown, ...)
            pass


class OffloadEngine:
    """Context manager that offloads saved activations of selected layers.

    Enter it once per layer and pass each layer's output through :meth:`sync`; see
    :func:`offload_examples.get_cpu_offload_context`, which builds it.

    Parameters
    ----------
    schedule:
        Which layers are offloaded and when they are released and reloaded: a
        :class:`~offload_examples.DefaultSchedule` (copies start as tensors are saved), a
        :class:`~offload_examples.SyncDictSchedule` (copies start when a layer's forward ends,
        driven through :attr:`synchronizer`), or ``None`` for manual synchronization (you call
        :attr:`synchronizer`'s methods yourself).
    model_layers:
        Context entries per iteration; only with ``schedule=None`` (schedules carry their own).
    device:
        Tensors saved on this device are candidates; tensors elsewhere are kept as they are.
    min_offload_bytes:
        Storages smaller than this stay on the device (copying them costs more than it saves).
    retain_pinned_cpu_buffers:
        Keep host buffers from one iteration to the next (no pinning after the first step).
    offload_stream:
        Stream for device-to-host copies; a new one when ``None``.
    host_memory_limit:
        Most host bytes the pool may hold; beyond it tensors stay on the device (with a warning).
    """

    def __init__(
        self,
        schedule: DefaultSchedule | SyncDictSchedule | None,
        *,
        device: torch.device,
        model_layers: int | None = None,
        min_offload_bytes: int = 1024,
        retain_pinned_cpu_buffers: bool = False,
        offload_stream: torch.cuda.Stream | None = None,
        host_memory_limit: int | None = None,
    ):
        if not isinstance(min_offload_bytes, int) or min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be an int >= 0, got {min_offload_bytes!r}")
        if schedule is None:
            if not isinstance(model_layers, int) or isinstance(model_layers, bool) or model_layers < 1:
                raise ValueError(f"model_layers must be an int >= 1, got {model_layers!r}")
        elif model_layers is not None and model_layers != schedule.model_layers:
            raise ValueError(f"model_layers={model_layers} disagrees with the schedule's {schedule.model_layers}")
        self.schedule = schedule
        self.model_layers = schedule.model_layers if schedule is not None else model_layers
        #: Copy each tensor as it is saved (default schedule), or a whole layer when told to.
        self.copy_on_save = isinstance(schedule, DefaultSchedule)
        self.interleaved = schedule is None or schedule.interleaved
        #: Start offloads, releases and reloads by hand (TE's ``ManualOffloadSynchronizer`` API).
        self.synchronizer = OffloadSynchronizer(self)
        self.device = device
        self.min_offload_bytes = min_offload_bytes
        self.streams = Streams(device, offload_stream)
        self.pool = HostBufferPool(
            pin_memory=device.type == "cuda", retain=retain_pinned_cpu_buffers, limit_bytes=host_memory_limit
        )
        #: Set to ``True`` to log ``torch.cuda.memory_allocated()`` at each phase in :attr:`memory_trace`.
        self.record_memory = False
        #: Timing marks for one step (:func:`offload_examples.timeline.record_layer_timeline` sets it).
        self.recorder: StepRecorder | None = None
        self._lock = threading.RLock()  # views die and backward hooks run on autograd's threads
        self._warned: set[str] = set()
        self.iteration = -1
        self._in_layer = False
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._new_iteration()

    # ------------------------------------------------------------------ public read-outs
    @property
    def offloaded_bytes(self) -> int:
        """Bytes copied to host memory in the current (or last) iteration."""
        return sum(s.offloaded_bytes for s in self.stats)

    def theoretical(self) -> ResidentTrace:
        """The schedule's prediction for the bytes this iteration saved and offloaded.

        Its ``saving`` is the peak-memory saving to expect in theory; its ``points`` say how many
        offloaded bytes should be on the device at each phase (compare :attr:`resident_trace`).
        A :class:`~offload_examples.SyncDictSchedule` without an order is walked along the order
        the phases ran in; manual synchronization along the actions as they were called.
        """
        offloaded = [s.offloaded_bytes for s in self.stats]
        kept = [s.candidate_bytes - s.offloaded_bytes for s in self.stats]
        if isinstance(self.schedule, DefaultSchedule):
            return self.schedule.simulate(offloaded, kept)
        if isinstance(self.schedule, SyncDictSchedule):
            return self.schedule.simulate(offloaded, kept, self.schedule.order or self.phase_order())
        recorded = RecordedSchedule.from_events(self.events, self.model_layers)
        return recorded.simulate(offloaded, kept)

    def phase_order(self) -> list[tuple[str, int]]:
        """The order in which layer phases started in the current (or last) iteration."""
        return [(kind, j) for kind, j in self.events if kind in ("forward", "backward")]

    def release_buffers(self) -> None:
        """Free the pinned host buffers that are not in use (those of captured graphs stay)."""
        self.pool.release()

    def capturing(self) -> bool:
        """Whether the current CUDA stream is being captured into a graph (never on the CPU)."""
        return self.streams.is_cuda and torch.cuda.is_current_stream_capturing()

    def freeze_host_buffers(self) -> None:
        """Allocate no more host buffers: later steps reuse the ones made so far.

        A CUDA graph capture needs exactly this, and the engine behaves so by itself while
        capturing. Calling it after an eager warm-up step runs that graph-safe path eagerly (on
        a CPU too): buffers stay fixed, nothing is pinned per step, and a step that would need a
        new buffer raises :class:`GraphCaptureError` during its forward.
        """
        self.pool.frozen = True

    # ------------------------------------------------------------------ iterations
    def _new_iteration(self) -> None:
        """Forget the last iteration; its records that autograd still holds live on the host."""
        with self._lock:
            for records in getattr(self, "_records", []):
                for rec in records:
                    if rec.host is not None:  # never-offloaded records keep their only copy
                        rec.drop_device()
            if self.iteration >= 0:  # a capture starting now takes its buffers from the free lists
                self.pool.end_iteration(keep_free=self.capturing() or self.pool.frozen)
            self.iteration += 1
            n = self.model_layers
            self._records: list[list[_StorageRecord]] = [[] for _ in range(n)]
            self._by_storage: list[dict[int, _StorageRecord]] = [{} for _ in range(n)]
            self._seen: list[set[int]] = [set() for _ in range(n)]
            #: Where each layer is in its life this iteration (see :class:`OffloadSynchronizer`).
            self.layer_state: list[str] = ["not run"] * n
            self.stats = [LayerStats() for _ in range(n)]
            #: ``(kind, layer)`` in the order the engine acted (see the module docstring).
            self.events: list[tuple[str, int]] = []
            #: ``(phase, layer, bytes)``: offloadable bytes on the device at the end of each
            #: forward and at the start of each backward, as :meth:`DefaultSchedule.simulate` counts.
            self.resident_trace: list[tuple[str, int, int]] = []
            #: ``(phase, layer, bytes allocated on the device)`` when :attr:`record_memory` is set.
            self.memory_trace: list[tuple[str, int, int]] = []
            self.resident_bytes = 0
            self.live_views = 0
            self._entered = 0
            self._backward_seen = False
            self._backwards: set[int] = set()

    def _abort(self) -> None:
        """A layer's forward raised: give back every buffer and start afresh."""
        with self._lock:
            for records in self._records:
                for rec in records:
                    rec.aborted = True
                    rec.free()
            self._new_iteration()

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> OffloadEngine:
        if self._in_layer:
            raise RuntimeError("the offload context is already active: it cannot be nested")
        if getattr(_active, "engine", None) is not None:
            raise RuntimeError(
                "another offload context is already active in this thread: contexts cannot be nested "
                "(the inner one would take every tensor the outer one should see). Give each layer "
                "one context; two models may each have their own, entered one after the other."
            )
        if self.capturing() and self.recorder is not None:
            raise GraphCaptureError(
                "timing marks are read on the host after the step, which a CUDA graph replay never "
                "reaches: record a timeline of an eager step, or of a replay with the profiler"
            )
        with self._lock:
            n = self.model_layers
            if self.interleaved:  # the iteration ends once every entry's backward has run
                ended = self._entered == n and (len(self._backwards) == n or
                                                (self.live_views == 0 and not self._backward_seen))
            else:
                ended = self._backward_seen or (self._entered == n and self.live_views == 0)
            if ended:
                self._new_iteration()
            elif self._entered == n:
                raise RuntimeError(
                    f"the offload context was entered more than model_layers={n} times before "
                    + ("a backward pass" if not self.interleaved else
                       f"the backwards of entries {sorted(set(range(n)) - self._backwards)} ran")
                    + ". Set model_layers to the number of entries per iteration (layers x "
                    "micro-batches), and keep forwards that are not part of the step (a pipeline "
                    "stage's shape inference, an evaluation pass) outside the context."
                )
            j = self._entered
            self.layer_state[j] = "running"
            ready = self._mark()
            self._run_actions("forward", j)
            self.events.append(("forward", j))
            self._note_phase("forward", j, ready)
        self._layer = j
        self._in_layer = True
        _active.engine = self
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
        self._hooks = None
        self._in_layer = False
        _active.engine = None
        if exc_type is not None:
            self._abort()
            return
        with self._lock:
            j = self._layer
            self.layer_state[j] = "offloading" if self.copy_on_save and self.schedule.is_offloaded(j) else "saved"
            if isinstance(self.schedule, SyncDictSchedule) and self.schedule.is_offloaded(j):
                self._start_offload(j)
            self.resident_trace.append(("forward", j, self.resident_bytes))
            self._entered += 1

    def sync(self, x: torch.Tensor) -> torch.Tensor:
        """Mark ``x`` as the output of the layer that just ran; returns ``x``.

        The gradient of ``x`` arrives exactly when that layer's backward starts, so a hook on it
        is where the schedule starts reloads.
        """
        if self._in_layer:
            raise RuntimeError("sync must be called after leaving the offload context, not inside it")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"sync expects the layer's output tensor, got {type(x).__name__}")
        if self._entered == 0:
            raise RuntimeError("sync was called before any layer ran inside the offload context")
        if x.requires_grad:
            x.register_hook(functools.partial(_grad_hook, weakref.ref(self), self.iteration, self._entered - 1))
        return x

    # ------------------------------------------------------------------ the three actions
    def _start_offload(self, layer: int) -> None:
        """Queue the device-to-host copies of a layer whose saving was deferred (manual, dict)."""
        stats = self.stats[layer]
        for rec in self._records[layer]:
            if rec.host is not None or rec.device is None:
                continue
            try:
                rec.copy_out()
            except GraphCaptureError:
                raise
            except (HostMemoryLimitError, RuntimeError) as err:
                self._warn_once("host", f"keeping saved tensors of layer {layer} on the device: {err}")
                continue
            stats.offloaded_storages += 1
            stats.offloaded_bytes += rec.nbytes
            stats.offloaded_tensors += rec.views
            self.resident_bytes += rec.nbytes
        self.layer_state[layer] = "offloading"
        self.events.append(("offload_start", layer))

    def _release(self, layer: int) -> None:
        """Step 3: the compute stream waits for the copies, then the GPU memory is dropped."""
        for rec in self._records[layer]:
            if rec.device is not None and rec.host is not None:
                rec.check_capture("released")
                rec.check_version()
                rec.drop_device()
                self.resident_bytes -= rec.nbytes
        self.layer_state[layer] = "released"
        self.events += [("offload_finished", layer), ("release", layer)]

    def _reload(self, records: list[_StorageRecord]) -> None:
        """Step 4: allocate on the compute stream, copy on the host-to-device stream."""
        s = self.streams
        compute = s.current()
        todo = [r for r in records if r.device is None and r.host is not None and not r.aborted]
        for rec in todo:
            rec.check_capture("reloaded")
        for rec in todo:
            rec.device = torch.empty(rec.nbytes, dtype=torch.uint8, device=self.device)
            rec.alloc_stream = compute
            if rec.iteration == self.iteration:
                self.resident_bytes += rec.nbytes
        s.wait_stream(s.h2d, compute)
        for rec in todo:
            try:
                rec.copy_in(compute)
            except RuntimeError as err:  # CUDA refuses to wait on an event of another capture
                if not rec.captured:
                    raise
                raise GraphCaptureError(
                    f"layer {rec.layer}'s saved tensors were offloaded in one CUDA graph capture and are "
                    "reloaded in another (make_graphed_callables captures forward and backward separately). "
                    "Capture the forward and the backward of the offloaded layers in one graph."
                ) from err

    def _reload_layer(self, layer: int) -> None:
        self._reload(self._records[layer])
        self.layer_state[layer] = "reloading"
        self.events.append(("reload_start", layer))

    def _run_actions(self, phase: str, layer: int) -> None:
        """What a schedule asks for when ``phase`` of ``layer`` starts (nothing in manual mode)."""
        if self.schedule is None:
            return
        dict_mode = isinstance(self.schedule, SyncDictSchedule)
        for action, i in self.schedule.actions(phase, layer):
            state = self.layer_state[i]
            if action == "release":
                if dict_mode and state != "offloading":
                    raise RuntimeError(f"{self.schedule.describe(i)}: the release came at the {phase} of "
                                       f"layer {layer}, but layer {i} {_STATE_WORDS[state]}")
                self._release(i)
            else:
                if dict_mode and state != "released":
                    raise RuntimeError(f"{self.schedule.describe(i)}: the reload came at the {phase} of "
                                       f"layer {layer}, but layer {i} {_STATE_WORDS[state]}")
                self._reload_layer(i)

    def _backward_started(self, iteration: int, layer: int) -> None:
        with self._lock:
            if iteration != self.iteration:
                return  # a graph kept from an older iteration: its views reload on demand
            if isinstance(self.schedule, SyncDictSchedule) and self.schedule.is_offloaded(layer):
                state = self.layer_state[layer]
                if state != "reloading":
                    raise RuntimeError(f"{self.schedule.describe(layer)}: the backward of layer {layer} "
                                       f"started, but the layer {_STATE_WORDS[state]}")
            self._backward_seen = True
            self._backwards.add(layer)
            self.events.append(("backward", layer))
            ready = self._mark()
            self._run_actions("backward", layer)
            self.resident_trace.append(("backward", layer, self.resident_bytes))
            self._note_phase("backward", layer, ready)

    # ------------------------------------------------------------------ autograd hooks
    def _pack(self, t: torch.Tensor) -> _Kept | _SavedView:
        layer = self._layer
        stats = self.stats[layer]
        stats.saved_tensors += 1
        if self._keep(t):
            stats.kept_tensors += 1
            return _Kept(t, layer)
        if self.schedule is not None and not self.schedule.is_offloaded(layer):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._seen[layer]:  # counted for the theory only
                self._seen[layer].add(storage.data_ptr())
                stats.candidate_bytes += storage.nbytes()
            stats.kept_tensors += 1
            return _Kept(t, layer)
        with self._lock:
            rec = self._record_for(t, layer)
            if rec is None:
                stats.kept_tensors += 1
                return _Kept(t, layer)
            if self.copy_on_save:
                stats.offloaded_tensors += 1
            self.live_views += 1
            return _SavedView(rec, t)

    def _keep(self, t: torch.Tensor) -> bool:
        """Whether a saved tensor stays on the device (see the docs' caveats page)."""
        if t.device != self.device or _is_weight_like(t):
            return True
        if getattr(t, _KEEP_ATTR, False) or (t._base is not None and getattr(t._base, _KEEP_ATTR, False)):
            return True
        if type(t) is not torch.Tensor:
            self._warn_once("subclass", f"tensor subclass {type(t).__name__} is not offloaded")
            return True
        if t._base is not None and t._base.grad_fn is None:
            # A view of data autograd did not produce (a batch cut into micro-batches, a buffer):
            # its storage is owned outside the graph, so a copy would free nothing.
            return True
        if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg():
            return True
        nbytes = t.untyped_storage().nbytes()
        return nbytes == 0 or nbytes < self.min_offload_bytes

    def _record_for(self, t: torch.Tensor, layer: int) -> _StorageRecord | None:
        """The record of ``t``'s storage: found, or made (and, by default, copied out at once)."""
        storage = t.untyped_storage()
        known = self._by_storage[layer].get(storage.data_ptr())
        if known is not None and known.device is not None and known.nbytes == storage.nbytes():
            if known.version != t._version:
                raise _in_place_error(layer)
            return known
        rec = _StorageRecord(self, layer, t)
        self.stats[layer].candidate_bytes += rec.nbytes
        if self.copy_on_save:
            try:
                rec.copy_out()
            except GraphCaptureError:
                raise
            except (HostMemoryLimitError, RuntimeError) as err:
                self._warn_once("host", f"keeping saved tensors on the device: {err}")
                self.stats[layer].candidate_bytes -= rec.nbytes  # counted again as kept below
                self._seen[layer].add(storage.data_ptr())
                return None
            self.stats[layer].offloaded_storages += 1
            self.stats[layer].offloaded_bytes += rec.nbytes
            self.resident_bytes += rec.nbytes
        self._records[layer].append(rec)
        self._by_storage[layer][storage.data_ptr()] = rec
        return rec

    def _unpack(self, view: _SavedView | _Kept) -> torch.Tensor:
        if isinstance(view, _Kept):
            return view.unpack()
        rec = view.record
        if rec.aborted:
            raise RuntimeError(
                "this saved tensor belonged to a forward pass that raised an exception; "
                "its memory was given back. Run the forward again before calling backward."
            )
        rec.check_capture("used by backward")
        rec.check_version()
        if rec.device is None:
            if isinstance(self.schedule, SyncDictSchedule) and rec.iteration == self.iteration:
                raise RuntimeError(
                    f"{self.schedule.describe(rec.layer)}: backward needs layer {rec.layer}'s saved tensors "
                    "but their reload was never started (pass each layer's output through sync() so "
                    "backward triggers are seen)"
                )
            self._warn_once(
                "on_demand",
                f"layer {rec.layer}'s saved tensors were reloaded on demand (no overlap): "
                + ("call start_reload_layer() before its backward" if self.schedule is None else
                   "pass each layer's output through sync() so reloads start ahead of time"),
            )
            with self._lock:
                self._reload([rec])
        self.streams.wait(self.streams.current(), rec.reloaded)  # only this tensor's copy
        return torch.empty(0, dtype=view.dtype, device=self.device).set_(
            rec.device.untyped_storage(), view.offset, view.size, view.stride
        )

    def _view_dropped(self, rec: _StorageRecord) -> None:
        with self._lock:
            rec.views -= 1
            if rec.iteration == self.iteration:
                self.live_views -= 1
            if rec.views == 0 and not rec.aborted:
                if rec.device is not None and rec.host is not None and rec.iteration == self.iteration:
                    self.resident_bytes -= rec.nbytes
                rec.free()

    def _mark(self):
        return self.recorder.mark(self.streams.current()) if self.recorder else None

    def _note_phase(self, phase: str, layer: int, ready) -> None:
        """Log a phase that has started (its actions queued) for the memory and timing read-outs."""
        if self.record_memory and self.streams.is_cuda:
            self.memory_trace.append((phase, layer, torch.cuda.memory_allocated(self.device)))
        if self.recorder:
            self.recorder.add_phase(phase, layer, ready, self._mark())

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, OffloadWarning, stacklevel=3)


def _no_buffer_error(layer: int, captured: bool, err: NoFreeBufferError) -> GraphCaptureError:
    if captured:
        why = ("the engine does not pin host memory during a CUDA graph capture (it fails on many PyTorch "
               "releases). Run at least one eager step with the same shapes before capturing, so the pool "
               "holds every buffer")
    else:
        why = ("the host buffers were frozen (freeze_host_buffers), so a step may only use buffers that "
               "earlier steps made; this step saves a tensor of a size they did not")
    return GraphCaptureError(f"layer {layer}: {err}: {why}")


_STATE_WORDS = {
    "not run": "has not run its forward in this iteration",
    "running": "is still running its forward",
    "saved": "has not started its offload",
    "offloading": "has not been released (its release trigger has not come)",
    "released": "has not started its reload (its reload trigger has not come)",
    "reloading": "has already started its reload",
}


class OffloadSynchronizer:
    """Manual control of when each layer is offloaded, released and reloaded.

    Call-compatible with Transformer Engine's ``ManualOffloadSynchronizer``. A layer is one
    entry of the context in the current iteration; a layer never touched stays on the GPU.
    Backward waits for each reloaded tensor's own copy. Calls out of order raise at once.
    """

    def __init__(self, engine: OffloadEngine):
        self._engine = weakref.proxy(engine)

    def start_offload_layer(self, layer_id: int) -> None:
        """Queue layer ``layer_id``'s device-to-host copies (its forward must have ended)."""
        e = self._check(layer_id, "start_offload_layer", {"saved"})
        e._start_offload(layer_id)

    def release_activation_forward_gpu_memory(self, layer_id: int) -> None:
        """Make the compute stream wait for the layer's copies, then drop its GPU memory."""
        e = self._check(layer_id, "release_activation_forward_gpu_memory", {"offloading"})
        e._release(layer_id)

    def start_reload_layer(self, layer_id: int) -> None:
        """Queue layer ``layer_id``'s host-to-device copies (it must have been released)."""
        e = self._check(layer_id, "start_reload_layer", {"released"})
        e._reload_layer(layer_id)

    def _check(self, layer_id: int, what: str, allowed: set[str]) -> OffloadEngine:
        e = self._engine
        if e.schedule is not None and not isinstance(e.schedule, SyncDictSchedule):
            raise RuntimeError(f"{what}: this context follows {type(e.schedule).__name__}; "
                               "build it with manual_synchronization=True to drive it by hand")
        n = e.model_layers
        if not isinstance(layer_id, int) or isinstance(layer_id, bool) or not 0 <= layer_id < n:
            raise IndexError(f"{what}({layer_id!r}): layer index out of range [0, {n - 1}] (model_layers={n})")
        with e._lock:
            state = e.layer_state[layer_id]
            if state not in allowed:
                raise RuntimeError(f"{what}({layer_id}): layer {layer_id} {_STATE_WORDS[state]}")
        return e


def _grad_hook(engine_ref: weakref.ref, iteration: int, layer: int, grad: torch.Tensor) -> None:
    engine = engine_ref()
    if engine is not None:
        engine._backward_started(iteration, layer)
