"""``get_cpu_offload_context``: the entry point, call-compatible with Transformer Engine's."""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch

from .engine import OffloadEngine
from .schedule import DefaultSchedule, SyncDictSchedule

__all__ = ["get_cpu_offload_context"]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: torch.cuda.Stream | None = None,
    synchronization_dict: Mapping[int, tuple[bool, int, bool, int]] | None = None,
    *,
    min_offload_bytes: int = 1024,
    host_memory_limit: int | None = None,
    device: torch.device | str | None = None,
) -> tuple:
    """Build an offload context and its sync function.

    The positional parameters mirror ``transformer_engine.pytorch.get_cpu_offload_context`` so
    code written for one runs with the other::

        ctx, sync = get_cpu_offload_context(enabled=True, num_layers=4, model_layers=20)
        for layer in layers:
            with ctx:
                x = layer(x)
            x = sync(x)
        x.sum().backward()

    Parameters
    ----------
    enabled:
        When ``False`` return ``(contextlib.nullcontext(), identity)``.
    num_layers:
        ``k``: offload the saved activations of the first ``k`` layers (``0 <= k <= N - 1``).
        Ignored with ``manual_synchronization`` or ``synchronization_dict``.
    model_layers:
        ``N``: how many times the context is entered per iteration.
    offload_activations:
        Offload tensors saved for backward (the only kind supported so far).
    offload_weights:
        Not part of the context; raises ``NotImplementedError``. Stream weights from host memory
        with :class:`~offload_examples.StreamedLayers` instead.
    manual_synchronization:
        Return a third element, an :class:`~offload_examples.engine.OffloadSynchronizer`, and
        offload, release and reload layers only when its methods are called.
    retain_pinned_cpu_buffers:
        Keep pinned host buffers from one iteration to the next, so no memory is pinned after
        the first step.
    offload_stream:
        CUDA stream for device-to-host copies; a new one when ``None``.
    synchronization_dict:
        ``{layer: (offload_fwd, offload_num, reload_fwd, reload_num)}``: a declarative schedule
        for any order of forwards and backwards (see :class:`~offload_examples.SyncDictSchedule`),
        run through the same synchronizer as manual mode.
    min_offload_bytes:
        Storages smaller than this stay on the device.
    host_memory_limit:
        Most pinned bytes to hold; tensors beyond it stay on the device (with a warning).
    device:
        The compute device; the current CUDA device when CUDA is available, else the CPU.

    Returns
    -------
    tuple
        ``(context, sync_function)``, or ``(context, sync_function, synchronizer)`` with
        ``manual_synchronization=True``. The context is an
        :class:`~offload_examples.engine.OffloadEngine`, which also reports what it offloaded.
    """
    if not enabled:
        return (contextlib.nullcontext(), _identity) + ((None,) if manual_synchronization else ())
    if offload_weights:
        raise NotImplementedError(
            "offload_weights=True is not part of the offload context: stream weights from host memory with "
            "offload_examples.StreamedLayers(layers, device), which loads each layer just before it runs"
        )
    if not offload_activations:
        raise ValueError("nothing to offload: offload_activations=False and offload_weights=False")
    if manual_synchronization and synchronization_dict is not None:
        raise ValueError("pass either manual_synchronization=True or a synchronization_dict, not both: "
                         "the dict drives the synchronizer itself")
    if manual_synchronization:
        schedule = None
    elif synchronization_dict is not None:
        schedule = SyncDictSchedule(synchronization_dict, model_layers)
    else:
        schedule = DefaultSchedule(num_layers, model_layers)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    engine = OffloadEngine(
        schedule,
        device=device,
        model_layers=model_layers if schedule is None else None,
        min_offload_bytes=min_offload_bytes,
        retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        offload_stream=offload_stream,
        host_memory_limit=host_memory_limit,
    )
    if manual_synchronization:
        return engine, engine.sync, engine.synchronizer
    return engine, engine.sync
