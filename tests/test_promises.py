"""What the engine promises next to what users combine it with, each promise a few tests (CPU).

- **Checkpointing**: the context around a checkpoint offloads what the checkpoint keeps, and
  ``offload_layers`` composes with checkpointing that wraps a layer's call (transformers'
  ``gradient_checkpointing_enable``), reentrant or not.
- **torch.compile**: a whole compiled model with ``offload_layers`` trains bitwise as compiled without it.
- **Threads**: ``no_grad`` passes may share an engine with a training thread.
- **Exceptions**: after any failure (``KeyboardInterrupt`` included, refused hooks, a failure between
  layers or inside a synchronizer call) the next step is right without ``reset()``, in every mode.
- **No leaks**: ``sync`` leaves no hook behind on a leaf, the host pool keeps nothing for sizes gone.
- **Autograd's checks**: an in-place change is refused exactly where autograd refuses it.
- **What is offloaded**: parameters and their casts stay; other tensors go, a leaf that requires grad
  excepted (its graph holds it); data the caller lets go of after the forward is freed.

The reliability page lists these promises with the tests that hold them.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from offload_examples import OffloadWarning, get_cpu_offload_context, offload_layers
from offload_examples.instruments.models import enable_activation_checkpointing
from test_lifetimes import MODES, N, ORDER, assert_idle, data, forward, make_ctx, make_model, run, same

CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.a, self.b = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class CheckpointedBlock(Block):
    """Like transformers' ``GradientCheckpointingLayer``: the checkpoint wraps the whole call, hooks included."""

    reentrant = False

    def __call__(self, *args, **kwargs):
        if self.training:
            return checkpoint(super().__call__, *args, use_reentrant=self.reentrant, **kwargs)
        return super().__call__(*args, **kwargs)


class Model(nn.Module):
    def __init__(self, block: type = Block, n: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(32, 32)
        self.layers = nn.ModuleList(block() for _ in range(n))

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return h


def train_step(model: nn.Module, x: torch.Tensor, call=None) -> list[torch.Tensor]:
    (model if call is None else call)(x).square().mean().backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


X = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------- checkpointing
@pytest.mark.parametrize("reentrant", [False, True])
def test_offload_layers_offloads_what_a_checkpoint_around_each_layer_keeps(reentrant):
    CheckpointedBlock.reentrant = reentrant
    model = Model(CheckpointedBlock)
    expected = train_step(model, X)
    handle = offload_layers(model, CheckpointedBlock, num_layers=2, device=CPU)
    for call in (None, model.forward, None):  # model.forward() skips the model's own hooks
        assert same(expected, train_step(model, X, call))
        # the checkpoint keeps each layer's input (8 x 32 floats); its internals are recomputed
        assert [s.offloaded_bytes for s in handle.ctx.stats] == [8 * 32 * 4] * 2 + [0, 0]
        assert handle.ctx.live_views == 0
    handle.remove()
    assert type(model.layers[0]) is CheckpointedBlock and same(expected, train_step(model, X))


def test_offload_layers_without_checkpointing_offloads_the_layers_internals():
    model = Model()
    expected = train_step(model, X)
    handle = offload_layers(model, Block, num_layers=2, device=CPU)
    assert same(expected, train_step(model, X))
    assert all(s.offloaded_bytes > 8 * 32 * 4 for s in handle.ctx.stats[:2])
    handle.remove()


# ---------------------------------------------------------------- torch.compile
@pytest.mark.slow
def test_a_compiled_model_with_offload_layers_trains_as_compiled_without_it():
    torch._dynamo.reset()
    model = Model()
    handle = offload_layers(model, Block, num_layers=2, device=CPU)
    compiled = torch.compile(model)
    with_offload = [train_step(model, X, compiled) for _ in range(2)]
    assert handle.ctx.offloaded_bytes > 0 and handle.ctx.live_views == 0
    handle.remove()
    torch._dynamo.reset()
    compiled = torch.compile(model)
    assert all(same(train_step(model, X, compiled), g) for g in with_offload)
    torch._dynamo.reset()


# ---------------------------------------------------------------- threads
def test_a_no_grad_thread_may_enter_while_a_training_thread_is_inside_a_layer():
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=CPU)
    layers = [Block(), Block()]
    inside, done, errors = threading.Event(), threading.Event(), []

    def infer():
        inside.wait()
        try:
            with torch.no_grad():
                with ctx:
                    y = layers[0](X)
                sync(y)
        except BaseException as err:
            errors.append(err)
        done.set()

    thread = threading.Thread(target=infer)
    thread.start()
    h = X.clone().requires_grad_()
    with ctx:
        inside.set()
        done.wait(30)
        h = layers[0](h)
    h = sync(h)
    with ctx:
        h = layers[1](h)
    sync(h).sum().backward()
    thread.join()
    assert not errors, errors
    assert ctx.stats[0].offloaded_bytes > 0


def test_a_second_training_thread_is_refused_with_a_clear_error():
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=CPU)
    inside, done, errors = threading.Event(), threading.Event(), []

    def train():
        inside.wait()
        try:
            with ctx:
                pass
        except RuntimeError as err:
            errors.append(str(err))
        done.set()

    thread = threading.Thread(target=train)
    thread.start()
    with ctx:
        inside.set()
        done.wait(30)
    thread.join()
    assert errors and "another thread is inside a layer" in errors[0]


# ---------------------------------------------------------------- exceptions
class Interrupting(Block):
    armed = False

    def forward(self, x):
        if Interrupting.armed:
            raise KeyboardInterrupt
        return super().forward(x)


def test_keyboard_interrupt_inside_an_offload_layers_layer_leaves_nothing_open():
    model = Model(Interrupting)
    expected = train_step(model, X)
    handle = offload_layers(model, Interrupting, num_layers=2, device=CPU)
    Interrupting.armed = True
    with pytest.raises(KeyboardInterrupt):
        model(X)
    Interrupting.armed = False
    assert handle.ctx.open_entry is None and handle.ctx._inside is None
    # no hook of the engine left for unrelated code in this thread
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    for _ in range(2):
        assert same(expected, train_step(model, X))
    handle.remove()


@pytest.mark.parametrize("mode", MODES)
def test_keyboard_interrupt_between_layers_and_the_next_step_is_right(mode):
    model, x = make_model(), data()
    expected = run(model, x)
    ctx, sync, synchronizer = make_ctx(mode)

    class Stop(KeyboardInterrupt):
        pass

    def interrupted():
        h = x
        for j, layer in enumerate(model):
            with ctx:
                h = layer(h)
            h = sync(h)
            if synchronizer is not None and j < 2:
                synchronizer.start_offload_layer(j)
            if j == 2:
                raise Stop

    with pytest.raises(Stop):
        interrupted()
    for _ in range(2):  # no reset(): the dropped graph told the engine the step was over
        assert same(expected, run(model, x, ctx, sync, synchronizer))
        assert ctx.phase_order() == ORDER
        assert [s.offloaded_bytes > 0 for s in ctx.stats] == [True, True, False, False]
        assert_idle(ctx)


@pytest.mark.parametrize("mode", MODES)
def test_refused_saved_tensor_hooks_give_a_clear_error_and_the_next_step_is_right(mode):
    model, x = make_model(), data()
    expected = run(model, x)
    ctx, sync, synchronizer = make_ctx(mode)
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in here"):
        with pytest.raises(RuntimeError, match="saved-tensor hooks are refused here"):
            forward(model, x, ctx, sync, synchronizer)
    assert ctx.open_entry is None
    for _ in range(2):
        assert same(expected, run(model, x, ctx, sync, synchronizer))
        assert ctx.phase_order() == ORDER


def test_a_failure_inside_a_synchronizer_call_abandons_the_step_and_the_next_is_right():
    model, x = make_model(), data()
    expected = run(model, x)
    ctx, sync, synchronizer = make_ctx("manual")
    h = forward(model, x, ctx, sync, synchronizer)
    with pytest.raises(RuntimeError, match=r"start_offload_layer\(0\)"):
        synchronizer.start_offload_layer(0)  # already started: an illegal move
    with pytest.raises(RuntimeError, match="step that failed or was reset"):
        h.square().mean().backward()
    del h
    model.zero_grad(set_to_none=True)
    x.grad = None
    for _ in range(2):
        assert same(expected, run(model, x, ctx, sync, synchronizer))


@pytest.mark.parametrize("mode", MODES)
def test_a_frozen_pool_meeting_a_new_size_fails_that_step_only(mode):
    model, x = make_model(), data()
    expected = run(model, x)
    ctx, sync, synchronizer = make_ctx(mode, retain_pinned_cpu_buffers=True)
    assert same(expected, run(model, x, ctx, sync, synchronizer))
    ctx.freeze_host_buffers()
    wider = torch.randn(16, 16, generator=torch.Generator().manual_seed(3)).requires_grad_()
    with pytest.raises(RuntimeError, match="frozen"):
        run(model, wider, ctx, sync, synchronizer)
    model.zero_grad(set_to_none=True)
    for _ in range(2):
        assert same(expected, run(model, x, ctx, sync, synchronizer))


@pytest.mark.parametrize("mode", MODES)
def test_a_kept_graph_without_backward_does_not_stop_the_next_step(mode):
    """A forward with grad whose output is kept (an evaluation pass), then training steps."""
    model, x = make_model(), data()
    expected = run(model, x)
    ctx, sync, synchronizer = make_ctx(mode)
    kept = forward(model, x, ctx, sync, synchronizer)
    if synchronizer is not None:
        synchronizer.release_activation_forward_gpu_memory(1)
    for _ in range(2):
        assert same(expected, run(model, x, ctx, sync, synchronizer))
    del kept


@pytest.mark.parametrize("mode", MODES)
def test_a_partial_backward_does_not_stop_the_next_step(mode):
    model, x = make_model(), data()
    expected = run(model, x)
    ctx, sync, synchronizer = make_ctx(mode)
    h = forward(model, x, ctx, sync, synchronizer)
    if synchronizer is not None:
        synchronizer.release_activation_forward_gpu_memory(1)
        synchronizer.start_reload_layer(1)
    torch.autograd.grad(h.square().mean(), list(model[3].parameters()))  # only the last layer's backward
    del h
    for _ in range(2):
        assert same(expected, run(model, x, ctx, sync, synchronizer))


# ---------------------------------------------------------------- no leaks
def test_sync_leaves_no_hook_on_a_leaf_a_layer_hands_back():
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=CPU)
    identity, block = nn.Identity(), Block()
    x = X.clone().requires_grad_()
    for _ in range(50):
        with ctx:
            h = identity(x)
        h = sync(h)
        with ctx:
            h = block(h)
        sync(h).sum().backward()
    assert len(x._backward_hooks or {}) <= 1  # the current step's, taken off when the next begins


def test_the_host_pool_keeps_nothing_for_sizes_that_are_gone():
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=CPU,
                                        retain_pinned_cpu_buffers=True)
    blocks = [Block(), Block()]
    for rows in range(1, 60):
        h = torch.randn(rows, 32, requires_grad=True)
        for block in blocks:
            with ctx:
                h = block(h)
            h = sync(h)
        h.sum().backward()
    assert len(ctx.pool._free) <= 4  # the sizes of the last step, not one list per size ever seen


# ---------------------------------------------------------------- autograd's checks
def _aliased_step(offload: bool, modify: str) -> str:
    """Layer 0 saves ``h`` and ``hd = h.data`` (same memory, separate version counters), in either order."""
    torch.manual_seed(0)
    first, second = nn.Linear(32, 32), nn.Linear(32, 32)
    weight = nn.Parameter(torch.randn(8, 32))
    ctx, sync = (get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=CPU, min_offload_bytes=0)
                 if offload else (torch.enable_grad(), lambda t: t))
    with ctx:
        h = first(X)
        hd = h.data
        out = torch.sin(h) + hd * weight if modify == "alias" else hd * weight + torch.sin(h)
    out = sync(out)
    with ctx:
        out = second(out)
    out = sync(out)
    (hd if modify == "alias" else h.detach()).add_(1)  # each bumps one of the two counters
    try:
        out.sum().backward()
    except RuntimeError as err:
        return "raised" if "modified" in str(err) or "inplace" in str(err) else str(err)
    return "computed"


@pytest.mark.parametrize("modify", ["alias", "original"])
def test_an_in_place_change_is_refused_exactly_where_autograd_refuses_it(modify):
    assert _aliased_step(True, modify) == _aliased_step(False, modify) == "raised"


# ---------------------------------------------------------------- what is offloaded
def test_an_input_the_caller_lets_go_of_is_freed_and_parameters_stay():
    block, tail = Block(), Block()
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=CPU)
    inp = torch.randn(64, 32)  # data: needs no grad
    probe = weakref.ref(inp.untyped_storage())
    with ctx:
        h = block(inp)
    h = sync(h)
    with ctx:
        h = tail(h)  # the release of layer 0
    h = sync(h)
    del inp
    assert probe() is None, "the engine kept the input alive after the caller let go of it"
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    assert not params & {rec.address for rec in ctx._records[0]}, "a parameter was offloaded"
    h.sum().backward()


def test_a_leaf_that_requires_grad_and_its_cast_stay_and_what_is_made_from_them_goes():
    """Its graph holds such a leaf, and autocast's cache holds casts of it: a copy would free nothing."""
    class Cast(nn.Module):
        def forward(self, x):
            return torch.sin(x.double()).float()  # sin saves its input: the cast

    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=CPU)
    x = torch.randn(64, 32, requires_grad=True)
    with ctx:
        h = Cast()(x)
        h = h * x  # saves h (an activation) and x
    h = sync(h)
    with ctx:
        h = Block()(h)
    sync(h).sum().backward()
    assert ctx.stats[0].offloaded_bytes == 64 * 32 * 4 and ctx.stats[0].offloaded_storages == 1  # h alone


# ---------------------------------------------------------------- offload_layers and counts
def test_offload_layers_never_chooses_the_model_itself():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)])
    handle = offload_layers(model, nn.Sequential, num_layers=2, device=CPU)
    assert handle.names == [str(i) for i in range(6)] and handle.ctx.model_layers == 6
    x = X.clone().requires_grad_()
    model(x).sum().backward()
    assert handle.ctx.offloaded_bytes > 0
    handle.remove()


def test_a_hand_looped_module_list_works_across_steps():
    layers = nn.ModuleList(Block() for _ in range(4))
    reference = [p.clone() for p in layers.parameters()]
    handle = offload_layers(layers, Block, num_layers=2, device=CPU)
    for _ in range(3):
        h = X.clone().requires_grad_()
        for layer in layers:
            h = layer(h)
        h.sum().backward()
    assert handle.ctx.stats[0].offloaded_bytes > 0 and all(torch.equal(a, b) for a, b in zip(reference, layers.parameters()))
    handle.remove()


def test_more_entries_than_model_layers_warn_with_the_true_count():
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=6, device=CPU)
    h = X.clone().requires_grad_()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for block in [Block() for _ in range(8)]:
            with ctx:
                h = block(h)
            h = sync(h)
        h.sum().backward()
    messages = [str(w.message) for w in record]
    assert any("entered 8 times before this backward, but model_layers=6" in m for m in messages), messages
    assert not any("sync()" in m for m in messages), "a hint about sync() that does not apply"


def test_a_cuda_device_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="no CUDA"):
        get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device="cuda")


# ---------------------------------------------------------------- found by a review (each failed before its fix)
@pytest.mark.parametrize("mode", MODES)
def test_a_failure_before_the_first_sync_ends_the_step(mode):
    """Nothing synced yet: the offloaded tensors that die unused tell the engine the graph is gone."""
    model, x = make_model(), data()
    expected = run(model, x)
    ctx, sync, synchronizer = make_ctx(mode)
    with pytest.raises(MemoryError):
        with ctx:
            h = model[0](x)
        raise MemoryError("skipped batch")  # a loop that catches it goes on with the next batch
    del h
    for _ in range(2):
        assert same(expected, run(model, x, ctx, sync, synchronizer))
        assert ctx.phase_order() == ORDER


def test_a_kept_exception_does_not_stall_offload_layers():
    """IPython keeps the last exception (and so its frames and tensors): the layer that began the step
    beginning it again tells offload_layers that the last step is over."""
    model = Model(Interrupting)
    expected = train_step(model, X)
    handle = offload_layers(model, Interrupting, num_layers=2, device=CPU)
    kept = []

    def failing(h):
        h = model.embed(h)
        h = model.layers[0](h)
        h = model.layers[1](h)
        raise ValueError("the loss failed")

    try:
        failing(X)
    except ValueError as err:
        kept.append(err)  # holds the frames, the graph, the triggers
    for _ in range(2):
        assert same(expected, train_step(model, X))
        assert handle.ctx.phase_order()[0] == ("forward", 0)
    handle.remove()


def test_a_layer_handing_back_a_kept_leaf_does_not_hide_a_failed_step():
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3, device=CPU)
    identity, blocks = nn.Identity(), [Block(), Block()]
    x = X.clone().requires_grad_()

    def step(fail: bool):
        with ctx:
            h = identity(x)
        h = sync(h)  # a leaf: its hook lives as long as the caller keeps x
        for j, block in enumerate(blocks):
            with ctx:
                h = block(h)
            h = sync(h)
            if fail and j == 0:
                raise ValueError("between layers")
        h.sum().backward()

    with pytest.raises(ValueError):
        step(True)
    for _ in range(2):
        step(False)
        assert ctx.phase_order() == [("forward", j) for j in range(3)] + [("backward", j) for j in (2, 1, 0)]


def test_the_pool_gives_back_from_inside_its_own_lock():
    """The garbage collector may free a graph, and give its buffers back, while acquire() holds the lock."""
    from offload_examples.core.host_pool import HostBufferPool

    pool = HostBufferPool(pin_memory=False)
    buf = pool.acquire(64)
    done = threading.Event()

    def reenter():
        with pool._lock:
            pool.give_back(buf, None)
        done.set()

    thread = threading.Thread(target=reenter, daemon=True)
    thread.start()
    assert done.wait(10), "give_back deadlocked inside the pool's own lock"


def test_a_model_dropped_without_remove_takes_its_layers_and_engine_with_it():
    model = Model()
    handle = offload_layers(model, Block, num_layers=2, device=CPU)
    train_step(model, X)
    layer, engine = weakref.ref(model.layers[0]), weakref.ref(handle.ctx)
    del model, handle
    assert layer() is None and engine() is None


def test_layers_compiled_one_by_one_are_offloaded():
    model = Model()
    expected = train_step(model, X)
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer, backend="eager")
    handle = offload_layers(model, Block, num_layers=2, device=CPU)
    assert same(expected, train_step(model, X))
    assert [s.offloaded_bytes > 0 for s in handle.ctx.stats] == [True, True, False, False]
    handle.remove()
    torch._dynamo.reset()


def test_offload_layers_again_after_another_class_swap_and_remove():
    model = Model()
    expected = train_step(model, X)
    handle = offload_layers(model, Block, num_layers=2, device=CPU)
    for layer in model.layers:  # as FSDP2's fully_shard does: a subclass of the class it finds
        layer.__class__ = type(f"Sharded{type(layer).__name__}", (type(layer),), {})
    assert same(expected, train_step(model, X))
    handle.remove()
    handle = offload_layers(model, Block, num_layers=2, device=CPU)
    assert same(expected, train_step(model, X)) and handle.ctx.offloaded_bytes > 0
    handle.remove()


def test_a_failed_entry_under_warnings_as_errors_leaves_nothing_open():
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=CPU)
    blocks = [Block(), Block()]

    def entered(block):
        def run(h):
            with ctx:
                return block(h)
        return run

    h = X.clone().requires_grad_()
    with pytest.raises(OffloadWarning, match="inside a torch.utils.checkpoint region"):  # an error in the tests
        checkpoint(entered(blocks[0]), h, use_reentrant=False)
    assert ctx.open_entry is None and all(s.value != "is still running its forward" for s in ctx.layer_state)
    for block in blocks:
        with ctx:
            h = block(h)
        h = sync(h)
    h.sum().backward()
    assert ctx.stats[0].offloaded_bytes > 0


def test_an_in_place_change_after_a_save_nobody_backpropagates_through_is_accepted():
    """Autograd refuses an in-place change only where a backward reads the changed tensor."""
    def step(offload: bool):
        torch.manual_seed(0)
        lin, head, lin2, tail = nn.Linear(32, 64), nn.Linear(64, 3), nn.Linear(64, 32), nn.Linear(32, 32)
        ctx, sync = (get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=CPU,
                                             min_offload_bytes=0) if offload else (torch.enable_grad(), lambda t: t))
        with ctx:
            h = lin(X)
            aux = head(h)  # saves h; its output is only logged
            h.relu_()  # relu_ saves its result: h again, one version later
            out = lin2(h)
        out = sync(out)
        with ctx:
            out = tail(out)
        sync(out).square().mean().backward()
        del aux
        return [p.grad.clone() for p in lin.parameters()]

    assert same(step(False), step(True))


def test_a_second_thread_entering_between_the_first_threads_layers_is_refused():
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=CPU)
    blocks, errors = [Block(), Block()], []
    h = X.clone().requires_grad_()
    with ctx:
        h = blocks[0](h)
    h = sync(h)

    def other():
        try:
            with ctx:
                blocks[1](X)
        except RuntimeError as err:
            errors.append(str(err))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(30)
    assert errors and "another thread is in the middle of a step" in errors[0]
    with ctx:
        h = blocks[1](h)
    sync(h).sum().backward()
    assert ctx.phase_order() == [("forward", 0), ("forward", 1), ("backward", 1), ("backward", 0)]


def test_a_model_with_offload_layers_pickles_as_the_plain_model():
    import copy
    import io

    model = Model()
    handle = offload_layers(model, Block, num_layers=2, device=CPU)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.layers[0]) is Block and type(copy.deepcopy(model).layers[0]) is Block
    assert same(train_step(loaded, X), train_step(model, X))
    handle.remove()


def test_offload_layers_rebuilds_a_namedtuple_output():
    import collections

    Out = collections.namedtuple("Out", "hidden extra")

    class TupleBlock(Block):
        def forward(self, x):
            return Out(super().forward(x), 1)

    layers = nn.ModuleList(TupleBlock() for _ in range(3))
    handle = offload_layers(layers, TupleBlock, num_layers=1, device=CPU)
    h = X.clone().requires_grad_()
    for layer in layers:
        out = layer(h)
        assert isinstance(out, Out)
        h = out.hidden
    h.sum().backward()
    handle.remove()


def test_nested_offload_layers_are_refused_when_applied():
    model = Model()
    handle = offload_layers(model, Block, num_layers=2, device=CPU)
    with pytest.raises(ValueError, match="offloaded by another offload_layers"):
        offload_layers(model, nn.Linear, num_layers=2, device=CPU)
    handle.remove()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_transformers_model_with_gradient_checkpointing_offloads_its_checkpoint_inputs(reentrant):
    """An unmodified Llama from transformers, built from its config, with gradient_checkpointing_enable():
    bitwise equal gradients, and what each offloaded layer gives the host is its checkpoint's input."""
    transformers = pytest.importorskip("transformers")  # the hf extra, part of the test extra
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=64, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).train()
    enable_activation_checkpointing(model, reentrant)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def grads():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids).last_hidden_state.float().square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    expected = grads()
    handle = offload_layers(model, type(model.layers[0]), num_layers=2, device=CPU)
    for _ in range(2):
        assert same(expected, grads())
        assert [s.offloaded_bytes for s in handle.ctx.stats] == [2 * 16 * 64 * 4] * 2 + [0, 0]
    handle.remove()
