"""CUDA graphs with offloading.

CPU: the graph-safe path (frozen host buffers: fixed buffers, nothing pinned per step, a clear
error instead of a silent fallback) runs eagerly and gives bitwise-equal gradients; the pool keeps
a graph's buffers out of circulation. GPU: a whole captured step replays with every gradient
bitwise equal to an eager step without offloading, the saving during replay is the theory's, the
replay is no slower than the eager offloaded step, and what cannot be captured fails at capture.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from offload_examples import GraphCaptureError, get_cpu_offload_context
from offload_examples.features.graphs import capture_step
from offload_examples.core.host_pool import HostBufferPool, NoFreeBufferError
from offload_examples.instruments.graph_variants import TE_VARIANTS, VARIANTS, memory_row
from offload_examples.instruments.measure import (balanced_rounds, compare_grads, deterministic_kernels, measure_steps,
                                                  training_step)
from offload_examples.instruments.models import build_basic_model, build_linear_stack
from offload_examples.scenarios.cuda_graphs import GraphsConfig, format_report, run

from fresh_processes import start_for_selected_tests


def free_buffer_ids(pool: HostBufferPool) -> set[int]:
    return {id(b) for bufs in pool._free.values() for b in bufs}


def test_graph_safe_path_reuses_fixed_buffers_and_gives_bitwise_gradients():
    model = build_basic_model(4, 32, 4, 64, kind="torch")
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4, device="cpu",
                                        retain_pinned_cpu_buffers=True)
    warm = torch.randn(2, 8, 32, requires_grad=True)
    measure_steps(model, warm, ctx, sync, steps=1, warmup=0)  # the warm-up step makes the buffers
    ctx.freeze_host_buffers()
    buffers, allocations = free_buffer_ids(ctx.pool), ctx.pool.allocations
    assert buffers
    for seed in range(5):  # fresh inputs, like replays
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        check = compare_grads(measure_steps(model, x, steps=1, warmup=0),
                              measure_steps(model, x, ctx, sync, steps=1, warmup=0))
        assert check.equal, check
        assert ctx.offloaded_bytes > 0
        assert free_buffer_ids(ctx.pool) == buffers and ctx.pool.allocations == allocations


def test_graph_safe_path_refuses_a_step_that_needs_new_buffers_and_recovers():
    model = build_linear_stack(3, 16)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=3, device="cpu",
                                        retain_pinned_cpu_buffers=True)
    measure_steps(model, torch.randn(4, 16, requires_grad=True), ctx, sync, steps=1, warmup=0)
    ctx.freeze_host_buffers()
    bigger = torch.randn(8, 16, requires_grad=True)  # saves tensors of sizes no buffer has
    with pytest.raises(GraphCaptureError, match=r"layer 0: no free host buffer of \d+ bytes.*frozen"):
        training_step(model, bigger, ctx, sync)
    assert ctx.live_views == 0 and ctx.resident_bytes == 0  # the failed forward gave everything back
    x = torch.randn(4, 16, requires_grad=True)  # the warmed-up shape still works
    assert compare_grads(measure_steps(model, x, steps=1, warmup=0),
                         measure_steps(model, x, ctx, sync, steps=1, warmup=0)).equal


def test_pool_keeps_buffers_lent_to_a_graph_out_of_circulation():
    pool = HostBufferPool(pin_memory=False, retain=True)
    eager = pool.acquire(64)
    pool.give_back(eager, None)
    graphed = pool.acquire(64, for_graph=True)  # reuses the free one, which the graph now owns
    assert graphed is eager and graphed.for_graph
    pool.give_back(graphed, None)
    assert pool.free_bytes == 0 and pool.graph_bytes == 64
    pool.end_iteration()
    pool.release()
    assert pool.held_bytes == 64  # never freed while the pool lives: a replay writes into it
    with pytest.raises(NoFreeBufferError, match="may not allocate"):
        pool.acquire(64, for_graph=True)
    assert pool.acquire(64) is not graphed  # an eager user gets a new buffer, never the graph's


def test_capture_step_needs_cuda_and_a_warmup():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        capture_step(lambda x: x, x, [])


@pytest.fixture(scope="module")
def cpu_report():
    return run(GraphsConfig.small(), "cpu", progress=None)


def test_scenario_runs_the_graph_safe_path_on_cpu(cpu_report):
    report = cpu_report
    assert report["grads_equal"] and report["checks"] == 3 and not report["captured"]
    assert report["grads_equal_by_variant"] == {"eager + offload, frozen buffers": True}
    assert report["pinned_allocations_after_freeze"] == 0
    assert "capture needs CUDA" in format_report(report)


def test_on_cpu_the_eager_variants_take_turns_and_the_graphed_ones_need_cuda(cpu_report):
    """The two eager variants take turns in balanced rounds; the offloading one has its overhead's spread
    against the other; the four graphed variants have no row and print as needing CUDA."""
    rows = cpu_report["rows"]
    assert list(rows) == ["eager", "eager + offload"]
    assert cpu_report["rounds"] == balanced_rounds(2, GraphsConfig.small().replays)
    for row in rows.values():
        assert row["peak_bytes"] is None and row["step_ms_range"][0] <= row["step_ms"] <= row["step_ms_range"][1]
    spread = rows["eager + offload"]
    assert spread["overhead_range"][0] <= spread["overhead_quartiles"][0] <= spread["overhead"] \
        <= spread["overhead_quartiles"][1] <= spread["overhead_range"][1]
    lines = format_report(cpu_report).splitlines()
    for name in VARIANTS[2:]:
        assert any(re.fullmatch(re.escape(name) + r" +needs CUDA", line) for line in lines), name


def _cuda_shaped(cpu_report: dict) -> dict:
    """The CPU report with what a run on CUDA adds, in made-up numbers: peaks, the four graphed rows with
    their pools and spreads, and the captures' entries."""
    report = copy.deepcopy(cpu_report)
    rows, mib = report["rows"], 2**20
    spread = {"overhead": 0.083, "overhead_quartiles": [0.079, 0.088], "overhead_range": [0.071, 0.102]}
    times = {"step_ms": 42.5, "step_ms_range": [42.4, 42.6]}
    rows["eager"].update(memory_row(4000 * mib))
    rows["eager + offload"].update(memory_row(3440 * mib, 4000 * mib, 560 * mib))
    rows["graphed"] = {**memory_row(4100 * mib), **times}
    rows["graphed + offload"] = {**memory_row(3540 * mib, 4100 * mib, 560 * mib), **times, **spread}
    rows["per-layer graphs"] = {**memory_row(4200 * mib, key="pool_bytes"), **times}
    rows["per-layer graphs + offload"] = {**memory_row(3660 * mib, 4200 * mib, 560 * mib, key="pool_bytes"),
                                          **times, **spread}
    report.update(device_type="cuda", device="NVIDIA H200", captured=True, per_layer_backend="torch",
                  per_layer_offloaded_bytes=560 * mib, d2h_busy_ms=11.6, d2h_overlapped_ms=8.6, copy_bound_ms=41.9,
                  link_gb_per_s={"d2h": 54.9, "h2d": 55.0}, per_layer_over_reference=0.004)
    return report


def test_the_report_of_a_te_run_compares_the_engine_with_te_offload_and_the_copy_bound(cpu_report):
    """On Transformer Engine's layers the report adds TE's offloading, eager and in a whole-step graph,
    with their overheads, and each offloading variant of the engine against them, round by round; the
    per-layer graphs' step is set against the copy bound."""
    report = _cuda_shaped(cpu_report)
    rows = report["rows"]
    te_spread = {"overhead": 0.041, "overhead_quartiles": [0.03, 0.05], "overhead_range": [0.01, 0.06]}
    for name in TE_VARIANTS:
        rows[name] = {**memory_row(3500 * 2**20, 4000 * 2**20), "step_ms": 44.0, "step_ms_range": [43.9, 44.1],
                      **te_spread}
    rows["per-layer graphs + offload"]["against"] = {
        "graphed + TE offload": {"overhead": -0.035, "overhead_quartiles": [-0.04, -0.03], "overhead_range": [0, 0]}}
    text = format_report(report)
    for name in TE_VARIANTS:
        assert re.search(re.escape(name) + r" +44\.0 ms +\+4\.1% \(\+3\.0% \.\. \+5\.0%\)", text), text
    assert "copy bound: 41.9 ms (the schedule's copies at 54.9 GB/s out and 55.0 GB/s back" in text
    assert "per-layer graphs + offload: +0.4% over the larger of it and" in text
    assert "per-layer graphs + offload against graphed + TE offload: -3.5% (-4.0% .. -3.0%)" in text


def test_the_report_of_a_cuda_run_shows_six_variants_with_the_overheads_spread(cpu_report):
    """A memory table and a time table, each with a line for every variant; the offloading variants'
    savings against theory, and their overheads with the quartiles."""
    text = format_report(_cuda_shaped(cpu_report))
    lines: dict[str, str] = {}
    for line in text.splitlines():  # a variant's lines of both tables, joined
        name = line.split("  ")[0]
        lines[name] = lines.get(name, "") + " | " + line
    assert "needs CUDA" not in text and "CPU run" not in text
    assert "overhead of offloading (median, quartiles)" in text
    assert "4.00 GiB " in lines["graphed"] and "4.10 GiB pool" in lines["per-layer graphs"]
    for name in ("eager + offload", "graphed + offload", "per-layer graphs + offload"):
        assert "of theory" in lines[name], lines[name]
    for name in ("graphed + offload", "per-layer graphs + offload"):
        assert lines[name].endswith("+8.3% (+7.9% .. +8.8%)"), lines[name]
    assert "96.4% of theory" in lines["per-layer graphs + offload"]  # a pool 540 MiB smaller, of 560
    assert "smaller by 540.00 MiB;\nthe engine offloaded 560.00 MiB a step" in text
    assert "11.6 ms, 8.6 ms of it while kernels ran" in text


# ---------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def graphs_report():
    report = run(GraphsConfig(), "cuda", progress=print)
    print(format_report(report))
    return report


@pytest.mark.gpu
def test_gpu_replays_are_bitwise_equal_to_eager_without_offloading(graphs_report):
    r = graphs_report
    assert r["captured"] and r["checks"] >= 5
    assert r["grads_equal"], r["max_abs_diff"]


@pytest.mark.gpu
def test_gpu_saving_during_replay_matches_theory(graphs_report):
    row = graphs_report["rows"]["graphed + offload"]
    assert graphs_report["graph_theoretical_saving_bytes"] > 256 * 2**20
    assert row["saving_ratio"] >= 0.95, row


@pytest.mark.gpu
def test_gpu_replay_is_no_slower_than_the_eager_offloaded_step(graphs_report):
    rows = graphs_report["rows"]
    assert rows["graphed + offload"]["step_ms"] <= rows["eager + offload"]["step_ms"], rows
    # and the copies really run inside the replayed graph, mostly under kernels
    assert graphs_report["d2h_busy_ms"] > 0 and graphs_report["d2h_overlapped_ms"] >= 0.5 * graphs_report["d2h_busy_ms"]


@pytest.mark.gpu
def test_gpu_six_variants_replay_bitwise_and_per_layer_graphs_save_the_offloaded_bytes(cuda):
    """A smaller model than the default, still large enough that the offloaded bytes stand well above
    the pools' rounding: every variant has a row and a time, every graph replays bitwise, the per-layer
    graphs' pool shrinks by about what the engine offloaded, and each offloading variant's overhead has
    its spread over the rounds."""
    report = run(GraphsConfig(layers=6, offload=2, seq=512, batch=4, replays=6, checks=2, warmup=1), cuda,
                 progress=None)
    print(format_report(report))
    rows = report["rows"]
    assert tuple(rows) == VARIANTS and all(r["step_ms"] > 0 for r in rows.values())
    assert report["grads_equal"], report["grads_equal_by_variant"]
    assert set(report["grads_equal_by_variant"]) == set(VARIANTS[2:])
    moved = report["per_layer_offloaded_bytes"]
    assert moved > 0 and rows["per-layer graphs + offload"]["saving_bytes"] >= 0.9 * moved, (rows, moved)
    for name in VARIANTS[1::2]:
        low, high = rows[name]["overhead_range"]
        assert low <= rows[name]["overhead_quartiles"][0] <= rows[name]["overhead"] <= high, rows[name]


@pytest.mark.gpu
def test_gpu_te_per_layer_graphs_take_turns_with_te_offload_eager_and_graphed(te, cuda):
    """On Transformer Engine's layers the scenario adds TE's own offloading, eagerly and with the whole
    step captured: every variant replays bitwise like an eager step without offloading, and the engine's
    per-layer graphs are set against both and against the copy bound, round by round."""
    report = run(GraphsConfig(layers=6, offload=2, seq=512, batch=4, replays=6, checks=2, warmup=1, kind="te",
                              skip="graphed"), cuda, progress=None)
    print(format_report(report))
    rows = report["rows"]
    assert set(TE_VARIANTS) <= set(rows) and "graphed" not in rows
    assert report["grads_equal"], report["grads_equal_by_variant"]
    assert set(rows["per-layer graphs + offload"]["against"]) == set(TE_VARIANTS)
    assert report["copy_bound_ms"] > 0 and report["per_layer_backend"] == "te"


def _small_cuda_model(cuda):
    layers = build_linear_stack(4, 256, device=cuda)
    return layers, torch.randn(8, 256, device=cuda, requires_grad=True)


_SETUP = """
import torch
from offload_examples import GraphCaptureError, get_cpu_offload_context
from offload_examples.features.graphs import capture_step
from offload_examples.instruments.measure import training_step
from offload_examples.instruments.models import build_linear_stack
layers = build_linear_stack(4, 256, device="cuda")
x = torch.randn(8, 256, device="cuda", requires_grad=True)
ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4, retain_pinned_cpu_buffers={retain})
"""


# The captures that must fail; keyed by their test.
_PROGRAMS = {
    "test_gpu_capture_without_warmed_buffers_fails_at_capture": _SETUP.format(retain=False) + """
training_step(layers, x)
torch.cuda.synchronize()
with torch.cuda.graph(torch.cuda.CUDAGraph()):
    training_step(layers, x, ctx, sync)
""",
    "test_gpu_timing_marks_cannot_be_captured": _SETUP.format(retain=True) + """
from offload_examples.instruments.timeline import StepRecorder
ctx.recorder = StepRecorder(torch.device("cuda", 0))
capture_step(lambda x: training_step(layers, x, ctx, sync), x, layers.parameters())
""",
    "test_gpu_forward_and_backward_in_separate_graphs_capture": _SETUP.format(retain=True) + """
class Whole(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = layers

    def forward(self, h):
        for layer in self.layers:
            with ctx:
                h = layer(h)
            h = sync(h)
        return h

def grads(out):
    out.square().mean().backward()
    found = [out.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]
    x.grad = None
    for p in layers.parameters():
        p.grad = None
    return found

side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):  # eager work before a capture runs on a side stream
    h = x
    for layer in layers:
        h = layer(h)
    eager = grads(h)
torch.cuda.current_stream().wait_stream(side)
graphed = torch.cuda.make_graphed_callables(Whole(), (x,))
print("captured")
replays = [grads(graphed(x)) for _ in range(2)]
print("bitwise", all(torch.equal(a, b) for r in replays for a, b in zip(eager, r)))
""",
    "test_gpu_optimizer_offload_refuses_a_captured_backward": _SETUP.format(retain=True) + """
from offload_examples import OptimizerOffload
opt = OptimizerOffload(layers.parameters(), torch.optim.Adam, fraction=1.0)
capture_step(lambda x: training_step(layers, x), x, layers.parameters())
""",
}


@pytest.fixture(scope="module")
def _capture_programs(request):
    """Each capture that must fail runs in a fresh process: one that CUDA aborts leaves PyTorch's
    CUDA random generator marked as capturing for the rest of the process. All start when the first
    of their tests asks (after the timed report above), so that they overlap."""
    yield from start_for_selected_tests(request, _PROGRAMS, timeout_s=120)


def _capture_fails(request, programs) -> str:
    """The error output of the requesting test's fresh process, which must have failed."""
    done = programs.result(request.node.originalname)
    assert done.returncode != 0, done.stdout
    return done.stderr


@pytest.mark.gpu
def test_gpu_capture_without_warmed_buffers_fails_at_capture(request, _capture_programs):
    # The warm-up runs without offloading (it makes cuBLAS's handle and workspace, which a capture
    # cannot), so the pool is empty when the capture needs layer 0's first buffer.
    err = _capture_fails(request, _capture_programs)
    assert "GraphCaptureError: layer 0: no free host buffer" in err, err[-3000:]
    assert "does not pin host memory during a CUDA graph capture" in err, err[-3000:]
    assert "Run at least one eager step" in err, err[-3000:]


@pytest.mark.gpu
def test_gpu_timing_marks_cannot_be_captured(request, _capture_programs):
    err = _capture_fails(request, _capture_programs)
    assert "GraphCaptureError: timing marks" in err, err[-3000:]


@pytest.mark.gpu
def test_gpu_forward_and_backward_in_separate_graphs_capture(request, _capture_programs):
    """The whole model as one callable of make_graphed_callables: a forward graph whose releases join
    the copies to the host, and a backward graph whose reloads need no wait for them."""
    done = _capture_programs.result(request.node.originalname)
    assert done.returncode == 0 and "captured" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "bitwise True" in done.stdout, done.stdout[-3000:]  # replays equal an eager step without offloading


@pytest.mark.gpu
def test_gpu_eager_steps_after_a_capture_do_not_touch_the_graphs_buffers(cuda):
    layers, x = _small_cuda_model(cuda)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4, retain_pinned_cpu_buffers=True)
    with deterministic_kernels():
        captured = capture_step(lambda x: training_step(layers, x, ctx, sync), x, layers.parameters())
        graph_buffers = {id(b) for b in ctx.pool._kept_for_graphs}
        assert graph_buffers and ctx.pool.graph_bytes == ctx.offloaded_bytes
        captured.replay(x)
        eager = measure_steps(layers, x, ctx, sync, steps=1, warmup=0)  # allocates its own buffers
        assert not graph_buffers & free_buffer_ids(ctx.pool)
        out = captured.replay(x).to("cpu", copy=True)
    assert torch.equal(out, eager.output)


@pytest.mark.gpu
def test_gpu_per_module_graphs_inside_the_context_offload_nothing(cuda):
    """What the CUDA-graph page says of make_graphed_callables per layer, used inside the context:
    no error, the right gradients, and nothing offloaded (the graphs keep their own activations)."""
    layers, x = _small_cuda_model(cuda)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4)
    with deterministic_kernels():
        plain = measure_steps(layers, x, steps=1, warmup=0)
        sample = torch.randn_like(x).requires_grad_()
        graphed = [torch.cuda.make_graphed_callables(layer, (sample,)) for layer in layers]
        offloaded = measure_steps(torch.nn.ModuleList(graphed), x, ctx, sync, steps=1, warmup=0)
    assert ctx.offloaded_bytes == 0 and sum(s.candidate_bytes for s in ctx.stats) == 0
    torch.testing.assert_close(offloaded.output, plain.output)
    for name, grad in plain.grads.items():
        torch.testing.assert_close(offloaded.grads[name], grad, msg=name)


@pytest.mark.gpu
def test_gpu_optimizer_offload_refuses_a_captured_backward(request, _capture_programs):
    err = _capture_fails(request, _capture_programs)
    assert "GraphCaptureError: OptimizerOffload copies gradients in backward hooks" in err, err[-3000:]
    assert 'grad_copy="step"' in err, err[-3000:]


@pytest.mark.gpu
def test_gpu_replays_with_optimizer_offload_copying_at_the_step(cuda):
    """zero_grad(set_to_none=True) between replays is harmless; with grad_copy="step" the wrapper
    trains from the replays' gradients like plain SGD trains from eager steps."""
    from offload_examples import OptimizerOffload

    layers, x = _small_cuda_model(cuda)
    ref_layers = [copy.deepcopy(layer) for layer in layers]
    ref_params = [p for layer in ref_layers for p in layer.parameters()]
    ref = torch.optim.SGD(ref_params, lr=0.1)
    opt = OptimizerOffload(layers.parameters(), torch.optim.SGD, fraction=0.5, grad_copy="step", lr=0.1)
    inputs = [torch.randn_like(x) for _ in range(3)]
    with deterministic_kernels():
        captured = capture_step(lambda x: training_step(layers, x), x, layers.parameters())
        for xi in inputs:
            opt.zero_grad(set_to_none=True)
            captured.replay(xi)
            opt.step()
            ref.zero_grad(set_to_none=True)
            training_step(ref_layers, xi.clone().requires_grad_())
            ref.step()
    for p, q in zip(layers.parameters(), ref_params):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)  # the host half rounds like a CPU
