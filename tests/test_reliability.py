"""Reliability: long runs, faults, autograd semantics and random models, on the CPU (GPU variants marked).

Each test states what it tried; the docs' reliability page summarises them.
"""

from __future__ import annotations

import gc
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from offload_examples import OffloadWarning, get_cpu_offload_context
from offload_examples.instruments.measure import training_step
from offload_examples.instruments.models import Checkpointed, build_linear_stack
from offload_examples.scenarios import pipeline
from offload_examples.core.schedule import sync_dict_for_order

CPU = torch.device("cpu")
SOAK_STEPS = 1000


def offload(k: int, n: int, device=CPU, **kw):
    return get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n, device=device, **kw)


def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def data(*shape: int, device=CPU) -> torch.Tensor:
    return torch.randn(*(shape or (4, 16)), generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()


def engine_is_idle(ctx) -> bool:
    """Nothing lent out, nothing resident, no saved view alive."""
    return ctx.live_views == 0 and ctx.resident_bytes == 0 and ctx.pool.free_bytes == ctx.pool.held_bytes


# ---------------------------------------------------------------- soak
def rss_bytes() -> int:
    """This process's resident memory now (Linux), pinned host buffers included."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(device: torch.device, steps: int, width: int = 256) -> dict:
    """``steps`` training steps with the garbage collector off: memory that only a collection
    would give back (a reference cycle) shows up as drift, and fails the test. Every seventh step
    is a forward whose output is dropped without a backward (a skipped step), through layers
    ending in ``tanh``, which saves its own output (the case that once formed a cycle)."""
    stack = build_linear_stack(4, width, device=device)
    model, x = nn.ModuleList(nn.Sequential(*layer, nn.Tanh()) for layer in stack), data(16, width, device=device)
    training_step(model, x)
    expected = grads(model, x)
    ctx, sync = offload(2, 4, device, retain_pinned_cpu_buffers=True)
    training_step(model, x, ctx, sync)  # warm-up: the pool allocates here
    grads(model, x)
    cuda = device.type == "cuda"
    gc.collect()  # garbage of earlier tests must not be counted as this run's
    if cuda:
        torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device) if cuda else None
    pool = (ctx.pool.held_bytes, ctx.pool.allocations)
    drift, rss = [], []
    gc.disable()
    try:
        for step in range(steps):
            if step % 7 == 3:
                forward_only(model, x, ctx, sync)
                assert ctx.live_views == 0, f"step {step}: a dropped forward left saved tensors alive"
                if cuda:
                    torch.cuda.synchronize()
                    drift.append(torch.cuda.memory_allocated(device) - base)
            training_step(model, x, ctx, sync)
            if step == steps - 1:  # the last step's gradients against the run without offloading
                assert same(expected, grads(model, x)), "gradients of the last step differ"
            model.zero_grad(set_to_none=True)
            x.grad = None
            assert engine_is_idle(ctx), f"step {step}: the engine still holds something"
            assert (ctx.pool.held_bytes, ctx.pool.allocations) == pool, f"step {step}: the pinned pool grew"
            if cuda:
                torch.cuda.synchronize()
                drift.append(torch.cuda.memory_allocated(device) - base)
            if step % 100 == 99:
                rss.append(rss_bytes())
    finally:
        gc.enable()
    return {"pool_bytes": pool[0], "offloaded_bytes": ctx.offloaded_bytes, "drift": drift, "rss": rss}


def forward_only(model: nn.Module, x: torch.Tensor, ctx, sync) -> None:
    h = x
    for layer in model:
        with ctx:
            h = layer(h)
        h = sync(h)
    del h  # dropped without a backward: every saved tensor must be freed now, not by the collector


def check_soak(report: dict, steps: int) -> None:
    assert report["pool_bytes"] > 0 and report["offloaded_bytes"] > 0
    # Leaking one step's offloaded bytes every 10 steps would grow the process by this much.
    leak = (steps - 100) // 10 * report["offloaded_bytes"]
    growth = report["rss"][-1] - report["rss"][0]
    assert growth < leak, f"host memory grew by {growth} bytes over {steps - 100} steps (a leak would add {leak})"


def test_soak_cpu():
    check_soak(soak(CPU, SOAK_STEPS), SOAK_STEPS)


@pytest.mark.gpu
def test_soak_gpu(cuda):
    report = soak(cuda, SOAK_STEPS, width=1024)
    check_soak(report, SOAK_STEPS)
    assert max(map(abs, report["drift"])) == 0, "GPU memory did not return to its baseline after every step"


# ---------------------------------------------------------------- faults
class Boom(Exception):
    pass


class FailingBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if FailingBackward.armed:
            raise Boom("failure during backward")
        return g


class FailingLayer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return FailingBackward.apply(torch.tanh(self.linear(x)))


def run(model, x, ctx=None, sync=None):
    training_step(model, x, ctx, sync)
    return grads(model, x)


@pytest.mark.parametrize("where", ["forward", "backward", "keyboard-interrupt"])
def test_a_fault_leaves_the_engine_usable_and_releases_memory(where, device=CPU):
    model = nn.ModuleList(FailingLayer(32) for _ in range(4)).to(device)
    x = data(4, 32, device=device)
    expected = run(model, x)
    ctx, sync = offload(3, 4, device, retain_pinned_cpu_buffers=True)
    run(model, x, ctx, sync)
    error = KeyboardInterrupt if where == "keyboard-interrupt" else Boom
    try:
        with pytest.raises(error):
            h = x
            for i, layer in enumerate(model):
                with ctx:
                    h = layer(h)
                    if i == 2 and where != "backward":
                        raise error()
                h = sync(h)
            FailingBackward.armed = True
            h.sum().backward()
    finally:
        FailingBackward.armed = False
    del h  # the failed graph goes with its last reference, as it does in a training loop
    assert engine_is_idle(ctx)
    for _ in range(2):
        assert same(expected, run(model, x, ctx, sync))
    assert engine_is_idle(ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_fault_on_the_gpu_gives_the_memory_back(where, cuda):
    model = nn.ModuleList(FailingLayer(1024) for _ in range(4)).to(cuda)
    x = data(4096, 1024, device=cuda)
    ctx, sync = offload(3, 4, cuda, retain_pinned_cpu_buffers=True)
    run(model, x, ctx, sync)
    gc.collect()  # earlier tests' garbage, freed by a collection inside the window, would lower the count
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(cuda)
    try:
        with pytest.raises(Boom):
            h = x
            for i, layer in enumerate(model):
                with ctx:
                    h = layer(h)
                    if i == 2 and where == "forward":
                        raise Boom()
                h = sync(h)
            FailingBackward.armed = True
            h.sum().backward()
    finally:
        FailingBackward.armed = False
    del h
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(cuda) == base
    assert engine_is_idle(ctx)


def test_pinned_allocation_failure_keeps_tensors_on_the_device(monkeypatch):
    model, x = build_linear_stack(3, 16), data()
    expected = run(model, x)
    ctx, sync = offload(2, 3)

    def fail(nbytes):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(ctx.pool, "_allocate", fail)
    with pytest.warns(OffloadWarning, match=r"keeping saved tensors of layer \d+ on the device: CUDA error"):
        got = run(model, x, ctx, sync)
    assert same(expected, got) and ctx.offloaded_bytes == 0 and engine_is_idle(ctx)


def test_host_cap_in_dict_mode_keeps_tensors_on_the_device():
    model = nn.ModuleList([build_linear_stack(1, 16)[0]])
    x = torch.randn(8, 4, 16, requires_grad=True)
    order = pipeline.ORDER
    ref = run_order(model, x, order)
    ctx, sync = get_cpu_offload_context(enabled=True, model_layers=8, synchronization_dict=pipeline.SYNC_DICT,
                                        device=CPU, host_memory_limit=1)
    with pytest.warns(OffloadWarning, match="host memory limit"):
        got = run_order(model, x, order, ctx, sync)
    assert same(ref, got) and ctx.offloaded_bytes == 0


def run_order(model, x, order, ctx=None, sync=None):
    from offload_examples.core.schedule import parse_order

    pipeline.pipeline_step(model[0], x, parse_order(order) if isinstance(order, str) else order, ctx, sync)
    return grads(model, x)


# ---------------------------------------------------------------- autograd semantics
def test_no_grad_and_inference_mode_save_and_offload_nothing():
    model, x = build_linear_stack(3, 16), data()
    ctx, sync = offload(2, 3)
    for mode in (torch.no_grad, torch.inference_mode):
        for _ in range(2):  # two iterations' worth of entries
            with mode():
                h = x
                for layer in model:
                    with ctx:
                        h = layer(h)
            assert sum(s.saved_tensors for s in ctx.stats) == 0 and ctx.offloaded_bytes == 0
    expected = run(model, x)
    assert same(expected, run(model, x, ctx, sync))  # and training still works afterwards


def test_autocast():
    model, x = build_linear_stack(3, 32), data(4, 32)

    def step(ctx=None, sync=None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run(model, x, ctx, sync)

    expected = step()
    ctx, sync = offload(2, 3)
    assert same(expected, step(ctx, sync))
    assert ctx.offloaded_bytes > 0
    # autocast's bf16 copies of the weights are weights, not activations: they stay
    assert all(s.offloaded_bytes < s.candidate_bytes + 1 for s in ctx.stats)


def test_checkpoint_inside_an_offloaded_layer():
    torch.manual_seed(0)
    model = nn.ModuleList([Checkpointed(build_linear_stack(1, 32)[0]), build_linear_stack(1, 32)[0],
                           Checkpointed(build_linear_stack(1, 32)[0])])
    x = data(4, 32)
    expected = run(model, x)
    ctx, sync = offload(2, 3)
    assert same(expected, run(model, x, ctx, sync))
    assert same(expected, run(model, x, ctx, sync))


def test_channels_last_and_other_strides_come_back_as_they_went():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            seen.append(("saved", x.stride(), x.storage_offset()))
            return x * 1

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            seen.append(("unpacked", x.stride(), x.storage_offset()))
            return g

    conv = nn.Conv2d(8, 8, 3, padding=1).to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 16, 16).to(memory_format=torch.channels_last).requires_grad_()

    def layer0(h):
        return Probe.apply(conv(h))

    def layer1(h):
        return Probe.apply(h.transpose(2, 3)[:, :, 1:, :])  # non-contiguous view with an offset

    ctx, sync = offload(2, 3)
    h = x
    for f in (layer0, layer1, torch.relu):
        with ctx:
            h = f(h)
        h = sync(h)
    h.sum().backward()
    saved = [s[1:] for s in seen if s[0] == "saved"]
    unpacked = [s[1:] for s in seen if s[0] == "unpacked"]
    assert sorted(saved) == sorted(unpacked) and ctx.stats[0].offloaded_bytes > 0


@pytest.mark.parametrize("kind", ["zero-size", "complex", "int64", "bool", "float16"])
def test_unusual_dtypes_and_sizes_come_back_bitwise(kind):
    made = {
        "zero-size": lambda: torch.empty(0, 5),
        "complex": lambda: torch.randn(64, 64, dtype=torch.complex64),
        "int64": lambda: torch.randint(-2**40, 2**40, (64, 64)),
        "bool": lambda: torch.rand(64, 64) > 0.5,
        "float16": lambda: torch.randn(64, 64).half(),
    }[kind]
    stash = {}

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            t = made()
            stash["sent"] = t.clone()
            ctx.save_for_backward(t)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors
            stash["back"] = t.clone()
            return g * 2

    ctx, sync = offload(1, 2, min_offload_bytes=0)
    h = data()
    for f in (Keep.apply, torch.tanh):
        with ctx:
            h = f(h)
        h = sync(h)
    h.sum().backward()
    a, b = stash["sent"], stash["back"]
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                                                      b.view(-1).view(torch.uint8) if b.numel() else b)
    if kind != "zero-size":
        assert ctx.stats[0].offloaded_bytes > 0


class Tagged(torch.Tensor):
    """A tensor subclass the engine does not know how to rebuild."""


def test_tensor_subclasses_stay_on_the_device_with_a_warning():
    class SaveTagged(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x.detach().as_subclass(Tagged) * 1)
            return x * 3

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors
            assert type(t) is Tagged
            return g * 3

    ctx, sync = offload(1, 2)
    h = data()
    with pytest.warns(OffloadWarning, match="tensor subclass Tagged is not offloaded"):
        for f in (SaveTagged.apply, torch.tanh):
            with ctx:
                h = f(h)
            h = sync(h)
    h.sum().backward()


def test_two_models_with_their_own_contexts():
    a, b = build_linear_stack(3, 16, seed=1), build_linear_stack(4, 16, seed=2)
    xa, xb = data(), data()
    ea, eb = run(a, xa), run(b, xb)
    ca, sa = offload(2, 3)
    cb, sb = offload(3, 4)
    for _ in range(3):  # interleaved: a's forward, b's forward, then both backwards
        ha, hb = xa, xb
        for layer in a:
            with ca:
                ha = layer(ha)
            ha = sa(ha)
        for layer in b:
            with cb:
                hb = layer(hb)
            hb = sb(hb)
        (ha.square().mean() + hb.square().mean()).backward()
        assert same(ea, grads(a, xa)) and same(eb, grads(b, xb))


def test_nested_contexts_of_two_engines_are_rejected():
    ca, _ = offload(1, 2)
    cb, _ = offload(1, 2)
    with ca:
        with pytest.raises(RuntimeError, match="another offload context is already active"):
            with cb:
                pass
    with cb:  # and both work again afterwards
        pass


# ---------------------------------------------------------------- property-based: random models, k and schedules
LAYERS = {
    "linear": lambda w: nn.Linear(w, w),
    "mlp": lambda w: nn.Sequential(nn.Linear(w, 2 * w), nn.GELU(), nn.Linear(2 * w, w)),
    "norm": lambda w: nn.Sequential(nn.LayerNorm(w), nn.Linear(w, w), nn.SiLU()),
    "attention": lambda w: nn.TransformerEncoderLayer(w, 2, 2 * w, dropout=0.0, batch_first=True),
    "views": lambda w: ChunkMix(w),
}


class ChunkMix(nn.Module):
    """Saves views: chunks of one projection, transposed."""

    def __init__(self, w: int):
        super().__init__()
        self.proj = nn.Linear(w, 2 * w)

    def forward(self, x):
        a, b = self.proj(x).chunk(2, dim=-1)
        return (a.transpose(-1, -2).sigmoid().transpose(-1, -2) * b).tanh()


FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(kinds=st.lists(st.sampled_from(sorted(LAYERS)), min_size=2, max_size=6), data_=st.data(),
       width=st.sampled_from([8, 16]), min_bytes=st.sampled_from([0, 1024]))
def test_random_stacks_and_k_give_bitwise_equal_gradients(kinds, data_, width, min_bytes):
    k = data_.draw(st.integers(0, len(kinds) - 1), label="k")
    torch.manual_seed(0)
    model = nn.ModuleList(LAYERS[kind](width) for kind in kinds)
    x = torch.randn(2, 6, width, requires_grad=True)
    expected = run(model, x)
    ctx, sync = offload(k, len(kinds), min_offload_bytes=min_bytes)
    for _ in range(2):
        assert same(expected, run(model, x, ctx, sync))
    assert engine_is_idle(ctx)


@st.composite
def interleaved_orders(draw, n: int):
    """A random order of n forwards (in order) and n backwards, each after its own forward."""
    order, done_f, pending = [], 0, []
    while done_f < n or pending:
        can_f, can_b = done_f < n, bool(pending)
        if can_f and (not can_b or draw(st.booleans())):
            order.append(("forward", done_f))
            pending.append(done_f)
            done_f += 1
        else:
            j = draw(st.sampled_from(pending))
            pending.remove(j)
            order.append(("backward", j))
    return order


@FAST
@given(data_=st.data(), n=st.integers(3, 8), release_after=st.integers(1, 3), reload_before=st.integers(1, 2))
def test_random_orders_and_sync_dicts_give_bitwise_equal_gradients(data_, n, release_after, reload_before):
    order = data_.draw(interleaved_orders(n), label="order")
    offload_set = data_.draw(st.sets(st.integers(0, n - 1)), label="offload")
    sync_dict = sync_dict_for_order(order, offload=sorted(offload_set), release_after=release_after,
                                    reload_before=reload_before)
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))])
    x = torch.randn(n, 3, 16, requires_grad=True)
    expected = run_order(model, x, order)
    ctx, sync = get_cpu_offload_context(enabled=True, model_layers=n, synchronization_dict=sync_dict, device=CPU,
                                        min_offload_bytes=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OffloadWarning)  # a correct dict never needs an on-demand reload
        assert same(expected, run_order(model, x, order, ctx, sync))
    assert ctx.phase_order() == order
    assert [s.offloaded_bytes > 0 for s in ctx.stats] == [i in sync_dict for i in range(n)]
