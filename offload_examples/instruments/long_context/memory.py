"""A training step's peak device memory, and a device-memory limit, on a GPU and on a CPU.

On a GPU the step's peak is CUDA's ``max_memory_allocated`` and the limit is the caching allocator's
own (:func:`device_memory_limit` sets ``torch.cuda.set_per_process_memory_fraction``): a step over it
raises ``torch.OutOfMemoryError`` as on a smaller GPU.

A CPU has no device memory to run out of, so :class:`CpuMemoryMeter` counts it the way CUDA's allocator
would: every storage an operation allocates during the step is added when it is made and taken away when
it is freed (a weak reference's callback), on top of ``base_bytes`` (weights, optimizer state). What the
offload engine copies to host buffers is host memory, not device memory: the bytes its pools hold are
left out. Over ``limit_bytes`` the meter raises ``torch.OutOfMemoryError`` before the next operation
runs, so a search for the longest sequence meets real refusals in the middle of a step on a CPU too.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from offload_examples.core.host_pool import HostBufferPool

__all__ = ["CpuMemoryMeter", "OutOfMemoryError", "device_memory_limit", "expandable_segments", "held_bytes",
           "single_thread_on_cpu", "step_memory"]

#: What running out of device memory raises: ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``
#: before torch 2.5, the same class since).
OutOfMemoryError = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def _storages(values: Any, out: list[torch.UntypedStorage] | None = None) -> list[torch.UntypedStorage]:
    """The storages of the tensors (and the storages) in an operation's arguments or results: nested tuples,
    lists and dicts (a plain walk: ``torch.utils._pytree`` took half of a metered step)."""
    out = [] if out is None else out
    if isinstance(values, torch.Tensor):
        out.append(values.untyped_storage())
    elif isinstance(values, torch.UntypedStorage):
        out.append(values)
    elif isinstance(values, (tuple, list)):
        for v in values:
            _storages(v, out)
    elif isinstance(values, dict):
        for v in values.values():
            _storages(v, out)
    return out


class CpuMemoryMeter(TorchDispatchMode):
    """Device memory of a CPU run as a GPU's allocator would count it, and a limit on it.

    Parameters
    ----------
    base_bytes:
        What is allocated before the block (weights, optimizer state): :func:`held_bytes`.
    limit_bytes:
        Most bytes allowed; ``None`` for no limit.
    host_pools:
        The offload engines' host pools: the bytes they hold are host memory, left out.

    Attributes
    ----------
    peak_bytes:
        The most bytes counted at once (``base_bytes`` included), read before every operation and at the end.
    """

    def __init__(self, base_bytes: int = 0, limit_bytes: int | None = None,
                 host_pools: Sequence[HostBufferPool] = ()):
        super().__init__()
        self.base_bytes, self.limit_bytes, self.host_pools = base_bytes, limit_bytes, tuple(host_pools)
        self.live = 0
        self.peak_bytes = base_bytes
        self._host_at_start = 0
        self._refs: dict[int, weakref.ref] = {}

    @property
    def now_bytes(self) -> int:
        """Bytes counted now: the base, plus what operations allocated and did not free, less host buffers."""
        host = sum(p.held_bytes for p in self.host_pools) - self._host_at_start
        return self.base_bytes + self.live - host

    def __enter__(self) -> CpuMemoryMeter:
        self._host_at_start = sum(p.held_bytes for p in self.host_pools)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self._check(raise_over=False)
        super().__exit__(*exc)

    def _check(self, raise_over: bool = True) -> None:
        now = self.now_bytes
        self.peak_bytes = max(self.peak_bytes, now)
        if raise_over and self.limit_bytes is not None and now > self.limit_bytes:
            raise OutOfMemoryError(f"CPU memory limit: {now} bytes counted > limit {self.limit_bytes} bytes")

    def _freed(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        self._check()  # the state the last operation left: over the limit, the next one is refused
        out = func(*args, **(kwargs or {}))
        given = {id(s) for s in _storages((args, kwargs))}
        for storage in _storages(out):
            key = id(storage)
            if key in given or key in self._refs:  # in place, a view, or counted already
                continue
            nbytes = storage.nbytes()
            self._refs[key] = weakref.ref(storage, lambda _, key=key, n=nbytes: self._freed(key, n))
            self.live += nbytes
        return out


def held_bytes(*holders: nn.Module | torch.optim.Optimizer | torch.Tensor) -> int:
    """Bytes of the distinct storages of modules (parameters, their gradients, buffers), optimizers
    (their state) and tensors: what a step starts with."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr() or id(s)] = s.nbytes()

    for h in holders:
        if isinstance(h, nn.Module):
            for p in h.parameters():
                add(p)
                add(p.grad)
            for b in h.buffers():
                add(b)
        elif isinstance(h, torch.optim.Optimizer):
            for state in h.state.values():
                for v in state.values():
                    add(v)
        else:
            add(h)
    return sum(seen.values())


@contextlib.contextmanager
def step_memory(device: torch.device, base_bytes: int = 0, limit_bytes: int | None = None,
                host_pools: Sequence[HostBufferPool] = ()) -> Iterator[dict[str, int]]:
    """Measure the block's peak device memory: ``{"peak_bytes": ...}`` once the block ends.

    On a GPU the limit is the allocator's (:func:`device_memory_limit`, set around the whole search),
    and ``base_bytes`` and ``host_pools`` are not needed; on a CPU a :class:`CpuMemoryMeter` counts and
    limits.
    """
    reading: dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield reading
        torch.cuda.synchronize(device)
        reading["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        return
    meter = CpuMemoryMeter(base_bytes, limit_bytes, host_pools)
    with meter:
        yield reading
    reading["peak_bytes"] = meter.peak_bytes


@contextlib.contextmanager
def device_memory_limit(device: torch.device, limit_bytes: int | None) -> Iterator[int | None]:
    """On a GPU, let the allocator hand out at most ``limit_bytes`` (``None``: all of the GPU) inside the
    block, and yield the limit in effect (the GPU's total memory without one); on a CPU yield
    ``limit_bytes`` (the meter applies it step by step)."""
    if device.type != "cuda":
        yield limit_bytes
        return
    index = device.index if device.index is not None else torch.cuda.current_device()  # the setter needs one
    total = torch.cuda.get_device_properties(index).total_memory
    if limit_bytes is None or limit_bytes >= total:
        yield total
        return
    torch.cuda.set_per_process_memory_fraction(limit_bytes / total, index)
    try:
        yield limit_bytes
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)


@contextlib.contextmanager
def expandable_segments(device: torch.device) -> Iterator[None]:
    """On a GPU, let CUDA's caching allocator grow its segments in place inside the block
    (``expandable_segments``): long sequences allocate large blocks of sizes that change with the
    length, and with fixed segments the memory reserved runs gigabytes ahead of the memory allocated,
    so a step runs out under a memory limit long before its tensors fill it."""
    # torch 2.11 moved the setter to the accelerator API and deprecated CUDA's own
    settings = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                or getattr(torch.cuda.memory, "_set_allocator_settings", None))
    # a setting of the user's own (PYTORCH_CUDA_ALLOC_CONF) is left as it is, and not undone afterwards
    users_own = "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if device.type != "cuda" or settings is None or users_own:
        yield
        return
    settings("expandable_segments:True")
    try:
        yield
    finally:
        settings("expandable_segments:False")


@contextlib.contextmanager
def single_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """On a CPU, run the block on one thread (a GPU run is left as it is).

    A CPU run is a model small enough for a CPU, metered operation by operation: its operations are too
    small to share among threads, and where other processes keep the cores busy, threads waiting for
    one another made its steps ten times slower than one thread alone.
    """
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
