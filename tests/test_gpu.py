"""GPU checks: real memory against theory, bitwise bf16 gradients, pinned-buffer reuse.

Marked ``gpu``: they run wherever CUDA is available. Set ``OFFLOAD_EXAMPLES_RESULTS=DIR`` to keep
each test's report as JSON.
"""

from __future__ import annotations

import os

import pytest
import torch

from offload_examples import get_cpu_offload_context
from offload_examples.instruments.measure import compare_grads, measure_steps, resident_vs_theory
from offload_examples.instruments.models import build_linear_stack
from offload_examples.instruments.report import write_json
from offload_examples.scenarios.basic import BasicConfig, format_report, run

pytestmark = pytest.mark.gpu


def keep(name: str, report: dict) -> None:
    if os.environ.get("OFFLOAD_EXAMPLES_RESULTS"):
        write_json(os.path.join(os.environ["OFFLOAD_EXAMPLES_RESULTS"], f"{name}.json"), report)


@pytest.fixture(scope="module")
def basic_report():
    report = run(BasicConfig(), "cuda", progress=print)
    print(format_report(report))
    keep("gpu_basic", {k: v for k, v in report.items() if k != "events"})
    return report


def test_basic_saving_is_at_least_95_percent_of_theory(basic_report):
    r = basic_report
    assert r["theoretical_saving_bytes"] > 2**30  # a multi-GB saving at the default size
    assert r["saving_ratio"] >= 0.95, f"measured {r['saving_bytes']} vs theory {r['theoretical_saving_bytes']}"


def test_basic_gpu_plus_host_bytes_equal_the_no_offload_peak(basic_report):
    r = basic_report
    total = r["peak_with_bytes"] + r["offloaded_bytes"]
    assert abs(total - r["peak_without_bytes"]) <= 0.01 * r["peak_without_bytes"]


def test_basic_bf16_grads_bitwise_equal(basic_report):
    assert basic_report["config"]["dtype"] == "bfloat16"
    assert basic_report["grads_equal"], basic_report["max_abs_diff"]
    assert basic_report["resident_matches_theory"]


def test_linear_stack_bf16_grads_bitwise_equal(cuda):
    model = build_linear_stack(6, 1024, device=cuda, dtype=torch.bfloat16)
    x = torch.randn(8, 512, 1024, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    ref = measure_steps(model, x, steps=2, warmup=1)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=5, model_layers=6)
    got = measure_steps(model, x, ctx, sync, steps=2, warmup=1)
    check = compare_grads(ref, got)
    assert check.equal, (check.mismatched, check.max_abs_diff)
    assert got.peak_bytes < ref.peak_bytes


def test_early_first_reload_bitwise_and_at_most_one_layer_above_the_default(cuda):
    """``early_first_reload``: the same bits, the engine's resident count as its schedule says, and a
    peak above the default schedule's by at most one layer's offloaded bytes (it holds one layer more
    than the default's backward at the backward of N - 2, and never more than the forward's count)."""
    model = build_linear_stack(8, 1024, device=cuda, dtype=torch.bfloat16)
    x = torch.randn(8, 512, 1024, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    ref = measure_steps(model, x, steps=2, warmup=1)
    runs = {}
    for early in (False, True):
        ctx, sync = get_cpu_offload_context(enabled=True, num_layers=4, model_layers=8, early_first_reload=early)
        runs[early] = (measure_steps(model, x, ctx, sync, steps=2, warmup=1), ctx)
        check = compare_grads(ref, runs[early][0])
        assert check.equal, (early, check.mismatched, check.max_abs_diff)
        assert all(got == want for _, _, got, want in resident_vs_theory(ctx))
    (default, _), (early, ctx) = runs[False], runs[True]
    assert ("reload_start", 3) in ctx.events[ctx.events.index(("backward", 6)):ctx.events.index(("backward", 5))]
    one_layer = max(s.offloaded_bytes for s in ctx.stats)
    assert default.peak_bytes <= early.peak_bytes <= default.peak_bytes + one_layer


def test_retained_pinned_buffers_are_not_reallocated(cuda):
    model = build_linear_stack(4, 512, device=cuda, dtype=torch.bfloat16)
    x = torch.randn(4, 256, 512, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=3, model_layers=4, retain_pinned_cpu_buffers=True)
    measure_steps(model, x, ctx, sync, steps=1, warmup=0)
    first, held = ctx.pool.allocations, ctx.pool.held_bytes
    assert first > 0 and all(b.data.is_pinned() for bufs in ctx.pool._free.values() for b in bufs)
    measure_steps(model, x, ctx, sync, steps=5, warmup=0)
    assert (ctx.pool.allocations, ctx.pool.held_bytes) == (first, held)


def test_a_second_context_pins_nothing_new(cuda):
    """Contexts that do not retain their buffers hand them to PyTorch's pinned-memory cache as soon as
    they are free, so a second context (the first one still alive) pins no new host memory."""
    model = build_linear_stack(4, 512, device=cuda, dtype=torch.bfloat16)
    x = torch.randn(4, 256, 512, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    first, sync = get_cpu_offload_context(enabled=True, num_layers=3, model_layers=4)
    measure_steps(model, x, first, sync, steps=1, warmup=0)
    torch.cuda.synchronize()
    pinned = torch.cuda.host_memory_stats()["num_host_alloc"]  # cudaHostAlloc calls so far
    assert first.pool.held_bytes == 0 and first.offloaded_bytes > 0
    second, sync2 = get_cpu_offload_context(enabled=True, num_layers=3, model_layers=4)
    measure_steps(model, x, second, sync2, steps=1, warmup=0)
    torch.cuda.synchronize()
    assert second.offloaded_bytes == first.offloaded_bytes
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == pinned, "the second context pinned memory again"


def test_no_host_synchronisation_on_the_hot_path(cuda):
    """CUDA's sync debug mode raises on any call that makes the host wait for the device."""
    model = build_linear_stack(4, 512, device=cuda, dtype=torch.bfloat16)
    x = torch.randn(4, 256, 512, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=3, model_layers=4, retain_pinned_cpu_buffers=True)
    measure_steps(model, x, ctx, sync, steps=1, warmup=0)  # first step pins host memory
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            h = x
            for layer in model:
                with ctx:
                    h = layer(h)
                h = sync(h)
            h.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ctx.offloaded_bytes > 0 and ("backward", 0) in ctx.events[-2:]  # both steps ran through


def test_gpu_measurements_count_no_output_of_an_earlier_step():
    """measure_steps, measure_paired and measure_round_robin see the same peak for the same step: no
    output kept from an earlier step (or from the reference's) counts in a measured step's peak."""
    from offload_examples.instruments.measure import measure_paired, measure_round_robin, training_step

    layers = build_linear_stack(4, 1024, device="cuda")
    x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4, device="cuda")
    step = lambda: training_step(layers, x, ctx, sync)  # noqa: E731
    alone = measure_steps(layers, x, ctx, sync, steps=3, warmup=2)
    paired, _ = measure_paired(layers, x, lambda: training_step(layers, x), step, steps=3, warmup=2)
    turns = measure_round_robin({"plain": (layers, x2, lambda: training_step(layers, x2)), "offloaded": (layers, x, step)},
                                steps=3, warmup=2)["offloaded"]
    out_bytes = x.numel() * x.element_size()  # one output: what a kept one would add
    assert abs(paired.peak_bytes - alone.peak_bytes) < out_bytes // 4, (paired.peak_bytes, alone.peak_bytes)
    # taking turns, the other run's input gradient is allocated too: only what the step adds compares
    for m in (paired, turns):
        assert abs(m.activation_peak_bytes - alone.activation_peak_bytes) < out_bytes // 4
