"""The streams the engine works on, and the one way a copy crosses between them.

Compute runs on the caller's current stream. Device-to-host copies get their own stream so they
overlap with the forward; host-to-device copies get another so that, in the backward, a reload
never queues behind an offload (and both directions of PCIe are used at once).

Every copy between device and host memory in this package goes through :meth:`Streams.copy`,
and every use of its result on another stream through :meth:`Streams.use`. Together they keep
the three rules that make cross-stream copies safe with PyTorch's caching allocator:

1. **Wait for the producer.** The copy stream waits (on the device) for the stream or event
   that wrote the source, so the copy reads finished data.
2. **Record the end.** An event marks the end of the copy; a consumer waits for that event, not
   for the whole stream, so it never waits for unrelated copies.
3. **Mark every stream that touches a block.** The allocator hands a freed block back to the
   stream that allocated it (its *home*) without looking at other streams. So before the owner
   drops a device tensor, its home stream must have waited for every copy that read or wrote
   it (:meth:`Streams.fence`), and a consumer on any stream other than the home marks its use
   (``record_stream``), so the block is not reused while that stream may still read it.

On the CPU every wait and event is a no-op and copies run synchronously, so the engine executes
the same lines with or without a GPU.

Under a CUDA graph capture one more rule holds: CUDA ends a capture only when every stream forked
from the captured one has been joined back into it. A copy queued while the caller's stream is being
captured is such a fork; it stays open until :meth:`Streams.join` makes the captured stream wait
for it. Once joined, everything the captured stream runs later (in this capture, in later captures
on it, and in every replay, which runs the graphs in the order they were captured) comes after the
copy, so a wait for its event is not needed; and it would be forbidden when it crosses into
another capture. So waits for joined copies are skipped.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Protocol, Sequence, Union

import torch

__all__ = ["CopyObserver", "Streams", "resolve_device"]

# ``torch.cuda.current_stream`` builds a new Stream object on every call, which costs more host time
# than anything else the engine does per saved tensor. This read-out of the same value (the stream's
# id, device and type) builds nothing; where it is missing, the public call is used.
_current_stream_key = getattr(torch._C, "_cuda_getCurrentStream", None)

#: What a copy can be ordered after: all work queued on a stream so far, or one event.
After = Union[torch.cuda.Stream, torch.cuda.Event, None]


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """``device`` with its index: ``"cuda"`` becomes the current CUDA device, ``None`` the current
    CUDA device or the CPU. Saved tensors are compared with it, and ``cuda`` is not ``cuda:0``."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}, but this PyTorch has no CUDA (torch.cuda.is_available() is False): "
                         "pass device='cpu', or install a CUDA build of PyTorch")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class CopyObserver(Protocol):
    """Receives timing marks around copies (see :class:`offload_examples.instruments.timeline.StepRecorder`)."""

    def mark(self, stream: torch.cuda.Stream | None) -> object: ...

    def add_copy(self, lane: str, layer: int, start: object, end: object, nbytes: int) -> None: ...


class Streams:
    """Side streams for one device.

    Parameters
    ----------
    device:
        The compute device. For ``cpu`` no streams are created.
    offload_stream:
        Stream to use for device-to-host copies (Transformer Engine's ``offload_stream``);
        a new one when ``None``.
    """

    def __init__(self, device: torch.device, offload_stream: torch.cuda.Stream | None = None):
        self.device = device
        self.is_cuda = device.type == "cuda"
        if offload_stream is not None and not self.is_cuda:
            raise ValueError("offload_stream was given but the offload device is not a CUDA device")
        if offload_stream is not None and offload_stream.device != device:
            # its copies would wait for, and be waited on by, streams of another device
            raise ValueError(f"offload_stream is a stream of {offload_stream.device}, but the offload device is "
                             f"{device}: pass a stream of {device}")
        if self.is_cuda:
            # PyTorch hands out its pooled streams in turn, 32 of each priority, to whoever asks: a
            # copy stream from the default-priority pool would, once in 32 draws, be the very stream
            # the caller computes or captures on (its own torch.cuda.Stream(), torch.cuda.graph's
            # capture stream), and the copies would queue behind the kernels instead of running
            # beside them. Priority -2 has a pool of its own on GPUs with that many levels (Hopper
            # has four), which neither default streams nor FSDP2's (priority -1) come from; priority
            # orders kernels only, and these streams run copies.
            self.d2h = offload_stream or torch.cuda.Stream(device, priority=-2)
            self.h2d = torch.cuda.Stream(device, priority=-2)
        else:
            self.d2h = self.h2d = None
        #: Set to time every copy (the timeline's recorder); ``None`` costs nothing.
        self.observer: CopyObserver | None = None
        # (key, stream) of the last current stream seen, replaced as one object: threads (autograd's
        # run backward) may call current() at the same time, each with its own current stream.
        self._last_current: tuple[tuple, torch.cuda.Stream] | None = None
        #: Copies queued while their caller's stream was being captured and not joined back yet: (that
        #: stream, the copy's end). :meth:`join` closes them before the capture may end.
        self.forks: list[tuple[torch.cuda.Stream, torch.cuda.Event]] = []
        self._forks_lock = threading.Lock()  # autograd's threads fork reloads; its final callback joins

    def current(self) -> torch.cuda.Stream | None:
        """The compute stream: whatever stream the caller is running on now."""
        if not self.is_cuda:
            return None
        if _current_stream_key is None:
            return torch.cuda.current_stream(self.device)
        key = _current_stream_key(self.device.index)
        last = self._last_current
        if last is not None and last[0] == key:
            return last[1]
        stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        self._last_current = (key, stream)
        return stream

    def on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        """Make ``stream`` (one of this device's) current inside the block: allocations there belong to it."""
        if stream is None:
            return contextlib.nullcontext()
        if torch.cuda.current_device() != self.device.index:  # torch.cuda.stream also restores the device
            return torch.cuda.stream(stream)
        return _OnStream(stream, self.current())

    def copy(self, dst: torch.Tensor | Sequence[torch.Tensor], src: torch.Tensor | Sequence[torch.Tensor], *,
             on: torch.cuda.Stream | None, after: After | tuple[After, ...], lane: str = "", layer: int = -1,
             src_owned_elsewhere: bool = False) -> torch.cuda.Event | None:
        """Copy ``src`` into ``dst`` on stream ``on`` once ``after`` is done; return the copy's end event.

        ``after`` names what wrote ``src`` and what may still use ``dst``: streams (all their
        work queued so far) or events. The caller keeps both tensors alive until the returned
        event has been waited for by the stream that frees them (:meth:`fence`). When the caller
        cannot promise that for ``src`` (``src_owned_elsewhere``: a gradient the user may free
        with ``zero_grad``), the copy stream's use of it is marked on the allocator instead.
        ``dst`` and ``src`` may be equally long sequences: the copies are queued back to back, after
        the same waits, and one event marks the end of them all (the stream switch, the waits and the
        event are paid once per batch).
        """
        pairs = ((dst, src),) if isinstance(dst, torch.Tensor) else tuple(zip(dst, src, strict=True))
        if on is not None:
            for producer in after if isinstance(after, tuple) else (after,):
                if isinstance(producer, torch.cuda.Event):
                    if not _covered(producer, after):
                        on.wait_event(producer)
                elif producer is not None and producer != on:
                    on.wait_stream(producer)
        observer = self.observer
        start = observer.mark(on) if observer else None  # after the waits: when the copy can begin
        # A copy into or out of a tensor that requires grad would be recorded by autograd.
        tracked = any(d.requires_grad or s.requires_grad for d, s in pairs)
        with self.on(on), (torch.no_grad() if tracked else contextlib.nullcontext()):
            for d, s in pairs:
                d.copy_(s, non_blocking=on is not None)
                if src_owned_elsewhere and on is not None and s.is_cuda:
                    s.record_stream(on)
            done = on.record_event() if on is not None else None
        if done is not None and torch.cuda.is_current_stream_capturing():  # the caller's stream: a fork
            done.origin = self.current()
            with self._forks_lock:
                self.forks.append((done.origin, done))
        if observer:
            observer.add_copy(lane, layer, start, observer.mark(on), sum(d.numel() * d.element_size() for d, _ in pairs))
        return done

    @staticmethod
    def use(tensor: torch.Tensor, ready: torch.cuda.Event | None, stream: torch.cuda.Stream | None) -> None:
        """Let ``stream`` read ``tensor`` once the copy that filled it (``ready``) is done.

        ``record_stream`` does nothing when ``stream`` is the tensor's home; on any other stream
        it keeps the allocator from reusing the block until that stream's work is done.
        """
        if stream is None:
            return
        if ready is not None and not _covered(ready, stream):
            stream.wait_event(ready)
            _mark_joined(ready, stream)
        if tensor.is_cuda:
            tensor.record_stream(stream)

    @staticmethod
    def fence(stream: torch.cuda.Stream | None, *copies: torch.cuda.Event | None) -> None:
        """Make ``stream`` wait (on the device) for ``copies``: before it drops memory it allocated
        that they read or wrote, or before it reads what they wrote."""
        if stream is None:
            return
        for event in copies:
            if event is not None and not _covered(event, stream):
                stream.wait_event(event)
                _mark_joined(event, stream)

    def join(self) -> int:
        """Make each captured stream wait for the copies forked from it (:attr:`forks`): after this a
        capture may end. Marks them joined, so that later waits for them are skipped. Returns how many."""
        with self._forks_lock:
            forks, self.forks = self.forks, []
        joined = 0
        for stream, done in forks:
            if not _joined(done):  # a fence or a use may have joined it already
                stream.wait_event(done)
                done.joined = True
                joined += 1
        return joined

    def forget_forks(self) -> None:
        """Drop the record of forks whose capture is over (it ended, or failed): none needs a join any
        more, and a join now would wait on an event of another capture."""
        with self._forks_lock:
            self.forks = []

    @staticmethod
    def now(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event marking everything queued on ``stream`` so far (``None`` on the CPU)."""
        return stream.record_event() if stream is not None else None


def _joined(event: torch.cuda.Event) -> bool:
    """Whether ``event`` ends a copy already joined into the captured stream it was forked from."""
    return getattr(event, "joined", False)


def _covered(event: torch.cuda.Event, waiting: object) -> bool:
    """Whether a wait for ``event`` is covered already: the copy was joined into the stream it was
    forked from, and the waiting stream is that one (or, for a copy, one of the streams it waits for
    first, ``waiting`` being its producers)."""
    if not getattr(event, "joined", False):
        return False
    streams = waiting if isinstance(waiting, tuple) else (waiting,)
    return any(s is not None and s is not event and s == event.origin for s in streams)


def _mark_joined(event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
    """``stream`` has just waited for ``event``: if the copy was forked from ``stream`` under a capture,
    that wait joined it back."""
    if getattr(event, "origin", None) == stream:
        event.joined = True


class _OnStream:
    """``torch.cuda.stream(stream)`` for a stream of the current device, whose current stream is
    ``previous``: the same switch and switch back, without looking the current stream up again."""

    __slots__ = ("stream", "previous")

    def __init__(self, stream: torch.cuda.Stream, previous: torch.cuda.Stream):
        self.stream, self.previous = stream, previous

    def __enter__(self) -> None:
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self.previous)
