"""The engine's promises on the GPU: checkpointing on a transformers model, a compiled model, and
Transformer Engine's own memory check (one of two layers offloaded, the input let go of).

The CPU side of each promise is in ``test_promises.py``; here the memory is real: measured peaks
against what the engine says it offloaded.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from offload_examples import get_cpu_offload_context, offload_layers
from offload_examples.instruments.measure import compare_grads, measure_steps, requested_bytes
from offload_examples.instruments.models import enable_activation_checkpointing

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def transformers():
    if importlib.util.find_spec("transformers") is None:
        if os.environ.get("OFFLOAD_EXAMPLES_REQUIRE_GPU") == "1":
            pytest.fail("OFFLOAD_EXAMPLES_REQUIRE_GPU=1 but transformers is not installed")
        pytest.skip("transformers is not installed")
    import transformers

    return transformers


def _llama(transformers, cuda, reentrant: bool | None):
    """A small Llama built from its config (random weights), bf16, eager attention (deterministic)."""
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                                      num_attention_heads=8, num_key_value_heads=8, vocab_size=512,
                                      attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).to(cuda, torch.bfloat16).train()
    if reentrant is not None:
        enable_activation_checkpointing(model, reentrant)
    return model


def _forward_memory_and_grads(model, ids, steps: int = 2):
    """What the forward leaves allocated for the backward (the bytes asked for, above those asked for
    before it: a few MiB of blocks handed out larger than asked would blur a 48 MiB saving), and the
    layers' gradients, of the last of ``steps`` steps."""
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = requested_bytes()
        loss = model(input_ids=ids).last_hidden_state.float().square().mean()
        torch.cuda.synchronize()
        held = requested_bytes() - before
        loss.backward()
        del loss
    # the layers' gradients (the embedding's backward accumulates with atomics: not bitwise even alone)
    return held, [p.grad.clone() for name, p in model.named_parameters() if not name.startswith("embed")]


@pytest.mark.parametrize("reentrant", [False, True])
def test_gpu_offload_layers_frees_what_transformers_checkpointing_keeps(transformers, cuda, reentrant):
    """transformers' activation checkpointing keeps each layer's input for backward; offloading the
    first k layers moves exactly those inputs to the host: what the forward leaves on the GPU falls by
    the bytes the engine offloaded (the theory), and the gradients are the same bits.

    (Where the step's peak is depends on the model: late in the backward the weight gradients have
    grown and the offloaded inputs are back, so the peak falls only where the inputs outweigh them.)"""
    ids = torch.randint(0, 512, (4, 2048), device=cuda, generator=torch.Generator(cuda).manual_seed(1))
    model = _llama(transformers, cuda, reentrant)
    layer_class = type(model.layers[0])
    held_without, expected = _forward_memory_and_grads(model, ids)
    handle = offload_layers(model, layer_class, num_layers=3)
    held_with, got = _forward_memory_and_grads(model, ids)
    offloaded = handle.ctx.offloaded_bytes
    handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(expected, got)), "gradients differ"
    one_input = 4 * 2048 * 1024 * 2  # what the checkpoint keeps per layer: its hidden states, bf16
    assert offloaded == 3 * one_input, [s.offloaded_bytes for s in handle.ctx.stats]
    saving = held_without - held_with
    print(f"reentrant={reentrant}: after the forward {held_without / 2**20:.1f} -> {held_with / 2**20:.1f} MiB, "
          f"saving {saving / 2**20:.1f} MiB of {offloaded / 2**20:.1f} MiB offloaded")
    assert abs(saving - offloaded) <= 0.02 * offloaded


def test_gpu_a_compiled_model_with_offload_layers_keeps_the_bits_and_the_saving(cuda):
    from torch import nn

    from offload_examples.instruments.models import build_linear_stack

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = build_linear_stack(6, 1024, device=cuda, dtype=torch.bfloat16)

        def forward(self, h):
            for layer in self.layers:
                h = layer(h)
            return h

    torch._dynamo.reset()
    model = Stack()
    x = torch.randn(8, 512, 1024, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(model)

    def step():
        out = compiled(x)
        out.float().square().mean().backward()
        return out.detach()

    ref = measure_steps(model.layers, x, steps=2, warmup=1, step=step)
    handle = offload_layers(model, nn.Sequential, num_layers=3)
    got = measure_steps(model.layers, x, steps=2, warmup=1, step=step)
    offloaded = handle.ctx.offloaded_bytes
    handle.remove()
    torch._dynamo.reset()
    check = compare_grads(ref, got)
    assert check.equal, (check.mismatched, check.max_abs_diff)
    print(f"compiled: peak {ref.peak_bytes / 2**20:.1f} -> {got.peak_bytes / 2**20:.1f} MiB, {offloaded / 2**20:.1f} MiB offloaded")
    assert offloaded > 0 and ref.peak_bytes - got.peak_bytes >= 0.5 * offloaded


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "MultiheadAttention",
                                  "TransformerLayer"])
def test_gpu_te_layers_memory_returns_to_its_level_as_with_te_offload(te, cuda, kind):
    """Transformer Engine's own memory check, for this engine and TE's offload side by side: one of two
    layers offloaded, the input let go of after the forward. The engine holds no more than TE's offload."""
    hidden, heads = 256, 4

    def layer():
        cls = getattr(te, kind)
        if kind == "MultiheadAttention":
            return cls(hidden, heads, attention_dropout=0.0, params_dtype=torch.bfloat16)
        if kind == "TransformerLayer":
            return cls(hidden, hidden, heads, attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.bfloat16)
        return cls(hidden, hidden, params_dtype=torch.bfloat16)

    torch.manual_seed(0)
    block = layer().to(cuda)
    held = {}
    _memory_beside_te(te, cuda, block, held)
    print(f"{kind}: held after the forward, engine {held['engine'] / 2**20:.1f} MiB, TE {held['te'] / 2**20:.1f} MiB")
    assert held["engine"] <= held["te"] + 2**20


def _memory_beside_te(te, cuda, block, held: dict) -> None:
    hidden = 256
    for name, make in (("engine", lambda: get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)),
                       ("te", lambda: te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2,
                                                                 offload_activations=True, offload_weights=False))):
        ctx, sync = make()[:2]
        for _ in range(2):  # the second pass is measured (warm caches, pinned buffers)
            torch.cuda.synchronize()
            level = requested_bytes()  # the bytes asked for: a block may be handed out larger
            inp = torch.randn(128, 512, hidden, device=cuda, dtype=torch.bfloat16)
            with ctx:
                out = block(inp)
            out = sync(out)
            with ctx:
                out = out + 1
            out = sync(out)
            del inp
            torch.cuda.synchronize()
            held[name] = requested_bytes() - level
            out.sum().backward()
            del out
