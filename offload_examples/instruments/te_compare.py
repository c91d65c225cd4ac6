"""This package's engine next to Transformer Engine's own offloading, on TE's tutorial-shaped model.

The model has the shape of Transformer Engine's CPU-offloading tutorial: every layer an
``nn.Linear`` followed by a ``te.TransformerLayer``. :func:`compare_with_te` trains it three
ways under one precision recipe (bf16, or FP8 autocast with one of TE's scaling recipes):
without offloading, with this package's ``get_cpu_offload_context`` and with TE's. It reports each
one's peak-memory saving, its step time and overhead with their spreads, and whether its output and
gradients equal the run without offloading bit for bit; and the two offloads against each other,
round by round. Every run has a model of its own, built the same way (TE's FP8 scaling bookkeeping is global,
keyed by the recipe's settings, so runs of one recipe still share it), and the runs take turns step
by step (:func:`~offload_examples.instruments.measure.measure_round_robin`): on these small,
launch-bound layers a step's time drifts with the host's speed by more than the offloads differ, and
separate runs of a few steps each compared that drift rather than the offloads. It needs CUDA and
Transformer Engine.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from offload_examples.core import te_path
from offload_examples.core.api import get_cpu_offload_context
from offload_examples.instruments.measure import (Measurement, compare_grads, measure_round_robin, overhead_spread,
                                                  training_step)
from offload_examples.instruments.models import import_transformer_engine

__all__ = ["RECIPES", "TeModel", "compare_with_te", "fp8_autocast", "summarize", "te_tutorial_model"]

#: The precision recipes compared: bf16, and FP8 with TE's delayed and current scaling (FP8 needs a GPU of
#: compute capability 8.9 or later, such as the H100 and H200).
RECIPES = ("bf16", "DelayedScaling", "Float8CurrentScaling")


@dataclass(frozen=True)
class TeModel:
    """Sizes of the tutorial-shaped model (the defaults fit an 80 GB GPU in a few seconds a step)."""

    layers: int = 8
    hidden: int = 1024
    ffn: int = 4096
    heads: int = 8
    seq: int = 1024
    batch: int = 8


def te_tutorial_model(size: TeModel, device: torch.device | str = "cuda", seed: int = 0) -> nn.ModuleList:
    """``size.layers`` layers of ``Linear(hidden, hidden)`` then ``te.TransformerLayer``, in bf16."""
    import_transformer_engine()
    import transformer_engine.pytorch as te

    torch.manual_seed(seed)
    layers = nn.ModuleList(
        nn.Sequential(nn.Linear(size.hidden, size.hidden),
                      te.TransformerLayer(size.hidden, size.ffn, size.heads, hidden_dropout=0.0, attention_dropout=0.0,
                                          attn_input_format="bshd"))
        for _ in range(size.layers)
    )
    return layers.to(device=device, dtype=torch.bfloat16)


def fp8_autocast(recipe: str, fp8_recipe: Any = None) -> contextlib.AbstractContextManager:
    """TE's FP8 autocast with the named scaling recipe, or no autocast for ``"bf16"``.

    ``fp8_recipe`` is the recipe object to use (one of that recipe's class), made anew when ``None``:
    a caller running many steps can make it once.
    """
    if recipe == "bf16":
        return contextlib.nullcontext()
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as recipes

    fp8_recipe = fp8_recipe if fp8_recipe is not None else getattr(recipes, recipe)()
    if hasattr(te, "autocast"):  # TE 2.x; fp8_autocast is its deprecated spelling
        return te.autocast(enabled=True, recipe=fp8_recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe)


def _te_step(model: nn.ModuleList, x: torch.Tensor, ctx: Any, sync: Any, recipe: str, fp8_recipe: Any,
             on_path: bool) -> torch.Tensor:
    """One training step under ``recipe``, on TE's offload path (``on_path``) or its default one."""
    with fp8_autocast(recipe, fp8_recipe), te_path.offload_path(on_path):
        return training_step(model, x, ctx, sync)


def summarize(measured: dict[str, Measurement], recipe: str, k: int) -> dict[str, Any]:
    """The report of :func:`compare_with_te` from the runs its round robin measured (by name)."""
    base = measured["no offload"]
    out: dict[str, Any] = {"recipe": recipe, "k": k,
                           "deterministic": compare_grads(base, measured["no offload, again"]).equal}
    for name, m in measured.items():
        out[name] = {
            # what one step added to memory (the other runs' models and gradients are allocated too)
            "activation_peak_bytes": m.activation_peak_bytes,
            "saving_bytes": base.activation_peak_bytes - m.activation_peak_bytes,
            "step_ms": m.median_ms,
            "step_ms_range": [min(m.step_ms), max(m.step_ms)],
            **overhead_spread(m.step_ms, base.step_ms),
            "bitwise_equal": compare_grads(base, m).equal,
        }
    # the two offloads compared round by round: the difference of their overheads against the run
    # without offloading would carry the spread of both
    out["this engine vs Transformer Engine"] = overhead_spread(measured["this engine"].step_ms,
                                                              measured["Transformer Engine"].step_ms)
    return out


def compare_with_te(size: TeModel, k: int, recipe: str = "bf16", steps: int = 10) -> dict[str, Any]:
    """Train without offloading, with this engine and with TE's offloading of the first ``k`` layers.

    Returns a row per run: ``activation_peak_bytes`` (the most one step added to memory),
    ``saving_bytes`` (that of the run without offloading minus this run's), ``step_ms`` (median of
    ``steps``) and ``step_ms_range`` (its fastest and slowest step), ``overhead`` (against the run
    without offloading: the median over the rounds of the ratio, less one) with ``overhead_quartiles``
    and ``overhead_range`` (the first and third quartile, and the extremes, of that ratio less one over
    the rounds), and ``bitwise_equal`` (output and every gradient equal to the run without offloading).
    A second run without offloading (``"no offload, again"``) checks that the model is deterministic here
    (``"deterministic"``), so a difference can only come from the offloading; its overhead, between two
    runs of the same step, is what the measurement itself leaves. ``"this engine vs Transformer
    Engine"`` compares the two offloads round by round (``overhead`` and its spread, as in the rows).
    The runs take turns step by step, after two warm-up rounds; with the default ``steps`` every run
    comes right after every other one equally often.

    Inside either offload TE's layers take their offload path (:mod:`offload_examples.core.te_path`),
    so the runs without offloading take it too; the row ``"no offload, TE's default path"`` is the
    model outside any offload context, and its ``bitwise_equal`` says whether the path changes the result.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("compare_with_te needs CUDA (and Transformer Engine)")
    import_transformer_engine()
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as recipes

    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(size.batch, size.seq, size.hidden, generator=gen, dtype=torch.bfloat16).cuda()
    offloads: dict[str, Callable[[int], Any] | None] = {
        "no offload": None,
        "no offload, again": None,
        "no offload, TE's default path": None,
        "this engine": lambda n: get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n,
                                                         retain_pinned_cpu_buffers=True),
        "Transformer Engine": lambda n: te.get_cpu_offload_context(True, k, n, True, False),
    }
    runs = {}
    for name, offload in offloads.items():
        model = te_tutorial_model(size, x.device)
        ctx, sync = offload(size.layers) if offload else (None, None)
        own_x = x.clone().requires_grad_()
        fp8_recipe = None if recipe == "bf16" else getattr(recipes, recipe)()  # made once, not every step
        on_path = name != "no offload, TE's default path"
        runs[name] = (model, own_x, partial(_te_step, model, own_x, ctx, sync, recipe, fp8_recipe, on_path))
    return summarize(measure_round_robin(runs, steps=steps), recipe, k)
