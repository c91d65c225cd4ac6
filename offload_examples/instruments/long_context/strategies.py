"""The strategies the long-context scenario compares, each applied to the unmodified model.

- ``no offload``: every layer keeps what it saves.
- ``checkpoint``: transformers' activation checkpointing: each layer keeps only its input and runs its
  forward again in the backward.
- ``checkpoint + offload``: the same, with the checkpoints' inputs of all layers but the last in pinned
  host memory: :func:`~offload_examples.features.apply.offload_layers` around layers whose call
  transformers checkpoints offloads exactly what each checkpoint keeps, but the first layer's input,
  which checkpointing makes a leaf that requires grad and the engine keeps, as it keeps parameters.
- ``engine``: the engine's k-of-N offloading of everything the first ``k`` layers save, at the ``k``
  best for each length: the fewest layers whose predicted peak fits the memory limit (fewer copies,
  faster), within the pinned host budget.
- ``planner``: :func:`~offload_examples.features.planner.plan` given the memory limit and the pinned
  host budget chooses keep, offload or recompute for each layer, at each length.

The last two need each layer's costs at every length the search tries (and the search of the third
predicts from them where its inputs fill the host budget). :class:`CostModel` gives them
from one step of the model at one length, through an engine that offloads nothing and counts what each
layer saves, with the step's time split evenly over the layers; bytes and times are scaled in
proportion to the length (memory-efficient attention saves bytes in proportion to it; times grow
faster, which only makes copies easier to hide than predicted). The planner's own
:func:`~offload_examples.instruments.plan_model.measure_model_costs` measures each layer and each
choice far more closely, at one length and many steps' cost.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from offload_examples.core.errors import OffloadWarning
from offload_examples.features.apply import OffloadedLayers, offload_layers
from offload_examples.features.planner import (KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_OFFLOAD, RECOMPUTED, LayerCost,
                                                LinkCost, Plan, plan, plan_host_bytes, simulate_plan)
from offload_examples.instruments.measure import deterministic_kernels, free_memory
from offload_examples.instruments.long_context.memory import OutOfMemoryError, held_bytes, step_memory
from offload_examples.instruments.long_context.model import decoder_layers, lora_step
from offload_examples.instruments.long_context.search import Probe, longest_multiple
from offload_examples.instruments.models import enable_activation_checkpointing

__all__ = ["STRATEGIES", "CostModel", "Setting", "Trainee", "choose", "gradients_at", "least_memory",
           "measure_cost_model", "predicted_longest", "run_at", "strategy_mode"]

#: The strategies, in the order the scenario runs them.
STRATEGIES = ("no offload", "checkpoint", "checkpoint + offload", "engine", "planner")
_CHECKPOINTED = ("checkpoint", "checkpoint + offload", "planner")
_NO_LIMIT = 2**62  # the planner's budget where nothing limits memory


@dataclass
class Trainee:
    """The model being fine-tuned, its optimizer, and how one of its steps is run."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    batch: int
    vocab: int
    loss_chunk: int
    seed: int = 0

    def __post_init__(self) -> None:
        self.layer_cls = type(decoder_layers(self.model)[0])  # before offload_layers swaps any class
        self.layers = len(decoder_layers(self.model))

    def ids(self, seq: int) -> torch.Tensor:
        """``batch`` random sequences of ``seq`` tokens (the same for the same length)."""
        gen = torch.Generator().manual_seed(self.seed + seq)
        return torch.randint(0, self.vocab, (self.batch, seq), generator=gen).to(self.device)

    def step(self, ids: torch.Tensor, optimize: bool = True) -> torch.Tensor:
        """One training step on ``ids`` (:func:`~offload_examples.instruments.long_context.model.lora_step`)."""
        return lora_step(self.model, ids, self.loss_chunk, self.optimizer if optimize else None)


@contextlib.contextmanager
def strategy_mode(trainee: Trainee, strategy: str) -> Iterator[None]:
    """Turn on transformers' activation checkpointing for the strategies that use it, and off afterwards."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from: {', '.join(STRATEGIES)}")
    if strategy not in _CHECKPOINTED:
        yield
        return
    enable_activation_checkpointing(trainee.model)
    try:
        yield
    finally:
        model = trainee.model  # transformers 5 names it activation_checkpointing, older ones gradient_checkpointing
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
        model.disable_input_require_grads()  # the hook that enabling added (the model keeps its own)


@dataclass(frozen=True)
class CostModel:
    """The planner's costs of an unmodified model's layers at any length, from one step measured at ``seq``
    (the adapter; see the module's docstring).

    ``saved_bytes`` and ``input_bytes``: per layer, what its forward saves and what the engine offloads of it
    when checkpointed (its input, unless the engine keeps that on the device); ``layer_ms``: one layer's
    forward time; ``static_bytes``: weights and optimizer state;
    ``other_bytes``: the part of the rest of the step's peak (the backward's temporaries) that grows with
    the length, and ``other_fixed_bytes`` the part that does not (a chunk of the loss's logits);
    ``storage_bytes``: per layer, the bytes of each storage it saves (``None`` where unknown), which the
    planner needs to count pinned host memory, each storage a buffer rounded up to a power of two.
    """

    seq: int
    saved_bytes: tuple[int, ...]
    input_bytes: tuple[int, ...]
    layer_ms: float
    static_bytes: int
    other_bytes: int
    link: LinkCost
    other_fixed_bytes: int = 0
    storage_bytes: tuple[tuple[int, ...] | None, ...] | None = None

    def at(self, seq: int) -> tuple[list[LayerCost], int]:
        """``(one LayerCost per layer, base bytes)`` at ``seq`` tokens, for :func:`plan`: every size scaled
        with the length, as the activations are."""
        f, sizes = seq / self.seq, self.storage_bytes or (None,) * len(self.saved_bytes)
        if len(sizes) != len(self.saved_bytes):
            raise ValueError(f"storage_bytes has {len(sizes)} entries for {len(self.saved_bytes)} layers")
        costs = [LayerCost(self.layer_ms * f, 2 * self.layer_ms * f, round(s * f), round(i * f),
                           storage_bytes=_scaled(each, f, round(s * f)))
                 for s, i, each in zip(self.saved_bytes, self.input_bytes, sizes)]
        return costs, self.static_bytes + self.other_fixed_bytes + round(self.other_bytes * f)


def _scaled(sizes: tuple[int, ...] | None, f: float, total: int) -> tuple[int, ...] | None:
    """Storage sizes scaled by ``f`` that add up to ``total``: each rounded down, then one byte more to those
    rounding cut most, until they add up (none below zero, each within a byte of its share)."""
    if not sizes:
        return None
    exact = [size * f for size in sizes]
    scaled = [math.floor(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: scaled[i] - exact[i])[:max(total - sum(scaled), 0)]:
        scaled[i] += 1
    return tuple(scaled)


def measure_cost_model(trainee: Trainee, seq: int, link: LinkCost, max_seq: int | None = None) -> CostModel:
    """Measure a :class:`CostModel`: each layer's saved bytes and time from a step at ``seq`` tokens with
    nothing checkpointed (the engine's probe counts them), and the rest of the peak from two steps with
    every layer checkpointed, at ``16 seq`` and ``32 seq`` tokens (half ``max_seq`` and ``max_seq`` where
    that is shorter, never below ``seq`` and ``2 seq``; each step after one to warm up; where those run out
    of memory, at half the lengths, while the longer is above ``8 seq``).

    The checkpointed steps are what long sequences run (they fit where keeping everything does not). Their
    lengths must be long enough for the memory that grows with the length to set the peak: at a few times
    ``seq`` the peak is still the loss's chunk of logits and the kernels' workspaces, a line through two
    such peaks grows too slowly, and the lengths the model then predicts run out of memory near the limit
    (on Llama 3 8B's shape, checkpointed peaks at 4,096 and 8,192 tokens grow about three fifths as fast
    as those near 250,000; at 16,384 and 32,768 tokens, as fast). A line through the two gives the part
    that grows and the part that does not.

    Each layer's input is what the engine offloads of it in the first checkpointed step: nothing where the
    engine keeps the input on the device (the first layer's, which transformers' checkpointing makes a
    leaf that requires grad, and which the engine takes for one held elsewhere), so that a plan neither
    counts host memory for it nor expects the device to free it.
    """
    ms, saved, _, static, sizes = _measure_step(trainee, seq)
    top = max(min(32 * seq, max_seq or 32 * seq), 2 * seq)
    while True:
        lengths = (max(top // 2, seq), top)
        try:
            with strategy_mode(trainee, "checkpoint"):
                steps = [_measure_step(trainee, n) for n in lengths]
            break
        except OutOfMemoryError:  # a device too small for those lengths: half of them, while above 8 seq
            free_memory()
            if top <= 8 * seq:
                raise
            top //= 2
    # what a checkpointed step holds beyond the inputs it offloads and one layer's recomputation
    rest = [step[2] - max(saved) * n // seq for step, n in zip(steps, lengths)]
    inputs = tuple(round(s * seq / lengths[0]) for s in steps[0][1])
    per_token = max((rest[1] - rest[0]) / (lengths[1] - lengths[0]), 0.0)
    fixed = max(round(rest[0] - per_token * lengths[0]), 0)
    return CostModel(seq, saved, inputs, ms / 3 / trainee.layers, static, round(per_token * seq), link, fixed, sizes)


def _measure_step(trainee: Trainee, seq: int) -> tuple[float, tuple[int, ...], int, int, tuple]:
    """``(step ms, saved bytes per layer, the rest of the peak, static bytes, each layer's storage sizes)`` of a
    step at ``seq`` tokens (a layer's sizes ``None`` where they do not add up to its saved bytes)."""
    ids = trainee.ids(seq)
    handle = offload_layers(trainee.model, trainee.layer_cls, num_layers=0, device=trainee.device)
    try:
        trainee.step(ids)
        static = held_bytes(trainee.model, trainee.optimizer, ids)
        with step_memory(trainee.device, static) as mem:
            start = time.perf_counter()
            trainee.step(ids)
            if trainee.device.type == "cuda":
                torch.cuda.synchronize(trainee.device)
            ms = (time.perf_counter() - start) * 1e3
        saved = tuple(s.candidate_bytes for s in handle.ctx.stats)
        sizes = tuple(tuple(s.candidate_sizes) if sum(s.candidate_sizes) == s.candidate_bytes else None
                      for s in handle.ctx.stats)
    finally:
        handle.remove()
    if trainee.device.type == "cuda":
        static = torch.cuda.memory_allocated(trainee.device)
    return ms, saved, max(mem["peak_bytes"] - static - sum(saved), 0), static, sizes


@dataclass(frozen=True)
class Setting:
    """What a strategy runs at one length: which layers are checkpointed, how many of the first layers the
    engine offloads (with byte caps, from a plan), and in words."""

    strategy: str
    checkpointed: tuple[bool, ...]
    offloaded: int
    caps: tuple[tuple[int, int], ...] = ()
    note: str = ""
    fits: bool = True  # the cost model predicts it within the limit (engine, planner, checkpoint + offload)
    predicted_peak_bytes: int | None = None  # what the cost model predicts (the same three)


def choose(strategy: str, seq: int, layers: int, costs: CostModel | None, limit_bytes: int | None,
           host_budget_bytes: int, check: bool = False) -> Setting:
    """The :class:`Setting` of ``strategy`` at ``seq`` tokens under the device ``limit_bytes`` (``None``:
    none) and the pinned ``host_budget_bytes``.

    ``check``: the setting for the gradient check, which must exercise what the strategy can do: the
    engine offloads all layers but the last, and the planner gets one layer's worth of host memory and
    a budget halfway between its lowest-peak plan and keeping everything, so that its plan mixes the
    three choices.
    """
    every, none = (True,) * layers, (False,) * layers
    if strategy == "no offload":
        return Setting(strategy, none, 0)
    if strategy == "checkpoint":
        return Setting(strategy, every, 0)
    if strategy == "checkpoint + offload":  # the planner's plan that holds least: inputs to the host while it has room
        peak = least_memory("planner", layers, costs, seq, host_budget_bytes).predicted_peak_bytes if costs else None
        note = "checkpoint inputs offloaded but the last layer's and the first's (a leaf)"
        return Setting(strategy, every, layers - 1, note=note,
                       fits=not peak or limit_bytes is None or peak <= limit_bytes, predicted_peak_bytes=peak)
    if strategy not in ("engine", "planner"):
        raise ValueError(f"unknown strategy {strategy!r}; choose from: {', '.join(STRATEGIES)}")
    if costs is None:
        raise ValueError(f"the {strategy} strategy needs the layers' costs (measure_cost_model)")
    layer_costs, base = costs.at(seq)
    budget = _NO_LIMIT if limit_bytes is None else limit_bytes
    if strategy == "engine":
        k, fits = (layers - 1, True) if check else _best_k(layer_costs, costs.link, base, budget, host_budget_bytes)
        peak = simulate_plan((OFFLOAD,) * k + (KEEP,) * (layers - k), layer_costs, costs.link, base)[0]
        return Setting(strategy, none, k, note=f"k = {k} of {layers}" + ("" if fits else " (predicted over)"),
                       fits=fits, predicted_peak_bytes=peak)
    if check:  # one layer's worth of pinned host memory (as plans count it), and a budget only recomputation meets
        host_budget_bytes = min(host_budget_bytes, plan_host_bytes((OFFLOAD,), layer_costs[:1]))
        keep_peak = simulate_plan((KEEP,) * layers, layer_costs, costs.link, base)[0]
        low = plan(layer_costs, costs.link, 0, base, host_budget_bytes=host_budget_bytes).predicted_peak_bytes
        budget = (keep_peak + low) // 2
    chosen = plan(layer_costs, costs.link, budget, base, host_budget_bytes=host_budget_bytes)
    if chosen.offload_prefix is None:
        raise AssertionError("the planner offloads a prefix of the layers (prefix_only)")
    return Setting(strategy, tuple(c in RECOMPUTED for c in chosen.choices), chosen.offload_prefix,
                   tuple(chosen.capped.items()), chosen.summary() + ("" if chosen.feasible else " (predicted over)"),
                   chosen.feasible, chosen.predicted_peak_bytes)


def least_memory(strategy: str, layers: int, costs: CostModel, seq: int, host_budget_bytes: int) -> Setting:
    """The setting of ``strategy`` that holds least on the device, whatever the cost model predicts.

    For the planner: every layer recomputed, the inputs of all but the last offloaded (RECOMPUTE_OFFLOAD),
    where the host budget holds them. The cost model counts the loss's memory once for the whole step,
    so it sees no difference between keeping the last layer and recomputing it, while on the device a
    kept last layer holds its activations through the loss; this plan is what the planner falls back
    to when the plans of lowest predicted peak do not fit. For the engine: :func:`choose` at no budget.
    """
    if strategy != "planner":
        return choose(strategy, seq, layers, costs, 0, host_budget_bytes)
    layer_costs, base = costs.at(seq)

    def choices_of(k: int) -> tuple:
        return (RECOMPUTE_OFFLOAD,) * k + (RECOMPUTE,) * (layers - k)

    k = layers - 1
    while k and plan_host_bytes(choices_of(k), layer_costs) > host_budget_bytes:
        k -= 1
    if not any(cost.input_bytes for cost in layer_costs[:k]):  # nothing would leave (a first input the engine keeps)
        k = 0
    choices = choices_of(k)
    peak = simulate_plan(choices, layer_costs, costs.link, base)[0]
    summary = Plan(choices, peak, 0.0).summary()
    return Setting(strategy, (True,) * layers, k, note=summary + " (least memory)", fits=False,
                   predicted_peak_bytes=peak)


def _best_k(costs: list[LayerCost], link: LinkCost, base: int, budget: int, host_budget: int) -> tuple[int, bool]:
    """``(k, whether it fits)``: the fewest offloaded first layers whose predicted peak fits ``budget``, within
    the host budget; where none fits, the most the host budget allows (the lowest peak)."""
    n, fits_host = len(costs), 0
    for k in range(n):
        choices = (OFFLOAD,) * k + (KEEP,) * (n - k)
        if plan_host_bytes(choices, costs) > host_budget:
            break
        fits_host = k
        if simulate_plan(choices, costs, link, base)[0] <= budget:
            return k, True
    return fits_host, False


def predicted_longest(strategy: str, costs: CostModel, layers: int, limit_bytes: int | None, host_budget_bytes: int,
                      resolution: int, max_seq: int) -> int:
    """The longest multiple of ``resolution`` (at most ``max_seq``) at which the engine or the planner finds a
    setting that :class:`CostModel` predicts to fit, or checkpointing with offloaded inputs fits: what their
    search tries first."""
    return longest_multiple(lambda seq: choose(strategy, seq, layers, costs, limit_bytes, host_budget_bytes).fits,
                            resolution, max_seq)


@contextlib.contextmanager
def _applied(trainee: Trainee, setting: Setting, host_budget_bytes: int) -> Iterator[OffloadedLayers | None]:
    """The model as ``setting`` runs it (inside :func:`strategy_mode`), and as before afterwards."""
    layers = decoder_layers(trainee.model)
    flags = [layer.gradient_checkpointing for layer in layers]
    for layer, on in zip(layers, setting.checkpointed):
        layer.gradient_checkpointing = on and hasattr(layer, "_gradient_checkpointing_func")
    handle = None
    if setting.offloaded:
        handle = offload_layers(trainee.model, trainee.layer_cls, num_layers=setting.offloaded, device=trainee.device,
                                host_memory_limit=host_budget_bytes,
                                max_offload_bytes_per_layer=dict(setting.caps) or None)
    try:
        yield handle
    finally:
        if handle is not None:
            handle.remove()
        for layer, on in zip(layers, flags):
            layer.gradient_checkpointing = on


def run_at(trainee: Trainee, setting: Setting, seq: int, *, limit_bytes: int | None, host_budget_bytes: int,
           warmup: int = 1, steps: int = 1) -> Probe:
    """``warmup`` then ``steps`` training steps at ``seq`` tokens under ``setting``: the peak device memory of
    them all, the engine's pinned host memory (the most its pool reserved, as the pinned allocator rounds
    it), and tokens per second over the timed steps.

    Raises ``torch.OutOfMemoryError`` where a step does not fit (on a CPU, over ``limit_bytes``).
    """
    ids = trainee.ids(seq)
    cuda = trainee.device.type == "cuda"
    peak, times = 0, []
    trainee.optimizer.zero_grad(set_to_none=True)  # a step that failed may have left some
    with _applied(trainee, setting, host_budget_bytes) as handle, warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", "keeping saved tensors", OffloadWarning)  # over the host budget
        pools = [handle.ctx.pool] if handle is not None else []
        for i in range(warmup + steps):
            # what the step starts with: the CPU's meter counts from it (CUDA's allocator needs nothing)
            base = 0 if cuda else held_bytes(trainee.model, trainee.optimizer, ids)
            with step_memory(trainee.device, base, limit_bytes, pools) as mem:
                start = time.perf_counter()
                trainee.step(ids)
                if cuda:
                    torch.cuda.synchronize(trainee.device)
                elapsed = time.perf_counter() - start
            peak = max(peak, mem["peak_bytes"])
            if i >= warmup:
                times.append(elapsed)
        # pinned as the OS sees it (each buffer rounded up to a power of two): what the host budget limits
        host = handle.ctx.pool.peak_pinned_bytes if handle is not None else 0
    kept = any(issubclass(w.category, OffloadWarning) for w in caught)
    note = setting.note + ("; the host budget kept some tensors on the device" if kept else "")
    times.sort()
    return Probe(seq, True, peak, host, trainee.batch * seq / times[len(times) // 2], note.strip("; "),
                 setting.predicted_peak_bytes)


def gradients_at(trainee: Trainee, setting: Setting, seq: int, host_budget_bytes: int) -> tuple[dict, int]:
    """The adapters' gradients of one step at ``seq`` tokens under ``setting``, with deterministic kernels and
    without the optimizer's step (copied to the host), and the bytes the engine offloaded."""
    ids = trainee.ids(seq)
    trainee.optimizer.zero_grad(set_to_none=True)
    with _applied(trainee, setting, host_budget_bytes) as handle, deterministic_kernels():
        trainee.step(ids, optimize=False)
        offloaded = sum(s.offloaded_bytes for s in handle.ctx.stats) if handle is not None else 0
    grads = {n: p.grad.to("cpu", copy=True) for n, p in trainee.model.named_parameters() if p.grad is not None}
    trainee.optimizer.zero_grad(set_to_none=True)
    return grads, offloaded
