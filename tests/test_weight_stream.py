"""Weight streaming: gradients equal to a resident run, the schedule of loads and write-backs, the
bookkeeping of bytes on the device, errors on misuse; on a GPU, the memory saving against theory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload_examples import StreamedLayers
from offload_examples.instruments.measure import compare_grads, deterministic_kernels, measure_steps
from offload_examples.instruments.models import build_basic_model, build_linear_stack
from offload_examples.scenarios.weight_streaming import WeightsConfig, _by_position, format_report, run


def resident_and_streamed(layers: nn.ModuleList, x: torch.Tensor, device="cpu"):
    resident = copy.deepcopy(layers).to(device)
    streamed = StreamedLayers(list(copy.deepcopy(layers)), device)
    return resident, nn.ModuleList([streamed]), streamed


@pytest.mark.parametrize("build", [
    lambda: build_linear_stack(5, 32),
    lambda: build_basic_model(3, 32, 4, 64, kind="torch", dropout=0.2),  # random layers recompute alike
    lambda: nn.ModuleList([nn.Linear(16, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 8), nn.Tanh())]),
])
def test_gradients_bitwise_equal_to_resident(build):
    layers = build()
    width = next(layers[0].parameters()).shape[1]
    x = torch.randn(2, 7, width, requires_grad=True)
    resident, model, _ = resident_and_streamed(layers, x)
    torch.manual_seed(3)
    ref = measure_steps(resident, x, steps=2, warmup=1)
    torch.manual_seed(3)
    got = measure_steps(model, x, steps=2, warmup=1)
    check = compare_grads(_by_position(ref), _by_position(got))
    assert check.equal and check.compared == len(list(layers.parameters())) + 2, check


def test_parameters_live_on_the_host_between_steps_and_a_host_optimizer_trains_them():
    layers = build_linear_stack(3, 16)
    x = torch.randn(4, 16)
    resident, model, streamed = resident_and_streamed(layers, x)
    opt_r = torch.optim.SGD(resident.parameters(), lr=0.1, momentum=0.9)
    opt_s = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        for m, opt in ((resident, opt_r), (model, opt_s)):
            h = x
            for layer in m:
                h = layer(h)
            h.square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for a, b in zip(resident.parameters(), model.parameters()):
        assert torch.equal(a, b)
    for layer, host in zip(streamed.layers, streamed._host):  # parameters are views of their layer's buffer
        for p in layer.parameters():
            assert p.device.type == "cpu" and p.untyped_storage().data_ptr() == host.data.data_ptr()


def test_schedule_prefetches_one_layer_ahead_and_writes_back_one_behind():
    streamed = StreamedLayers(list(build_linear_stack(4, 8)), "cpu")
    streamed(torch.randn(2, 8)).sum().backward()
    forward = [("load", 0), ("load", 1), ("drop", 0), ("load", 2), ("drop", 1), ("load", 3), ("drop", 2)]
    backward = [
        ("load", 2), ("drop", 3), ("write", 3),                 # layer 3 (kept loaded from its forward)
        ("load", 1), ("drop", 2), ("write", 2),                 # layer 2: layer 3's write-back still running
        ("load", 0), ("free", 3), ("drop", 1), ("write", 1),
        ("free", 2), ("drop", 0), ("write", 0), ("free", 1), ("free", 0),  # layer 0: all written back
    ]
    assert streamed.events == forward + backward


def test_at_most_two_layers_of_weights_and_gradients_on_the_device():
    layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 64), nn.Linear(64, 8), nn.Linear(8, 8)])
    streamed = StreamedLayers(list(layers), "cpu")
    streamed(torch.randn(3, 8)).sum().backward()
    sizes = streamed.weight_bytes
    assert streamed.resident_bound() == 2 * (sizes[1] + sizes[2])
    assert 0 < streamed.peak_device_bytes <= streamed.resident_bound()
    assert streamed.device_bytes == 0  # nothing left on the device after the step


def test_pinned_pool_does_not_grow_across_steps():
    streamed = StreamedLayers(list(build_linear_stack(3, 16)), "cpu")
    held, allocations = streamed.pool.held_bytes, streamed.pool.allocations
    assert held == 2 * sum(streamed.weight_bytes)  # weights + gradients, nothing else
    for _ in range(3):
        streamed.zero_grad(set_to_none=True)
        streamed(torch.randn(2, 16)).sum().backward()
    assert (streamed.pool.held_bytes, streamed.pool.allocations) == (held, allocations)


def accumulate(model: nn.Module, micro_batches: list[torch.Tensor]) -> None:
    for x in micro_batches:
        h = x
        for layer in model:
            h = layer(h)
        h.square().mean().backward()


@pytest.mark.parametrize("clear", ["none", "zeros", "by hand"])
def test_gradients_accumulate_bitwise_like_autograd(clear):
    """Three micro-batches without clearing in between: the sums equal a resident model's, whether
    the first backward starts from no gradients, from zeroed ones, or from ones set by hand."""
    layers = nn.ModuleList([nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 8), nn.Linear(8, 16, bias=False)])
    resident, model, streamed = resident_and_streamed(layers, None)
    micro = [torch.randn(3, 16) for _ in range(3)]
    accumulate(resident, micro[:1])
    accumulate(model, micro[:1])
    if clear == "zeros":
        resident.zero_grad(set_to_none=False)
        model.zero_grad(set_to_none=False)
    elif clear == "by hand":
        for a, b in zip(resident.parameters(), model.parameters()):
            a.grad = torch.full_like(a, 0.5)
            b.grad = torch.full_like(b, 0.5)
    accumulate(resident, micro[1:])
    accumulate(model, micro[1:])
    for (name, a), b in zip(resident.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
    assert ("load grads", 0) in streamed.events
    assert 0 < streamed.peak_device_bytes <= streamed.resident_bound(accumulating=True)
    assert streamed.device_bytes == 0


def test_a_parameter_without_a_new_gradient_keeps_its_old_one():
    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    streamed = StreamedLayers([Skip(), nn.Linear(4, 4)], "cpu")
    unused = streamed.layers[0].unused.weight
    unused.grad = torch.ones_like(unused)
    streamed(torch.randn(2, 4)).sum().backward()
    assert torch.equal(unused.grad, torch.ones_like(unused))


def run_both(resident: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    for m in (resident, model):
        accumulate(m, [x])


def assert_same_grads(resident: nn.Module, model: nn.Module) -> None:
    for (name, a), b in zip(resident.named_parameters(), model.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        assert a.grad is None or torch.equal(a.grad, b.grad), name


class Fails(nn.Module):
    """A layer that raises in its forward or backward when told to."""

    def __init__(self, width: int):
        super().__init__()
        self.linear, self.fail = nn.Linear(width, width), ""

    def forward(self, x):
        if self.fail == "forward":
            raise RuntimeError("forward failed")
        y = self.linear(x)
        if self.fail == "backward" and torch.is_grad_enabled():
            y.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("backward failed")))
        return y


@pytest.mark.parametrize("interruption", ["no_grad forward", "forward raises", "backward raises"])
def test_a_step_after_an_interrupted_one_uses_the_current_weights(interruption):
    """Whatever the last step left loaded is given back: changed weights are loaded afresh."""
    layers = nn.ModuleList([nn.Linear(8, 8), Fails(8), nn.Linear(8, 8)])
    resident, model, streamed = resident_and_streamed(layers, None)
    x = torch.randn(3, 8)
    if interruption == "no_grad forward":
        with torch.no_grad():
            streamed(x)
    else:
        streamed.layers[1].fail = interruption.split()[0]
        with pytest.raises(RuntimeError, match="failed"):
            streamed(x).sum().backward()
        streamed.layers[1].fail = ""
    with torch.no_grad():  # an optimizer step, say
        for a, b in zip(resident.parameters(), model.parameters()):
            a.mul_(2)
            b.mul_(2)
    streamed.zero_grad(set_to_none=True)
    run_both(resident, model, x)
    assert_same_grads(resident, model)
    assert streamed.device_bytes == 0 and not streamed._loaded and not streamed._writing


def test_frozen_parameters_and_a_first_layer_without_any():
    """A parameter-free first layer on an input without grad never runs backward: the write-backs
    still finish and nothing stays on the device. Frozen parameters get no gradient."""
    layers = nn.ModuleList([nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 8)])
    layers[2].bias.requires_grad_(False)
    resident, model, streamed = resident_and_streamed(layers, None)
    run_both(resident, model, torch.randn(3, 8))
    assert_same_grads(resident, model)
    assert streamed.device_bytes == 0 and not streamed._loaded and not streamed._writing
    assert ("write", 1) in streamed.events and not any(e[1] == 0 for e in streamed.events if e[0] == "write")


def test_recomputation_runs_under_the_forwards_autocast():
    layers = build_linear_stack(3, 16)
    resident, model, _ = resident_and_streamed(layers, None)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = []
        for m in (resident, model):
            h = x
            for layer in m:
                h = layer(h)
            outs.append(h)
    for out in outs:
        assert out.dtype == torch.bfloat16
        out.float().square().mean().backward()
    assert_same_grads(resident, model)


def test_bad_layers_are_clear_errors():
    with pytest.raises(ValueError, match="at least one layer"):
        StreamedLayers([], "cpu")
    shared = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="shares a parameter"):
        StreamedLayers([shared, nn.GELU(), shared], "cpu")


def test_scenario_reports_equal_gradients_and_the_bound():
    report = run(WeightsConfig.small(), "cpu", progress=None)
    assert report["grads_equal"] and report["streamed_weight_grad_peak_bytes"] <= report["streamed_bound_bytes"]
    assert "bitwise equal to the resident run: True" in format_report(report)


# ---------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_weight_memory_saving_matches_theory_and_gradients_are_bitwise(cuda):
    """Weight-dominated size: 12 layers x 64 MiB of bf16 weights, a one-token batch."""
    layers = build_linear_stack(12, 2048, dtype=torch.bfloat16)
    x = torch.randn(1, 1, 2048, dtype=torch.bfloat16, device=cuda, requires_grad=True)
    torch.cuda.synchronize()
    outside = torch.cuda.memory_allocated()
    with deterministic_kernels():
        resident = copy.deepcopy(layers).to(cuda)
        ref = measure_steps(resident, x, steps=2, warmup=1)
        del resident
        streamed = StreamedLayers(list(copy.deepcopy(layers)), cuda)
        streamed.reset_peak()
        got = measure_steps(nn.ModuleList([streamed]), x, steps=2, warmup=1)
    weights = sum(streamed.weight_bytes)
    assert streamed.peak_device_bytes <= streamed.resident_bound()
    saving = (ref.peak_bytes - outside) - (got.peak_bytes - outside)
    theory = 2 * weights - streamed.peak_device_bytes
    print(f"resident {ref.peak_bytes - outside} B, streamed {got.peak_bytes - outside} B, saving {saving} vs {theory}")
    assert abs(saving - theory) <= 0.05 * theory
    assert compare_grads(_by_position(ref), _by_position(got)).equal


@pytest.mark.gpu
def test_gpu_scenario_streams_with_overlap(cuda):
    # 8 x 2048 tokens make a layer's compute (~6 ms on an H100) longer than its 256 MiB weight load
    # (~5 ms at 55 GB/s); with fewer tokens the loads outlast the kernels and cannot be hidden.
    report = run(WeightsConfig(layers=8, seq=2048), cuda, progress=None)
    print(format_report(report))
    assert report["grads_equal"]
    assert abs(report["saving_ratio"] - 1) <= 0.05
    # the loads run while layers compute: most of their time overlaps with kernels
    assert report["host-to-device_overlapped_ms"] >= 0.8 * report["host-to-device_busy_ms"]


@pytest.mark.gpu
def test_gpu_gradient_accumulation_is_bitwise_and_bounded(cuda):
    layers = build_linear_stack(6, 1024, dtype=torch.bfloat16)
    micro = [torch.randn(2, 256, 1024, dtype=torch.bfloat16, device=cuda) for _ in range(3)]
    with deterministic_kernels():
        resident = copy.deepcopy(layers).to(cuda)
        streamed = StreamedLayers(list(copy.deepcopy(layers)), cuda)
        accumulate(resident, micro)
        accumulate(nn.ModuleList([streamed]), micro)
    for (name, a), b in zip(resident.named_parameters(), streamed.parameters()):
        assert torch.equal(a.grad.cpu(), b.grad), name
    assert streamed.resident_bound() < streamed.peak_device_bytes <= streamed.resident_bound(accumulating=True)
