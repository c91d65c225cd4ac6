"""``get_cpu_offload_context``: the entry point, call-compatible with Transformer Engine's."""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Mapping, Union

import torch

from .engine import OffloadEngine
from .synchronizer import OffloadSynchronizer
from .schedule import DefaultSchedule, SyncDictSchedule
from .streams import resolve_device

__all__ = ["get_cpu_offload_context"]

SyncFunction = Callable[[torch.Tensor], torch.Tensor]
OffloadContext = Union[OffloadEngine, contextlib.nullcontext]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _disabled(manual_synchronization: bool) -> tuple:
    return (contextlib.nullcontext(), _identity) + ((None,) if manual_synchronization else ())


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: torch.cuda.Stream | None = None,
    *,
    synchronization_dict: Mapping[int, tuple[bool, int, bool, int]] | None = None,
    min_offload_bytes: int = 1024,
    host_memory_limit: int | None = None,
    device: torch.device | str | None = None,
    max_offload_bytes_per_layer: int | Mapping[int, int] | None = None,
    early_first_reload: bool = False,
) -> tuple[OffloadContext, SyncFunction] | tuple[OffloadContext, SyncFunction, OffloadSynchronizer | None]:
    """Build an offload context and its sync function.

    The nine positional parameters have the names, order and defaults of
    ``transformer_engine.pytorch.get_cpu_offload_context`` (Transformer Engine 2.x), so code
    written for one runs with the other, including callers such as Megatron-LM that pass all of
    them positionally. Everything after them is keyword-only and specific to this package::

        ctx, sync = get_cpu_offload_context(enabled=True, num_layers=4, model_layers=20)
        for layer in layers:
            with ctx:
                x = layer(x)
            x = sync(x)
        x.sum().backward()

    Parameters
    ----------
    enabled : bool, default False
        When ``False``, return ``(contextlib.nullcontext(), identity)`` (with a third element,
        ``None``, when ``manual_synchronization=True``) and check nothing else.
    num_layers : int, default 1
        ``k``: offload the saved activations of the first ``k`` layers (``0 <= k <= N - 1``).
        Ignored with ``manual_synchronization`` or ``synchronization_dict``.
    model_layers : int, default 1
        ``N``: how many times the context is entered per iteration.
    offload_activations : bool, default True
        Offload tensors saved for backward. With ``offload_weights=False`` too there is nothing
        to offload and a ``ValueError`` is raised.
    offload_weights : bool, default False
        Accepted for compatibility; has no effect beyond a ``DeprecationWarning``, as in
        Transformer Engine. With ``offload_activations=False`` the disabled contexts are
        returned. To keep weights in host memory, stream them with
        :class:`~offload_examples.StreamedLayers`.
    double_buffering : bool, default False
        Accepted for compatibility; has no effect: reloads are allocated per tensor.
    manual_synchronization : bool, default False
        Return a third element, an :class:`~offload_examples.OffloadSynchronizer`, and
        offload, release and reload layers only when its methods are called.
    retain_pinned_cpu_buffers : bool, default False
        Keep pinned host buffers from one iteration to the next, so no memory is pinned after
        the first step.
    offload_stream : torch.cuda.Stream or None, default None
        CUDA stream for device-to-host copies; a new one when ``None``. Allowed in every mode
        (Transformer Engine accepts it only with ``manual_synchronization=True``).
    synchronization_dict : dict or None, default None
        Keyword-only. ``{layer: (offload_fwd, offload_num, reload_fwd, reload_num)}``: a
        declarative schedule for any order of forwards and backwards (see
        :class:`~offload_examples.SyncDictSchedule`), run through the same synchronizer as manual
        mode. Not a Transformer Engine parameter in any release.
    min_offload_bytes : int, default 1024
        Keyword-only. Storages smaller than this stay on the device.
    host_memory_limit : int or None, default None
        Keyword-only. Most pinned bytes to hold, each host buffer counted as PyTorch's pinned
        allocator reserves it (rounded up to a power of two: ``pinned_nbytes``); tensors beyond it
        stay on the device (with a warning). ``None`` for no limit.
    device : torch.device, str or None, default None
        Keyword-only. The compute device; the current CUDA device when CUDA is available, else
        the CPU.
    max_offload_bytes_per_layer : int, dict of int to int, or None, default None
        Keyword-only. Most bytes one offloaded layer copies out per iteration; storages saved after
        that stay on the device (storages in save order, each while it still fits). An int caps
        every offloaded layer, ``{layer: bytes}`` only the layers named. ``None``: no cap. To offload only
        what some submodules save, see :meth:`~offload_examples.OffloadEngine.offload_modules`.
    early_first_reload : bool, default False
        Keyword-only. Start the reload needed first with the backward of layer ``N - 2``, one layer
        earlier (see :class:`~offload_examples.DefaultSchedule`): faster when the copies take longer
        than the compute, at a peak higher by about one layer's weight gradients. Only for the
        default schedule.

    Returns
    -------
    tuple
        ``(context, sync_function)``, or ``(context, sync_function, synchronizer)`` with
        ``manual_synchronization=True``. The context is an
        :class:`~offload_examples.OffloadEngine`, which also reports what it offloaded.

    Raises
    ------
    ValueError
        ``offload_activations`` and ``offload_weights`` both ``False``; ``num_layers`` outside
        ``[0, model_layers - 1]``; ``manual_synchronization`` together with
        ``synchronization_dict``; ``early_first_reload`` with either of them.
    TypeError
        Non-integer layer counts; an extra (``synchronization_dict`` or later) passed
        positionally.

    Warns
    -----
    DeprecationWarning
        ``offload_weights=True``.
    """
    del double_buffering  # accepted for compatibility; has no effect
    if not enabled:
        return _disabled(manual_synchronization)
    if not offload_activations and not offload_weights:
        raise ValueError("nothing to offload: offload_activations=False and offload_weights=False")
    if offload_weights:
        warnings.warn(
            "offload_weights=True has no effect (as in Transformer Engine, where it is deprecated): only "
            "activations are offloaded; to keep weights in host memory use offload_examples.StreamedLayers",
            DeprecationWarning,
            stacklevel=2,
        )
        if not offload_activations:
            return _disabled(manual_synchronization)
    if manual_synchronization and synchronization_dict is not None:
        raise ValueError("pass either manual_synchronization=True or a synchronization_dict, not both: "
                         "the dict drives the synchronizer itself")
    if early_first_reload and (manual_synchronization or synchronization_dict is not None):
        raise ValueError("early_first_reload belongs to the default schedule: with manual_synchronization or a "
                         "synchronization_dict, start the reloads where you want them")
    if manual_synchronization:
        schedule = None
    elif synchronization_dict is not None:
        schedule = SyncDictSchedule(synchronization_dict, model_layers)
    else:
        schedule = DefaultSchedule(num_layers, model_layers, early_first_reload=early_first_reload)
    device = resolve_device(device)
    engine = OffloadEngine(
        schedule,
        device=device,
        model_layers=model_layers if schedule is None else None,
        min_offload_bytes=min_offload_bytes,
        retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        offload_stream=offload_stream,
        host_memory_limit=host_memory_limit,
        max_offload_bytes_per_layer=max_offload_bytes_per_layer,
    )
    if manual_synchronization:
        return engine, engine.sync, engine.synchronizer
    return engine, engine.sync
