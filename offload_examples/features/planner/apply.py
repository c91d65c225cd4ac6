"""A plan made runnable: the recomputed layers wrapped in checkpointing, an engine for the offloaded ones.

Two ways to run it: :func:`apply_plan` for a loop you write (``with ctx:`` and ``sync`` around each
layer), :func:`apply_plan_to_model` for a model that runs its own layers (a Hugging Face model),
whose layers it wraps as :func:`~offload_examples.offload_layers` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...core.engine import OffloadEngine
from ...core.streams import resolve_device
from ..apply import (LayerChoice, OffloadedLayers, _attach, _check_free, _chosen_layers, checkpointed_call,
                     checkpointed_module)
from .costs import RECOMPUTED, LayerCost
from .model import Plan, offload_schedule

__all__ = ["Checkpointed", "PlannedLayers", "apply_plan", "apply_plan_to_model"]


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
    (:func:`~offload_examples.core.te_path.recompute_on_same_path`; the checkpointing is
    :func:`~offload_examples.features.apply.checkpointed_call` and
    :func:`~offload_examples.features.apply.checkpointed_module`).
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
            return checkpointed_call(self.layer, *args, **kwargs)
        with checkpointed_module(self.layer, self.module):
            return self.layer(*args, **kwargs)

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
    engine = _engine(chosen, len(layers), device, engine_options)
    # a RECOMPUTE_OFFLOAD layer is checkpointed inside the engine's context: the engine offloads what the
    # checkpoint keeps
    run = [Checkpointed(layer, module) if c in RECOMPUTED else layer
           for layer, c, module in zip(layers, chosen.choices, chosen.modules)]
    return engine, engine.sync, run


def _engine(chosen: Plan, n: int, device: torch.device | str | None, engine_options: dict[str, Any]) -> OffloadEngine:
    """The engine that offloads exactly the plan's offloaded layers of ``n``, its caps included."""
    if len(chosen.choices) != n:
        raise ValueError(f"the plan has {len(chosen.choices)} choices but there are {n} layers")
    if chosen.capped:
        if engine_options.get("max_offload_bytes_per_layer") is not None:
            raise ValueError("the plan caps the bytes of some layers: max_offload_bytes_per_layer would override it")
        engine_options["max_offload_bytes_per_layer"] = chosen.capped
    if chosen.host_budget_bytes is not None:
        # the engine refuses to pin more than the plan was allowed, instead of exhausting the node's memory
        engine_options.setdefault("host_memory_limit", chosen.host_budget_bytes)
    offloaded = list(chosen.offloaded)
    # a plan that offloads nothing must not hook every layer in every step, as a probe does
    engine_options.setdefault("count_every_layer", False)
    return OffloadEngine(offload_schedule(offloaded, n), device=resolve_device(device), **engine_options)


@dataclass
class PlannedLayers(OffloadedLayers):
    """What :func:`apply_plan_to_model` did: an :class:`~offload_examples.features.apply.OffloadedLayers`
    (``ctx``, ``sync``, ``names`` in the order the model calls the layers, ``remove()``) with the plan
    it runs, and the costs it was made from where they are known (``plan_layers`` sets them)."""

    plan: Plan | None = None
    costs: list[LayerCost] = field(default_factory=list, repr=False)


def _model_device(model: nn.Module, device: torch.device | str | None = None) -> torch.device:
    """Where the model's first parameter (or buffer) lives: the device its activations are saved on.

    A ``device`` given must be that one: an engine on another device would see none of the layers'
    saved tensors as its own, measure nothing and offload nothing, without an error.
    """
    where = next((t.device for t in (*model.parameters(), *model.buffers())), None)
    if device is None:
        return resolve_device(None) if where is None else where
    want = resolve_device(device)
    if where is not None and (want.type != where.type or None not in (want.index, where.index) and want.index != where.index):
        raise ValueError(f"device={want} but the model's parameters are on {where}: the layers' activations are saved "
                         "where the model runs (leave device=None)")
    return want


def apply_plan_to_model(chosen: Plan, model: nn.Module, layers: LayerChoice | list[str], *,
                        device: torch.device | str | None = None, **engine_options: Any) -> PlannedLayers:
    """Run a plan on a model that calls its own layers, without editing its ``forward``.

    Each chosen layer is wrapped as :func:`~offload_examples.offload_layers` wraps it (its class
    swapped for one whose ``__call__`` enters the engine's context and passes the output through
    ``sync``), and the layers the plan recomputes are checkpointed inside that context
    (non-reentrant, every positional and keyword argument passed through: masks, position embeddings,
    ``**kwargs``), whole or the submodule ``chosen.modules`` names. The training code stays as it
    was::

        handle = apply_plan_to_model(chosen, model, LlamaDecoderLayer)
        model(input_ids, labels=input_ids).loss.backward()
        handle.remove()  # the model as it was

    Parameters
    ----------
    chosen:
        The plan: one choice per layer, in the order the model calls the layers (the engine numbers
        a step's layers in that order).
    model:
        The model; its ``forward`` is not touched.
    layers:
        Which submodules are the layers, as for :func:`~offload_examples.offload_layers` (a type, a
        class name, a tuple of these, a test on ``(name, module)``), found in registration order; or
        a list of their qualified names in the order the model calls them, where that differs
        (``names`` of :func:`~offload_examples.instruments.plan_model.measure_model_costs`).
    device:
        Where the activations are saved; ``None``: where the model's first parameter is.
    engine_options:
        Keyword arguments of :class:`~offload_examples.OffloadEngine` (``retain_pinned_cpu_buffers``,
        ``min_offload_bytes``, ``count_every_layer``...); the plan's ``caps`` become its
        ``max_offload_bytes_per_layer``.

    Returns
    -------
    PlannedLayers
        The handle: its ``remove()`` puts the model back; a layer that runs at another place in a
        step than the plan gives it raises ``RuntimeError`` there.

    Raises
    ------
    ValueError
        No layer matches, a name is not a submodule, the plan and the layers differ in length, a
        submodule the plan recomputes is missing from its layer, a layer is another handle's
        already, or both the plan and ``engine_options`` cap bytes.
    """
    if isinstance(layers, list):
        if not layers or not all(isinstance(name, str) for name in layers):
            raise ValueError(f"layers as a list must be the layers' qualified names, at least one, got {layers!r}")
        found = []
        for name in layers:
            try:
                found.append((name, model.get_submodule(name)))
            except AttributeError:
                raise ValueError(f"layers: {name!r} is no submodule of {type(model).__name__}") from None
    else:
        found = _chosen_layers(model, layers)
    if len(chosen.choices) != len(found):
        raise ValueError(f"the plan has {len(chosen.choices)} choices but {len(found)} layers were found: "
                         + ", ".join(name for name, _ in found))
    for i, module in chosen.recomputed_modules.items():
        try:
            found[i][1].get_submodule(module)
        except AttributeError:
            raise ValueError(f"the plan recomputes {module!r} in layer {i} ({found[i][0]!r}), which has no "
                             "such submodule") from None
    _check_free(found)
    engine = _engine(chosen, len(found), _model_device(model, device), engine_options)
    handle = PlannedLayers(engine, engine.sync, [name for name, _ in found], plan=chosen)
    return _attach(handle, found, {i: chosen.modules[i] for i in chosen.recomputed}, ordered=True)
