"""The planner for a model that calls its own layers (a Hugging Face model): measure, plan and apply in one call.

:func:`~offload_examples.instruments.plan_costs.measure_costs` measures a list of layers it calls
itself, ``h = layer(h)``. A transformers decoder layer is called by its model with an attention
mask, position embeddings and keyword arguments, so here the model's own training step runs the
layers instead, with each chosen layer wrapped as :func:`~offload_examples.offload_layers` wraps it:
its call enters the engine's context, so the same probe engine counts what it saves and marks its
forward and backward, and the same timed runs (kept, offloaded, recomputed, a submodule
recomputed) take turns, the choices applied to the model as a plan is
(:func:`~offload_examples.features.planner.apply_plan_to_model`). The measurement itself is
``measure_costs``' (``plan_costs._measure``); only how a step runs differs (``_ModelSteps``)::

    from offload_examples.instruments.plan_model import plan_layers

    def step():  # what the training loop runs, without the optimizer
        model(input_ids, labels=input_ids, use_cache=False).loss.backward()

    handle = plan_layers(model, LlamaDecoderLayer, step, budget_bytes=8 * 2**30)
    print(handle.plan)
    ...  # the training loop, unchanged
    handle.remove()  # the model as it was

The layers are numbered in the order the model calls them, found in a first step: an encoder's
before a decoder's, whatever order they were registered in.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from offload_examples.core.api import get_cpu_offload_context
from offload_examples.core.engine import OffloadEngine
from offload_examples.core.errors import OffloadWarning
from offload_examples.core.streams import resolve_device
from offload_examples.features.apply import LayerChoice, OffloadedLayers, _attach, _check_free, _chosen_layers
from offload_examples.features.planner import LayerCost, LinkCost, PlannedLayers, apply_plan_to_model, plan
from offload_examples.features.planner.apply import _model_device
from offload_examples.features.planner.costs import _check
from offload_examples.instruments.plan_costs import _hook_free_engine, _measure, measure_link
from offload_examples.instruments.timeline import Span, record_layer_timeline

__all__ = ["measure_model_costs", "plan_layers"]


class _ModelSteps:
    """Steps of ``model`` run by ``step()``, the layers ``found`` (in call order) wrapped for each one."""

    def __init__(self, model: nn.Module, found: list[tuple[str, nn.Module]], step: Callable[[], Any],
                 device: torch.device):
        self.model, self.found, self.step, self.device = model, found, step, device
        self.names = [name for name, _ in found]

    def zero(self) -> None:
        self.model.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def probing(self, ctx: OffloadEngine, sync: Callable) -> Iterator[Callable[[], Any]]:
        handle = _attach(OffloadedLayers(ctx, sync, list(self.names)), self.found, ordered=True)
        try:
            yield self.step
        finally:
            handle.remove()

    def timed(self, offloaded: Sequence[int], recomputed: dict[int, str | None]
              ) -> tuple[Callable[[], list[Span]], OffloadEngine]:
        engine = _hook_free_engine(offloaded, len(self.found), self.device)

        def one() -> None:
            # runs take turns step by step, each with its own engine: the layers are the run's for one step
            handle = _attach(OffloadedLayers(engine, engine.sync, list(self.names)), self.found, recomputed,
                             ordered=True)
            try:
                self.zero()
                self.step()
            finally:
                handle.remove()

        return (lambda: record_layer_timeline(one, engine)), engine


def _call_order(model: nn.Module, found: list[tuple[str, nn.Module]], step: Callable[[], Any],
                device: torch.device) -> list[tuple[str, nn.Module]]:
    """``found`` in the order one ``step()`` calls them, each entering a probe engine; ``ValueError``
    when the step runs none of them, misses one, or runs no backward through them.

    The engine numbers a step's layers as they enter, so a plan's choices are in this order, which
    registration order need not be (a model may register its decoder first).
    """
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=0, model_layers=len(found), device=device)
    order: list[int] = []

    twice: set[int] = set()

    def called(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            if i not in order:
                order.append(i)
            elif torch._C._current_graph_task_id() == -1:  # not a checkpoint's recomputation in the backward
                twice.add(i)
        return hook

    hooks = [layer.register_forward_pre_hook(called(i)) for i, (_, layer) in enumerate(found)]
    handle = _attach(OffloadedLayers(ctx, sync, [name for name, _ in found]), found)
    try:
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # a step that misses layers is told below, in words about the step
            warnings.simplefilter("ignore", OffloadWarning)
            step()
    finally:
        handle.remove()
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
    if not order:
        raise ValueError(f"step() ran none of the {len(found)} chosen layers: it must run the model's forward")
    if twice:
        raise ValueError(f"step() ran the chosen layers {[found[i][0] for i in sorted(twice)]} more than once in its "
                         "forward: the planner counts what each layer saves in one call (each must run once per step)")
    missing = [name for i, (name, _) in enumerate(found) if i not in order]
    if missing:
        raise ValueError(f"step() did not run the chosen layers {missing}: each must run once per step")
    if not any(kind == "backward" for kind, _ in ctx.events):
        raise ValueError("step() ran no backward through the chosen layers: it must run the forward, the loss and "
                         "loss.backward(), as a training step does")
    return [found[i] for i in order]


def measure_model_costs(model: nn.Module, layers: LayerChoice, step: Callable[[], Any], steps: int = 20,
                        per_choice: bool = True, pool_kinds: bool = True,
                        recompute_modules: Sequence[str] | None = None,
                        device: torch.device | str | None = None) -> tuple[list[LayerCost], int, list[str]]:
    """:func:`~offload_examples.instruments.plan_costs.measure_costs` for the layers of an unmodified model,
    measured through its own training step.

    Parameters
    ----------
    model:
        The model; its ``forward`` is not touched. Its layers may take any arguments.
    layers:
        Which submodules are the layers, as for :func:`~offload_examples.offload_layers`: a type, a class
        name, a tuple of these (``(BartEncoderLayer, BartDecoderLayer)``) or a test on ``(name, module)``.
    step:
        Runs one training step without arguments: the forward, the loss and ``loss.backward()``, not the
        optimizer (the weights should stay as they are while the steps are measured). It runs many
        times; the model's ``.grad`` are cleared before each, and at the end. A layer that updates a
        cache in its forward cannot be recomputed: pass ``use_cache=False``.
    steps, per_choice, pool_kinds, recompute_modules:
        As for :func:`~offload_examples.instruments.plan_costs.measure_costs`.
    device:
        Where the activations are saved; ``None``: where the model's first parameter is.

    Returns
    -------
    tuple
        ``(costs, base, names)``: one cost per layer and the base bytes, as ``measure_costs``
        returns them, and the layers' qualified names, all in the order the model calls the layers,
        the order a plan's choices take (give the names to
        :func:`~offload_examples.features.planner.apply_plan_to_model`).

    Raises
    ------
    ValueError
        No layer matches, a layer is another handle's already, or the first step runs none of the
        layers, misses one or runs no backward (each layer must run once per step).
    """
    if not callable(step):
        raise TypeError(f"step must be a function that runs one training step, got {type(step).__name__}")
    found = _chosen_layers(model, layers)
    _check_free(found)
    device = _model_device(model, device)
    found = _call_order(model, found, step, device)
    costs, base = _measure([layer for _, layer in found], _ModelSteps(model, found, step, device), steps,
                           per_choice, pool_kinds, recompute_modules)
    return costs, base, [name for name, _ in found]


def plan_layers(model: nn.Module, layers: LayerChoice, step: Callable[[], Any], budget_bytes: int, *,
                link: LinkCost | None = None, steps: int = 20, per_choice: bool = True, pool_kinds: bool = True,
                recompute_modules: Sequence[str] | None = None, prefix_only: bool = True, partial: bool = True,
                host_budget_bytes: int | str | None = "auto", device: torch.device | str | None = None,
                **engine_options: Any) -> PlannedLayers:
    """Keep, offload or recompute each layer of an unmodified model, the fastest way that fits a budget.

    Measures the layers through ``step`` (:func:`measure_model_costs`), plans for ``budget_bytes``
    (:func:`~offload_examples.features.planner.plan`) and applies the plan to the model
    (:func:`~offload_examples.features.planner.apply_plan_to_model`): the training code stays as it was.

    Parameters
    ----------
    model, layers, step:
        As for :func:`measure_model_costs`.
    budget_bytes:
        The most bytes the step may hold at its peak, the base bytes (on a GPU, what is allocated
        before the step: weights, optimizer state) included.
    link:
        The copy link's speed; ``None`` measures it (:func:`~offload_examples.instruments.plan_costs.measure_link`).
    steps, per_choice, pool_kinds, recompute_modules:
        As for :func:`~offload_examples.instruments.plan_costs.measure_costs`.
    prefix_only, partial, host_budget_bytes:
        As for :func:`~offload_examples.features.planner.plan` (by default the pinned host memory
        stays within :func:`~offload_examples.features.planner.host_budget`).
    device:
        Where the activations are saved; ``None``: where the model's first parameter is.
    engine_options:
        Keyword arguments of :class:`~offload_examples.OffloadEngine` for the plan's engine.

    Returns
    -------
    PlannedLayers
        The handle: ``plan`` (print it for a row per layer), ``costs``, ``names`` (the layers in the
        order the model calls them), ``ctx`` (the engine: what it offloaded), and ``remove()``.

    Raises
    ------
    ValueError
        As :func:`measure_model_costs`, and when no plan fits ``budget_bytes`` within the host budget
        (the message names the smallest budget that works, and the host memory the plans that fit
        ``budget_bytes`` would need where that is what is short).
    """
    _check("plan_layers", "budget_bytes", budget_bytes, int)  # before minutes of measuring, not after
    costs, base, names = measure_model_costs(model, layers, step, steps, per_choice, pool_kinds, recompute_modules,
                                             device)
    if link is None:
        link = measure_link(_model_device(model) if device is None else device)
    chosen = plan(costs, link, budget_bytes, base, prefix_only, partial, host_budget_bytes)
    if not chosen.feasible:
        peak = chosen.predicted_peak_bytes
        host = "" if chosen.host_budget_bytes is None else f", host budget {chosen.host_budget_bytes} bytes"
        short = f"; or: {chosen.why}" if "pinned host memory" in chosen.why else ""
        raise ValueError(f"no plan fits budget_bytes={budget_bytes}: the smallest budget that works is {peak} bytes "
                         f"({peak / 2**20:.2f} MiB, {base} of them base bytes{host}; plan {chosen.summary()}){short}")
    handle = apply_plan_to_model(chosen, model, names, device=device, **engine_options)
    handle.costs = costs
    return handle
