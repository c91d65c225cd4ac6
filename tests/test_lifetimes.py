"""Lifetimes: what the engine holds, and for how long, when a step ends normally, early or by a fault.

Regression tests for defects a review found in the engine before its rewrite (f46a305): records
that formed reference cycles with the outputs they saved (and with the engine), faults that left
interleaved schedules stuck or misaligned, a failed device-to-host copy that kept its unwritten
host buffer, a finaliser that swallowed its errors, and intermediates of custom
``autograd.Function`` s that were never offloaded. All run on the CPU, in every mode that applies:
the default schedule, manual synchronization and a ``synchronization_dict``.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from torch import nn

from offload_examples import OffloadWarning, SyncDictSchedule, get_cpu_offload_context
from offload_examples.instruments.models import build_linear_stack

CPU = torch.device("cpu")
N = 4  # entries of the context per iteration: layers 0 and 1 are offloaded in every mode
MODES = ["default", "manual", "dict"]
#: The order every step below runs in: all forwards, then one backward through every layer.
ORDER = [("forward", j) for j in range(N)] + [("backward", j) for j in reversed(range(N))]
#: Layer 0 released at 2F, layer 1 at 3B (so it is still held when a step ends without backward);
#: both reloaded at 2B.
SYNC_DICT = {0: (True, 2, False, 2), 1: (False, 3, False, 2)}
SyncDictSchedule(SYNC_DICT, N, ORDER)  # checked against the order once, at import

ACTIVATIONS = {  # ops that save their own output for backward
    "tanh": torch.tanh,
    "exp": torch.exp,
    "sigmoid": torch.sigmoid,
    "softmax": lambda t: torch.softmax(t, dim=-1),
}


class Boom(Exception):
    pass


class FailingBackward(torch.autograd.Function):
    """Identity (a clone) that saves its input and raises in the backward of layer ``fail_layer``."""

    fail_layer: int | None = None

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if FailingBackward.fail_layer == ctx.layer:
            raise Boom(f"failure in the backward of layer {ctx.layer}")
        return g, None


class Block(nn.Module):
    """Linear -> an op that saves its output -> Linear -> FailingBackward.

    Keeps a weak reference to the storage of the activation each forward made in ``probes``.
    """

    def __init__(self, index: int, width: int = 16, act: str = "tanh"):
        super().__init__()
        self.index, self.act = index, ACTIVATIONS[act]
        self.a, self.b = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.probes: list[weakref.ref] = []

    def forward(self, x):
        h = self.act(self.a(x))
        self.probes.append(weakref.ref(h.untyped_storage()))
        return FailingBackward.apply(self.b(h), self.index)


def make_model(act: str = "tanh") -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block(i, act=act) for i in range(N))


def data(seed: int = 1) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def make_ctx(mode: str, **kw):
    """``(ctx, sync, synchronizer)``; the synchronizer is ``None`` except in manual mode."""
    if mode == "default":
        ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=N, device=CPU, **kw)
        return ctx, sync, None
    if mode == "manual":
        return get_cpu_offload_context(enabled=True, model_layers=N, manual_synchronization=True, device=CPU, **kw)
    ctx, sync = get_cpu_offload_context(enabled=True, model_layers=N, synchronization_dict=SYNC_DICT, device=CPU, **kw)
    return ctx, sync, None


def forward(model, x, ctx=None, sync=None, synchronizer=None, fault_at: int | None = None):
    """The forwards of one step; in manual mode the synchronizer follows :data:`SYNC_DICT`."""
    h = x
    for j, layer in enumerate(model):
        if synchronizer is not None and j == 2:
            synchronizer.release_activation_forward_gpu_memory(0)
        if ctx is None:
            h = layer(h)
            continue
        with ctx:
            h = layer(h)
            if j == fault_at:
                raise Boom(f"failure in the forward of layer {j}")
        h = sync(h)
        if synchronizer is not None and j < 2:
            synchronizer.start_offload_layer(j)
    return h


def backward(h, synchronizer=None) -> None:
    if synchronizer is not None:
        synchronizer.release_activation_forward_gpu_memory(1)
        synchronizer.start_reload_layer(1)
        synchronizer.start_reload_layer(0)
    h.square().mean().backward()


def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    return out


def run(model, x, ctx=None, sync=None, synchronizer=None) -> list[torch.Tensor]:
    """One full training step; its gradients."""
    backward(forward(model, x, ctx, sync, synchronizer), synchronizer)
    return grads(model, x)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def assert_idle(ctx) -> None:
    """No saved view alive, nothing resident, every host buffer back in the pool, no record holding memory."""
    assert ctx.live_views == 0
    assert ctx.resident_bytes == 0
    assert ctx.pool.held_bytes == ctx.pool.free_bytes
    records = [rec for recs in ctx._records for rec in recs]
    assert all(rec.host is None for rec in records), "a record still holds a host buffer"
    assert all(rec.device is None for rec in records), "a record still holds device memory"


def assert_recovered(model, x, ctx, sync, synchronizer, expected) -> None:
    """The next steps start afresh at entry 0, follow the schedule and give bitwise equal gradients."""
    for _ in range(2):
        assert same(expected, run(model, x, ctx, sync, synchronizer))
        assert ctx.phase_order() == ORDER
        assert [s.offloaded_bytes > 0 for s in ctx.stats] == [True, True, False, False]
        assert_idle(ctx)


# ---------------------------------------------------------------- 1. reference cycles
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
@pytest.mark.parametrize("mode", MODES)
def test_forward_without_backward_frees_saved_outputs_without_gc(mode, act):
    """Reference cycle leak: a saved op output (and the engine) must be freed without the garbage collector."""
    model, x = make_model(act), data()
    expected = run(model, x)
    ctx, sync, synchronizer = make_ctx(mode, retain_pinned_cpu_buffers=True)
    gc.disable()
    try:
        for layer in model:
            layer.probes.clear()
        h = forward(model, x, ctx, sync, synchronizer)  # e.g. an evaluation pass with grad on
        probes = [p for layer in model for p in layer.probes]
        assert len(probes) == N and probes[-1]() is not None  # held by the graph (released layers' are gone)
        del h
        alive = [j for j, p in enumerate(probes) if p() is not None]
        assert not alive, f"the saved activations of layers {alive} outlived their graph"
        assert_idle(ctx)
        assert_recovered(model, x, ctx, sync, synchronizer, expected)
        engine = weakref.ref(ctx)
        del ctx, sync, synchronizer
        assert engine() is None, "the engine (and its pinned pool) is kept alive by a reference cycle"
    finally:
        gc.enable()


# ---------------------------------------------------------------- 2. faults
def _fail_once_at_enter(monkeypatch, ctx, layer: int) -> None:
    """The engine's per-phase actions raise once, when the forward of ``layer`` enters the context."""
    actions, fired = ctx._run_actions, []

    def flaky(phase, j):
        if phase == "forward" and j == layer and not fired:
            fired.append(j)
            raise Boom(f"failure at the entry of layer {j}")
        return actions(phase, j)

    monkeypatch.setattr(ctx, "_run_actions", flaky)


@pytest.mark.parametrize("where", ["forward", "backward", "enter"])
@pytest.mark.parametrize("mode", MODES)
def test_a_fault_frees_everything_and_the_next_step_works(mode, where, monkeypatch):
    """Fault recovery: after a fault in a forward, a backward or __enter__, all is freed and the next step is right."""
    model, x = make_model(), data()
    expected = run(model, x)
    ctx, sync, synchronizer = make_ctx(mode, retain_pinned_cpu_buffers=True)
    assert same(expected, run(model, x, ctx, sync, synchronizer))  # warm-up: the pool allocates here
    held = ctx.pool.held_bytes
    if where == "enter":
        _fail_once_at_enter(monkeypatch, ctx, 2)
    try:
        with pytest.raises(Boom):
            FailingBackward.fail_layer = 1 if where == "backward" else None
            h = None
            h = forward(model, x, ctx, sync, synchronizer, fault_at=2 if where == "forward" else None)
            backward(h, synchronizer)
    finally:
        FailingBackward.fail_layer = None
    del h  # the failed step's graph goes with its last reference, as in a training loop
    model.zero_grad(set_to_none=True)
    x.grad = None
    assert_idle(ctx)
    assert_recovered(model, x, ctx, sync, synchronizer, expected)
    assert ctx.pool.held_bytes == held  # nothing leaked from the pool, nothing pinned afresh


@pytest.mark.parametrize("mode", MODES)
def test_reset_abandons_an_iteration(mode):
    """Fault recovery: reset() frees an abandoned step, its backward raises a clear error, the next step works."""
    model, x = make_model(), data()
    expected = run(model, x)
    ctx, sync, synchronizer = make_ctx(mode, retain_pinned_cpu_buffers=True)
    assert same(expected, run(model, x, ctx, sync, synchronizer))
    h = forward(model, x, ctx, sync, synchronizer)  # ... and then the loss fails, outside the context
    ctx.reset()
    assert_idle(ctx)
    with pytest.raises(RuntimeError, match="step that failed or was reset"):
        h.square().mean().backward()
    del h
    model.zero_grad(set_to_none=True)
    x.grad = None
    assert_recovered(model, x, ctx, sync, synchronizer, expected)


# ---------------------------------------------------------------- 3. a failed device-to-host copy
def _fail_next_device_to_host_copy(monkeypatch, ctx) -> list[int]:
    """Make the device-to-host copy of the next storage copied out raise, whenever it is tried again;
    returns a list that receives that storage's bytes.

    The engine copies through ``ctx.streams.copy`` (one storage, or a layer's batch of them: a batch
    that fails is retried one storage at a time, so only the failing one stays); f46a305 had no such
    method and called ``host.data.copy_(device, non_blocking=True)`` in ``_StorageRecord.copy_out``,
    so there the first such call (a forward makes no other) is made to fail instead.
    """
    failed: list[int] = []
    streams = ctx.streams
    if hasattr(type(streams), "copy"):
        copy, bad = streams.copy, []

        def failing_copy(dst, src, *, lane="", **kw):
            srcs = [src] if torch.is_tensor(src) else list(src)
            if lane == "device-to-host":
                if not bad:
                    bad.append(srcs[0].data_ptr())
                    failed.append(srcs[0].numel() * srcs[0].element_size())
                if bad[0] in [t.data_ptr() for t in srcs]:
                    raise RuntimeError("injected: device-to-host copy failed")
            return copy(dst, src, lane=lane, **kw)

        monkeypatch.setattr(streams, "copy", failing_copy)
    else:
        copy_ = torch.Tensor.copy_

        def failing_copy_(self, src, non_blocking=False):
            if not failed and non_blocking and self.dtype == src.dtype == torch.uint8 and self.dim() == 1:
                failed.append(src.numel())
                raise RuntimeError("injected: device-to-host copy failed")
            return copy_(self, src, non_blocking=non_blocking)

        monkeypatch.setattr(torch.Tensor, "copy_", failing_copy_)
    return failed


@pytest.mark.parametrize("retain", [True, False], ids=["retain", "no-retain"])
@pytest.mark.parametrize("mode", MODES)
def test_failed_device_to_host_copy_keeps_the_tensor_and_returns_the_buffer(mode, retain, monkeypatch):
    """Failed D2H copy: the tensor stays on the device, bitwise gradients, the buffer goes back, a warning."""
    model, x, y = make_model(), data(1), data(2)
    expected = run(model, y)
    ctx, sync, synchronizer = make_ctx(mode, retain_pinned_cpu_buffers=retain)
    run(model, x, ctx, sync, synchronizer)  # a step on other data first: a retained buffer holds x's activations
    clean = [s.offloaded_bytes for s in ctx.stats]
    failed = _fail_next_device_to_host_copy(monkeypatch, ctx)
    with pytest.warns(OffloadWarning, match=r"keeping saved tensors of layer 0 on the device: .*injected"):
        got = run(model, y, ctx, sync, synchronizer)
    assert len(failed) == 1
    assert same(expected, got)
    # the storage whose copy failed stayed on the device: it is missing from layer 0's offloaded bytes
    assert [s.offloaded_bytes for s in ctx.stats] == [clean[0] - failed[0]] + clean[1:]
    assert_idle(ctx)
    if not retain:
        assert ctx.pool.held_bytes == 0
    monkeypatch.undo()
    assert same(expected, run(model, y, ctx, sync, synchronizer))  # the next step offloads everything again
    assert [s.offloaded_bytes for s in ctx.stats] == clean
    assert_idle(ctx)


def _fail_next_host_to_device_copy(monkeypatch, ctx) -> list[int]:
    """Make the next host-to-device copy raise, leaving its destination unwritten (here 0xFF bytes, so
    that what backward would read is deterministic: a failed copy leaves whatever memory it got)."""
    failed: list[int] = []
    copy = ctx.streams.copy

    def failing_copy(dst, src, *, lane="", **kw):
        if not failed and lane == "host-to-device":
            failed.append(dst.numel())
            dst.fill_(255)
            raise RuntimeError("injected: host-to-device copy failed")
        return copy(dst, src, lane=lane, **kw)

    monkeypatch.setattr(ctx.streams, "copy", failing_copy)
    return failed


@pytest.mark.parametrize("case", ["manual-go-on", "default-retry"])
def test_failed_host_to_device_copy_never_feeds_backward_an_unwritten_buffer(case, monkeypatch):
    """Failed H2D copy: a backward after a failed reload raises or reloads again, never reads the unwritten buffer."""
    mode = case.split("-")[0]
    model, x = make_model(), data()
    expected = run(model, x)
    ctx, sync, synchronizer = make_ctx(mode)
    failed = _fail_next_host_to_device_copy(monkeypatch, ctx)
    h = forward(model, x, ctx, sync, synchronizer)
    loss = h.square().mean()
    try:
        if case == "manual-go-on":  # the caller sees start_reload_layer fail, and goes on
            synchronizer.release_activation_forward_gpu_memory(1)
            with pytest.raises(RuntimeError, match="injected"):
                synchronizer.start_reload_layer(1)
            synchronizer.start_reload_layer(0)
        else:  # the reload in layer 1's gradient hook fails; the caller retries the backward
            with pytest.raises(RuntimeError, match="injected"):
                loss.backward(retain_graph=True)
            model.zero_grad(set_to_none=True)
            x.grad = None
        assert failed
        with pytest.warns(OffloadWarning, match="reloaded on demand"):  # what the failed reload left on the host
            loss.backward()
    except RuntimeError as err:  # a clear error is an acceptable answer; the injected one is not it
        assert "injected" not in str(err)
        return
    assert same(expected, grads(model, x)), "backward computed with the bytes of a failed host-to-device copy"


@pytest.mark.parametrize("mode", MODES)
def test_failed_host_to_device_copy_then_dropped_graph_leaves_the_engine_idle(mode, monkeypatch):
    """Failed H2D copy: once the failed step's graph is dropped, the engine's read-outs are back at zero."""
    model, x = make_model(), data()
    expected = run(model, x)
    ctx, sync, synchronizer = make_ctx(mode, retain_pinned_cpu_buffers=True)
    _fail_next_host_to_device_copy(monkeypatch, ctx)
    with pytest.raises(RuntimeError, match="injected"):
        run(model, x, ctx, sync, synchronizer)
    model.zero_grad(set_to_none=True)
    x.grad = None
    monkeypatch.undo()
    try:
        assert_idle(ctx)
    finally:  # the next step is right either way
        assert same(expected, run(model, x, ctx, sync, synchronizer))


# ---------------------------------------------------------------- 4. the finaliser
def test_a_failure_in_the_saved_view_finaliser_is_reported(monkeypatch):
    """Finaliser: an error while freeing a saved view is reported as an OffloadWarning, not swallowed."""
    model, x = make_model(), data()
    ctx, sync, _ = make_ctx("default")
    h = forward(model, x, ctx, sync)

    def broken(record, used):
        raise RuntimeError("injected: freeing failed")

    monkeypatch.setattr(ctx, "_view_dropped", broken)
    with pytest.warns(OffloadWarning, match=r"freeing a saved tensor of layer [01] failed: .*injected"):
        del h  # autograd drops the saved views here


# ---------------------------------------------------------------- 5. custom autograd.Function intermediates
class FusedQKV(torch.autograd.Function):
    """``q, k, v = split(x @ w)`` as in fused attention projections; saves the three views of ``qkv``."""

    qkv_bytes: list[int] = []

    @staticmethod
    def forward(ctx, x, w):
        qkv = x @ w
        FusedQKV.qkv_bytes.append(qkv.untyped_storage().nbytes())
        q, k, v = qkv.chunk(3, dim=-1)
        ctx.save_for_backward(q, k, v, x, w)
        return q * k + v

    @staticmethod
    def backward(ctx, g):
        q, k, v, x, w = ctx.saved_tensors
        dqkv = torch.cat([g * k, g * q, g], dim=-1)
        return dqkv @ w.t(), x.t() @ dqkv


class QKVLayer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, 3 * width) / width**0.5)

    def forward(self, x):
        return FusedQKV.apply(x, self.w)


def test_custom_function_intermediates_are_offloaded():
    """Custom Function intermediates: views of a fused qkv made inside forward are offloaded, gradients bitwise."""
    torch.manual_seed(0)
    width = 32
    model = nn.ModuleList(QKVLayer(width) for _ in range(3))
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(1)).requires_grad_()
    expected = run(model, x)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=3, device=CPU)
    for _ in range(2):
        FusedQKV.qkv_bytes.clear()
        assert same(expected, run(model, x, ctx, sync))
        qkv = FusedQKV.qkv_bytes[0]
        # layer 0 saves q, k, v (one storage) and its input x, a leaf (kept); layer 1 also offloads its input
        assert ctx.stats[0].offloaded_bytes == qkv
        assert ctx.stats[1].offloaded_bytes == qkv + x.numel() * x.element_size()
        assert ctx.stats[2].offloaded_bytes == 0


def test_a_view_of_caller_owned_data_is_not_offloaded():
    """Custom Function intermediates (counterpart): a micro-batch view of a batch the caller keeps is not offloaded."""
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Sequential(nn.Linear(16, 64), nn.Tanh()), nn.Linear(64, 16)])
    batch = torch.randn(3, 8, 16)  # the caller keeps it (it needs no grad); layer 0 sees batch[1]
    batch_bytes = batch.untyped_storage().nbytes()

    def step(ctx=None, sync=None):
        h = batch[1]
        for layer in model:
            if ctx is None:
                h = layer(h)
                continue
            with ctx:
                h = layer(h)
            h = sync(h)
        h.square().mean().backward()
        out = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out

    expected = step()
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=CPU)
    for _ in range(2):
        assert same(expected, step(ctx, sync))
        tanh_bytes = 8 * 64 * 4  # layer 0 saves batch[1] (for the Linear) and the Tanh output
        assert ctx.stats[0].offloaded_bytes == tanh_bytes != batch_bytes
        assert ctx.stats[0].offloaded_storages == 1


# ---------------------------------------------------------------- found by a review
def test_entries_under_no_grad_do_not_count():
    """An evaluation pass under no_grad inside the context (a shorter stack, an early exit) saves
    nothing and must not shift the next training step's layers."""
    model, x = build_linear_stack(4, 16), data()
    expected = run(model, x)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4, device="cpu")
    with torch.no_grad():
        h = x
        for layer in model[:2]:
            with ctx:
                h = layer(h)
            h = sync(h)
    assert same(expected, run(model, x, ctx, sync))
    assert ctx.phase_order()[:4] == [("forward", j) for j in range(4)]
    assert [s.offloaded_bytes > 0 for s in ctx.stats] == [True, True, False, False]


@pytest.mark.parametrize("entries", [3, 6])
def test_a_step_with_another_number_of_layers_warns_and_stays_correct(entries):
    """The default schedule counts layers by position: a step of 3 or 6 layers with model_layers=4
    warns, reloads what it must on demand, and computes the right gradients (it once raised)."""
    model, x = build_linear_stack(entries, 16), data()
    expected = run(model, x)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4, device="cpu")
    with pytest.warns(OffloadWarning) as caught:
        got = run(model, x, ctx, sync)
    assert same(expected, got)
    assert any("model_layers=4" in str(w.message) for w in caught)


def test_autocast_weight_casts_seen_through_a_transpose_stay():
    """nn.Linear under autocast saves `weight_bf16.t()`, a view of autocast's cached cast: a copy
    would free nothing (the cache holds it), so it stays on the device."""
    model = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(3))
    x = torch.randn(4, 256, requires_grad=True)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=3, device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x
        for layer in model:
            with ctx:
                h = torch.tanh(layer(h))
            h = sync(h)
    h.float().sum().backward()
    weight_cast = 256 * 256 * 2
    assert 0 < ctx.stats[1].offloaded_bytes < weight_cast, ctx.stats[1]


def test_a_weight_an_op_returns_on_its_parameters_memory_stays():
    """Transformer Engine's fused QKV weight: a custom Function hands back three parameters that sit
    side by side in one buffer as one new tensor on that memory (no copy, not a view). The layer saves
    it; the parameters hold it anyway, so it stays (a copy would free nothing, and its reload would
    duplicate the weight)."""

    class NoopCat(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *weights):
            first = weights[0]
            rows = sum(w.shape[0] for w in weights)
            return torch.empty(0, dtype=first.dtype).set_(first.untyped_storage(), 0, (rows, first.shape[1]))

        @staticmethod
        def backward(ctx, g):
            return tuple(g.split(g.shape[0] // 3))

    class FusedQkv(torch.nn.Module):
        def __init__(self, width: int):
            super().__init__()
            buffer = torch.randn(3 * width, width) / width**0.5
            self.q, self.k, self.v = (torch.nn.Parameter(part) for part in buffer.split(width))

        def forward(self, x):
            return torch.tanh(torch.nn.functional.linear(x, NoopCat.apply(self.q, self.k, self.v)))

    width = 64
    model = torch.nn.ModuleList(torch.nn.Sequential(FusedQkv(width), torch.nn.Linear(3 * width, width)) for _ in range(3))
    x = torch.randn(32, width, requires_grad=True)
    assert model[0][0].q.untyped_storage().data_ptr() == model[0][0].v.untyped_storage().data_ptr()
    expected = run(model, x)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=3, device="cpu", min_offload_bytes=0)
    assert same(expected, run(model, x, ctx, sync))
    fused_weight = 3 * width * width * 4
    activations = 32 * 3 * width * 4  # the tanh output the layer saves (the Linear saves it as its input)
    assert ctx.stats[0].offloaded_bytes == activations, (ctx.stats[0], fused_weight)


def test_a_layer_output_that_views_a_custom_function_buffer_is_offloaded():
    """A custom Function returning a view of its own padded buffer (flash-attention style): the
    output is made by autograd, so the layers that save it offload it."""

    class Padded(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            padded = torch.nn.functional.pad(x, (0, 8)) * 2
            return padded[..., : x.shape[-1]]

        @staticmethod
        def backward(ctx, g):
            return g * 2

    lin = build_linear_stack(3, 16)
    model = torch.nn.ModuleList(torch.nn.Sequential(layer, torch.nn.Tanh()) for layer in lin)
    x = data()

    def step(ctx=None, sync=None):
        h = x
        for layer in model:
            with ctx or torch.enable_grad():
                h = layer(Padded.apply(h))
            h = sync(h) if sync else h
        h.square().mean().backward()
        return grads(model, x)

    expected = step()
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=3, device="cpu")
    assert same(expected, step(ctx, sync))
    # layer 1's first op saves layer 0's output, a view of Padded's buffer: once left on the device
    assert ctx.stats[1].offloaded_bytes >= 8 * (16 + 8) * 4, ctx.stats[1]


def test_in_place_change_after_release_through_the_base_is_caught():
    """A saved temporary view of caller data (`a.view(-1)`) dies after its op, but its base lives:
    an in-place change of the base after the release must still raise, as autograd does."""
    a = torch.randn(64, 16)
    w = torch.randn(16 * 64, requires_grad=True)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device="cpu",
                                        min_offload_bytes=0)
    with ctx:
        h = (w * a.view(-1) * 1.0).sum().reshape(1)
    h = sync(h)
    with ctx:
        out = h * 2
    out = sync(out)
    a.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


# ---------------------------------------------------------------------- layers that run without hooks
def _linear_layers(n: int = 4, width: int = 64) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                                   torch.nn.Linear(2 * width, width)) for _ in range(n))


def _grads(layers: torch.nn.ModuleList, x: torch.Tensor, run) -> list[torch.Tensor]:
    for p in layers.parameters():
        p.grad = None
    run(x).square().mean().backward()
    return [p.grad.clone() for p in layers.parameters()]


def test_a_checkpoint_around_each_entry_works_in_every_step():
    """Gradient checkpointing of blocks whose forward enters the context: the checkpoint keeps the
    region, the entry counts but hooks nothing (with one warning that says where the context belongs),
    and the recomputation in backward passes through, in every step."""
    from torch.utils.checkpoint import checkpoint

    layers, x = _linear_layers(), torch.randn(4, 16, 64)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=4, device="cpu")

    def entered(layer):
        def run(h):
            with ctx:
                return layer(h)
        return run

    def offloaded(h):
        for layer in layers:
            h = sync(checkpoint(entered(layer), h, use_reentrant=False))
        return h

    def plain(h):
        for layer in layers:
            h = layer(h)
        return h

    reference = _grads(layers, x, plain)
    with pytest.warns(OffloadWarning, match="inside a torch.utils.checkpoint region"):
        grads = _grads(layers, x, offloaded)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(reference, grads))
        assert ctx.live_views == 0 and ctx.offloaded_bytes == 0 and ctx.stats[0].saved_tensors == 0
        grads = _grads(layers, x, offloaded)


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_context_around_a_checkpoint_offloads_what_the_checkpoint_keeps(reentrant):
    """The context outside the checkpoint: the checkpoint's inputs are offloaded, its internals
    recomputed, bitwise, in every step; the recomputation in backward does not count as an entry."""
    from torch.utils.checkpoint import checkpoint

    layers, x = _linear_layers(), torch.randn(4, 16, 64)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4, device="cpu")

    def offloaded(h):
        h = h * 1.0  # the first layer's input comes from autograd, like the others'
        for layer in layers:
            with ctx:
                h = checkpoint(layer, h, use_reentrant=reentrant)
            h = sync(h)
        return h

    def plain(h):
        h = h * 1.0
        for layer in layers:
            h = layer(h)
        return h

    x.requires_grad_(reentrant)  # reentrant checkpointing needs an input that requires grad
    reference = _grads(layers, x, plain)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(reference, _grads(layers, x, offloaded)))
        # only each offloaded layer's input (what the checkpoint keeps) went to the host
        assert [s.offloaded_bytes for s in ctx.stats] == [x.numel() * 4] * 2 + [0, 0]
        assert ctx.live_views == 0 and ctx.events.count(("forward", 0)) == 1


def test_counts_of_layers_without_hooks_follow_a_change_of_shape():
    """Stats of layers that are not offloaded are carried over, and counted again when a layer's
    output changes shape: the theory of a step with a 4x batch is that of a fresh engine."""
    layers = _linear_layers()

    def through(ctx, sync):
        def run(h):
            for layer in layers:
                with ctx:
                    h = layer(h)
                h = sync(h)
            return h
        return run

    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=4, device="cpu")
    _grads(layers, torch.randn(2, 16, 64), through(ctx, sync))
    big = torch.randn(8, 16, 64)
    _grads(layers, big, through(ctx, sync))  # the change is seen at layer 0's output: layers 1..3 recounted
    fresh, fresh_sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=4, device="cpu")
    _grads(layers, big, through(fresh, fresh_sync))
    assert ctx.stats == fresh.stats
    assert ctx.theoretical() == fresh.theoretical()
    _grads(layers, big, through(ctx, sync))  # and the next step carries the new counts
    assert ctx.stats == fresh.stats


# ---------------------------------------------------------------- saved tensors something else holds
class CachedFusedWeight(nn.Module):
    """Transformer Engine's fused QKV weight when its parts are separate parameters: a new tensor
    (a ``cat`` of two weights, made by autograd) built every forward and kept by the module until
    its backward. A layer that saves it frees nothing by offloading it."""

    def __init__(self, width: int, keep: bool):
        super().__init__()
        self.a, self.b = (nn.Parameter(torch.randn(width, width) / width**0.5) for _ in range(2))
        self.keep, self.cache = keep, []

    def forward(self, x):
        w = torch.cat([self.a, self.b])
        if self.keep:
            self.cache.append(w)
        y = x @ w.t()  # saves x and w
        return torch.tanh(y.view(*x.shape[:-1], 2, -1).sum(-2))


def _host_to_device_bytes(monkeypatch) -> list[int]:
    from offload_examples.core.streams import Streams

    copied, copy = [], Streams.copy

    def counting(self, dst, src, **kw):
        if kw.get("lane") == "host-to-device":
            copied.append(dst.numel() * dst.element_size())
        return copy(self, dst, src, **kw)

    monkeypatch.setattr(Streams, "copy", counting)
    return copied


@pytest.mark.parametrize("mode", MODES)
def test_a_saved_tensor_held_elsewhere_is_counted_and_read_in_place(mode, monkeypatch):
    """Released while the module still holds it: the release counts it as held (the theory keeps it on
    the device), and backward reads the original memory instead of reloading a duplicate. The same goes
    for a layer's ``tanh`` output, which the next layer saves as its input."""
    model = nn.ModuleList(CachedFusedWeight(16, keep=True) for _ in range(N))
    x = data()
    expected = run(model, x)
    copied = _host_to_device_bytes(monkeypatch)
    ctx, sync, synchronizer = make_ctx(mode, min_offload_bytes=0)
    for _ in range(2):  # the second step reuses the host buffers
        for m in model:
            m.cache.clear()
        copied.clear()
        assert same(expected, run(model, x, ctx, sync, synchronizer))
        fused, out = 2 * 16 * 16 * 4, 8 * 16 * 4
        # layer 1's output is held by layer 2, which is not offloaded; layer 0's only by layer 1's record
        assert [s.held_bytes for s in ctx.stats] == [fused, fused + out, 0, 0]
        # only layer 0's output was freed (at layer 1's release): each layer that saved it reloads it
        assert copied == [out, out]
        plain = ctx.schedule.predict([s.offloaded_bytes for s in ctx.stats],
                                     [s.candidate_bytes - s.offloaded_bytes for s in ctx.stats], ctx.events)
        if plain.saving > 0:  # (manual mode's order here reloads before the peak: no saving at all)
            assert ctx.theoretical().peak_with > plain.peak_with  # the held bytes stay in the theory's peak
        assert ctx.theoretical().points == plain.points  # the engine's own count is unchanged
        assert_idle(ctx)


@pytest.mark.parametrize("mode", MODES)
def test_a_saved_tensor_let_go_after_release_is_reloaded_from_the_host(mode, monkeypatch):
    """Held at release, dropped before the backward: its memory is gone, so the host copy comes back
    (the layers' outputs, which the next layers still hold, are read in place)."""
    model = nn.ModuleList(CachedFusedWeight(16, keep=True) for _ in range(N))
    x = data()
    expected = run(model, x)
    copied = _host_to_device_bytes(monkeypatch)
    ctx, sync, synchronizer = make_ctx(mode, min_offload_bytes=0)
    for m in model:
        m.cache.clear()
    h = forward(model, x, ctx, sync, synchronizer)
    for m in model:
        m.cache.clear()  # the framework lets go before the backward
    backward(h, synchronizer)
    assert same(expected, grads(model, x))
    fused, out = 2 * 16 * 16 * 4, 8 * 16 * 4
    assert ctx.stats[0].held_bytes == fused  # layer 1 is released after the cache let go in some modes
    assert sum(copied) == ctx.offloaded_bytes - out  # all but layer 1's output, still held by layer 2
    assert_idle(ctx)


class CachesDetached(nn.Module):
    """Keeps ``h.detach()`` of an activation it saved (a handle on the activation, sharing its version
    counter); ``h`` itself dies with the forward."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.a, self.b, self.cache = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), []

    def forward(self, x):
        h = torch.tanh(self.a(x))  # tanh saves its output h
        self.cache.append(h.detach())
        return self.b(h)


@pytest.mark.parametrize("mode", MODES)
def test_an_in_place_change_after_release_through_a_kept_detach_raises(mode):
    """Found by review: the storage is still alive at reload, so the record would take back the changed
    bytes; autograd raises without offloading, and so must the engine (not compute with them)."""
    model = nn.ModuleList(CachesDetached() for _ in range(N))
    ctx, sync, synchronizer = make_ctx(mode, min_offload_bytes=0)
    h = forward(model, data(), ctx, sync, synchronizer)  # layer 0 is released by now in every mode
    model[0].cache[-1].mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation|in place"):
        backward(h, synchronizer)


def test_a_storage_aliased_through_dlpack_is_not_counted_as_the_engines():
    """Found by review: another storage over the same memory (DLPack, ``from_numpy``) is not one of the
    engine's own references, so a tensor the caller still holds is counted as held."""

    class Alias(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.from_dlpack(x.detach())

        @staticmethod
        def backward(ctx, g):
            return g

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.cache = nn.Linear(16, 64), []

        def forward(self, x):
            y = torch.tanh(self.l(x))
            self.cache.append(y)
            return y

    class Aliasing(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(64, 16)

        def forward(self, y):
            z = Alias.apply(y)
            assert z.untyped_storage()._cdata != y.untyped_storage()._cdata
            return self.l(z * z)

    model = nn.ModuleList([Cached(), Aliasing(), nn.Linear(16, 16), nn.Linear(16, 16)])
    x = data()
    expected = run(model, x)
    model[0].cache.clear()
    ctx, sync, synchronizer = make_ctx("default", min_offload_bytes=0)
    assert same(expected, run(model, x, ctx, sync, synchronizer))
    assert ctx.stats[0].held_bytes == 8 * 64 * 4  # y: still in the module's cache at the release


class _StandInStream:
    """Stands for a CUDA stream as a record's home on the CPU (hashable; never waited on there)."""


@pytest.mark.parametrize("mode", ["dict", "manual"])
def test_a_batch_that_raises_gives_back_the_buffers_of_the_batches_after_it(mode, monkeypatch):
    """A layer's copies at its end go in one batch per home stream. When the first batch raises
    something other than a ``RuntimeError`` (an interrupt), the buffers already borrowed for the other
    batches go back to the pool too (a review found them lent forever)."""
    import itertools

    from offload_examples.core import engine as engine_module
    from offload_examples.core.streams import Streams

    homes, init = itertools.cycle([_StandInStream(), _StandInStream()]), engine_module._StorageRecord.__init__

    def two_homes(self, *args):
        init(self, *args)
        self.home = next(homes)

    monkeypatch.setattr(engine_module._StorageRecord, "__init__", two_homes)
    monkeypatch.setattr(Streams, "on", staticmethod(lambda stream: contextlib.nullcontext()))
    model, x = make_model(), data()
    ctx, sync, synchronizer = make_ctx(mode, retain_pinned_cpu_buffers=True, min_offload_bytes=0)
    run(model, x, ctx, sync, synchronizer)
    assert len(ctx._records[0]) >= 2  # so that layer 0's records have both homes: two batches
    copy, batches = ctx.streams.copy, []

    def interrupted(dst, src, *, lane="", **kw):
        if lane == "device-to-host" and not torch.is_tensor(dst):
            batches.append(len(dst))
            raise KeyboardInterrupt
        return copy(dst, src, lane=lane, **kw)

    monkeypatch.setattr(ctx.streams, "copy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        forward(model, x, ctx, sync, synchronizer)
    ctx.reset()
    assert batches and ctx.pool.held_bytes == ctx.pool.free_bytes  # nothing lent: every buffer came back
