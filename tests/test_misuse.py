"""Bad input and misuse: each gets a clear error or correct gradients, never a hang or a wrong result."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_examples import OffloadWarning, get_cpu_offload_context
from offload_examples.instruments.measure import training_step
from offload_examples.instruments.models import build_basic_model, build_linear_stack

CPU = torch.device("cpu")


def offload(k: int, n: int, **kw):
    return get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n, device=CPU, **kw)


def data(seed: int = 0) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    return out


@pytest.mark.parametrize(
    "k,n,error,match",
    [
        (3, 3, ValueError, "between 0 and model_layers - 1"),
        (5, 3, ValueError, "between 0 and model_layers - 1"),
        (-1, 3, ValueError, "between 0"),
        (0, 0, ValueError, "model_layers must be >= 1"),
        (0, -2, ValueError, "model_layers must be >= 1"),
        (1.5, 3, TypeError, "num_layers must be an int"),
        (1, "3", TypeError, "model_layers must be an int"),
    ],
)
def test_bad_layer_counts(k, n, error, match):
    with pytest.raises(error, match=match):
        offload(k, n)


@pytest.mark.parametrize(
    "kw,error,match",
    [
        (dict(min_offload_bytes=-1), ValueError, "min_offload_bytes"),
        (dict(host_memory_limit=-5), ValueError, "host memory limit"),
        (dict(offload_activations=False), ValueError, "nothing to offload"),
        (dict(manual_synchronization=True, synchronization_dict={}), ValueError, "not both"),
        (dict(offload_stream=object()), ValueError, "offload_stream"),
    ],
)
def test_bad_options(kw, error, match):
    with pytest.raises(error, match=match):
        offload(1, 2, **kw)


@pytest.mark.parametrize("field", ["num_layers", "hidden", "heads", "ffn"])
def test_negative_model_sizes(field):
    sizes = dict(num_layers=2, hidden=8, heads=2, ffn=16, kind="torch")
    sizes[field] = -1
    with pytest.raises(ValueError, match=field if field != "num_layers" else "num_layers"):
        build_basic_model(**sizes)


def test_sync_inside_the_context():
    ctx, sync = offload(1, 2)
    with ctx, pytest.raises(RuntimeError, match="after leaving the offload context"):
        sync(nn.Linear(16, 16)(data()))


def test_sync_with_a_non_tensor():
    ctx, sync = offload(1, 2)
    with ctx:
        y = nn.Linear(16, 16)(data())
    with pytest.raises(TypeError, match="got tuple"):
        sync((y,))


def test_sync_before_any_layer():
    _, sync = offload(1, 2)
    with pytest.raises(RuntimeError, match="before any layer"):
        sync(data())


def test_nested_context():
    ctx, _ = offload(1, 2)
    with ctx, pytest.raises(RuntimeError, match="cannot be nested"):
        with ctx:
            pass


def test_nested_inside_an_entry_made_under_no_grad():
    """An entry under no_grad saves nothing; a real entry inside it used to run, then the outer exit
    ended the layer a second time with a message about its release."""
    ctx, _ = offload(1, 2)
    with torch.no_grad(), ctx, torch.enable_grad(), pytest.raises(RuntimeError, match="cannot be nested"):
        with ctx:
            pass
    with torch.no_grad(), ctx:  # and the context is usable again
        pass


def test_entering_more_than_model_layers_times():
    model, x = build_linear_stack(3, 16), data()
    ctx, sync = offload(1, 2)
    expected = training_step(model, x)
    # The third entry starts the next iteration (as after a forward whose backward was skipped);
    # the backward then finds one entry where the schedule expects two, and counts all three.
    with pytest.warns(OffloadWarning) as caught:
        got = training_step(model, x, ctx, sync)
    messages = [str(w.message) for w in caught]
    assert any("entered 3 times before this backward, but model_layers=2" in m for m in messages), messages
    assert torch.equal(expected, got)


def test_retain_graph_then_second_backward():
    model, x = build_linear_stack(4, 16), data()

    def twice(ctx=None, sync=None):
        h = x
        for layer in model:
            with ctx or torch.enable_grad():
                h = layer(h)
            h = sync(h) if sync else h
        loss = h.square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return grads(model, x)

    expected = twice()
    ctx, sync = offload(3, 4)
    for _ in range(2):  # and the next iteration still works
        assert all(torch.equal(a, b) for a, b in zip(expected, twice(ctx, sync)))


def test_exception_in_a_layer_frees_everything_and_recovers():
    model, x = build_linear_stack(3, 16), data()
    training_step(model, x)
    expected = grads(model, x)
    ctx, sync = offload(2, 3)

    class Boom(Exception):
        pass

    h = x
    with pytest.raises(Boom):
        for i, layer in enumerate(model):
            with ctx:
                h = layer(h)
                if i == 1:
                    raise Boom
            h = sync(h)
    assert all(not rec.host and rec.device is None for rs in ctx._records for rec in rs)  # new iteration
    assert ctx.pool.held_bytes == ctx.pool.free_bytes  # every buffer came back
    with pytest.raises(RuntimeError, match="step that failed or was reset"):
        h.sum().backward()  # the stale graph says why it cannot run
    model.zero_grad(set_to_none=True)
    x.grad = None
    training_step(model, x, ctx, sync)
    assert all(torch.equal(a, b) for a, b in zip(expected, grads(model, x)))


class InPlaceAfterSave(nn.Module):
    def forward(self, x):
        h = x * 2
        y = h.sin()  # saves h
        h.add_(1)  # ... which is then changed
        return y


@pytest.mark.parametrize("k,min_bytes", [(1, 0), (1, 10**6), (0, 0)], ids=["offloaded", "small", "layer-kept"])
def test_in_place_change_of_a_saved_tensor_is_an_error(k, min_bytes):
    """Saved-tensor hooks switch off autograd's own check: the engine must do it, for every tensor."""
    ctx, sync = offload(k, 3, min_offload_bytes=min_bytes)
    h = data()
    with pytest.raises(RuntimeError, match="modified in place"):
        for layer in [InPlaceAfterSave(), nn.Identity(), nn.Identity()]:
            with ctx:
                h = layer(h)
            h = sync(h)
        h.sum().backward()


def test_missing_sync_reloads_on_demand_with_a_warning():
    model, x = build_linear_stack(3, 16), data()
    training_step(model, x)
    expected = grads(model, x)
    ctx, _ = offload(2, 3)
    with pytest.warns(OffloadWarning, match="on demand"):
        training_step(model, x, ctx, sync=None)
    assert all(torch.equal(a, b) for a, b in zip(expected, grads(model, x)))


def test_host_memory_limit_keeps_tensors_on_device():
    model, x = build_linear_stack(3, 16), data()
    training_step(model, x)
    expected = grads(model, x)
    ctx, sync = offload(2, 3, host_memory_limit=2048)
    with pytest.warns(OffloadWarning, match="host memory limit"):
        training_step(model, x, ctx, sync)
    assert ctx.pool.peak_bytes <= 2048
    assert all(torch.equal(a, b) for a, b in zip(expected, grads(model, x)))


def test_a_storage_resized_inside_the_layer_stays_on_the_device():
    """FSDP-style: a saved storage shrunk inside the layer and re-grown and refilled before backward.
    The copy at the layer's end would read past the shrunk allocation (review of the batched copies:
    wrong gradients, or a crash when freed to 0 bytes); it stays where it is, with a warning."""
    torch.manual_seed(0)
    shards = nn.ParameterList(nn.Parameter(torch.randn(16, 64) * 0.05) for _ in range(3))

    def step(ctx=None, sync=None):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        h, gathered = x, []
        for j in range(3):
            with ctx if ctx is not None else torch.enable_grad():
                w = torch.cat([shards[j]] * 4)  # made by autograd, not weight-like: a candidate
                y = h @ w  # saves w
                gathered.append((w, w.detach().clone()))
                w.untyped_storage().resize_(64 if j else 0)  # shrunk (layer 0: freed)
                h = y.tanh()
            h = sync(h) if sync else h
        for w, full in gathered:  # re-gathered before backward
            w.untyped_storage().resize_(full.untyped_storage().nbytes())
            w.untyped_storage().copy_(full.untyped_storage())
        h.sum().backward()
        out = [p.grad.clone() for p in shards] + [x.grad.clone()]
        shards.zero_grad(set_to_none=True)
        return out

    ref = step()
    ctx, sync = offload(2, 3)
    with pytest.warns(OffloadWarning, match="resized"):
        got = step(ctx, sync)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    # w (16 KiB) stayed: layer 0 offloaded its tanh output, layer 1 that and its input
    assert [ctx.stats[j].offloaded_bytes for j in (0, 1)] == [8192, 16384]


def test_a_strided_nested_tensor_stays_on_the_device_with_a_warning():
    """A nested tensor has no sizes: the policy used to read them (autocast's cast test) and raised
    an internal error from inside autograd. It is kept, like a tensor subclass, and said so once."""
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=torch.device("cpu"),
                                        min_offload_bytes=0)
    parts = [torch.randn(3, 4), torch.randn(5, 4)]
    nt = torch.nested.nested_tensor(parts, layout=torch.strided, requires_grad=True)
    with pytest.warns(OffloadWarning, match="a nested tensor is not offloaded"):
        with ctx:
            y = (nt * 2).sin()
    y = sync(y)
    with ctx:
        z = y * 3
    z = sync(z)
    torch.nested.to_padded_tensor(z, 0.0).sum().backward()
    expected = [6 * (2 * p).cos() for p in parts]
    assert all(torch.allclose(g, e) for g, e in zip(nt.grad.unbind(), expected))
    assert ctx.stats[0].offloaded_bytes == 0 and ctx.stats[0].kept_tensors > 0


def test_an_offload_stream_of_another_device_is_refused():
    """Its copies would wait for streams of another device: refused before any stream is made."""
    from offload_examples.core.streams import Streams

    class OtherDeviceStream:  # stands in for torch.cuda.Stream(device=1); no GPU needed to refuse it
        device = torch.device("cuda", 1)

    with pytest.raises(ValueError, match="offload_stream is a stream of cuda:1, but the offload device is cuda:0"):
        Streams(torch.device("cuda", 0), OtherDeviceStream())


def test_views_and_casts_of_nested_tensors_do_not_break_the_policy():
    """The policy read the sizes and storage of a nested base or leaf it reached through a view or a
    grad_fn (a review's reproducers): a padded copy of a nested leaf, a component of a nested activation."""
    from offload_examples.core.policy import keep_reason

    cpu = torch.device("cpu")
    nt = torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(5, 4)], layout=torch.strided,
                                    requires_grad=True)
    padded = torch.nested.to_padded_tensor(nt * 2, 0.0)
    assert keep_reason(padded, cpu, 0) is None  # a plain activation: offloaded
    component = (nt * 2).unbind()[0]
    assert keep_reason(component, cpu, 0) in (None, "a view of a nested tensor or a tensor subclass")
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=cpu, min_offload_bytes=0)
    lin = nn.Linear(4, 4)
    with pytest.warns(OffloadWarning, match="a nested tensor is not offloaded"), ctx:
        h = lin(torch.nested.to_padded_tensor(nt, 0.0))  # to_padded_tensor saves the nested input
    h = sync(h)
    with ctx:
        out = lin(h)
    sync(out).sum().backward()
    assert nt.grad is not None and ctx.live_views == 0


def test_nested_outputs_of_new_lengths_are_counted_again():
    """Counts of layers that are not offloaded carry over while their outputs keep their shapes; a nested
    output of new component lengths is a new shape."""
    from offload_examples.core.readouts import _shape

    a = torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(5, 4)], layout=torch.strided)
    b = torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(9, 4)], layout=torch.strided)
    assert _shape(a) != _shape(b) and _shape(a) == _shape(a.clone())
    ja = torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(5, 4)], layout=torch.jagged)
    jb = torch.nested.nested_tensor([torch.randn(3, 4), torch.randn(9, 4)], layout=torch.jagged)
    assert _shape(ja) != _shape(jb)


def test_an_entry_under_no_grad_never_left_is_forgotten_by_reset():
    ctx, sync = offload(1, 2)
    with torch.no_grad():
        ctx.__enter__()  # a caller's loop broke out without leaving it
    with pytest.raises(RuntimeError, match="entered under no_grad"):
        with ctx:
            pass
    ctx.reset()
    model, x = build_linear_stack(2, 16), data()
    training_step(model, x, ctx, sync)  # works again


def test_threads_share_an_engine_for_no_grad_entries():
    """Inference threads entering one engine under no_grad at the same time: no one's entry is another's."""
    import threading

    ctx, _ = offload(1, 2)
    errors, start = [], threading.Barrier(4)

    def work():
        try:
            start.wait()
            for _ in range(200):
                with torch.no_grad(), ctx:
                    pass
        except Exception as err:  # noqa: BLE001 - collected and asserted below
            errors.append(err)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    model, x = build_linear_stack(2, 16), data()
    training_step(model, x, *offload(1, 2))


def test_sync_after_a_no_grad_entry_hooks_nothing():
    """An eval pass under no_grad whose layers hand back their input (Identity, eval-mode Dropout) and
    whose input requires grad: sync neither fails ("before any layer ran") nor leaves a hook on that
    tensor, pass after pass; training steps around it keep their schedule."""
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device="cpu")
    x = torch.randn(4, 4, requires_grad=True)

    def eval_pass():
        with torch.no_grad():
            h = x
            for layer in (torch.nn.Identity(), torch.nn.Dropout().eval()):
                with ctx:
                    h = layer(h)
                h = sync(h)
        return h

    assert eval_pass() is x  # before any real entry
    lin = torch.nn.Linear(4, 4)
    for _ in range(2):
        h = x
        for _layer in range(2):
            with ctx:
                h = lin(h)
            h = sync(h)
        h.sum().backward()
        eval_pass()
    assert not x._backward_hooks
    assert [e for e in ctx.events if e[0] == "backward"] == [("backward", 1), ("backward", 0)]


def test_a_no_grad_entry_between_a_layer_and_its_sync_keeps_the_layers_hook():
    """A teacher run under no_grad through the same context between a student layer and its sync
    (found by review): the student's output, made with grad enabled, is still marked, so reloads
    start at their backward and a reentrant checkpoint's no_grad forward still fails loudly."""
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device="cpu")
    student, teacher = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    x = torch.randn(4, 4, requires_grad=True)
    h, t = x, x.detach()
    for _ in range(2):
        with ctx:
            h = student(h)
        with torch.no_grad(), ctx:
            t = teacher(t)
        h = sync(h)
    h.sum().backward()
    assert [e for e in ctx.events if e[0] in ("backward", "reload_start")] == [
        ("backward", 1), ("reload_start", 0), ("backward", 0)]
    ctx.reset()
    with pytest.raises(RuntimeError, match="before any layer ran"):
        with torch.no_grad(), ctx:  # what a reentrant checkpoint's forward looks like to the context
            out = student(x)
        sync(out + 0 * x)  # reentrant checkpoint's output: made with grad enabled (it has a grad_fn)


def _layer0_stats(layer0):
    """Run ``layer0`` as the offloaded first of two layers; its stats and gradients against no offloading."""
    torch.manual_seed(0)
    x, w = torch.randn(8, 16, requires_grad=True), nn.Parameter(torch.randn(16, 16))
    ref = layer0(x, w) * 3
    ref.sum().backward()
    ref_grads = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=torch.device("cpu"),
                                        min_offload_bytes=0)
    with ctx:
        h = layer0(x, w)
    h = sync(h)
    with ctx:
        h = h * 3
    sync(h).sum().backward()
    assert torch.equal(x.grad, ref_grads[0]) and torch.equal(w.grad, ref_grads[1])
    return ctx.stats[0]


def test_a_parameter_written_in_place_stays_on_the_device():
    """A frozen Parameter that a module fills from an activation (a cache) gets a grad_fn; the module
    keeps it, so a copy would free nothing (a review of the faster policy found it offloaded)."""
    module = nn.Module()  # holds the cache, as a model would

    def layer0(x, w):
        module.cache = nn.Parameter(torch.zeros(8, 16), requires_grad=False)  # a fresh one each step
        module.cache.copy_(torch.tanh(x @ w))  # the cache now has a grad_fn (CopyBackwards)
        return module.cache * x  # saves the cache
    stats = _layer0_stats(layer0)
    assert stats.held_bytes == 0, "the parameter was offloaded, but the module still holds it"
    assert stats.offloaded_bytes == 8 * 16 * 4  # tanh's output only


def test_a_sparse_activation_is_kept_without_reading_its_storage():
    """A sparse tensor has no storage: the policy keeps it before anything asks for one."""
    stats = _layer0_stats(lambda x, w: torch.sparse.mm(torch.relu(x @ w).to_sparse(), w))
    assert stats.kept_tensors >= 1 and stats.offloaded_bytes > 0
    stats = _layer0_stats(lambda x, w: torch.sparse.mm(x.to_sparse(), w))  # made from a leaf: the weight
    assert stats.offloaded_bytes == 0  # the policy raised here: it read the storage a sparse tensor lacks
