"""Offloading inside per-layer CUDA graphs (:func:`~offload_examples.features.graphs.make_graphed_layers`).

CPU: the engine's per-layer capture rules run with the capture flag forced on: a layer's copies to
the host start at the next layer's entry and are spread over the entries before its release, a layer
saved in a capture is never copied outside one, every copy forked under a capture is joined once, and
waits for joined copies are skipped; the gradients stay bitwise those of a step without
offloading. GPU: each layer captured in a forward and a backward graph of its own, with
PyTorch's ``make_graphed_callables`` and with Transformer Engine's, replays bitwise like eager
steps without offloading, dropout included, and its memory pool is smaller by about what the
engine moved; a whole model's forward and backward captured as two graphs works too.
"""

from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch

from offload_examples import get_cpu_offload_context
from offload_examples.core.streams import Streams
from offload_examples.features.graphs import make_graphed_layers
from offload_examples.instruments.graph_variants import pool_growth
from offload_examples.instruments.measure import deterministic_kernels, training_step
from offload_examples.instruments.models import build_basic_model, build_linear_stack
from offload_examples.instruments.te_compare import RECIPES


def _grads(layers: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]


def _step(layers, x, ctx=None, sync=None) -> list[torch.Tensor]:
    for p in layers.parameters():
        p.grad = None
    x.grad = None
    training_step(layers, x, ctx, sync)
    return _grads(layers, x)


def _watched_step(layers, x, ctx, sync, watch) -> list[int]:
    """A training step through ``ctx``, with ``watch()`` read as each layer's entry closes."""
    for p in layers.parameters():
        p.grad = None
    x.grad = None
    h, seen = x, []
    for layer in layers:
        with ctx:
            h = layer(h)
        seen.append(watch())
        h = sync(h)
    h.float().square().mean().backward()
    return seen


# ---------------------------------------------------------------------------- CPU
def test_per_layer_scope_starts_a_layers_copies_at_the_next_entry_and_keeps_the_bits(monkeypatch):
    """While a capture holds one layer, the copies of the layer whose forward just ended wait for the
    next layer's entry (they run beside its forward, inside its graph); the step's gradients stay
    bitwise. The capture flag is forced on: on a CPU no stream is captured."""
    torch.manual_seed(0)
    layers = build_linear_stack(4, 32)
    x = torch.randn(8, 32, requires_grad=True)
    plain = _step(layers, x)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4, retain_pinned_cpu_buffers=True)
    _step(layers, x, ctx, sync)  # eager: the host buffers a capture would take from the pool
    eager_bytes = ctx.offloaded_bytes
    ctx.set_capture_scope("layer")
    monkeypatch.setattr(type(ctx), "capturing", lambda self: True)
    moved_after_exit = _watched_step(layers, x, ctx, sync, lambda: ctx.offloaded_bytes)
    assert moved_after_exit[0] == 0, "layer 0's copies started at its own exit"
    assert 0 < moved_after_exit[1] < moved_after_exit[2] == eager_bytes
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(layers, x)))


def _between_step(layers, x, ctx, sync, resize_after=None, held=None) -> list[torch.Tensor]:
    """A step with the capture flag forced on and ``copies_out="between"``: after each layer's forward, the
    storages it planned are copied out here as the replay wrapper copies them (on a CPU the "capture" runs).
    ``resize_after``: free ``held``'s storage after that layer and gather it again, with new values, before
    the backward (as FSDP does)."""
    from offload_examples.features.graphs import _bytes_at

    for p in layers.parameters():
        p.grad = None
    x.grad = None
    h = x
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h) if held is None or i else h @ held["w"].t()
        for rec, data in getattr(ctx, "_between", {}).get(i, ()):
            data[:rec.nbytes].copy_(_bytes_at(rec.address, rec.nbytes, torch.device("cpu")))
        h = sync(h)
        if i == resize_after:
            held["w"].untyped_storage().resize_(0)
    if resize_after is not None:
        held["w"].untyped_storage().resize_(held["w"].numel() * 4)
        held["w"].data.copy_(held["v"] * 2)
    h.float().square().mean().backward()
    return [p.grad.clone() for p in layers.parameters() if p.grad is not None] + [x.grad.clone()]


@pytest.mark.parametrize("resize", [False, True])
def test_copies_between_the_graphs_keep_the_bits_and_the_counts_of_copies_inside(monkeypatch, resize):
    """``copies_out="between"``: the capture plans each offloaded layer's copies (host buffers, addresses)
    and queues none; copied after the layer's forward, as the replays do, the step's gradients are bitwise
    those without offloading, and what the engine counts (bytes moved, resident bytes at every phase,
    events) equals what it counts with the copies inside the graphs. A storage resized before its release
    stays on the device, as in any step, and its host buffer goes back. The capture flag is forced on."""
    def run(copies_out: str):
        torch.manual_seed(0)
        layers = build_linear_stack(6, 32)
        x = torch.randn(8, 32, requires_grad=True)
        held = {"v": torch.randn(32, 32)} if resize else None

        def gathered() -> None:
            if held is not None:
                held["w"] = held["v"].clone()

        gathered()
        plain = _between_step(layers, x, contextlib.nullcontext(), lambda h: h, 0 if resize else None, held)
        ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=6,
                                            retain_pinned_cpu_buffers=True)
        gathered()
        _step(layers, x, ctx, sync)  # eager: the host buffers a capture takes from the pool
        ctx.set_capture_scope("layer")
        if copies_out == "between":
            ctx._copy_between_replays()
        monkeypatch.setattr(type(ctx), "capturing", lambda self: True)
        gathered()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grads = _between_step(layers, x, ctx, sync, 0 if resize else None, held)
        monkeypatch.undo()
        assert all(torch.equal(a, b) for a, b in zip(plain, grads)), copies_out
        said = " ".join(str(w.message) for w in caught)
        return ctx, said

    inside, said_inside = run("inside")
    between, said_between = run("between")
    assert [s.offloaded_bytes for s in between.stats] == [s.offloaded_bytes for s in inside.stats]
    assert [s.candidate_bytes for s in between.stats] == [s.candidate_bytes for s in inside.stats]
    # (a storage resized after its layer: inside the graphs it is seen at the next entry, between them at the
    # release; it counts as resident until then)
    assert resize or (between.resident_trace, between.pool.graph_bytes) == (inside.resident_trace,
                                                                             inside.pool.graph_bytes)
    assert between.resident_trace[-1] == inside.resident_trace[-1]
    assert between.pool.graph_bytes == inside.pool.graph_bytes  # a resized storage's buffer is no graph's
    assert [e for e in between.events if e[0] == "release"] == [e for e in inside.events if e[0] == "release"]
    assert ("resized" in said_between) == ("resized" in said_inside) == resize
    copies, waits = between._take_copies_between()
    assert waits == {4: [0], 5: [1]} and sorted(copies) == [0, 1]  # released before the forwards of N - k + i
    assert sum(n for items in copies.values() for _, n, _ in items) == between.offloaded_bytes
    assert between._take_copies_between() == ({}, {})  # taken once


def test_between_layers_wait_for_a_release_on_the_device_before_its_graph_and_on_the_host_after(monkeypatch):
    """The order the layers of ``copies_out="between"`` keep, with stand-ins for streams and events: a layer's
    copies are queued after its graph's replay; the graph that releases it waits for them on the device, and
    the host waits for them only once that graph is launched (so the backward is launched after them). The
    first replay of a step waits for copies a step cut short left unwaited for. In another training state a
    layer runs without copies or waits; captured in another graph, it refuses."""
    from offload_examples.features import graphs

    log: list[tuple] = []

    class Event:
        def __init__(self, name: str):
            self.name = name

        def synchronize(self) -> None:
            log.append(("host waits for", self.name))

    class Stream:
        def __init__(self, name: str):
            self.name = name

        def wait_stream(self, other: Stream) -> None:
            log.append((self.name, "waits for", other.name))

        def wait_event(self, event: Event) -> None:
            log.append((self.name, "waits for", event.name))

        def record_event(self) -> Event:
            return Event(f"copies of layer {log[-1][1]}")

    class Host:
        def __init__(self, layer: int):
            self.layer = layer

        def copy_(self, src: object, non_blocking: bool) -> None:
            assert non_blocking
            log.append(("copy out", self.layer))

    class Graphed(torch.nn.Module):
        def __init__(self, i: int):
            super().__init__()
            self.i = i

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            log.append(("replay" if self.training else "eager", self.i))
            return h

    compute = Stream("compute")
    capturing = {"now": False}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    between = object.__new__(graphs._CopiesBetween)
    between.stream, between.device, between.graphed = Stream("d2h"), torch.device("cpu"), [Graphed(i) for i in range(4)]
    between.copies, between.waits = {0: [(None, Host(0))], 1: [(None, Host(1))]}, {2: [0], 3: [1]}
    between.ends, between.releasing = {}, []
    layers = between.layers()
    step = [("replay", 0), ("d2h", "waits for", "compute"), ("copy out", 0),
            ("replay", 1), ("d2h", "waits for", "compute"), ("copy out", 1),
            ("compute", "waits for", "copies of layer 0"), ("replay", 2), ("host waits for", "copies of layer 0"),
            ("compute", "waits for", "copies of layer 1"), ("replay", 3), ("host waits for", "copies of layer 1")]
    for _ in range(2):
        log.clear()
        h = torch.zeros(1)
        for layer in layers:
            h = layer(h)
        assert log == step
    log.clear()
    h = layers[1](layers[0](h))  # a step that stops before the releases: the next one's first replay waits
    log.clear()
    for layer in layers:
        h = layer(h)
    assert log == [("compute", "waits for", "copies of layer 0"), ("compute", "waits for", "copies of layer 1")] + step
    log.clear()
    for layer in layers:
        layer.eval()
        layer(h)
    assert log == [("eager", i) for i in range(4)]
    layers[0].train()
    capturing["now"] = True
    with pytest.raises(RuntimeError, match="cannot be captured in another graph"):
        layers[0](h)


def test_per_layer_scope_spreads_a_layers_copies_over_the_entries_before_its_release(monkeypatch):
    """With many layers between an offloaded layer and its release, its copies are spread over their
    graphs (each copies about its share of the bytes left), all queued before the release; the bits
    stay those of a step without offloading."""
    torch.manual_seed(0)
    layers = build_basic_model(8, 32, 4, 64, kind="torch", dropout=0.0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    plain = _step(layers, x)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=8, retain_pinned_cpu_buffers=True)
    _step(layers, x, ctx, sync)
    whole = ctx.stats[0].offloaded_bytes
    ctx.set_capture_scope("layer")
    monkeypatch.setattr(type(ctx), "capturing", lambda self: True)
    copied = _watched_step(layers, x, ctx, sync, lambda: ctx.stats[0].offloaded_bytes)  # layer 0's bytes copied
    release = 8 - 2  # the default schedule releases layer 0 at the forward of entry N - k
    assert copied[0] == 0 and 0 < copied[1] < whole, copied  # a share, not all at once
    assert len(set(copied[1:release])) > 2, copied  # several graphs take part
    assert copied[release - 1] == whole, copied  # all of it queued before the release
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(layers, x)))


@pytest.mark.parametrize("piece", [None, 256])
def test_a_storage_resized_while_its_layer_waits_for_its_copies_stays_and_the_trace_follows_the_copies(
        monkeypatch, piece):
    """Per layer, a layer's storages wait for later entries to be copied. One resized meanwhile (as
    FSDP's reshard frees a gathered weight) is not copied: it stays on the device, with a warning, and
    the step keeps its bits; the resident bytes at every phase are what the schedule predicts."""
    from offload_examples import OffloadWarning
    from offload_examples.instruments.measure import resident_vs_theory

    torch.manual_seed(0)
    n = 8
    layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(n))
    x = torch.randn(16, 64, requires_grad=True)
    weight, held = torch.randn(64, 64), {}

    def step(ctx=None, sync=None, resize_after=None):
        for p in layers.parameters():
            p.grad = None
        x.grad = None
        h = x
        for i, layer in enumerate(layers):
            with ctx or torch.enable_grad():
                if i == 0:
                    for _ in range(4):
                        h = torch.tanh(h * 1.5)
                    held["w"] = weight.clone()  # gathered, like an FSDP unit's weight
                    h = h @ held["w"].t()
                else:
                    h = layer(h)
            h = sync(h) if sync else h
            if i == resize_after:
                held["w"].untyped_storage().resize_(0)  # resharded: its bytes are gone
        if resize_after is not None:  # gathered again before the backward
            held["w"].untyped_storage().resize_(weight.numel() * 4)
            held["w"].data.copy_(weight)
        h.float().square().mean().backward()
        return [p.grad.clone() for p in layers[1:].parameters()] + [x.grad.clone()]

    at = 1 if piece is None else 4  # before its copy began, or half-way through
    if piece is not None:
        from offload_examples.core import entries

        monkeypatch.setattr(entries, "MIN_PIECE_BYTES", piece)
    plain = step(resize_after=at)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=n, retain_pinned_cpu_buffers=True)
    step(ctx, sync)
    ctx.set_capture_scope("layer")
    monkeypatch.setattr(type(ctx), "capturing", lambda self: True)
    with pytest.warns(OffloadWarning, match="resized before its copy to the host " + ("began" if piece is None else "ended")):
        got = step(ctx, sync, resize_after=at)
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    stats = ctx.stats[0]  # the resized storage is no candidate: the theory keeps no bytes for it
    assert stats.candidate_bytes == stats.offloaded_bytes > 0, (stats.candidate_bytes, stats.offloaded_bytes)
    # nothing resized, another context (a graph keeps its buffers): in the forward the bytes waiting for
    # their copies count as on the device, as the schedule predicts at every phase; in the backward the
    # reload comes back a share at a time, all of it before the backward of the layer
    monkeypatch.setattr(type(ctx), "capturing", lambda self: False)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=n, retain_pinned_cpu_buffers=True)
    step(ctx, sync)
    ctx.set_capture_scope("layer")
    monkeypatch.setattr(type(ctx), "capturing", lambda self: True)
    step(ctx, sync)
    points = resident_vs_theory(ctx)
    forward = [(got, expected) for phase, _, got, expected in points if phase == "forward"]
    backward = [(got, expected) for phase, _, got, expected in points if phase == "backward"]
    assert all(got == expected for got, expected in forward), points
    assert all(got <= expected for got, expected in backward), points
    assert [got for got, _ in backward] == sorted(got for got, _ in backward), points  # it only grows
    assert backward[-2][0] == backward[-2][1] > 0, points  # all of layer 0 back by the backward of layer 1


def _queued(ctx, layer: int) -> int:
    return sum(r.queued for r in ctx._records[layer])


def _tanh_stack(n: int) -> torch.nn.ModuleList:
    """Layers that each offload one 16 KiB storage (the tanh's output, for a 64 x 64 input)."""
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
                               for _ in range(n))


def test_per_layer_scope_copies_a_storage_larger_than_a_share_in_pieces(monkeypatch):
    """A storage larger than a layer's share of the copies is copied in pieces over several graphs:
    each entry queues about its share (one piece more at most), all of it before the release, and
    the gradients stay bitwise."""
    from offload_examples.core import entries

    monkeypatch.setattr(entries, "MIN_PIECE_BYTES", 256)
    n = 8
    layers = _tanh_stack(n)
    x = torch.randn(64, 64, requires_grad=True)
    plain = _step(layers, x)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=n, retain_pinned_cpu_buffers=True)
    _step(layers, x, ctx, sync)
    whole = ctx.stats[0].offloaded_bytes
    ctx.set_capture_scope("layer")
    monkeypatch.setattr(type(ctx), "capturing", lambda self: True)
    queued = _watched_step(layers, x, ctx, sync, lambda: _queued(ctx, 0))
    release = n - 1  # layer 0 is released at the forward of entry N - k
    steps = [b - a for a, b in zip(queued, queued[1:release])]
    assert all(0 < d <= whole / (release - 1) + 256 for d in steps), (queued, whole)  # shares, in pieces
    assert queued[release - 1] == whole == ctx.stats[0].offloaded_bytes, queued
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(layers, x)))


def test_per_layer_scope_spreads_several_layers_copies_evenly_over_the_graphs(monkeypatch):
    """Three layers copying out, and back, at once: from the first graph in which a copy can run, each
    graph copies about as many bytes as the next (the layer due first first, room left for the layers
    whose copies start later, as the last step counted them), where shares taken layer by layer would
    crowd the graphs in which all three copy and leave the others idle; every byte is queued out before
    its release and back before its backward, and the gradients stay bitwise."""
    from offload_examples.core import engine as engine_module, entries

    monkeypatch.setattr(entries, "MIN_PIECE_BYTES", 256)
    n, k = 10, 3
    layers = _tanh_stack(n)
    x = torch.randn(64, 64, requires_grad=True)
    plain = _step(layers, x)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n, retain_pinned_cpu_buffers=True)
    _step(layers, x, ctx, sync)
    whole = [ctx.stats[j].offloaded_bytes for j in range(k)]
    ctx.set_capture_scope("layer")
    monkeypatch.setattr(type(ctx), "capturing", lambda self: True)
    copy_in, back = engine_module._StorageRecord.copy_in, {}

    def watched(rec, stop=None):  # bytes copied back in each backward's graph
        graph = len(ctx._backwards)
        back[graph] = back.get(graph, 0) + (stop or rec.nbytes) - rec.loaded
        return copy_in(rec, stop)

    monkeypatch.setattr(engine_module._StorageRecord, "copy_in", watched)
    queued = _watched_step(layers, x, ctx, sync, lambda: sum(_queued(ctx, j) for j in range(k)))
    per_graph = [b - a for a, b in zip([0] + queued, queued)]
    steady = per_graph[1:n - 1]  # from the first entry after a copy can start up to the last release
    assert max(steady) - min(steady) <= k * 256, per_graph  # even, to a piece's rounding
    assert [_queued(ctx, j) for j in range(k)] == whole, (queued, whole)
    graphs = sorted(back)  # from the first reload's backward to the last offloaded layer's own
    assert graphs == list(range(graphs[0], graphs[-1] + 1)) and len(graphs) > k, back
    steady = [back[g] for g in graphs[:-k]]  # before the offloaded layers' own backwards
    assert max(steady) - min(steady) <= k * 256 and sum(back.values()) == sum(whole), back
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(layers, x)))


def test_a_storage_half_copied_when_a_step_begins_again_stays_on_the_device(monkeypatch):
    """A step cut short while a storage is copied in pieces, its graph still held (a kept exception):
    when the next step begins, the half-copied storage keeps its device bytes and gives its buffer
    back, so the held graph's backward reads the bytes it saved, not a half-written buffer."""
    from offload_examples.core import entries

    monkeypatch.setattr(entries, "MIN_PIECE_BYTES", 256)
    n = 8
    layers = _tanh_stack(n)
    x = torch.randn(64, 64, requires_grad=True)

    def first_layers(ctx=None, sync=None):
        h = x
        for layer in layers[:3]:
            with ctx or torch.enable_grad():
                h = layer(h)
            h = sync(h) if sync else h
        return h

    for p in layers.parameters():
        p.grad = None
    first_layers().float().square().mean().backward()
    plain = _grads(layers[:3], x)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=n, retain_pinned_cpu_buffers=True)
    _step(layers, torch.randn_like(x).requires_grad_(), ctx, sync)  # the buffers, filled with other bytes
    ctx.set_capture_scope("layer")
    monkeypatch.setattr(type(ctx), "capturing", lambda self: True)
    for p in layers.parameters():
        p.grad = None
    x.grad = None
    held = first_layers(ctx, sync)
    assert 0 < _queued(ctx, 0) < ctx._records[0][0].nbytes, "layer 0's storage is half copied"
    ctx._step_begins_again()  # what offload_layers calls when the first layer runs again
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        held.float().square().mean().backward()
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(layers[:3], x)))
    del held
    gc.collect()
    assert ctx.pool.held_bytes == ctx.pool.free_bytes + ctx.pool.graph_bytes  # every buffer came back


def _in_pieces(monkeypatch):
    """Eight layers, the first offloaded, a context warmed up eagerly and then told that captures hold
    single layers (the capture flag forced on), copying storages in pieces of 256 bytes."""
    from offload_examples.core import entries

    monkeypatch.setattr(entries, "MIN_PIECE_BYTES", 256)
    layers = _tanh_stack(8)
    x = torch.randn(64, 64, requires_grad=True)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=8, retain_pinned_cpu_buffers=True)
    _step(layers, x, ctx, sync)
    ctx.set_capture_scope("layer")
    monkeypatch.setattr(type(ctx), "capturing", lambda self: True)
    return layers, x, ctx, sync


def test_a_step_cut_short_with_a_storage_half_copied_counts_no_bytes_twice(monkeypatch):
    """A step that enters 4 of 8 layers and then runs its backward, while a storage of layer 0 is half
    copied: it counts as resident only once all of it is queued, so nothing is taken off twice when its
    views die, and the count ends at zero."""
    layers, x, ctx, sync = _in_pieces(monkeypatch)
    h = x
    for layer in layers[:4]:
        with ctx:
            h = layer(h)
        h = sync(h)
    assert 0 < _queued(ctx, 0) < ctx._records[0][0].nbytes, "layer 0's storage is half copied"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the step ran fewer layers than the schedule counts
        h.float().square().mean().backward()
    del h
    gc.collect()
    assert min(b for _, _, b in ctx.resident_trace) >= 0 and ctx.resident_bytes == 0, (ctx.resident_trace,
                                                                                        ctx.resident_bytes)


def test_a_first_piece_that_fails_gives_its_buffer_back(monkeypatch):
    """The first piece of a storage's copy fails (a capture refusing it, say): the step fails, and the
    buffer it took from the pool goes back, though no storage held it yet."""
    from offload_examples.core.streams import Streams as S

    layers, x, ctx, sync = _in_pieces(monkeypatch)
    copy = S.copy

    def failing(self, dst, src, **kw):
        if isinstance(dst, torch.Tensor) and dst.numel() < 16384:  # a piece, not a whole storage
            raise RuntimeError("the copy failed")
        return copy(self, dst, src, **kw)

    monkeypatch.setattr(S, "copy", failing)
    with pytest.raises(RuntimeError, match="the copy failed"):
        _step(layers, x, ctx, sync)
    gc.collect()
    pool = ctx.pool
    assert pool.held_bytes == pool.free_bytes + pool.graph_bytes, (pool.held_bytes, pool.free_bytes, pool.graph_bytes)


def test_per_layer_scope_spreads_a_layers_reload_over_the_backwards_before_its_own(monkeypatch):
    """A layer's reload starts several layers' backwards before its own: per layer, each of their graphs
    copies back about its share of the bytes left, the tensors the layer's backward reads first first,
    all of it before that backward; the gradients stay bitwise."""
    torch.manual_seed(0)
    n, k = 8, 2
    layers = build_basic_model(n, 32, 4, 64, kind="torch", dropout=0.0)
    x = torch.randn(2, 16, 32, requires_grad=True)
    plain = _step(layers, x)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n, retain_pinned_cpu_buffers=True)
    _step(layers, x, ctx, sync)
    eager = {j: b for phase, j, b in ctx.resident_trace if phase == "backward"}
    ctx.set_capture_scope("layer")
    monkeypatch.setattr(type(ctx), "capturing", lambda self: True)
    _step(layers, x, ctx, sync)
    spread = {j: b for phase, j, b in ctx.resident_trace if phase == "backward"}
    first = k - 1 + max(1, n - 2 - k)  # the backward that starts the first offloaded layer's reload
    assert 0 < spread[first] < eager[first], (spread, eager)  # a share, not the whole layer
    assert len({spread[j] for j in range(first, 0, -1)}) > 3, spread  # several graphs take part
    assert spread[1] == eager[1] and spread[0] == eager[0], (spread, eager)  # all back in time
    assert all(torch.equal(a, b) for a, b in zip(plain, _grads(layers, x)))


def test_per_layer_scope_copies_a_large_storage_back_in_pieces_over_the_backwards(monkeypatch):
    """A storage larger than a backward graph's share of the reload comes back in pieces, one in each
    backward's graph from the reload's start, each about the share (a whole storage would stretch the
    one graph copying it); the pieces cover it once, all before its layer's backward, and the
    gradients stay bitwise."""
    from offload_examples.core import engine as engine_module

    layers, x, ctx, sync = _in_pieces(monkeypatch)
    plain = _step(layers, x)
    copy_in, pieces = engine_module._StorageRecord.copy_in, []

    def watched(rec, stop=None):
        pieces.append((len(ctx._backwards), rec.layer, rec.loaded, stop or rec.nbytes))
        return copy_in(rec, stop) if stop else copy_in(rec)

    monkeypatch.setattr(engine_module._StorageRecord, "copy_in", watched)
    grads = _step(layers, x, ctx, sync)
    nbytes = ctx.stats[0].offloaded_bytes  # layer 0 offloads one storage
    mine = [(graph, start, stop) for graph, layer, start, stop in pieces if layer == 0]
    graphs = [graph for graph, _, _ in mine]
    assert len(set(graphs)) == len(graphs) > 2, mine  # one piece in each of several backward graphs
    assert max(graphs) < len(layers), mine  # all queued by the graph of layer 0's own backward
    assert [s for _, s, _ in mine] == [0] + [e for _, _, e in mine[:-1]] and mine[-1][2] == nbytes, mine
    share = nbytes / (len(layers) - min(graphs))
    assert all(stop - start <= share + 256 for _, start, stop in mine), (mine, share)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    # its whole block is allocated with the first piece: from that backward on it counts as on the device
    backward = [b for phase, _, b in ctx.resident_trace if phase == "backward"]
    first = min(graphs)
    assert backward[first - 1] - backward[first - 2] == nbytes, (backward, first)


def test_capture_scope_is_checked():
    ctx, _ = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3)
    with pytest.raises(ValueError, match="'step' or 'layer'"):
        ctx.set_capture_scope("graph")
    manual, *_ = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3, manual_synchronization=True)
    with pytest.raises(ValueError, match="interleaved or manual schedule"):
        manual.set_capture_scope("layer")


def test_a_layer_captured_alone_cannot_have_its_copies_made_outside_a_graph(monkeypatch):
    """Per-layer capture where the next layer runs eagerly: the captured layer's bytes exist only in its
    graph's replays, so copying them eagerly would fill the host buffers with whatever the pool held.
    It is refused instead."""
    from offload_examples import GraphCaptureError

    layers = build_linear_stack(3, 16)
    x = torch.randn(4, 16, requires_grad=True)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3, retain_pinned_cpu_buffers=True)
    _step(layers, x, ctx, sync)
    ctx.set_capture_scope("layer")
    capturing = [True]
    monkeypatch.setattr(type(ctx), "capturing", lambda self: capturing[0])
    with ctx:
        h = layers[0](x)
    h = sync(h)
    capturing[0] = False  # layer 1 runs eagerly
    with pytest.raises(GraphCaptureError, match="copied to the host outside"):
        with ctx:
            layers[1](h)


def test_make_graphed_layers_needs_cuda():
    layers = build_linear_stack(2, 8)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)
    with pytest.raises(ValueError, match="CUDA device"):
        make_graphed_layers(layers, torch.randn(2, 8), ctx, sync)


class _Stream:
    def __init__(self):
        self.waited: list[object] = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


class _Event:
    pass


def test_a_copy_forked_under_capture_is_joined_once_and_then_never_waited_for():
    """Streams.join makes each captured stream wait once for the copies forked from it; a fence or a
    use by that stream joins too; after that the stream queues no wait for the copy again (it would
    cross into another capture, and the stream's order already covers it). Other streams still wait."""
    streams = Streams(torch.device("cpu"))
    home, side = _Stream(), _Stream()
    a, b = _Event(), _Event()
    a.origin, b.origin = home, home
    streams.forks = [(home, a), (home, b)]
    Streams.fence(home, a)  # the release of a's layer: a wait by its own stream joins it
    assert home.waited == [a] and a.joined
    assert streams.join() == 1 and home.waited == [a, b] and b.joined  # only b still needed its join
    Streams.fence(home, a, b)  # its own stream: ordered after both already
    assert home.waited == [a, b]
    Streams.use(torch.empty(0), b, side)  # another stream is not ordered by the join: it waits
    assert side.waited == [b]
    other = _Event()  # an eager copy's event (no origin): waited for as always
    Streams.fence(side, other)
    assert side.waited == [b, other] and not getattr(other, "joined", False)


# ---------------------------------------------------------------------------- GPU
N, K, BATCH, SEQ, HIDDEN = 6, 2, 4, 512, 1024


def _model(kind: str, dropout: float, cuda) -> torch.nn.ModuleList:
    return build_basic_model(N, HIDDEN, 16, 4 * HIDDEN, device=cuda, dtype=torch.bfloat16, kind=kind, dropout=dropout)


def _run(fns, x, rng) -> list[torch.Tensor]:
    """One training step through ``fns`` from the RNG state ``rng``: the output, then every gradient."""
    torch.cuda.set_rng_state(rng)
    h = x
    for f in fns:
        h = f(h)
    h.float().square().mean().backward()
    return [h.detach().clone()]


def _fp8_options(recipe: str) -> dict:
    """Transformer Engine's make_graphed_callables options for ``recipe`` (none for bf16); TE's FP8 state
    starts afresh, as a new model's would."""
    import inspect

    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as recipes

    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # releases before the quantization module
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    FP8GlobalStateManager.reset()
    if recipe == "bf16":
        return {}
    names = inspect.signature(te.make_graphed_callables).parameters
    on, which = ("enabled", "recipe") if "recipe" in names else ("fp8_enabled", "fp8_recipe")  # newer names first
    return {on: True, which: getattr(recipes, recipe)()}


def _clear(layers: torch.nn.Module, x: torch.Tensor) -> None:
    for p in layers.parameters():
        p.grad = None
    x.grad = None


def _graphed_step(kind: str, backend: str, dropout: float, cuda, offload: bool, **graph_options):
    """Eager steps on two inputs, then the per-layer graphs' replays on the same two: ``(eager, replays, the
    graphs' pool, bytes offloaded)``. Before the replays the graphs' host buffers are filled with 0xFF (what
    a copy that did not run would leave to reload), and before the second the copy stream is kept busy (a
    replay that did not wait for the copies out would overwrite what they have still to read)."""
    torch.manual_seed(0)
    layers = _model(kind, dropout, cuda)
    xs = [torch.randn(BATCH, SEQ, HIDDEN, device=cuda, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    x = xs[0]
    ctx, sync = get_cpu_offload_context(enabled=offload, num_layers=K, model_layers=N, retain_pinned_cpu_buffers=True)
    rng = torch.cuda.get_rng_state()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    eager = []
    with torch.cuda.stream(side):  # eager work before a capture runs on a side stream (PyTorch's rule)
        for xi in xs:
            _clear(layers, xi)
            eager.append(_run(list(layers), xi, rng) + _grads(layers, xi))
    torch.cuda.current_stream().wait_stream(side)
    _clear(layers, x)
    # the graphs' own pool: not the warm-up's blocks in the default one
    graphed, pool = pool_growth(lambda: make_graphed_layers(list(layers), x, ctx, sync, backend=backend,
                                                            **graph_options))
    if offload:  # the graphs' memory plan released what the copies moved, layer by layer
        assert all(("release", j) in ctx.events for j in range(K)), ctx.events
        assert ctx.pool.graph_bytes == ctx.offloaded_bytes > 0
        for buf in ctx.pool._kept_for_graphs:
            buf.data.fill_(255)
    replays = []
    for i, xi in enumerate(xs):
        _clear(layers, xi)
        if offload and i:
            with torch.cuda.stream(ctx.streams.d2h):
                torch.cuda._sleep(100_000_000)
        replays.append(_run(graphed, xi, rng) + _grads(layers, xi))
    torch.cuda.synchronize()
    return eager, replays, pool, (ctx.offloaded_bytes if offload else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("copies_out", ["inside", "between"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gpu_per_layer_graphs_with_offloading_replay_bitwise_and_save_the_offloaded_bytes(cuda, dropout, copies_out):
    """The copies to the host inside the graphs, or between their replays: the same bits, the same saving."""
    with deterministic_kernels():
        eager, replays, pool_plain, _ = _graphed_step("torch", "torch", dropout, cuda, offload=False)
        _, offloaded_replays, pool_offloaded, moved = _graphed_step("torch", "torch", dropout, cuda, offload=True,
                                                                     copies_out=copies_out)
    for reference, replay in zip(eager + eager, replays + offloaded_replays):
        assert all(torch.equal(a, b) for a, b in zip(reference, replay))
    assert moved > 0
    assert pool_plain - pool_offloaded >= 0.9 * moved, (pool_plain, pool_offloaded, moved)


@pytest.mark.gpu
@pytest.mark.parametrize("copies_out", ["inside", "between"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_te_per_layer_graphs_with_offloading_replay_bitwise(te, cuda, recipe, copies_out):
    """Transformer Engine's layers and its make_graphed_callables, in bf16 and under the FP8 recipes:
    each replay with offloading equals the same replay of the graphs without it (under FP8 the scaling
    state moves on from replay to replay, alike in both), and in bf16 an eager step too."""
    with deterministic_kernels():
        eager, plain, pool_plain, _ = _graphed_step("te", "te", 0.0, cuda, offload=False, **_fp8_options(recipe))
        _, replays, pool_offloaded, moved = _graphed_step("te", "te", 0.0, cuda, offload=True, copies_out=copies_out,
                                                          **_fp8_options(recipe))
    for reference, replay in zip(plain, replays):
        assert all(torch.equal(a, b) for a, b in zip(reference, replay))
    if recipe == "bf16":
        for reference, replay in zip(eager, replays):
            assert all(torch.equal(a, b) for a, b in zip(reference, replay))
    assert moved > 0 and pool_plain - pool_offloaded >= 0.9 * moved, (pool_plain, pool_offloaded, moved)
