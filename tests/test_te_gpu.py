"""Transformer Engine layers under the engine, on the GPU: what TE's own offloading tests check,
written for this project.

They need CUDA and Transformer Engine. Without TE they are skipped, unless
``OFFLOAD_EXAMPLES_REQUIRE_TE=1``, which makes them fail instead (set it on a node where TE belongs
to the stack).
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from offload_examples import get_cpu_offload_context
from offload_examples.core import te_path
from offload_examples.instruments.bench.model_grid import _held_bytes
from offload_examples.instruments.measure import compare_grads, measure_steps
from offload_examples.instruments.te_compare import RECIPES, TeModel, fp8_autocast, te_tutorial_model

pytestmark = pytest.mark.gpu

HIDDEN, FFN, HEADS, SEQ, BATCH = 1024, 4096, 8, 1024, 4
LAYERS, K = 6, 2


def tutorial_model(te, cuda) -> torch.nn.ModuleList:
    """The shape of TE's CPU-offloading tutorial: each layer a Linear and a TE TransformerLayer."""
    return te_tutorial_model(TeModel(LAYERS, HIDDEN, FFN, HEADS, SEQ, BATCH), cuda)


def data(cuda) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen, dtype=torch.bfloat16)
    return x.to(cuda).requires_grad_()


def test_gpu_te_tutorial_loop_runs_unchanged_and_offloads_everything_the_layers_hold(te, cuda):
    """The tutorial's loop, with this package's get_cpu_offload_context: the k offloaded layers give
    up at least 97% of what their forwards hold (measured by the allocator, not by any engine)."""
    model, x = tutorial_model(te, cuda), data(cuda)
    measure_steps(model, x, steps=1, warmup=1)  # TE's workspaces and caches exist from here on
    with te_path.offload_path():  # what the layers hold on the path they take inside the context
        held = _held_bytes(model, x)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=K, model_layers=LAYERS)
    h = x
    for layer in model:  # the tutorial's loop, as written there
        with ctx:
            h = layer(h)
        h = sync(h)
    h.sum().backward()
    offloaded = sum(s.offloaded_bytes for s in ctx.stats[:K])
    assert offloaded >= 0.97 * sum(held[:K]), (offloaded, held[:K])


def test_gpu_te_gpu_plus_host_bytes_equal_the_bytes_without_offloading(te, cuda):
    """After the forward, GPU memory with offloading plus what went to the host equals GPU memory
    without offloading (within 10% of the offloaded bytes): no stray reference keeps an offloaded
    tensor on the GPU. Then the backward gives everything back (a leak check)."""
    model, x = tutorial_model(te, cuda), data(cuda)
    measure_steps(model, x, steps=1, warmup=1)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=K, model_layers=LAYERS,
                                        retain_pinned_cpu_buffers=True)

    def forward(ctx=None, sync=None):
        h = x
        for layer in model:
            with ctx or contextlib.nullcontext():
                h = layer(h)
            h = sync(h) if sync else h
        return h

    measure_steps(model, x, ctx, sync, steps=1, warmup=1)  # pins the host buffers once
    gc.collect()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    plain = forward()
    torch.cuda.synchronize()
    without = torch.cuda.memory_allocated() - start
    del plain
    h = forward(ctx, sync)
    torch.cuda.synchronize()
    with_offload = torch.cuda.memory_allocated() - start
    released = sum(s.offloaded_bytes for s in ctx.stats[:K])
    assert released > 0
    assert abs(with_offload + released - without) <= 0.1 * released, (with_offload, released, without)
    h.float().sum().backward()
    model.zero_grad(set_to_none=True)
    x.grad = None
    del h
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == start, "memory not given back after the backward"
    assert ctx.live_views == 0 and ctx.resident_bytes == 0


def recipe_steps(te, cuda, recipe, x, ctx=None, sync=None, offload_path=True):
    """Two steps of a fresh model (FP8 scaling state starts anew) under ``recipe``; TE's layers on their
    offload path (as inside either offload) or on their default path."""
    model = tutorial_model(te, cuda)
    with fp8_autocast(recipe), te_path.offload_path(offload_path):
        return measure_steps(model, x, ctx, sync, steps=2, warmup=1)


@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_te_gradients_are_bitwise_equal_under_every_recipe(te, cuda, recipe):
    """Offloading changes no bit of the output or of any gradient, in bf16 and under FP8 autocast
    (against the same computation without offloading: TE's layers on their offload path)."""
    x = data(cuda)
    ref, again = recipe_steps(te, cuda, recipe, x), recipe_steps(te, cuda, recipe, x)
    assert compare_grads(ref, again).equal, "the run without offloading is not deterministic here"
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=K, model_layers=LAYERS)
    got = recipe_steps(te, cuda, recipe, x, ctx, sync, offload_path=False)  # the engine turns the path on itself
    check = compare_grads(ref, got)
    assert check.equal, check
    assert sum(s.offloaded_bytes for s in ctx.stats) > 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_te_offload_path_gives_the_default_paths_bits(te, cuda, recipe):
    """The path TE's layers take inside an offload context (which the engine turns on: core/te_path.py)
    computes the same output and gradients, bit for bit, as their default path."""
    x = data(cuda)
    default = recipe_steps(te, cuda, recipe, x, offload_path=False)
    check = compare_grads(default, recipe_steps(te, cuda, recipe, x))
    assert check.equal, check


@pytest.mark.parametrize("recipe", ["bf16", "DelayedScaling"])
def test_gpu_compare_with_te_takes_turns_and_keeps_every_bit(te, cuda, recipe):
    """Notebook 02's comparison: five runs taking turns, each on its own model; the model is
    deterministic here, both offloads change no bit and both free memory."""
    from offload_examples.instruments.te_compare import compare_with_te

    row = compare_with_te(TeModel(layers=4, seq=512, batch=2), k=2, recipe=recipe, steps=3)
    assert row["deterministic"]
    assert row["no offload"]["overhead"] == 0 and row["no offload"]["saving_bytes"] == 0
    for name in ("this engine", "Transformer Engine"):
        assert row[name]["bitwise_equal"], name
        assert row[name]["saving_bytes"] > 0, (name, row[name])
        low, high = row[name]["step_ms_range"]
        assert low <= row[name]["step_ms"] <= high, (name, row[name])
        low, high = row[name]["overhead_range"]
        assert low <= row[name]["overhead_quartiles"][0] <= row[name]["overhead"] <= high, (name, row[name])
    assert row["this engine vs Transformer Engine"]["overhead"] > -1


def test_gpu_te_plans_recompute_te_submodules_bitwise(te, cuda):
    """measure_costs finds submodules of TE's TransformerLayer to recompute alone, each freeing part of
    what the layer holds; a plan recomputing TE's MLP in one layer and its attention in another, beside
    two offloaded layers, gives the plain step's output and gradients bit for bit (TE's offload path)."""
    from offload_examples.features.planner import KEEP, OFFLOAD, RECOMPUTE, Plan, apply_plan
    from offload_examples.instruments.measure import snapshot, training_step
    from offload_examples.instruments.plan_costs import measure_costs

    model, x = tutorial_model(te, cuda), data(cuda)
    costs, _ = measure_costs(list(model), x, steps=2)
    options = {m.module: m for m in costs[1].recompute_modules}
    assert {"1.layernorm_mlp", "1.self_attention"} & set(options), costs[1]
    for cost in costs:
        assert all(m.kept_bytes < cost.saved_bytes and m.module_bytes > 0 for m in cost.recompute_modules)
    with te_path.offload_path():
        reference = snapshot(model, x, training_step(model, x))
    model.zero_grad(set_to_none=True)
    x.grad = None
    choices = (OFFLOAD, OFFLOAD, RECOMPUTE, RECOMPUTE, KEEP, KEEP)
    chosen = Plan(choices, 0, 0.0, modules=(None, None, "1.layernorm_mlp", "1.self_attention", None, None))
    ctx, sync, layers = apply_plan(chosen, list(model), cuda)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        x.grad = None
        check = compare_grads(reference, snapshot(model, x, training_step(layers, x, ctx, sync)))
        assert check.equal, check
        assert [s.offloaded_bytes > 0 for s in ctx.stats] == [c is OFFLOAD for c in choices]
