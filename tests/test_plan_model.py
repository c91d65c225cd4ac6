"""The planner on models that call their own layers (CPU): measured through the model's own training
step, planned, applied to the model (plan_layers, measure_model_costs, apply_plan_to_model).

Each case compares gradients bit for bit with the model run without a plan, checks from the engine's
counts that each layer does what the plan chose for it, and that ``remove()`` gives the model back.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_examples import offload_layers
from offload_examples.features.apply import find_layers
from offload_examples.features.planner import (KEEP, OFFLOAD, OFFLOADED, RECOMPUTE, LinkCost, Plan,
                                                apply_plan_to_model)
from offload_examples.instruments.models import enable_activation_checkpointing
from offload_examples.instruments.plan_model import measure_model_costs, plan_layers

CPU = torch.device("cpu")
LINK = LinkCost(10.0, 10.0, 10.0)  # a fixed link: the tests check what a plan does, not which plan


def grads(model: nn.Module, step) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # dropout, where a model has it, draws the same masks in every compared step
    step()
    out = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def kept_bytes(model: nn.Module, layers, step) -> list[int]:
    """What each layer saves for its backward, kept: a probe (offload_layers offloading none) counts it."""
    probe = offload_layers(model, layers, num_layers=0, device=CPU)
    grads(model, step)
    out = [s.candidate_bytes for s in probe.ctx.stats]
    probe.remove()
    return out


# ---------------------------------------------------------------------- transformers' Llama
def llama(checkpointing: bool):
    transformers = pytest.importorskip("transformers")  # the hf extra, part of the test extra
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=64, attn_implementation="eager",
                                      use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    if checkpointing:
        enable_activation_checkpointing(model, reentrant=False)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def step():  # the training step, as a loop runs it (no optimizer)
        model(input_ids=ids, labels=ids).loss.backward()

    return model, type(model.model.layers[0]), step


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_a_plan_applied_to_llama_does_what_it_chose_bitwise(checkpointing):
    """One layer offloaded, one recomputed whole, one recomputing its MLP, one kept: the gradients are
    the unplanned model's bit for bit; only the offloaded layer copies out (all it saves); the
    recomputed ones save less than kept (with transformers' checkpointing a layer saves only its
    checkpoint's input already: no more than kept); ``remove()`` gives the model back."""
    model, cls, step = llama(checkpointing)
    expected = grads(model, step)
    kept = kept_bytes(model, cls, step)
    chosen = Plan((OFFLOAD, RECOMPUTE, RECOMPUTE, KEEP), 0, 0.0, modules=(None, None, "mlp", None))
    handle = apply_plan_to_model(chosen, model, cls, count_every_layer=True)  # count kept layers too
    assert handle.plan is chosen and handle.names == [f"model.layers.{i}" for i in range(4)]
    for _ in range(2):
        assert same(expected, grads(model, step))
        stats = handle.ctx.stats
        assert [s.offloaded_bytes for s in stats] == [kept[0], 0, 0, 0]
        assert stats[3].candidate_bytes == kept[3]
        if checkpointing:
            assert stats[1].candidate_bytes <= kept[1] and stats[2].candidate_bytes <= kept[2]
        else:
            assert stats[1].candidate_bytes < kept[1] / 4 and stats[2].candidate_bytes < kept[2]
    handle.remove()
    assert all(type(layer) is cls for layer in model.model.layers)
    assert same(expected, grads(model, step))
    offload_layers(model, cls, num_layers=1, device=CPU).remove()  # the layers are free again


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_plan_layers_measures_plans_and_applies_in_one_call(checkpointing):
    """plan_layers on Llama under half of what its layers save: a feasible plan within the budget, run
    bitwise, each offloaded layer copying out, no other; the measured bytes are what a probe counts."""
    model, cls, step = llama(checkpointing)
    expected = grads(model, step)
    kept = kept_bytes(model, cls, step)
    costs, base, names = measure_model_costs(model, cls, step, steps=1, recompute_modules=())
    assert [c.saved_bytes for c in costs] == kept and base == 0 and names == [f"model.layers.{i}" for i in range(4)]
    assert all(c.input_bytes == 2 * 16 * 64 * 4 and c.forward_ms > 0 and c.backward_ms > 0 for c in costs)
    assert all(p.grad is None for p in model.parameters())  # left as found
    budget = sum(kept) // 2
    handle = plan_layers(model, cls, step, budget, link=LINK, steps=1, recompute_modules=())
    chosen = handle.plan
    assert chosen.feasible and chosen.predicted_peak_bytes <= budget and len(handle.costs) == 4
    assert any(c is not KEEP for c in chosen.choices)
    for _ in range(2):
        assert same(expected, grads(model, step))
        assert [s.offloaded_bytes > 0 for s in handle.ctx.stats] == [c in OFFLOADED for c in chosen.choices]
    handle.remove()
    assert all(type(layer) is cls for layer in model.model.layers)


def test_bart_encoder_and_decoder_layers_are_planned_in_one_call():
    """A tuple of two layer classes (BART's encoder and decoder layers): one plan over both, the
    layers in the order they run, gradients bitwise; a plan that recomputes both kinds runs too
    (the decoder's layers take the encoder's output and masks as arguments)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.bart.modeling_bart import BartDecoderLayer, BartEncoderLayer

    config = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).train()  # dropout on: the same masks recomputed
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    layers = (BartEncoderLayer, BartDecoderLayer)
    expected = grads(model, step)
    kept = kept_bytes(model, layers, step)
    handle = plan_layers(model, layers, step, sum(kept) // 2, link=LINK, steps=1, recompute_modules=())
    assert handle.names == [f"model.encoder.layers.{i}" for i in range(2)] + [f"model.decoder.layers.{i}"
                                                                               for i in range(2)]
    assert handle.plan.feasible and len(handle.plan.choices) == 4
    assert same(expected, grads(model, step))
    handle.remove()
    chosen = Plan((RECOMPUTE, OFFLOAD, RECOMPUTE, KEEP), 0, 0.0)
    handle = apply_plan_to_model(chosen, model, layers)
    assert same(expected, grads(model, step))
    assert [s.offloaded_bytes > 0 for s in handle.ctx.stats] == [False, True, False, False]
    handle.remove()
    assert same(expected, grads(model, step))


# ---------------------------------------------------------------------- a small model of our own
class Block(nn.Module):
    """A layer called with keyword arguments besides its input, as transformers' layers are."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, h: torch.Tensor, *, mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return h + scale * self.mlp(h) * mask


class Backwards(nn.Module):
    """Registers its blocks in one order and calls them in the other."""

    def __init__(self, n: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (torch.arange(x.shape[-1]) % 3 != 0).float()
        for block in reversed(self.blocks):
            x = block(x, mask=mask, scale=0.5)
        return x


X = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))


def test_layers_are_numbered_in_the_order_the_model_calls_them():
    """measure_model_costs gives the layers in call order (not registration order); a plan applied in
    that order runs bitwise; applied in registration order it stops at the first misplaced layer."""
    model = Backwards()

    def step():
        model(X).square().mean().backward()

    expected = grads(model, step)
    costs, _, names = measure_model_costs(model, Block, step, steps=1, per_choice=False)
    assert names == ["blocks.2", "blocks.1", "blocks.0"] and len(costs) == 3
    chosen = Plan((OFFLOAD, RECOMPUTE, KEEP), 0, 0.0)
    handle = apply_plan_to_model(chosen, model, names, count_every_layer=True)
    assert same(expected, grads(model, step))
    assert [s.offloaded_bytes > 0 for s in handle.ctx.stats] == [True, False, False]
    assert handle.ctx.stats[1].candidate_bytes < costs[1].saved_bytes  # its checkpoint keeps less
    handle.remove()
    handle = apply_plan_to_model(chosen, model, Block)  # find_layers: registration order
    misplaced = "layer 'blocks.2' ran as layer 0 of the step, where the plan has 'blocks.0'"
    with pytest.raises(RuntimeError, match=misplaced):
        step()
    handle.remove()
    assert same(expected, grads(model, step))


def test_a_tuple_chooses_layers_of_any_of_its_classes():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Sequential(nn.Linear(2, 2)), nn.ReLU())
    assert [n for n, _ in find_layers(model, (nn.Linear, "ReLU"))] == ["0", "2.0", "3"]
    with pytest.raises(TypeError, match="tuple"):
        find_layers(model, ())
    # an entry that matches nothing is a mistake (a misspelt class name), not a smaller choice
    with pytest.raises(ValueError, match=r"matches \['Relu'\] of layers"):
        offload_layers(model, (nn.Linear, "Relu"), num_layers=1)


def test_bad_input_says_what_is_wrong():
    model = Backwards()

    def step():
        model(X).square().mean().backward()

    with pytest.raises(ValueError, match="no submodule of Backwards matches"):
        plan_layers(model, "LlamaDecoderLayer", step, 2**20, link=LINK)
    with pytest.raises(ValueError, match="ran no backward"):
        measure_model_costs(model, Block, lambda: model(X), steps=1)
    with pytest.raises(ValueError, match="ran none of the 3 chosen layers"):
        measure_model_costs(model, Block, lambda: None, steps=1)
    with pytest.raises(ValueError, match=r"did not run the chosen layers \['blocks.0', 'blocks.1'\]"):
        measure_model_costs(model, Block, lambda: model.blocks[2](X, mask=X).sum().backward(), steps=1)
    with pytest.raises(TypeError, match="step must be a function"):
        measure_model_costs(model, Block, model(X), steps=1)
    with pytest.raises(ValueError, match="budget_bytes must be"):
        plan_layers(model, Block, step, -1, link=LINK)
    assert all(type(b) is Block for b in model.blocks)  # every failure left the model as it was
    with pytest.raises(ValueError, match="the smallest budget that works is") as err:
        plan_layers(model, Block, step, 1, link=LINK, steps=1, per_choice=False)
    assert "\n" not in str(err.value)
    smallest = int(str(err.value).split("works is ")[1].split()[0])
    handle = plan_layers(model, Block, step, smallest, link=LINK, steps=1, per_choice=False)
    assert handle.plan.feasible and handle.plan.predicted_peak_bytes <= smallest
    handle.remove()
    with pytest.raises(ValueError, match="the plan has 2 choices but 3 layers were found"):
        apply_plan_to_model(Plan((OFFLOAD, KEEP), 0, 0.0), model, Block)
    with pytest.raises(ValueError, match="recomputes 'attn' in layer 1 .'blocks.1'., which has no such submodule"):
        apply_plan_to_model(Plan((KEEP, RECOMPUTE, KEEP), 0, 0.0, modules=(None, "attn", None)), model, Block)
    with pytest.raises(ValueError, match="no submodule"):
        apply_plan_to_model(Plan((KEEP, KEEP), 0, 0.0), model, ["blocks.0", "blocks.9"])
    held = offload_layers(model, Block, num_layers=1, device=CPU)
    with pytest.raises(ValueError, match="offloaded by another offload_layers"):
        apply_plan_to_model(Plan((KEEP,) * 3, 0, 0.0), model, Block)
    held.remove()


class Twice(Backwards):
    """Runs its blocks twice in one forward: each call saves its own activations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(super().forward(x))


def test_a_layer_run_twice_in_a_forward_or_on_another_device_is_refused_before_planning():
    model = Twice()
    step = lambda: model(X).square().mean().backward()  # noqa: E731
    with pytest.raises(ValueError, match=r"ran the chosen layers \['blocks.0', 'blocks.1', 'blocks.2'\] more than once"):
        measure_model_costs(model, Block, step, steps=1, per_choice=False)
    # (a checkpoint's recomputation in the backward calls a layer again, and is no second call: the
    # Llama tests with transformers' checkpointing on measure through it)
    model = Backwards()
    # an engine on another device than the model's sees none of its saved tensors: it would plan on nothing
    with pytest.raises(ValueError, match="device=meta but the model's parameters are on cpu"):
        measure_model_costs(model, Block, lambda: model(X).square().mean().backward(), steps=1, device="meta")
    with pytest.raises(ValueError, match="device=meta but the model's parameters are on cpu"):
        apply_plan_to_model(Plan((OFFLOAD, KEEP, KEEP), 0, 0.0), model, Block, device="meta")
    assert all(type(b) is Block for b in model.blocks)


def test_a_compiled_model_runs_a_plan_that_recomputes():
    """Dynamo cannot trace the checkpoint a plan recomputes with (its context keeps the first call's
    path): the recomputed layer runs outside the compiled graph, the rest compiled, the step whole."""
    torch._dynamo.reset()
    model = Backwards()
    compiled = torch.compile(model)
    step = lambda: compiled(X).square().mean().backward()  # noqa: E731
    handle = apply_plan_to_model(Plan((OFFLOAD, RECOMPUTE, RECOMPUTE), 0, 0.0, modules=(None, None, "mlp")),
                                 model, ["blocks.2", "blocks.1", "blocks.0"])
    try:
        eager = grads(model, lambda: model(X).square().mean().backward())
        got = grads(model, step)
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(eager, got))
        assert handle.ctx.stats[0].offloaded_bytes > 0
    finally:
        handle.remove()
        torch._dynamo.reset()
