"""Call compatibility with Transformer Engine 2.x's ``get_cpu_offload_context``, on the CPU.

TE's signature is ``(enabled, num_layers, model_layers, offload_activations, offload_weights,
double_buffering, manual_synchronization, retain_pinned_cpu_buffers, offload_stream)`` and
Megatron-LM passes all nine positionally; this package's extras are keyword-only after them.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from torch import nn

from offload_examples import OffloadEngine, get_cpu_offload_context
from offload_examples.instruments.measure import compare_grads, measure_steps

CPU = torch.device("cpu")
TE_PARAMETERS = [
    "enabled", "num_layers", "model_layers", "offload_activations", "offload_weights",
    "double_buffering", "manual_synchronization", "retain_pinned_cpu_buffers", "offload_stream",
]
SYNCHRONIZER_METHODS = ("start_offload_layer", "release_activation_forward_gpu_memory", "start_reload_layer")


def linear_stack(n: int = 4, width: int = 32, device: torch.device = CPU) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Linear(width, width) for _ in range(n)).to(device=device, dtype=torch.float32)


def input_for(width: int = 32, device: torch.device = CPU) -> torch.Tensor:
    x = torch.randn(3, 16, width, generator=torch.Generator().manual_seed(1))
    return x.to(device).requires_grad_()


def assert_trains_like_no_offload(ctx, sync, n: int = 4, device: torch.device = CPU) -> None:
    model, x = linear_stack(n, device=device), input_for(device=device)
    ref = measure_steps(model, x, steps=1, warmup=0)
    got = measure_steps(model, x, ctx, sync, steps=2, warmup=0)
    check = compare_grads(ref, got)
    assert check.equal, check.mismatched
    assert check.compared == len(list(model.parameters())) + 2  # every parameter, the input, the output


def test_signature_matches_transformer_engine():
    params = inspect.signature(get_cpu_offload_context).parameters
    positional = [name for name, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == TE_PARAMETERS
    defaults = [params[name].default for name in TE_PARAMETERS]
    assert defaults == [False, 1, 2 - 1, True, False, False, False, False, None]
    keyword_only = [name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only == ["synchronization_dict", "min_offload_bytes", "host_memory_limit", "device",
                            "max_offload_bytes_per_layer", "early_first_reload"]


def test_megatron_positional_call_returns_a_pair_and_trains_bitwise_equal():
    out = get_cpu_offload_context(True, 2, 4, True, False, False, False, False, None)
    assert len(out) == 2
    ctx, sync = out
    assert isinstance(ctx, OffloadEngine)
    # The default device is CUDA where available; train where the context offloads from.
    assert_trains_like_no_offload(ctx, sync, device=ctx.device)
    assert [s.offloaded_storages > 0 for s in ctx.stats] == [False, True, False, False]  # layer 0's input is a leaf
    assert ctx.offloaded_bytes > 0


def test_transformer_engine_keyword_call():
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=3, model_layers=4, offload_activations=True, offload_weights=False,
        double_buffering=False, manual_synchronization=False, retain_pinned_cpu_buffers=True,
        offload_stream=None, device=CPU,
    )
    assert_trains_like_no_offload(ctx, sync)
    assert [s.offloaded_storages > 0 for s in ctx.stats] == [False, True, True, False]


@pytest.mark.parametrize("positional", [True, False])
def test_double_buffering_does_not_enable_manual_mode(positional):
    if positional:
        out = get_cpu_offload_context(True, 2, 4, True, False, True, device=CPU)
    else:
        out = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4, double_buffering=True, device=CPU)
    assert len(out) == 2
    ctx, sync = out
    assert_trains_like_no_offload(ctx, sync)
    assert ctx.offloaded_bytes > 0


@pytest.mark.parametrize("double_buffering", [False, True])
def test_manual_synchronization_returns_a_synchronizer(double_buffering):
    out = get_cpu_offload_context(True, 1, 4, True, False, double_buffering, True, device=CPU)
    assert len(out) == 3
    ctx, sync, synchronizer = out
    for name in SYNCHRONIZER_METHODS:
        assert callable(getattr(synchronizer, name))

    # Drive it by hand: offload layers 1 and 2 during the forward, reload them before backward.
    model, x = linear_stack(), input_for()
    ref = measure_steps(model, x, steps=1, warmup=0)

    def step() -> torch.Tensor:
        h = x
        for i, layer in enumerate(model):
            with ctx:
                h = layer(h)
            h = sync(h)
            if i in (1, 2):
                synchronizer.start_offload_layer(i)
                synchronizer.release_activation_forward_gpu_memory(i)
        for i in (2, 1):
            synchronizer.start_reload_layer(i)
        h.float().square().mean().backward()
        return h.detach()

    got = measure_steps(model, x, steps=2, warmup=0, step=step)
    assert compare_grads(ref, got).equal
    assert [s.offloaded_storages > 0 for s in ctx.stats] == [False, True, True, False]


def assert_disabled(out: tuple, manual: bool) -> None:
    assert len(out) == (3 if manual else 2)
    assert isinstance(out[0], contextlib.nullcontext)
    t = torch.ones(2)
    assert out[1](t) is t
    if manual:
        assert out[2] is None


@pytest.mark.parametrize("manual", [False, True])
def test_disabled_returns_null_contexts(manual):
    assert_disabled(get_cpu_offload_context(False, 2, 4, True, False, False, manual), manual)


def test_offload_weights_warns_and_still_offloads_activations():
    with pytest.warns(DeprecationWarning, match="offload_weights=True has no effect.*StreamedLayers") as record:
        ctx, sync = get_cpu_offload_context(True, 2, 4, True, True, device=CPU)
    assert record[0].filename == __file__  # stacklevel points at the caller
    assert_trains_like_no_offload(ctx, sync)
    assert [s.offloaded_storages > 0 for s in ctx.stats] == [False, True, False, False]


@pytest.mark.parametrize("manual", [False, True])
def test_offload_weights_only_warns_and_returns_disabled_contexts(manual):
    with pytest.warns(DeprecationWarning, match="offload_weights"):
        out = get_cpu_offload_context(True, 2, 4, False, True, False, manual, device=CPU)
    assert_disabled(out, manual)


def test_nothing_to_offload_is_an_error():
    with pytest.raises(ValueError, match="nothing to offload"):
        get_cpu_offload_context(True, 2, 4, False, False, device=CPU)


def test_synchronization_dict_is_keyword_only():
    with pytest.raises(TypeError, match="positional argument"):
        get_cpu_offload_context(True, 1, 2, True, False, False, False, False, None, {0: (True, 1, False, 1)})
    # by keyword it is accepted
    ctx, sync = get_cpu_offload_context(True, model_layers=2, synchronization_dict={}, device=CPU)
    assert isinstance(ctx, OffloadEngine)
