"""The strategies: what each one runs as a model's forward, and where it cannot run.

Every strategy is a forward pass over the same layers (:func:`make_forward`); a step is that forward
and a backward (``_step``). Adding a strategy means a name in :data:`STRATEGIES`, a branch in
:func:`make_forward` and, where it cannot run everywhere, one in :func:`available`.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any, Callable, Sequence

import torch
from torch import nn

from offload_examples import get_cpu_offload_context
from offload_examples.core import te_path
from offload_examples.features.planner import Plan, apply_plan
from offload_examples.instruments.models import TE_LAYER, Checkpointed, has_transformer_engine

__all__ = [
    "SAVE_ON_CPU_ON_TE", "STRATEGIES", "TE_CONTEXT_ONLY", "TE_DEFAULT_PATH", "TE_ON_TORCH_LAYERS", "Forward",
    "available", "make_forward",
]


#: Strategy names, in the order they run.
STRATEGIES = (
    "no offload", "engine", "engine (fresh pinned)", "save_on_cpu", "torchtune", "transformer_engine", "checkpoint",
    "planner",
)


#: Transformer Engine's context around every layer with nothing offloaded (0 layers), run once per model
#: with ``transformer_engine``: what TE's hooks on every layer cost by themselves.
TE_CONTEXT_ONLY = "transformer_engine, nothing offloaded"


#: On Transformer Engine's layers every run takes the path TE's layers take inside an offload context
#: (the engine's or TE's; :mod:`offload_examples.core.te_path`), the no-offload baseline and the
#: recomputation included, so that all of them compute the same thing. This row is the same model
#: outside any offload context, paired with that baseline: what the path itself changes.
TE_DEFAULT_PATH = "no offload, TE's default path"


#: save_on_cpu on Transformer Engine's layers: the illegal access poisons the CUDA context, so every
#: later run of the process fails too.
SAVE_ON_CPU_ON_TE = ("crashes with Transformer Engine layers: CUDA illegal memory access "
                     "(seen with torch 2.11, TE 2.20.2)")


#: Transformer Engine's offload on PyTorch's layers: it raises at the first step and keeps what it held.
TE_ON_TORCH_LAYERS = ("runs on Transformer Engine's layers only: on PyTorch's it raises 'Tensor at index 4 "
                      "must be contiguous for CPU offload' at the first step and keeps what it held (TE 2.20.2)")


def available(strategy: str, device: torch.device, kind: str | None = None) -> str | None:
    """``None`` when ``strategy`` can run here on layers of ``kind``
    (see :func:`~offload_examples.instruments.models.layer_kind`), else why not."""
    if strategy == "save_on_cpu" and kind == TE_LAYER:
        return SAVE_ON_CPU_ON_TE
    if strategy == "torchtune" and importlib.util.find_spec("torchtune") is None:
        return "torchtune is not installed (pip install 'offload_examples[torchtune]')"
    if strategy in ("transformer_engine", TE_CONTEXT_ONLY, TE_DEFAULT_PATH):
        if not has_transformer_engine():
            return "Transformer Engine is not installed"
        if device.type != "cuda":
            return "Transformer Engine needs CUDA"
        if kind is not None and kind != TE_LAYER:
            return TE_ON_TORCH_LAYERS
    return None


Forward = Callable[[torch.Tensor], torch.Tensor]


def _through(layers: Sequence[nn.Module], h: torch.Tensor, ctx: Callable[[int], Any] | None = None,
             sync: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    for i, layer in enumerate(layers):
        with ctx(i) if ctx else contextlib.nullcontext():
            h = layer(h)
        h = sync(h) if sync else h
    return h


def make_forward(strategy: str, model: nn.ModuleList, k: int, device: torch.device,
                 chosen: Plan | None = None) -> tuple[Forward, Any]:
    """The forward pass of ``strategy`` treating the first ``k`` layers, and its engine (or ``None``).

    ``planner`` runs the plan ``chosen`` (``k`` only names the budget it was made for).
    """
    n = len(model)
    if strategy == "planner":
        if chosen is None:
            raise ValueError("the planner strategy needs a plan")
        ctx, sync, run_layers = apply_plan(chosen, list(model), device, retain_pinned_cpu_buffers=True)
        return lambda x: _through(run_layers, x, lambda i: ctx, sync), ctx
    if strategy == "no offload":
        return lambda x: _through(model, x), None
    if strategy == TE_DEFAULT_PATH:
        def outside(x: torch.Tensor) -> torch.Tensor:
            with te_path.offload_path(False):
                return _through(model, x)
        return outside, None
    if strategy in ("engine", "engine (fresh pinned)"):
        ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n, device=device,
                                            retain_pinned_cpu_buffers=strategy == "engine")
        return lambda x: _through(model, x, lambda i: ctx, sync), ctx
    if strategy == "save_on_cpu":
        pin = device.type == "cuda"  # pinning needs an accelerator

        def ctx(i: int) -> Any:
            return torch.autograd.graph.save_on_cpu(pin_memory=pin) if i < k else contextlib.nullcontext()
        return lambda x: _through(model, x, ctx), None
    if strategy == "checkpoint":
        wrapped = [Checkpointed(layer) if i < k else layer for i, layer in enumerate(model)]
        return lambda x: _through(wrapped, x), None
    if strategy == "torchtune":
        from torchtune.training import OffloadActivations

        def forward(x: torch.Tensor) -> torch.Tensor:
            with OffloadActivations(use_pin_memory=device.type == "cuda"):
                h = _through(model[:k], x)
            return _through(model[k:], h)
        return forward, None
    if strategy in ("transformer_engine", TE_CONTEXT_ONLY):
        import transformer_engine.pytorch as te

        ctx, sync = te.get_cpu_offload_context(True, k if strategy == "transformer_engine" else 0, n, True, False)
        return lambda x: _through(model, x, lambda i: ctx, sync), None
    raise ValueError(f"unknown strategy {strategy!r}")


def _step(forward: Forward, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        h = forward(x)
        h.float().square().mean().backward()
        return h.detach()
    return step
