"""Offloading chosen submodules, a byte cap per layer, and unmodified models (offload_layers), on the CPU.

Every case compares output and gradients bit for bit with the same model run without offloading,
and checks what was offloaded against what the chosen modules save, counted independently with a
saved-tensor hook.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_examples import get_cpu_offload_context
from offload_examples.features.apply import find_layers, offload_layers
from offload_examples.instruments.measure import compare_grads, snapshot

CPU = torch.device("cpu")
WIDTH = 32


class Block(nn.Module):
    """A layer with two parts whose saved tensors can be told apart: ``attn`` and ``mlp``."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.attn = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        h = x + self.attn(x)
        return h + self.mlp(h), None  # a tuple, as Hugging Face blocks return


class Model(nn.Module):
    """A model that runs its own layers: there is no loop to put a context into."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h, _ = block(h)
        return self.head(h)


def model_and_input(seed: int = 0) -> tuple[Model, torch.Tensor]:
    torch.manual_seed(seed)
    model = Model()
    x = torch.randn(8, 16, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)
    return model, x


def step(model: Model, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    x.grad = None
    out = model(x)
    out.square().mean().backward()
    return out.detach()


def saved_storages(module: nn.Module, model: Model, x: torch.Tensor) -> list[int]:
    """Sizes of the distinct storages saved while ``module`` runs, in the order they are saved."""
    inside, seen = [0], {}
    pre = module.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, inside[0] + 1))
    post = module.register_forward_hook(lambda m, a, o: inside.__setitem__(0, inside[0] - 1))

    def pack(t: torch.Tensor) -> torch.Tensor:
        weight = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
        if inside[0] and not weight and t.untyped_storage().nbytes() >= 1024:
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    pre.remove(), post.remove()
    return list(seen.values())


def saved_bytes(module: nn.Module, model: Model, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves while ``module`` runs (a plain hook's count)."""
    return sum(saved_storages(module, model, x))


def test_find_layers_by_type_name_and_function():
    model, _ = model_and_input()
    by_type = [name for name, _ in find_layers(model, Block)]
    assert by_type == [f"blocks.{i}" for i in range(4)]
    assert [name for name, _ in find_layers(model, "Block")] == by_type
    assert [name for name, _ in find_layers(model, lambda name, m: name.endswith(("0", "2")) and "." in name
                                            and name.count(".") == 1)] == ["blocks.0", "blocks.2"]
    with pytest.raises(ValueError, match="no submodule"):
        offload_layers(model, "GPT2Block", num_layers=1)


def test_unmodified_model_offloads_its_first_layers_bitwise():
    model, x = model_and_input()
    reference = snapshot(model, x, step(model, x))
    handle = offload_layers(model, Block, num_layers=2, device=CPU)
    for _ in range(2):  # the second step runs the non-offloaded layers without hooks
        got = snapshot(model, x, step(model, x))
        assert compare_grads(reference, got).equal
    stats = handle.ctx.stats
    assert stats[0].offloaded_bytes > 0 and stats[1].offloaded_bytes > 0
    assert stats[2].offloaded_bytes == stats[3].offloaded_bytes == 0
    assert handle.ctx.live_views == 0 and handle.ctx.resident_bytes == 0
    handle.remove()
    assert not any(b._forward_hooks or b._forward_pre_hooks for b in model.blocks)
    assert compare_grads(reference, snapshot(model, x, step(model, x))).equal


@pytest.mark.parametrize("chosen", [["attn"], ["mlp"], ["mlp.0"]])
def test_only_what_the_chosen_submodules_save_is_offloaded(chosen):
    model, x = model_and_input()
    reference = snapshot(model, x, step(model, x))
    expected = sum(saved_bytes(model.blocks[0].get_submodule(c), model, x) for c in chosen)
    handle = offload_layers(model, Block, num_layers=1, modules=chosen, device=CPU)
    got = snapshot(model, x, step(model, x))
    assert compare_grads(reference, got).equal
    assert 0 < handle.ctx.stats[0].offloaded_bytes == expected
    handle.remove()


def test_a_missing_submodule_name_is_a_clear_error():
    model, _ = model_and_input()
    with pytest.raises(ValueError, match="has no submodule 'attention'"):
        offload_layers(model, Block, num_layers=1, modules=["attention"])


@pytest.mark.parametrize("cap", [1, 5000, 20000, 10**9])
def test_the_byte_cap_bounds_each_layer_and_keeps_gradients_exact(cap):
    model, x = model_and_input()
    reference = snapshot(model, x, step(model, x))
    full = offload_layers(model, Block, num_layers=2, device=CPU)
    step(model, x)
    uncapped = [s.offloaded_bytes for s in full.ctx.stats[:2]]
    full.remove()
    expected = []
    for i in range(2):  # first saved, first offloaded: each new storage in save order, while the total fits
        total = 0
        for nbytes in saved_storages(model.blocks[i], model, x):
            total += nbytes if total + nbytes <= cap else 0
        expected.append(total)
    handle = offload_layers(model, Block, num_layers=2, device=CPU, max_offload_bytes_per_layer=cap)
    got = snapshot(model, x, step(model, x))
    assert compare_grads(reference, got).equal
    for i in range(2):
        assert handle.ctx.stats[i].offloaded_bytes == expected[i] <= min(cap, uncapped[i])
    if cap == 1:
        assert handle.ctx.offloaded_bytes == 0
    handle.remove()


def test_a_layer_that_raises_leaves_the_context_and_the_next_step_works():
    model, x = model_and_input()
    reference = snapshot(model, x, step(model, x))
    handle = offload_layers(model, Block, num_layers=2, device=CPU)
    boom = model.blocks[1].mlp.register_forward_hook(lambda m, a, o: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        step(model, x)
    boom.remove()
    handle.ctx.reset()
    got = snapshot(model, x, step(model, x))
    assert compare_grads(reference, got).equal
    assert handle.ctx.live_views == 0
    handle.remove()


def test_offload_modules_on_a_hand_written_loop():
    """The same selection through the engine's own method, with the usual with-block loop."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(3))
    x = torch.randn(4, 8, WIDTH, requires_grad=True)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3, device=CPU)
    ctx.offload_modules([blocks[0].attn])
    h = x
    for b in blocks:
        with ctx:
            h, _ = b(h)
        h = sync(h)
    h.sum().backward()
    attn_out = 4 * 8 * WIDTH * 4  # tanh saves its output: the only storage attn saves that is not a weight or x
    assert ctx.stats[0].offloaded_bytes == attn_out
    ctx.offload_all_modules()
    assert not blocks[0].attn._forward_hooks


def test_a_hook_that_raises_before_the_selection_does_not_stop_offloading():
    """A user's pre-hook on a chosen submodule raises before the selection counts the entry; torch
    still runs the selection's always-call hook, which must not count a leave it never entered."""
    model, x = model_and_input()
    handle = offload_layers(model, Block, num_layers=2, modules=["attn"], device=CPU)
    step(model, x)
    offloaded = handle.ctx.stats[0].offloaded_bytes
    assert offloaded > 0
    handle.remove()
    bad = model.blocks[0].attn.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(ValueError("bad input")))
    handle = offload_layers(model, Block, num_layers=2, modules=["attn"], device=CPU)
    with pytest.raises(ValueError, match="bad input"):
        step(model, x)
    bad.remove()
    handle.ctx.reset()
    step(model, x)
    assert handle.ctx.stats[0].offloaded_bytes == offloaded and handle.ctx.selection.depth == 0
    handle.remove()


def test_a_layer_called_twice_in_one_forward_is_a_clear_error():
    model, x = model_and_input()
    original = Model.forward

    def twice(self, h):
        h = self.embed(h)
        for block in [*self.blocks, self.blocks[1]]:
            h, _ = block(h)
        return self.head(h)

    handle = offload_layers(model, Block, num_layers=2, device=CPU)
    Model.forward = twice
    try:
        with pytest.raises(RuntimeError, match="'blocks.1' ran twice in one forward"):
            step(model, x)
    finally:
        Model.forward = original
    handle.ctx.reset()
    reference_model, _ = model_and_input()
    assert compare_grads(snapshot(reference_model, x, step(reference_model, x)), snapshot(model, x, step(model, x))).equal
    handle.remove()


def test_an_output_offload_layers_cannot_sync_abandons_the_step_cleanly():
    class DictBlock(Block):
        def forward(self, x):
            return {"hidden": super().forward(x)[0]}

    torch.manual_seed(0)
    layers = nn.ModuleList(DictBlock() for _ in range(3))
    handle = offload_layers(layers, DictBlock, num_layers=1, device=CPU)
    with pytest.raises(TypeError, match="returned dict"):
        layers[0](torch.randn(2, 4, WIDTH, requires_grad=True))
    assert handle.ctx.live_views == 0 and handle.ctx.resident_bytes == 0 and handle.ctx.events == []
    handle.remove()
