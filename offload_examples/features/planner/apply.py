"""A plan made runnable: the recomputed layers wrapped in checkpointing, an engine for the offloaded ones."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...core.engine import OffloadEngine
from ...core.streams import resolve_device
from ...core.te_path import recompute_on_same_path
from .costs import OFFLOAD, RECOMPUTE
from .model import Plan, offload_schedule

__all__ = ["Checkpointed", "apply_plan"]


def _checkpointed(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` under non-reentrant checkpointing, one tensor passed once.

    The recomputation gets each tensor checkpoint kept as a new object: a module that tests its
    arguments for identity would then compute something else than the first time
    (``nn.MultiheadAttention`` projects ``query is key is value`` in one matmul, else in three), and
    checkpointing refuses what it recomputes. So a tensor given in several places goes in once.
    """
    from torch.utils.checkpoint import checkpoint

    unique = list({id(a): a for a in args if isinstance(a, torch.Tensor)}.values())
    where = {id(t): j for j, t in enumerate(unique)}
    spec = [(where[id(a)], None) if isinstance(a, torch.Tensor) else (None, a) for a in args]

    def run(*tensors: torch.Tensor, **kw: Any) -> Any:
        return function(*(a if j is None else tensors[j] for j, a in spec), **kw)

    return checkpoint(run, *unique, use_reentrant=False, context_fn=recompute_on_same_path, **kwargs)


class Checkpointed(nn.Module):
    """Wrap a layer, or one submodule of it, in activation recomputation (``torch.utils.checkpoint``,
    non-reentrant).

    Without ``module`` only the layer's input is kept for backward and its forward runs again during
    backward. With ``module`` (a name for ``layer.get_submodule``) the layer runs as it is, except that
    that submodule's forward is checkpointed: the layer keeps what it saves outside the module, the
    module keeps only its inputs, and its forward runs again when the backward reaches it. The layer
    is not changed: the submodule's ``forward`` is replaced only while the layer's forward runs, so its
    parameters, hooks and ``state_dict`` keys stay as they are. Either recomputation takes the path
    Transformer Engine's layers took the first time
    (:func:`~offload_examples.core.te_path.recompute_on_same_path`).
    """

    def __init__(self, layer: nn.Module, module: str | None = None):
        super().__init__()
        self.layer = layer
        self.module = module
        if module is not None:
            if not isinstance(module, str) or not module:
                raise ValueError(f"module must name a submodule of the layer (a non-empty str), got {module!r}")
            layer.get_submodule(module)  # an unknown name fails here, not in the first step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.module is None:
            return _checkpointed(self.layer, *args, **kwargs)
        sub = self.layer.get_submodule(self.module)
        own = sub.__dict__.get("forward")  # a forward someone set on the instance: put back afterwards
        original = sub.forward
        # the recomputation calls `original` again, not `sub`: its hooks ran once, around the first call
        sub.forward = functools.partial(_checkpointed, original)
        try:
            return self.layer(*args, **kwargs)
        finally:
            if own is None:
                del sub.forward
            else:
                sub.forward = own

    def extra_repr(self) -> str:
        return "" if self.module is None else f"module={self.module!r}"


def apply_plan(chosen: Plan, layers: Sequence[nn.Module], device: torch.device | str | None = None,
               **engine_options: Any) -> tuple[OffloadEngine, Any, list[nn.Module]]:
    """A plan made runnable: ``(ctx, sync, layers)`` for the usual loop.

    The returned layers are ``layers`` with every recomputed one wrapped in :class:`Checkpointed` (the
    whole layer, or the submodule ``chosen.modules`` names); ``ctx`` offloads exactly the plan's
    offloaded layers, at :class:`SubsetSchedule`'s points (the engine's default schedule when they
    are the first ``k``)::

        ctx, sync, run_layers = apply_plan(chosen, model.layers)
        for layer in run_layers:
            with ctx:
                h = layer(h)
            h = sync(h)

    ``engine_options`` go to :class:`~offload_examples.OffloadEngine` (``retain_pinned_cpu_buffers``,
    ``min_offload_bytes``...); the plan's ``caps`` become its
    ``max_offload_bytes_per_layer``, and its ``host_budget_bytes`` the engine's ``host_memory_limit``
    (unless given here). Raises ``ValueError`` when the plan and the layers differ in
    length, or when both the plan and ``engine_options`` cap bytes.
    """
    if len(chosen.choices) != len(layers):
        raise ValueError(f"the plan has {len(chosen.choices)} choices but there are {len(layers)} layers")
    if chosen.capped:
        if engine_options.get("max_offload_bytes_per_layer") is not None:
            raise ValueError("the plan caps the bytes of some layers: max_offload_bytes_per_layer would override it")
        engine_options["max_offload_bytes_per_layer"] = chosen.capped
    if chosen.host_budget_bytes is not None:
        # the engine refuses to pin more than the plan was allowed, instead of exhausting the node's memory
        engine_options.setdefault("host_memory_limit", chosen.host_budget_bytes)
    offloaded = [i for i, c in enumerate(chosen.choices) if c is OFFLOAD]
    # a plan that offloads nothing must not hook every layer in every step, as a probe does
    engine_options.setdefault("count_every_layer", False)
    engine = OffloadEngine(offload_schedule(offloaded, len(layers)), device=resolve_device(device), **engine_options)
    run = [Checkpointed(layer, module) if c is RECOMPUTE else layer
           for layer, c, module in zip(layers, chosen.choices, chosen.modules)]
    return engine, engine.sync, run
