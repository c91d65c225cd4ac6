"""Host buffers for offloaded storages, reused across iterations.

Pinning host memory is slow (far slower than copying the same bytes over the link), so the engine
never pins on the hot path once training has reached a steady state: every offloaded storage
borrows a buffer of exactly its size from this pool and gives it back when autograd no longer
needs it. Training steps repeat the same shapes, so after the first step every request is met
from the free lists.

A buffer can be handed out again only after the last copy that touched it has finished. The
pool does not wait for that on the host: it stores the CUDA event of that copy with the buffer,
and the next user makes its copy stream wait on the event (a device-side wait, no host sync).

A CUDA graph bakes the addresses of the buffers it copies into and out of into its copy nodes,
and every replay uses them again. Buffers lent during a capture are therefore *kept for the
graph*: when they come back they leave circulation for good (never lent again, never freed by
:meth:`HostBufferPool.end_iteration` or :meth:`HostBufferPool.release`), so no eager step can
overwrite them and no replay can write into freed memory.

PyTorch's pinned allocator reserves the next power of two of every request (:func:`pinned_nbytes`), so
a pool that pins reserves more than it lends: it counts both, the bytes lent (``held_bytes``) and the
bytes pinned (``pinned_bytes``), and its limit applies to the pinned ones, the memory its buffers lock
(a buffer a non-retaining pool gives back leaves both counts but stays pinned in PyTorch's cache).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

import torch

__all__ = ["HostBuffer", "HostBufferPool", "HostMemoryLimitError", "NoFreeBufferError", "pinned_nbytes"]


def pinned_nbytes(nbytes: int, pinned: bool = True) -> int:
    """The host bytes a request of ``nbytes`` really takes.

    Parameters
    ----------
    nbytes:
        The bytes asked for.
    pinned:
        Whether the memory is pinned (``torch.empty(..., pin_memory=True)``).

    Returns
    -------
    int
        For pinned memory the next power of two at or above ``nbytes`` (0 for 0), else ``nbytes``.

    Notes
    -----
    PyTorch's caching host allocator keeps its free blocks in lists indexed by power-of-two size, so
    it rounds every request up to the next power of two before it pins (``PowerOf2Ceil`` in ATen's
    ``CachingHostAllocator``): a 288 MiB tensor locks 512 MiB of host memory. Unpinned memory comes
    from the ordinary allocator, which takes what is asked.
    """
    if not pinned or nbytes <= 0:
        return max(nbytes, 0)
    return 1 << (nbytes - 1).bit_length()


class HostMemoryLimitError(RuntimeError):
    """Raised by :meth:`HostBufferPool.acquire` when a buffer would exceed the host-memory cap (which counts
    the bytes pinning reserves, :func:`pinned_nbytes`)."""


class NoFreeBufferError(RuntimeError):
    """Raised by :meth:`HostBufferPool.acquire` when allocation is not allowed and none is free."""


@dataclass(eq=False)
class HostBuffer:
    """A flat ``uint8`` host tensor and the event its next user must wait for.

    Attributes
    ----------
    data:
        The host memory, pinned when the pool pins.
    ready:
        CUDA event recorded after the last copy that read or wrote ``data``; ``None`` when no
        copy is pending (always on CPU).
    for_graph:
        Lent during a CUDA graph capture: the graph owns it from then on.
    reserved:
        The host bytes ``data`` takes: :func:`pinned_nbytes` of its size when pinned, its size otherwise
        (the pool that allocates it sets it).
    """

    data: torch.Tensor
    ready: torch.cuda.Event | None = None
    used_in_iteration: int = field(default=-1)
    for_graph: bool = False
    reserved: int = 0

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class HostBufferPool:
    """Exact-size free lists of host buffers.

    Parameters
    ----------
    pin_memory:
        Allocate page-locked memory (needed for asynchronous device-to-host copies).
    retain:
        Keep returned buffers in the free lists for the next iteration (buffers not used in an
        iteration are dropped at its end). When ``False`` a returned buffer goes straight back to
        PyTorch's pinned-memory cache, where the next step or another context finds it.
    limit_bytes:
        Optional cap on the host bytes the pool may hold at once, counted as the OS sees them: each
        buffer as :func:`pinned_nbytes` (rounded up to a power of two when the pool pins, exact
        otherwise), i.e. against :attr:`pinned_bytes`; ``None`` for no cap.
    """

    def __init__(self, pin_memory: bool, retain: bool = True, limit_bytes: int | None = None):
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"host memory limit must be >= 0 bytes, got {limit_bytes}")
        self.pin_memory = pin_memory
        self.retain = retain
        self.limit_bytes = limit_bytes
        self._free: dict[int, list[HostBuffer]] = defaultdict(list)
        self._kept_for_graphs: list[HostBuffer] = []
        # reentrant: the garbage collector may free a graph (and give its buffers back) inside acquire()
        self._lock = threading.RLock()
        self._iteration = 0
        #: Bytes of host memory the pool holds (lent out or free), each buffer at the size asked for:
        #: what is comparable with the bytes offloaded.
        self.held_bytes = 0
        #: Most bytes the pool ever held at once (as :attr:`held_bytes` counts them).
        self.peak_bytes = 0
        #: Host bytes the pool's buffers really take (:func:`pinned_nbytes` of each when the pool pins):
        #: the pinned memory they lock, and what ``limit_bytes`` caps.
        self.pinned_bytes = 0
        #: Most bytes the pool ever took at once (as :attr:`pinned_bytes` counts them).
        self.peak_pinned_bytes = 0
        #: How many buffers were newly allocated (pinned) since the pool was made.
        self.allocations = 0
        #: When set, :meth:`acquire` never allocates: every buffer must come from the free lists.
        self.frozen = False

    def acquire(self, nbytes: int, *, for_graph: bool = False) -> HostBuffer:
        """Lend a buffer of exactly ``nbytes``; allocate one only if none is free.

        With ``for_graph`` (during a CUDA graph capture) or when the pool is :attr:`frozen`,
        nothing is allocated: pinning during a capture fails on many PyTorch releases, and a
        frozen pool promises fixed buffers. :class:`NoFreeBufferError` is raised instead.
        """
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                buf = free.pop()
                if not free:  # sizes come and go (dynamic shapes): keep no empty list behind
                    del self._free[nbytes]
            elif for_graph or self.frozen:
                raise NoFreeBufferError(
                    f"no free host buffer of {nbytes} bytes ({sum(map(len, self._free.values()))} free buffers "
                    f"of other sizes) and the pool may not allocate now"
                )
            else:
                buf = self._allocate(nbytes)
            buf.used_in_iteration = self._iteration
            buf.for_graph = buf.for_graph or for_graph
            return buf

    def _allocate(self, nbytes: int) -> HostBuffer:
        # the limit is on what the allocator reserves, not on what is asked: the OS runs out of the former
        reserved = pinned_nbytes(nbytes, self.pin_memory)
        if self.limit_bytes is not None and self.pinned_bytes + reserved > self.limit_bytes:
            rounded = f" ({reserved} reserved by the pinned allocator)" if reserved != nbytes else ""
            raise HostMemoryLimitError(
                f"offloading {nbytes} more bytes{rounded} would exceed the host memory limit of "
                f"{self.limit_bytes} bytes ({self.pinned_bytes} reserved)"
            )
        data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        self.allocations += 1
        self._count(nbytes, reserved)
        return HostBuffer(data, reserved=reserved)

    def _count(self, nbytes: int, reserved: int) -> None:
        """Add (or, below 0, take away) a buffer's bytes: asked for, and reserved."""
        self.held_bytes += nbytes
        self.pinned_bytes += reserved
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.peak_pinned_bytes = max(self.peak_pinned_bytes, self.pinned_bytes)

    def give_back(self, buf: HostBuffer, ready: torch.cuda.Event | None) -> None:
        """Return a buffer; ``ready`` is the event of the last copy that touched it.

        A pool that neither retains nor is frozen lets the buffer go at once, to PyTorch's
        pinned-memory cache: that cache waits for the copies queued on the memory by itself, and
        any other offload context in the process (or the next step) takes the memory from there
        instead of pinning afresh.
        """
        buf.ready = ready
        with self._lock:
            if buf.for_graph:  # a captured graph copies into it on every replay
                self._kept_for_graphs.append(buf)
            elif self.retain or self.frozen:
                self._free[buf.nbytes].append(buf)
            else:
                self._count(-buf.nbytes, -buf.reserved)

    def end_iteration(self, keep_free: bool = False) -> None:
        """Drop free buffers that the iteration just ended did not use (all, unless retaining).

        ``keep_free`` keeps every free buffer (a capture is starting and will need them).
        """
        with self._lock:
            for nbytes, bufs in list(self._free.items()):
                keep, drop = [], []
                for b in bufs:
                    kept = keep_free or (self.retain and b.used_in_iteration == self._iteration)
                    (keep if kept else drop).append(b)
                for b in drop:
                    self._count(-nbytes, -b.reserved)
                if keep:
                    self._free[nbytes] = keep
                else:
                    del self._free[nbytes]
            self._iteration += 1

    @property
    def graph_bytes(self) -> int:
        """Bytes kept for captured CUDA graphs (freed only with the pool)."""
        with self._lock:
            return sum(b.nbytes for b in self._kept_for_graphs)

    def release(self) -> None:
        """Free every buffer not currently lent out (buffers kept for graphs stay)."""
        with self._lock:
            for nbytes, bufs in self._free.items():
                for b in bufs:
                    self._count(-nbytes, -b.reserved)
            self._free.clear()

    @property
    def free_bytes(self) -> int:
        """Bytes held in the free lists (not lent out)."""
        with self._lock:
            return sum(n * len(b) for n, b in self._free.items())
