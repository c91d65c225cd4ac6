"""Transformer Engine's "offload enabled" switch (``core/te_path.py``), on the CPU with a stand-in module.

TE's layers ask ``transformer_engine.pytorch.cpu_offload.is_cpu_offload_enabled()``, which in TE 2.x
is ``OFFLOAD_SYNCHRONIZER is not None``. A fake module with that attribute stands in for TE here; the
GPU tests run the real one (gradients bitwise equal on either path).
"""

import sys
import types

import pytest
import torch

from offload_examples import get_cpu_offload_context
from offload_examples.core import te_path
from offload_examples.features.planner import Checkpointed


@pytest.fixture
def fake_te(monkeypatch):
    module = types.ModuleType(te_path._MODULE)
    module.OFFLOAD_SYNCHRONIZER = None
    monkeypatch.setitem(sys.modules, te_path._MODULE, module)
    return module


class Spy(torch.nn.Module):
    """Records, at each forward, whether TE's layers would take their offload path."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.seen = []

    def forward(self, x):
        self.seen.append(te_path.path_is_on())
        return torch.relu(self.lin(x))


def test_the_engine_turns_tes_offload_path_on_inside_each_entry_only(fake_te):
    spy = Spy()
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device="cpu")
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(2):
        with ctx:
            assert fake_te.OFFLOAD_SYNCHRONIZER is te_path.ENGINE_ACTIVE
            h = spy(x)
        assert fake_te.OFFLOAD_SYNCHRONIZER is None
        h = sync(h)
    h.sum().backward()
    assert spy.seen == [True, True]
    with pytest.raises(AttributeError, match="only tells TE's layers that an offload is active"):
        te_path.ENGINE_ACTIVE.start_offload_layer  # noqa: B018  (a later TE asking for a synchronizer)


def test_a_failed_layer_and_tes_own_context_keep_the_switch_right(fake_te):
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device="cpu")
    with pytest.raises(ValueError):
        with ctx:
            raise ValueError("the layer failed")
    assert fake_te.OFFLOAD_SYNCHRONIZER is None
    ctx.reset()
    theirs = object()  # TE's own context is open: the engine leaves its synchronizer in place
    fake_te.OFFLOAD_SYNCHRONIZER = theirs
    with ctx:
        assert fake_te.OFFLOAD_SYNCHRONIZER is theirs
    assert fake_te.OFFLOAD_SYNCHRONIZER is theirs


def test_entries_under_no_grad_take_tes_offload_path_and_a_missing_te_changes_nothing(fake_te, monkeypatch):
    """As under TE's own context, whatever the grad mode: a reentrant checkpoint runs its forward under
    no_grad and its recomputation with grad, and both must take the same path."""
    ctx, _ = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device="cpu")
    with torch.no_grad(), ctx:
        assert fake_te.OFFLOAD_SYNCHRONIZER is te_path.ENGINE_ACTIVE
    assert fake_te.OFFLOAD_SYNCHRONIZER is None
    with torch.no_grad():
        ctx.__enter__()  # never left ...
    ctx.reset()  # ... and forgotten: the switch goes off with it
    assert fake_te.OFFLOAD_SYNCHRONIZER is None
    monkeypatch.delitem(sys.modules, te_path._MODULE)
    with ctx:
        assert not te_path.path_is_on()
    with te_path.offload_path():
        assert not te_path.path_is_on()


def test_offload_path_forces_either_path_and_restores(fake_te):
    with te_path.offload_path():
        assert te_path.path_is_on()
        with te_path.offload_path(False):
            assert not te_path.path_is_on()
        assert fake_te.OFFLOAD_SYNCHRONIZER is te_path.ENGINE_ACTIVE
    assert fake_te.OFFLOAD_SYNCHRONIZER is None


def test_recomputation_runs_on_the_path_of_its_first_forward(fake_te):
    """Inside the engine's context a checkpointed layer's forward takes TE's offload path; its
    recomputation, in backward and outside the context, must take the same one (TE's layers save
    different tensors on each, which non-reentrant checkpointing would refuse)."""
    spy = Spy()
    layer = Checkpointed(spy)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=0, model_layers=1, device="cpu")
    x = torch.randn(4, 8, requires_grad=True)
    with ctx:
        h = layer(x)
    sync(h).sum().backward()
    assert spy.seen == [True, True]
    spy.seen.clear()
    layer(x).sum().backward()  # outside: the default path both times
    assert spy.seen == [False, False]


def test_a_graph_walked_twice_recomputes_twice(fake_te):
    """``retain_graph=True``: torch recomputes the checkpointed layer once per backward, and the
    recomputation's context is entered each time."""
    spy = Spy()
    layer = Checkpointed(spy)
    x = torch.randn(4, 8, requires_grad=True)
    with te_path.offload_path():
        out = layer(x).sum()
    out.backward(retain_graph=True)
    out.backward()
    assert spy.seen == [True, True, True]
    assert fake_te.OFFLOAD_SYNCHRONIZER is None


def test_entries_closing_out_of_order_in_two_threads_leave_the_switch_right(fake_te):
    """Engine A (thread 1) closes while engine B (thread 2) is still open: B's layers stay on the
    offload path, and once both closed the switch is off."""
    import threading

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def run(name, first, then, wait_for):
        ctx, _ = get_cpu_offload_context(enabled=True, num_layers=0, model_layers=1, device="cpu")
        x = torch.randn(2, 2, requires_grad=True)
        with ctx:
            x * 2
            first.set()
            wait_for.wait(5)
            seen[name] = te_path.path_is_on()
        then.set()

    t1 = threading.Thread(target=run, args=("A", a_in, a_out, b_in))
    t2 = threading.Thread(target=run, args=("B", b_in, threading.Event(), a_out))
    t1.start(); t2.start(); t1.join(10); t2.join(10)
    assert seen == {"A": True, "B": True}  # B looked after A had left
    assert fake_te.OFFLOAD_SYNCHRONIZER is None


def test_a_stray_second_exit_leaves_tes_own_context_alone(fake_te):
    ctx, _ = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device="cpu")
    x = torch.randn(4, 8, requires_grad=True)
    with ctx:
        x * 2
    theirs = object()
    fake_te.OFFLOAD_SYNCHRONIZER = theirs
    with pytest.raises(RuntimeError):
        ctx.__exit__(None, None, None)
    assert fake_te.OFFLOAD_SYNCHRONIZER is theirs
