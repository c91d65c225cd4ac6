"""The engine on the CPU: same code path as on a GPU, with synchronous copies."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from torch import nn

from offload_examples import HostMemoryLimitError, get_cpu_offload_context, mark_not_offload
from offload_examples.core.host_pool import HostBufferPool, pinned_nbytes
from offload_examples.instruments.measure import compare_grads, measure_steps, resident_vs_theory, training_step
from offload_examples.instruments.models import build_basic_model, build_linear_stack

CPU = torch.device("cpu")


def offload(k: int, n: int, **kw):
    return get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n, device=CPU, **kw)


def small_basic(n: int = 4):
    return build_basic_model(n, 32, 4, 64, kind="torch", seed=1)


def input_for(width: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(3, 16, width, generator=torch.Generator().manual_seed(seed)).requires_grad_()


# ---------------------------------------------------------------- gradients, bit for bit
@pytest.mark.parametrize("k", [1, 3])
def test_basic_model_grads_bitwise_equal(k):
    model, x = small_basic(4), input_for(32)
    ref = measure_steps(model, x, steps=1, warmup=0)
    ctx, sync = offload(k, 4)
    got = measure_steps(model, x, ctx, sync, steps=2, warmup=0)
    check = compare_grads(ref, got)
    assert check.equal, check.mismatched
    assert check.compared == len(list(model.parameters())) + 2  # every parameter, the input, the output
    assert ctx.offloaded_bytes > 0


def test_linear_stack_grads_bitwise_equal():
    model, x = build_linear_stack(5, 16, seed=3), input_for(16)
    ref = measure_steps(model, x, steps=1, warmup=0)
    ctx, sync = offload(4, 5)
    got = measure_steps(model, x, ctx, sync, steps=1, warmup=0)
    assert compare_grads(ref, got).equal
    assert [s.offloaded_storages > 0 for s in ctx.stats] == [True] * 4 + [False]


def test_transformer_encoder_layers_with_views():
    """nn.MultiheadAttention saves q/k/v as non-contiguous views of one projection."""
    torch.manual_seed(0)
    model = nn.ModuleList(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True) for _ in range(3))
    x = input_for(32)
    ref = measure_steps(model, x, steps=1, warmup=0)
    ctx, sync = offload(2, 3)
    got = measure_steps(model, x, ctx, sync, steps=1, warmup=0)
    assert compare_grads(ref, got).equal
    assert ctx.stats[0].offloaded_tensors > ctx.stats[0].offloaded_storages  # views shared storages


# ---------------------------------------------------------------- the schedule's order of events
def expected_events(n: int, k: int) -> list[tuple[str, int]]:
    """The issue's rule, written out independently of the engine and of DefaultSchedule."""
    events = []
    for j in range(n):
        for i in range(k):
            if j == n - k + i:  # layer i must be finished and released before forward N-k+i
                events += [("offload_finished", i), ("release", i)]
        events.append(("forward", j))
        if j < k:  # layer j's copies out are queued when its forward ends
            events.append(("offload_start", j))
    for j in reversed(range(n)):
        events.append(("backward", j))
        for i in range(k):
            if j == i + max(1, n - 2 - k):  # layer i's reload starts with the backward of i + max(1, N-2-k)
                events.append(("reload_start", i))
    return events


def expected_events_early(n: int, k: int) -> list[tuple[str, int]]:
    """With early_first_reload: as above, but layer k-1's reload starts with the backward of N-2 when
    that is later than its rule's (the other reloads are unchanged)."""
    default = [e for e in expected_events(n, k) if e != ("reload_start", k - 1)]
    if k == 0:
        return default
    at = max(k - 1 + max(1, n - 2 - k), n - 2)
    i = default.index(("backward", at)) + 1
    while i < len(default) and default[i][0] == "reload_start" and default[i][1] > k - 1:
        i += 1  # reloads started at the same backward: the one needed first first
    return default[:i] + [("reload_start", k - 1)] + default[i:]


@pytest.mark.parametrize("n,k", [(2, 1), (4, 0), (4, 2), (5, 2), (6, 5), (8, 3), (20, 4)])
def test_early_first_reload_moves_only_the_first_reload(n, k):
    model, x = build_linear_stack(n, 8), input_for(8)
    ref = measure_steps(model, x, None, None, steps=1, warmup=0)
    ctx, sync = offload(k, n, min_offload_bytes=0, early_first_reload=True)
    for _ in range(2):
        got = measure_steps(model, x, ctx, sync, steps=1, warmup=0)
        assert ctx.events == expected_events_early(n, k)
        assert compare_grads(ref, got).equal
        assert all(got == want for _, _, got, want in resident_vs_theory(ctx))
    if k and max(k - 1 + max(1, n - 2 - k), n - 2) != k - 1 + max(1, n - 2 - k):
        assert ctx.events != expected_events(n, k)  # the case is one where the option changes something


def test_early_first_reload_is_refused_where_there_is_no_default_schedule():
    with pytest.raises(ValueError, match="early_first_reload"):
        get_cpu_offload_context(True, 1, 4, manual_synchronization=True, early_first_reload=True, device=CPU)
    with pytest.raises(ValueError, match="early_first_reload"):
        get_cpu_offload_context(True, model_layers=4, synchronization_dict={0: (True, 2, False, 1)},
                                early_first_reload=True, device=CPU)
    with pytest.raises(TypeError, match="early_first_reload must be a bool"):
        offload(1, 4, early_first_reload=1)


@pytest.mark.parametrize("n,k", [(2, 1), (4, 0), (5, 2), (6, 5), (8, 3)])
def test_event_order_follows_the_rule(n, k):
    model, x = build_linear_stack(n, 8), input_for(8)
    ctx, sync = offload(k, n, min_offload_bytes=0)
    for _ in range(2):  # the second iteration must look exactly like the first
        training_step(model, x, ctx, sync)
        assert ctx.events == expected_events(n, k)


def test_a_layer_reloads_its_last_saved_storage_first(monkeypatch):
    """Backward reads a layer's tensors about in the reverse order of their saving, and waits for each
    record's own copy: the reload copies the storage saved last first (a storage saved twice counts
    at its last save), so the layer's backward can start before all of it is back."""
    from offload_examples.core import engine as engine_module

    ws = [(nn.Parameter(torch.randn(width, 16)), nn.Parameter(torch.randn(16, 32))) for width in (8, 32)]  # weights stay

    def layer(j: int, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ ws[j][0])  # saves x, then tanh's output
        h = h @ ws[j][1]  # saves tanh's output again
        return h.sin() + (x * x).sum(-1, keepdim=True)  # saves h, then x again (the last save)

    x0 = torch.randn(64, 8, requires_grad=True)
    order: list[int] = []
    copy_in = engine_module._StorageRecord.copy_in
    monkeypatch.setattr(engine_module._StorageRecord, "copy_in",
                        lambda rec, stop=None: (order.append(rec.nbytes), copy_in(rec, stop))[1])
    ctx, sync = offload(1, 2)
    grads = []
    for run in ("engine", "reference"):
        h = x0 * 1.0  # layer 0's input comes from autograd, so it is offloaded too
        for j in range(2):
            with ctx if run == "engine" else contextlib.nullcontext():
                h = layer(j, h)
            h = sync(h) if run == "engine" else h
        grads.append(torch.autograd.grad(h.square().sum(), [x0, *ws[0], *ws[1]]))
    assert [torch.equal(a, b) for a, b in zip(*grads)] == [True] * 5
    # x (64 x 8 floats), then h (64 x 32), then tanh's output (64 x 16)
    assert order == [64 * 8 * 4, 64 * 32 * 4, 64 * 16 * 4]


# ---------------------------------------------------------------- release: no references remain
class Probed(nn.Module):
    """Linear -> GELU -> Linear that keeps weak references to the storages of its saved
    intermediates and, at the start of its forward, lets the test look at every layer's."""

    def __init__(self, index: int, width: int, probe):
        super().__init__()
        self.index, self.probe = index, probe
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.refs: list[weakref.ref] = []

    def forward(self, x):
        self.probe(self.index)
        h = self.fc1(x)
        a = nn.functional.gelu(h)  # GELU saves h, fc2 saves a
        # a storage's Python object lives exactly as long as the storage (PyObject preservation),
        # so these see every owner: autograd, the engine, or a stray reference
        self.refs = [weakref.ref(h.untyped_storage()), weakref.ref(a.untyped_storage())]
        return self.fc2(a)


@pytest.mark.parametrize("offloading", [True, False])
def test_released_tensors_have_no_references_left(offloading):
    n, k = 6, 3
    seen: list[tuple[int, int, bool]] = []
    layers = nn.ModuleList()

    def probe(j):
        gc.collect()
        for i in range(j):
            seen.append((j, i, all(r() is None for r in layers[i].refs)))

    layers.extend(Probed(i, 16, probe) for i in range(n))
    x = input_for(16)
    ctx, sync = offload(k, n) if offloading else (None, None)
    training_step(layers, x, ctx, sync)
    for j, i, gone in seen:
        released = offloading and i < k and j >= n - k + i
        assert gone == released, f"layer {i} at forward {j}: released={released}, references gone={gone}"


def test_resident_bytes_match_the_schedule():
    n, k = 7, 3
    model, x = build_linear_stack(n, 16), input_for(16)
    ctx, sync = offload(k, n)
    training_step(model, x, ctx, sync)
    per_layer = [s.offloaded_bytes for s in ctx.stats]
    assert all(b > 0 for b in per_layer[:k]) and not any(per_layer[k:])

    def expected(phase, j):  # offloaded layers on the device, counted independently
        if phase == "forward":
            return sum(per_layer[i] for i in range(k) if i <= j < n - k + i)
        # reloaded at the backward of i + max(1, N-2-k), freed when its own backward ends
        return sum(per_layer[i] for i in range(k) if i <= j <= i + max(1, n - 2 - k))

    trace = ctx.resident_trace
    assert [(p, j) for p, j, _ in trace] == [("forward", j) for j in range(n)] + [
        ("backward", j) for j in reversed(range(n))
    ]
    assert [b for _, _, b in trace] == [expected(p, j) for p, j, _ in trace]
    assert all(got == want for _, _, got, want in resident_vs_theory(ctx))
    assert ctx.theoretical().saving == sum(per_layer)


# ---------------------------------------------------------------- which tensors, and how often
class SavesThrice(nn.Module):
    def forward(self, x):
        h = x + 1  # add saves nothing
        return h * h + h.sin()  # mul saves h twice, sin once


def test_same_tensor_saved_three_times_is_copied_once():
    x = input_for(16)
    ctx, sync = offload(1, 2)
    training_step([SavesThrice(), SavesThrice()], x, ctx, sync)
    s = ctx.stats[0]
    assert (s.offloaded_tensors, s.offloaded_storages, s.offloaded_bytes) == (3, 1, x.numel() * 4)
    assert ctx.pool.allocations == 1
    ref_x = x.detach().clone().requires_grad_()
    training_step([SavesThrice(), SavesThrice()], ref_x)
    assert torch.equal(x.grad, ref_x.grad)


class ViewCheck(torch.autograd.Function):
    """Saves two overlapping, non-contiguous views and checks how they come back."""

    seen: dict = {}

    @staticmethod
    def forward(ctx, q, kt):
        ctx.save_for_backward(q, kt)
        ViewCheck.seen["forward"] = [(t.shape, t.stride(), t.storage_offset()) for t in (q, kt)]
        return q @ kt

    @staticmethod
    def backward(ctx, g):
        q, kt = ctx.saved_tensors
        ViewCheck.seen["backward"] = [(t.shape, t.stride(), t.storage_offset()) for t in (q, kt)]
        ViewCheck.seen["shared"] = q.untyped_storage().data_ptr() == kt.untyped_storage().data_ptr()
        return g @ kt.transpose(-1, -2), q.transpose(-1, -2) @ g


class ViewLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 48)

    def forward(self, x):
        q, k, _ = self.proj(x).chunk(3, dim=-1)  # views at offsets 0 and 16 of one storage
        return ViewCheck.apply(q, k.transpose(-1, -2)) @ x  # k^T is non-contiguous


def test_views_come_back_with_strides_offsets_and_sharing():
    layers, x = [ViewLayer(), ViewLayer()], input_for(16)
    ctx, sync = offload(1, 2)
    training_step(layers, x, ctx, sync)  # layer 0's ViewCheck runs its backward last
    assert ViewCheck.seen["backward"] == ViewCheck.seen["forward"]
    assert ViewCheck.seen["shared"]
    # the projection output (once, for both views) and ViewCheck's output; x is a leaf and stays
    assert ctx.stats[0].offloaded_storages == 2
    ref = x.detach().clone().requires_grad_()
    training_step(layers, ref)
    assert torch.equal(x.grad, ref.grad)


class MarkedSave(nn.Module):
    def __init__(self):
        super().__init__()
        self.refs = []

    def forward(self, x):
        a, b = x * 2, x * 3
        mark_not_offload(a)
        self.refs = [weakref.ref(a.untyped_storage()), weakref.ref(b.untyped_storage())]
        return a * b  # saves a and b


def test_mark_not_offload_keeps_the_tensor():
    layers, x = [MarkedSave(), MarkedSave(), MarkedSave()], input_for(16)
    ctx, sync = offload(1, 3)
    h = x
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync(h)
    gc.collect()  # layer 0 is released now
    a_ref, b_ref = layers[0].refs
    assert a_ref() is not None and b_ref() is None
    assert ctx.stats[0].offloaded_tensors == 1 and ctx.stats[0].kept_tensors == 1
    h.sum().backward()


def test_parameters_are_never_offloaded():
    model, x = small_basic(3), input_for(32)
    ctx, sync = offload(2, 3, min_offload_bytes=0)
    training_step(model, x, ctx, sync)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert ctx.stats[0].offloaded_bytes > 0
    assert ctx.stats[0].kept_tensors > 0  # the weights (and x, a leaf) were seen and kept
    for layer_stats in ctx.stats:
        assert layer_stats.offloaded_bytes < sum(p.numel() * 4 for p in model.parameters())
    for records in ctx._records:
        for rec in records:
            for ref in rec.original_ref:
                assert ref() is None or ref().untyped_storage().data_ptr() not in param_storages


def test_small_tensors_stay():
    x = input_for(16)
    ctx, sync = offload(1, 2, min_offload_bytes=10**9)
    training_step([SavesThrice(), SavesThrice()], x, ctx, sync)
    assert ctx.offloaded_bytes == 0 and ctx.stats[0].kept_tensors == 3


# ---------------------------------------------------------------- host buffers
@pytest.mark.parametrize("retain", [True, False])
def test_host_buffers_are_reused_across_iterations(retain):
    model, x = build_linear_stack(4, 16), input_for(16)
    ctx, sync = offload(2, 4, retain_pinned_cpu_buffers=retain)
    training_step(model, x, ctx, sync)
    first = ctx.pool.allocations
    for _ in range(3):
        training_step(model, x, ctx, sync)
    assert first > 0
    assert ctx.pool.allocations == (first if retain else 4 * first)
    assert ctx.pool.peak_pinned_bytes == ctx.pool.peak_bytes > 0  # a CPU pins nothing: the bytes asked for
    ctx.release_buffers()
    assert ctx.pool.held_bytes == ctx.pool.pinned_bytes == 0


def test_pinned_nbytes_is_the_next_power_of_two_when_pinned():
    assert [pinned_nbytes(n) for n in (0, 1, 2, 3, 4096, 4097)] == [0, 1, 2, 4, 4096, 8192]
    for k in (10, 20, 33):
        assert (pinned_nbytes(2**k), pinned_nbytes(2**k + 1), pinned_nbytes(2**k - 1)) == (2**k, 2 ** (k + 1), 2**k)
    assert pinned_nbytes(288 * 2**20) == 512 * 2**20  # 9 x 32 MiB: a tensor of a long sequence
    assert pinned_nbytes(288 * 2**20, pinned=False) == 288 * 2**20 and pinned_nbytes(0, pinned=False) == 0


@pytest.fixture
def pins_on_cpu(monkeypatch):
    """``torch.empty(..., pin_memory=True)`` without a GPU: the memory is not pinned, but a pool made with
    ``pin_memory=True`` counts what PyTorch's pinned allocator would reserve."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, pin_memory=False, **kwargs: empty(*args, **kwargs))


def test_a_pinning_pool_counts_and_limits_the_bytes_the_allocator_reserves(pins_on_cpu):
    """Buffers of 600 and 700 bytes reserve 1024 each: the pool holds 1300 bytes (what was offloaded) and
    pins 2048, and its limit refuses a third buffer whose bytes fit but whose reservation does not."""
    pool = HostBufferPool(pin_memory=True, retain=True, limit_bytes=2500)
    a, b = pool.acquire(600), pool.acquire(700)
    assert (a.nbytes, a.reserved, b.reserved) == (600, 1024, 1024)
    assert (pool.held_bytes, pool.pinned_bytes) == (1300, 2048)
    with pytest.raises(HostMemoryLimitError, match=r"offloading 600 more bytes \(1024 reserved by the pinned "
                                                   r"allocator\) would exceed the host memory limit of 2500 bytes "
                                                   r"\(2048 reserved\)"):
        pool.acquire(600)  # 1900 bytes asked for in all, within the limit; 3072 pinned, over it
    pool.give_back(a, None)
    pool.give_back(b, None)
    pool.end_iteration()  # both were used in the iteration that ended: kept for the next
    assert (pool.held_bytes, pool.pinned_bytes) == (1300, 2048)
    pool.give_back(pool.acquire(700), None)
    pool.end_iteration()  # the 600-byte buffer was not used: dropped
    assert (pool.held_bytes, pool.pinned_bytes) == (700, 1024)
    pool.release()
    assert (pool.held_bytes, pool.pinned_bytes, pool.peak_bytes, pool.peak_pinned_bytes) == (0, 0, 1300, 2048)


def test_a_pinning_pool_forgets_what_it_gives_away_and_counts_what_graphs_keep(pins_on_cpu):
    passing = HostBufferPool(pin_memory=True, retain=False)  # each buffer goes back to PyTorch's cache
    passing.give_back(passing.acquire(3000), None)
    assert (passing.held_bytes, passing.pinned_bytes, passing.peak_pinned_bytes) == (0, 0, 4096)
    pool = HostBufferPool(pin_memory=True, retain=True)
    pool.give_back(pool.acquire(3000), None)
    pool.give_back(pool.acquire(3000, for_graph=True), None)  # the graph owns it from now on
    pool.end_iteration()
    pool.release()
    assert (pool.held_bytes, pool.pinned_bytes, pool.graph_bytes) == (3000, 4096, 3000)


def test_disabled_returns_null_context_and_identity():
    ctx, sync = get_cpu_offload_context(enabled=False, num_layers=99)
    assert isinstance(ctx, contextlib.nullcontext)
    t = torch.ones(2)
    assert sync(t) is t
