"""The offload engine: the whole life of an offloaded tensor, in the order it happens.

1. **Saved.** Inside ``with ctx:`` of an offloaded layer, autograd hands every tensor it saves for
   backward to :meth:`OffloadEngine._pack` (once an iteration has counted what they save, other
   layers run without hooks: :class:`~offload_examples.core.readouts.LayerCounts`).
   :func:`~offload_examples.core.policy.keep_reason` keeps weights and small tensors
   on the device. Any other tensor is looked
   up by its *storage*: the first tensor of a storage creates a :class:`_StorageRecord`, later
   tensors of the same storage (views, the same tensor saved again) reuse it, so each storage is
   copied once and views come back sharing memory. Autograd keeps a small :class:`_SavedView`.
   The record remembers the stream the tensor was saved on, its *home*: autograd runs the
   backward of an operation on the stream its forward ran on, so that is where it will be read.
2. **Copied out.** When the layer's forward ends (in manual mode: when the caller says so), each
   record copies its storage's bytes into a pinned host buffer on the device-to-host stream, after
   that stream has waited for the home stream (the tensors have only just been written). The
   layer's copies are queued in one batch, and one event marks the end of them all: on a
   launch-bound step, a stream switch, a wait and an event per tensor cost more host time than the
   copies themselves. The copies then run under the next layers' compute.
3. **Released.** When the schedule says so (by default at the forward of layer ``N - k + i`` for
   layer ``i``), the home stream waits for the copy's event, on the device, and the engine drops
   its reference to the GPU memory, so the caching allocator can hand it to the next layer.
4. **Reloaded.** When the schedule says so (by default at the backward of layer
   ``i + max(1, N - 2 - k)``, seen through the gradient hook placed by ``sync``), new GPU memory
   is allocated *on the home stream*, so it returns to the pool of the stream that reads it, and
   filled on the host-to-device stream; each record gets its own event, and the storage saved last
   is copied first (backward reads it first). If something else kept
   the original memory alive since the release (the caller's batch, a later layer's saved
   tensor), the record only takes it back: backward reads it in place, as without offloading,
   and no duplicate is made. (The release counted those bytes as held: they freed nothing.)
5. **Used.** When autograd unpacks a :class:`_SavedView`, the current stream waits for *that
   record's* reload event only, marks its use of the memory (a no-op on the home stream), and
   the view is rebuilt with its dtype, shape, strides and offset.
6. **Freed.** When autograd drops the last :class:`_SavedView` of a record (after the layer's
   backward, or when a graph is dropped without one), the GPU memory is dropped after the home
   stream has waited for the copies, and the host buffer goes back to the pool, tagged with the
   event of the last copy that touched it so that its next user can wait for it.

Which entries of ``with ctx:`` are layers of the step, when a new step begins, and when a layer's
backward starts are told in :mod:`~offload_examples.core.entries`.

Every copy goes through :meth:`Streams.copy <offload_examples.core.streams.Streams.copy>`, which
keeps the stream rules in one place. Records hold no reference to the engine and hold the saved
tensor detached, so a dropped graph frees its memory at once, without the garbage collector.
Without a GPU the same code runs with CPU tensors: copies are synchronous and land in separate
host buffers, and the originals are released exactly when they would be on the GPU.

**Inside a CUDA graph capture** the same steps are recorded instead of run (copies, event records
and waits are stream operations). Step 2 takes host buffers from the pool's free lists, kept by
``retain_pinned_cpu_buffers`` or :meth:`OffloadEngine.freeze_host_buffers` after an eager warm-up
(the engine never pins during a capture), and skips the wait for a buffer's last eager copy
(``torch.cuda.graph`` synchronizes first; a capture may not wait on an outside event). A record
lives only inside the capture that made it: forward and backward of offloaded layers are captured
together, or :class:`GraphCaptureError` is raised during the capture, never at replay.
"""

from __future__ import annotations

import operator
import threading
import warnings
import weakref
from collections.abc import Mapping

import torch

from .entries import EngineEntries, _disabled_for_dynamo
from .errors import (GraphCaptureError, OffloadWarning, aborted_step_error, capture_mismatch_error, in_place_error,
                     no_buffer_error, reload_never_started_error)
from .iteration import EngineIterations
from .layer_state import LayerState, LayerStats
from .host_pool import HostBuffer, HostBufferPool, NoFreeBufferError
from .readouts import EngineReadouts, LayerCounts
from .settings import EngineSettings, checked_settings
from .policy import (OUTSIDE_SELECTION, KeptTensor as _Kept, ModuleSelection, StorageWeakRef,
                     held_elsewhere, keep_reason, mark_not_offload, version_witness)
from .schedule import DefaultSchedule, ManualSchedule, SyncDictSchedule
from .streams import Streams, resolve_device
from .synchronizer import OffloadSynchronizer
from . import te_path

__all__ = [
    "GraphCaptureError", "LayerState", "LayerStats", "OffloadEngine", "OffloadWarning", "mark_not_offload",
]

class _StorageRecord:
    """One offloaded storage: its GPU bytes, its host copy, and the events that order them.

    It references the engine's streams and pool, never the engine, and the saved tensor only
    detached: no reference cycle can keep GPU memory alive after autograd lets go.
    """

    __slots__ = ("streams", "pool", "layer", "iteration", "nbytes", "home", "device", "original", "version",
                 "original_ref", "witness", "weak", "address", "host", "offloaded", "reloaded", "views", "aborted", "captured",
                 "tried", "last_saved", "slice_of_data", "queued", "loading", "loaded")

    def __init__(self, engine: OffloadEngine, layer: int, t: torch.Tensor, storage: torch.UntypedStorage,
                 home: torch.cuda.Stream | None, captured: bool):
        self.streams, self.pool = engine.streams, engine.pool
        self.layer, self.iteration = layer, engine.iteration
        self.nbytes = storage.nbytes()
        #: The stream the tensor was saved on: its backward reads it there, its reload is allocated there.
        self.home = home
        #: Flat uint8 view of the whole storage on the device, or None while it lives on the host.
        self.device: torch.Tensor | None = engine._no_bytes.new_empty(0).set_(storage)
        # Held (detached: same storage and version counter, no grad_fn) until release, so that an
        # in-place change can be detected; then only weakly.
        self.original: torch.Tensor | None = t.detach()
        self.version = t._version
        # After release: any live tensor sharing the version counter (a view's base often outlives it).
        self.original_ref = [weakref.ref(x) for x in (t, t._base) if x is not None]
        self.witness: torch.Tensor | None = None
        # The storage itself, weakly: alive after release only if something else holds it (step 4).
        self.weak, self.address = StorageWeakRef(storage), storage.data_ptr()
        self.host: HostBuffer | None = None  # attached once its copy is queued
        self.offloaded: torch.cuda.Event | None = None
        self.reloaded: torch.cuda.Event | None = None
        self.views = 0
        self.aborted = False
        #: Made while a CUDA graph was being captured: it lives only inside that graph.
        self.captured = captured
        self.tried = False  # a copy out was attempted (at most once)
        #: A slice of data autograd did not make (a micro-batch of the caller's batch): if someone else
        #: still holds the storage when the layer ends, copying it would move the whole buffer for nothing.
        self.slice_of_data = t.grad_fn is None and t.numel() * t.element_size() < self.nbytes
        #: When a tensor of this storage was last saved (the engine's count of saves): the reload order.
        self.last_saved = engine._saves
        #: Bytes whose copy to the host is queued: all or none, but for per-layer graphs (copy_piece).
        self.queued = 0
        self.loading, self.loaded = None, 0  # per-layer graphs: a reload's GPU bytes queued in part, and how many

    def borrow_host(self) -> HostBuffer:
        """Step 2, first half: a host buffer for the copy. Raises :class:`HostMemoryLimitError` (or the
        allocator's ``RuntimeError``) when none can be had, and :class:`GraphCaptureError` when none
        may be made now; the storage then simply stays on the device."""
        self.tried = True
        try:
            return self.pool.acquire(self.nbytes, for_graph=self.captured)
        except NoFreeBufferError as err:
            raise no_buffer_error(self.layer, self.captured, err) from None

    @staticmethod
    def copy_out(records: list[_StorageRecord], hosts: list[HostBuffer]) -> list[_StorageRecord]:
        """Step 2: queue the device-to-host copies of ``records`` (saved on one home stream) into ``hosts``.

        The copies wait for the home stream (the tensors have only just been written) and for each
        buffer's previous reload, which may still read it (not during a capture: the device was
        synchronized before it began); they run back to back and one event marks their end. The
        buffers are attached only once the copies are queued, so a failed copy can never leave an
        unwritten buffer to be reloaded; on failure they go back to the pool. Returns ``records``.
        """
        first = records[0]
        s = first.streams
        # buffers freed together share one ready event: wait for each event once
        after = (first.home,) if first.captured else (first.home, *dict.fromkeys(h.ready for h in hosts))
        try:
            done = s.copy([h.data for h in hosts], [r.device for r in records], on=s.d2h, after=after,
                          lane="device-to-host", layer=first.layer)
        except BaseException:
            queued = Streams.now(s.d2h)  # the copies queued before the failure still write some buffers
            for host in hosts:
                first.pool.give_back(host, queued or host.ready)
            raise
        for rec, host in zip(records, hosts):
            rec.offloaded, rec.host, rec.queued = done, host, rec.nbytes
        return records

    def copy_piece(self, host: HostBuffer, stop: int) -> bool:
        """Per-layer graphs: queue the copy of bytes ``[queued, stop)`` into ``host`` in the graph being
        captured, which joins it at its exit. The buffer is attached at the first piece; the release
        comes after the last (entries.py); a storage left half copied stays (``detach_host``)."""
        s = self.streams
        try:
            self.offloaded = s.copy(host.data[self.queued:stop], self.device[self.queued:stop], on=s.d2h,
                                    after=(self.home,), lane="device-to-host", layer=self.layer)
        except BaseException:
            if self.host is None:  # its first piece: the buffer is no one's yet
                self.pool.give_back(host, Streams.now(s.d2h) or host.ready)
            raise
        self.host, self.queued = host, stop
        return stop == self.nbytes

    def detach_host(self) -> None:  # a copy out left half done: the storage stays on the device
        self.pool.give_back(self.host, self.offloaded)
        self.host, self.offloaded, self.queued = None, None, 0

    def resized(self) -> bool:
        """Whether the storage was resized (``resize_``, as FSDP does to free and re-gather) since it was saved."""
        storage = self.device.untyped_storage()
        return storage.nbytes() != self.nbytes or storage.data_ptr() != self.address

    def check_capture(self, what: str, capturing: bool) -> None:
        """Refuse to mix a capture's records with work outside that capture (and vice versa)."""
        if self.captured != capturing:
            raise capture_mismatch_error(self.layer, self.captured, what)

    def shares_counter(self, t: torch.Tensor) -> bool:
        """Whether ``t`` surely shares the version counter of the tensor that made the record: the same
        tensor, or a view of the same base (an alias through ``.data`` has a counter of its own)."""
        base = t._base
        for ref in self.original_ref:
            x = ref()
            if x is not None and (x is t or x is base):
                return True
        return False

    def check_version(self) -> None:
        version = self.version
        held = self.original if self.original is not None else self.witness
        if held is not None and held._version != version:
            raise in_place_error(self.layer)
        for ref in self.original_ref:
            if (t := ref()) is not None and t._version != version:
                raise in_place_error(self.layer)

    def drop_device(self, capturing: bool, views_left: bool = True, waited: dict | None = None) -> None:
        """Steps 3 and 6: the home stream waits for the copies that read or wrote the GPU bytes,
        then they are dropped, so the allocator can reuse them on that stream without a race.

        ``waited``: a dict that a caller dropping many records at once passes to each. A layer's
        records share one copy event per home stream, so the wait (a driver call) is queued once.
        """
        if self.loading is not None:  # a reload queued in part: its bytes go as a whole reload's would
            self.device, self.loading, self.loaded = self.loading, None, 0
        if self.device is None:
            return
        if self.captured == capturing:
            key = (id(self.home), id(self.offloaded), id(self.reloaded))  # all alive while the caller loops
            busy = waited.get(key) if waited is not None else None
            if busy is None:
                Streams.fence(self.home, self.offloaded, self.reloaded)
                busy = (not capturing and self.reloaded is None and self.offloaded is not None
                        and not self.offloaded.query())
                if waited is not None:  # a copy seen running may have ended since: marking stays safe
                    waited[key] = busy
            if busy:
                # The copy out still reads the block, which may belong to another stream's pool
                # than the home's (a tensor made on one stream and saved on another): mark it.
                self.device.record_stream(self.streams.d2h)
        # else the waits would cross a capture's edge, which CUDA forbids; they are not needed:
        # the device was synchronized before the capture, and a graph's copies finish inside it.
        self.device = None
        if self.original is not None and views_left:  # keep its version counter, not its storage:
            self.witness = version_witness(self.original)  # an in-place change is still caught at unpack
        self.original = None

    def copy_in(self, stop: int | None = None) -> None:
        """Step 4: allocate GPU bytes on the home stream and queue the host-to-device copy of bytes ``[loaded,
        stop)`` (all that is left by default; per-layer graphs copy large storages back in pieces), or take back
        the original memory if it is still alive (no copy: the bytes never left)."""
        s, start, stop, device = self.streams, self.loaded, self.nbytes if stop is None else stop, self.loading
        if device is None:
            alive = torch.UntypedStorage._new_with_weak_ptr(self.weak.cdata)
            if alive is not None and alive.data_ptr() == self.address and alive.nbytes() == self.nbytes:
                self.device = torch.empty(0, dtype=torch.uint8, device=s.device).set_(alive)
                return
            with s.on(self.home):
                device = torch.empty(self.nbytes, dtype=torch.uint8, device=s.device)
        part = stop - start < self.nbytes  # a piece: a view of each side
        # The new block may be memory the home stream used until just now.
        self.reloaded = s.copy(device[start:stop] if part else device, self.host.data[start:stop] if part else
                               self.host.data, on=s.h2d, after=(self.home, self.offloaded), lane="host-to-device",
                               layer=self.layer)
        # only once its copy is queued: a failed copy leaves nothing unwritten to read
        self.device, self.loading, self.loaded = (device, None, 0) if stop == self.nbytes else (None, device, stop)

    def free(self, capturing: bool) -> None:
        """Step 6: give everything back once autograd no longer needs the storage."""
        self.drop_device(capturing, views_left=False)  # nothing will be unpacked: no witness needed
        if self.host is not None:
            self.pool.give_back(self.host, self.reloaded or self.offloaded)
            self.host = None


class _SavedView:
    """What autograd keeps instead of an offloaded tensor: how to rebuild it from its record.

    ``witness`` is ``None`` when the tensor shares its record's version counter (the first tensor
    saved of the storage, views of it, the same tensor saved again): the record checks it. A tensor
    on its own counter (an alias made through ``.data``) brings a witness of its own, so that an
    in-place change is caught exactly where autograd would catch it: through that tensor's counter.
    """

    __slots__ = ("record", "engine_ref", "dtype", "size", "stride", "offset", "witness", "version", "used")

    def __init__(self, record: _StorageRecord, t: torch.Tensor, engine_ref: weakref.ref[OffloadEngine],
                 own_counter: bool = False):
        self.record, self.engine_ref = record, engine_ref
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        self.version = t._version
        self.witness = version_witness(t.detach()) if own_counter else None
        self.used = False  # unpacked by a backward: a view dropped unused tells of a graph dropped
        record.views += 1

    def check_version(self) -> None:
        if self.witness is None:
            self.record.check_version()
        elif self.witness._version != self.version:
            raise in_place_error(self.record.layer)

    def __del__(self) -> None:
        try:
            engine = self.engine_ref()
            if engine is not None:
                engine._view_dropped(self.record, self.used)
            else:  # the engine is gone: free the record by itself
                self.record.views -= 1
                if self.record.views == 0 and not self.record.aborted:
                    self.record.free(capturing=False)
        except Exception as err:  # a finaliser must not raise; say what leaked instead
            try:
                warnings.warn(f"freeing a saved tensor of layer {self.record.layer} failed: {err!r}", OffloadWarning)
            except Exception:  # interpreter shutdown: nothing left to warn with
                pass


class OffloadEngine(EngineEntries, EngineIterations, EngineReadouts, EngineSettings):
    """Context manager that offloads saved activations of selected layers.

    Enter it once per layer and pass each layer's output through :meth:`sync`; see
    :func:`offload_examples.get_cpu_offload_context`, which builds it.

    Parameters
    ----------
    schedule:
        Which layers are offloaded and when they are released and reloaded: a
        :class:`~offload_examples.DefaultSchedule`, a
        :class:`~offload_examples.SyncDictSchedule` (copies start when a layer's forward ends in both),
        or a :class:`~offload_examples.core.schedule.ManualSchedule` (``None`` builds one from
        ``model_layers``): nothing happens until :attr:`synchronizer`'s methods are called.
    model_layers:
        Context entries per iteration; only with ``schedule=None`` (schedules carry their own).
    device:
        Tensors saved on this device are candidates; tensors elsewhere are kept as they are.
    min_offload_bytes:
        Storages smaller than this stay on the device (copying them costs more than it saves).
    retain_pinned_cpu_buffers:
        Keep host buffers from one iteration to the next (no pinning after the first step);
        otherwise they go back to PyTorch's pinned-memory cache, where other contexts find them.
    offload_stream:
        Stream for device-to-host copies; a new one when ``None``.
    host_memory_limit:
        Most pinned host bytes the pool may reserve (``pinned_nbytes`` per buffer); beyond it tensors stay on device.
    max_offload_bytes_per_layer:
        Most bytes one layer offloads per iteration; storages saved after that stay on the device
        (storages in the order they are saved, each while it still fits). One int for every
        offloaded layer, or ``{layer: bytes}`` for some of them (the others have no cap; the
        planner caps the last layer it offloads so). ``None``: no cap.
    count_every_layer:
        Hook and count every layer in every iteration. ``None``: only when the schedule offloads no
        layer (a probe); otherwise layers not offloaded run without hooks after the first iteration.
    """

    def __init__(
        self,
        schedule: DefaultSchedule | SyncDictSchedule | ManualSchedule | None,
        *,
        device: torch.device,
        model_layers: int | None = None,
        min_offload_bytes: int = 1024,
        retain_pinned_cpu_buffers: bool = False,
        offload_stream: torch.cuda.Stream | None = None,
        host_memory_limit: int | None = None,
        max_offload_bytes_per_layer: int | Mapping[int, int] | None = None,
        count_every_layer: bool | None = None,
    ):
        self.schedule = schedule = checked_settings(schedule, model_layers, min_offload_bytes,
                                                    max_offload_bytes_per_layer)
        self.model_layers = schedule.model_layers
        #: Start offloads, releases and reloads by hand (TE's ``ManualOffloadSynchronizer`` API).
        self.synchronizer = OffloadSynchronizer(self)
        self.device = device = resolve_device(device)  # a bare "cuda" kept every tensor: it is not "cuda:0"
        self.min_offload_bytes = min_offload_bytes
        # a mapping is copied: a caller changing theirs later would skip the checks above
        caps = max_offload_bytes_per_layer
        self.max_offload_bytes_per_layer = dict(caps) if isinstance(caps, Mapping) else caps
        self.selection: ModuleSelection | None = None  # see offload_modules()
        self.streams = Streams(device, offload_stream)
        self.pool = HostBufferPool(pin_memory=device.type == "cuda", retain=retain_pinned_cpu_buffers,
                                   limit_bytes=host_memory_limit)
        self.record_memory = False
        self._ref = weakref.ref(self)  # what each saved view holds (a graph keeps the engine through its hooks)
        self._lock = threading.RLock()  # views die and backward hooks run on autograd's threads
        self._warned: set[str] = set()
        self.iteration = -1
        self._init_entries()
        # A flat byte tensor on the device without memory: records view storages through copies of it
        self._no_bytes = torch.empty(0, dtype=torch.uint8, device=device)
        #: Which layers are hooked; an engine that offloads nothing is a probe and counts every layer.
        probe = not any(map(schedule.is_offloaded, range(self.model_layers)))
        self.counts = LayerCounts(every_iteration=probe if count_every_layer is None else count_every_layer)
        self._new_iteration()

    # ------------------------------------------------------------------ controls (more: EngineSettings)
    def capturing(self) -> bool:
        """Whether the current CUDA stream is being captured into a graph (never on the CPU)."""
        return self.streams.is_cuda and torch.cuda.is_current_stream_capturing()

    # ------------------------------------------------------------------ the three actions
    def _start_offload(self, layer: int) -> None:
        """Step 2 for every record of ``layer`` not copied yet."""
        self._copy_out(self._offload_candidates(layer))
        self.events.append(("offload_start", layer))

    def _offload_candidates(self, layer: int) -> list[_StorageRecord]:
        """The records of ``layer`` to copy now: not tried yet, still on the device, not resized since they
        were saved, and not a slice of a buffer that someone else still holds."""
        stats, todo, capturing = self.stats[layer], [], self.capturing()
        for rec in self._records[layer]:
            if rec.tried or rec.device is None:
                continue
            rec.check_capture("copied to the host", capturing)  # a graph's bytes exist only in its replays
            resized = rec.resized()
            if resized:  # the copy would read bytes the storage no longer has: autograd reads what it holds now
                self._warn_once("resized", f"a storage saved in layer {layer} was resized before its copy to the host "
                                           "began (resize_): it stays on the device")
            if resized or (rec.slice_of_data and held_elsewhere(rec.device, ours=2)):
                rec.tried = True
                stats.candidate_bytes -= rec.nbytes
                continue
            todo.append(rec)
        return todo

    def _copy_out(self, records: list[_StorageRecord]) -> None:
        """Step 2 for ``records``: those that get a host buffer are copied, one batch per home stream
        (a layer's copies at its end pay the stream switch, the waits and the event once)."""
        batches: dict[torch.cuda.Stream | None, tuple[list[_StorageRecord], list[HostBuffer]]] = {}
        pending = []  # the batches not copied yet: on any failure their buffers go back
        try:
            for rec in records:  # a capture may refuse a buffer (GraphCaptureError) halfway
                if (host := self._or_warn(rec.layer, rec.borrow_host)) is None:
                    continue
                if rec.home not in batches:
                    batches[rec.home] = ([], [])
                    pending.append(batches[rec.home])
                batches[rec.home][0].append(rec)
                batches[rec.home][1].append(host)
            while pending:
                recs, hosts = pending.pop(0)
                copied = self._or_warn(recs[0].layer, _StorageRecord.copy_out, recs, hosts)
                if copied is None and len(recs) > 1:  # one failed copy keeps only its own tensor: one by one
                    pending[:0] = [([rec], [host]) for rec in recs
                                   if (host := self._or_warn(rec.layer, rec.borrow_host)) is not None]
                for rec in copied or ():
                    self._count_offloaded(rec.layer, rec.nbytes, rec.views)
        except BaseException:
            for host in (h for _, hosts in pending for h in hosts):
                self.pool.give_back(host, host.ready)
            raise

    def _release(self, layer: int, why: str) -> bool:
        """Step 3: the home stream waits for the copies, then the GPU memory is dropped. Returns whether any was."""
        self._move(layer, LayerState.RELEASED, why)
        capturing = self.capturing()
        dropped, waited = False, {}
        for rec in self._records[layer]:
            if rec.device is not None and rec.host is not None and rec.queued == rec.nbytes:
                rec.check_capture("released", capturing)
                if held_elsewhere(rec.device, ours=self._engine_refs(rec)):  # dropping frees nothing
                    self.stats[layer].held_bytes += rec.nbytes
                rec.drop_device(capturing, waited=waited)
                self.resident_bytes -= rec.nbytes
                dropped = True
        self.events += [("offload_finished", layer), ("release", layer)]
        return dropped

    def _engine_refs(self, releasing: _StorageRecord) -> int:
        """Tensors that the engine's records which will drop them hold on ``releasing``'s storage (a layer's
        output that the next layer saves too has a record in each); a record not copied out keeps it, as others do."""
        refs = 0
        for rec in self._by_impl.get(releasing.weak.cdata, ()):
            if rec.host is not None and rec.device is not None:
                refs += 1 if rec.original is None else 2
        return refs

    def _reload(self, records: list[_StorageRecord]) -> None:
        """Step 4 for the records that live on the host."""
        capturing = self.capturing()
        todo = [r for r in records if r.device is None and r.host is not None and not r.aborted]
        for rec in todo:
            rec.check_capture("reloaded", capturing)
        for rec in todo:
            self._load(rec)  # a copy out joined in an earlier capture needs no wait (Streams.join)

    def _load(self, rec: _StorageRecord, stop: int | None = None) -> None:  # resident from its first piece, which
        first = rec.loading is None  # allocates all of its block
        rec.copy_in(stop)
        if first and rec.iteration == self.iteration:
            self.resident_bytes += rec.nbytes

    def _reload_layer(self, layer: int, why: str) -> None:
        self._move(layer, LayerState.RELOADING, why)
        # Backward reads a layer's tensors about in the reverse order of their saving (its last
        # operation's first), and waits for each record's own copy: reloading the last saved first
        # lets it start on those while the rest still copy in. When the copies are the bound, only
        # the first tensors of a layer's backward wait for them, not the whole layer.
        records = sorted(self._records[layer], key=operator.attrgetter("last_saved"), reverse=True)
        if self._per_layer_capture():  # spread over the graphs of the backwards up to its own
            self._deferred_reloads.append((layer, records))
        else:
            try:
                self._reload(records)
            except BaseException:
                self.layer_state[layer] = LayerState.RELEASED  # a retry reloads what is still on the host
                raise
        self.events.append(("reload_start", layer))

    # ------------------------------------------------------------------ autograd hooks
    @_disabled_for_dynamo  # autograd calls the hooks from compiled code too: they must run as written
    def _pack(self, t: torch.Tensor) -> _Kept | _SavedView:
        """Autograd's pack hook (step 1): a :class:`~offload_examples.core.policy.KeptTensor` for a tensor the policy keeps (or while
        a layer that is not offloaded is counted), else a :class:`_SavedView` of its storage's record."""
        # It runs for every tensor a hooked layer saves, on the host's critical path when the forward
        # is launch bound: what can be looked up once per entry (_offloading) is.
        layer = self._layer
        stats = self.stats[layer]
        stats.saved_tensors += 1
        reason = keep_reason(t, self.device, self.min_offload_bytes)
        if reason is None:
            if (self.selection is not None or self.max_offload_bytes_per_layer is not None) \
                    and not self._chosen(t, layer):
                reason = OUTSIDE_SELECTION
        elif type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_nested:
            self._warn_once("subclass", f"{reason} is not offloaded")
        if reason is not None:
            stats.kept_tensors += 1
            return _Kept(t, layer)
        if not self._offloading:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._seen[layer]:  # counted for the theory only
                self._seen[layer].add(storage.data_ptr())
                stats.candidate_bytes += storage.nbytes()
                stats.candidate_sizes.append(storage.nbytes())
            stats.kept_tensors += 1
            return _Kept(t, layer)
        with self._lock:
            rec = self._record_for(t, layer)
            self.live_views += 1
            return _SavedView(rec, t, self._ref, own_counter=not rec.shares_counter(t))

    def _record_for(self, t: torch.Tensor, layer: int) -> _StorageRecord:
        """The record of ``t``'s storage: found, or made (its copy waits for the end of the layer)."""
        storage = t.untyped_storage()
        address = storage.data_ptr()
        known = self._by_storage[layer].get(address)
        self._saves += 1
        if known is not None and known.device is not None and known.nbytes == storage.nbytes() \
                and not (known.shares_counter(t) and known.version != t._version):
            known.last_saved = self._saves
            return known
        # (a storage written in place since its first save gets a record of its own: autograd refuses
        # the first save's use at its backward, if that ever comes, and this one's bytes are the new ones)
        rec = _StorageRecord(self, layer, t, storage, self.streams.current(), self.capturing())
        stats = self.stats[layer]
        stats.candidate_bytes += rec.nbytes
        stats.candidate_sizes.append(rec.nbytes)
        self._records[layer].append(rec)
        self._by_storage[layer][address] = rec
        self._by_impl.setdefault(rec.weak.cdata, []).append(rec)
        return rec

    @_disabled_for_dynamo
    def _unpack(self, view: _SavedView | _Kept) -> torch.Tensor:
        """Autograd's unpack hook (step 5): the kept tensor, or the view rebuilt on its record's
        device memory once the current stream has waited for that record's reload."""
        if isinstance(view, _Kept):
            return view.unpack()
        rec = view.record
        if rec.aborted:
            raise aborted_step_error()
        rec.check_capture("used by backward", self.capturing())
        view.check_version()
        view.used = True
        if rec.device is None:
            self._reload_on_demand(rec)
        Streams.use(rec.device, rec.reloaded, self.streams.current())  # only this tensor's copy
        return rec.device.new_empty(0, dtype=view.dtype).set_(rec.device.untyped_storage(), view.offset, view.size,
                                                              view.stride)

    def _reload_on_demand(self, rec: _StorageRecord) -> None:
        if self.schedule.expects_reload(rec.layer) and rec.iteration == self.iteration:
            raise reload_never_started_error(self.schedule.describe(rec.layer), rec.layer)
        hint = self.schedule.reload_hint
        if not self.schedule.interleaved and self._entered != self.model_layers:
            hint = (f"this step entered the context {self._entered} times, not model_layers={self.model_layers}, "
                    "so the layers whose backward starts the reloads did not run")
        self._warn_once("on_demand", f"layer {rec.layer}'s saved tensors were reloaded on demand (no overlap): {hint}")
        with self._lock:
            self._reload([rec])

    def _view_dropped(self, rec: _StorageRecord, used: bool) -> None:
        with self._lock:
            rec.views -= 1
            if rec.iteration == self.iteration:
                self.live_views -= 1
                self._graph_dropped = self._graph_dropped or not used
            if rec.views == 0 and not rec.aborted:
                held = rec.device is not None or rec.loaded  # whole on the device, or a reload's block
                if held and rec.queued == rec.nbytes and rec.iteration == self.iteration:
                    self.resident_bytes -= rec.nbytes  # counted once all of it was queued out
                rec.free(self.capturing())
