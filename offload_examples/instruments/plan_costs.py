"""What the planner needs, measured on this machine: each layer's costs and the copy link's speed.

:func:`measure_costs` runs training steps through an engine that offloads nothing (a probe: its
hooks count what every layer saves) with timing marks on the compute stream, and returns one
:class:`~offload_examples.features.planner.LayerCost` per layer: forward and backward time (median
over the steps), the bytes its forward keeps for backward (and each storage's, in the order they
are saved: what a byte cap offloads), and the bytes of its input (what recomputation keeps instead).
It then times the layers kept, offloaded and recomputed (a few of each kind) without the probe's
hooks, in more runs that take turns step by step, and the times it returns are theirs: where a step is launch bound (the GPU waits for the host, as on Transformer Engine's layers),
hooks, copies and the checkpoint's host work lengthen it, and only timing them tells by how much; the
probe's hooks on every layer would lengthen every forward, where a plan's engine hooks only the layers
it offloads. Layers of one kind (same class, same parameter and buffer shapes and dtypes, same saved and
input bytes) then share one cost: each time is the median over the kind's layers, since timings of
identical layers differ only by noise, which an exact search would exploit (``pool_kinds=False`` keeps
each layer's own). :func:`measure_link` times pinned copies each way and both at once on a GPU; on a
CPU, where the engine's copies are host-to-host memory copies, it times those.

Typical use::

    costs, base = measure_costs(layers, x)
    chosen = plan(costs, measure_link(), budget_bytes=budget, base_bytes=base)
    ctx, sync, run_layers = apply_plan(chosen, layers)

The measurement never calls a layer itself: a step runs the layers, each inside the engine's context,
and the engine's hooks and marks do the counting and timing. :func:`measure_costs` loops over a list of
layers from one input (``h = layer(h)``); a model that calls its own layers, with masks, position
embeddings and keyword arguments, is measured the same way through its own training step, its layers
wrapped as ``offload_layers`` wraps them
(:func:`~offload_examples.instruments.plan_model.measure_model_costs`). What differs is only how a
step runs (``_LayerLoop`` here, ``_ModelSteps`` there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import statistics
import time
import warnings
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch import nn

from offload_examples.core.api import get_cpu_offload_context
from offload_examples.core.engine import OffloadEngine
from offload_examples.core.errors import OffloadWarning
from offload_examples.core.layer_state import LayerStats
from offload_examples.core.policy import is_weight_like
from offload_examples.features.planner import (TIME_FIELDS, Checkpointed, LayerCost, LinkCost, ModuleCost,
                                                 offload_schedule)
from offload_examples.instruments.measure import balanced_orders, quartiles, training_step
from offload_examples.instruments.timeline import Span, per_layer_ms, record_layer_timeline

__all__ = ["measure_costs", "measure_link", "module_candidates"]


def _zero(layers: Sequence[nn.Module], x: torch.Tensor) -> None:
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    x.grad = None


class _Steps(Protocol):
    """How the measurement runs a training step of the layers it measures, each layer inside a context."""

    device: torch.device

    def zero(self) -> None:
        """Clear the gradients the steps leave."""

    def probing(self, ctx: OffloadEngine, sync: Callable) -> contextlib.AbstractContextManager[Callable[[], Any]]:
        """A block in which the function it gives runs one step, every layer entering the probe ``ctx``."""

    def timed(self, offloaded: Sequence[int], recomputed: dict[int, str | None]
              ) -> tuple[Callable[[], list[Span]], OffloadEngine]:
        """A timed step with the layers ``offloaded`` offloaded and those in ``recomputed`` checkpointed
        (whole: ``None``, or the submodule named), and its engine (give its pool back)."""


class _LayerLoop:
    """:func:`measure_costs`' steps: ``h = layer(h)`` over ``layers`` from ``x`` (``training_step``)."""

    def __init__(self, layers: Sequence[nn.Module], x: torch.Tensor):
        self.layers, self.x, self.device = list(layers), x, x.device

    def zero(self) -> None:
        _zero(self.layers, self.x)

    @contextlib.contextmanager
    def probing(self, ctx: OffloadEngine, sync: Callable) -> Iterator[Callable[[], torch.Tensor]]:
        yield lambda: training_step(self.layers, self.x, ctx, sync)

    def timed(self, offloaded: Sequence[int], recomputed: dict[int, str | None]
              ) -> tuple[Callable[[], list[Span]], OffloadEngine]:
        run_layers = [Checkpointed(layer, recomputed[i]) if i in recomputed else layer
                      for i, layer in enumerate(self.layers)]
        return _hook_free_step(run_layers, self.x, offloaded, self.layers)


def _input_bytes(args: tuple, kwargs: dict) -> int:
    """The bytes of a layer's input the engine offloads when the layer is checkpointed: the storage of its
    first tensor argument, positional or keyword (the hidden state; masks and position embeddings are the
    same tensors for every layer, held anyway), or nothing where the engine keeps that on the device as it
    keeps parameters (a leaf that requires grad, as transformers' checkpointing makes the first layer's input)."""
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return 0 if first is None or is_weight_like(first) else first.untyped_storage().nbytes()


def measure_costs(layers: Sequence[nn.Module], x: torch.Tensor, steps: int = 20,
                  per_choice: bool = True, pool_kinds: bool = True,
                  recompute_modules: Sequence[str] | None = None) -> tuple[list[LayerCost], int]:
    """One :class:`~offload_examples.features.planner.LayerCost` per layer, and the base bytes.

    The base bytes are what is allocated on the device before the step (weights, the input): the
    planner adds them to every predicted peak. The steps clear the ``.grad`` of the layers' parameters
    and of ``x`` (also when one fails): call it before accumulating gradients, not in the middle.
    ``steps`` timed steps follow one warm-up step; each
    layer's times are the median over them, and the per-choice runs take ``steps`` rounds. What a
    choice adds is a difference of two runs' steps, noisier than either: with a few rounds the
    predictions of the same plans move far more from one measurement to the next than the measured
    steps do, hence 20. On a CPU the times are host times
    of a CPU run: right for planning a CPU run, not a prediction for a GPU.

    With ``per_choice`` (the default) more runs, taking turns step by step, time every layer kept
    and, for each kind of layer, a few of its layers offloaded and a few recomputed
    (``OFFLOAD_SAMPLE``, ``RECOMPUTE_SHARE``), with hooks only where a plan's engine has
    them. Then ``forward_ms`` and ``backward_ms`` are the kept run's; ``offloaded_forward_ms`` and
    ``offloaded_backward_ms`` are the kept ones plus what offloading added to the step's forwards and
    backwards per layer offloaded (the waits for copies left out: ``_busy_ms``; the planner's model
    adds its own), and ``recompute_ms`` what recomputing added to the step per layer recomputed:
    each the median over the rounds of the difference within a round, never below 0, the same for
    every layer of the kind (``_per_choice``). ``recompute_ms_quartiles`` (a layer's, and each
    :class:`~offload_examples.features.planner.ModuleCost`'s) are the lower and upper quartiles of
    those differences over the rounds, not clipped at 0: how far the rounds spread around the
    median the planner uses. The offloading runs pin host memory for the layers
    they offload, and give it back when they end.

    ``storage_modules`` (which submodule saved each storage: what a byte cap takes, in names) come
    from one more untimed step with hooks on every submodule, run eagerly where layers are compiled;
    a layer whose timed steps counted other storages than that step gets ``None``.

    ``recompute_modules`` (with ``per_choice``): the submodules, by name inside a layer, that a plan may
    recompute alone (``LayerCost.recompute_modules``). ``None`` chooses them from what the modules save
    (:func:`module_candidates`); ``()`` measures none. Each is timed like a recomputed layer, in one more
    run taking turns with the others, with the module checkpointed in the kind's sampled layers; what
    the layer then holds is counted in that run, and a module whose recomputation frees nothing is
    dropped. A module whose checkpointed step fails is left out with an ``OffloadWarning``.

    With ``pool_kinds`` (the default) layers of one kind share their times (``_pooled_by_kind``):
    each is the median over the kind's layers. The last layer, never timed offloaded, then gets its
    kind's offloaded times too (the planner never offloads it, so nothing reads them); with
    ``pool_kinds=False`` every layer keeps its own times (offloaded: its own kept times plus what
    offloading added to its kind's) and the last one's offloaded times stay ``None``.
    """
    return _measure(layers, _LayerLoop(layers, x), steps, per_choice, pool_kinds, recompute_modules)


def _measure(layers: Sequence[nn.Module], runner: _Steps, steps: int, per_choice: bool, pool_kinds: bool,
             recompute_modules: Sequence[str] | None) -> tuple[list[LayerCost], int]:
    """:func:`measure_costs` for layers that ``runner``'s steps run, ``layers`` in the order they run.

    A forward pre-hook on each layer reads its input (any arguments: ``_input_bytes``); the probe
    engine, which every layer enters, counts what each saves and marks where each phase starts.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n, device = len(layers), runner.device
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=0, model_layers=n, device=device)
    inputs: list[int] = []
    hooks = [layer.register_forward_pre_hook(lambda m, args, kwargs: inputs.append(_input_bytes(args, kwargs)),
                                             with_kwargs=True) for layer in layers]
    try:
        with runner.probing(ctx, sync) as one:
            def step() -> Any:
                runner.zero()
                inputs.clear()
                return one()

            step()  # warm-up: workspaces, caches, the allocator's blocks
            sites = _SavingModules.from_step(layers, ctx, step)  # one more untimed step: which module saved what
            cuda = device.type == "cuda"
            if cuda:
                torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device) if cuda else 0
            runs = [per_layer_ms(record_layer_timeline(step, ctx), n) for _ in range(steps)]
    finally:
        for h in hooks:
            h.remove()
        runner.zero()
    fwd, bwd = _medians(runs, n)
    costs = [LayerCost(f, b, s.candidate_bytes, inp, storage_bytes=tuple(s.candidate_sizes),
                       storage_modules=sites.names(i, ctx.stats) if sites is not None else None)
             for i, (f, b, s, inp) in enumerate(zip(fwd, bwd, ctx.stats, inputs))]
    if per_choice:
        costs = _per_choice(costs, layers, runner, steps, recompute_modules)
    return (_pooled_by_kind(costs, layers) if pool_kinds else costs), base


def _bytes_under(cost: LayerCost) -> dict[str, int]:
    """Bytes each submodule's forward saved, its own submodules' included, from ``storage_modules``."""
    under: dict[str, int] = {}
    for size, name in zip(cost.storage_bytes or (), cost.storage_modules or ()):
        parts = name.split(".") if name else []
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            under[prefix] = under.get(prefix, 0) + size
    return under


#: :func:`module_candidates`' bounds: a module saving less of its layer's bytes frees too little to be
#: worth a run; one saving more is nearly the whole layer (its submodules are looked at instead).
MODULE_SHARE = (0.1, 0.9)
#: At most this many submodules a layer kind are candidates (the largest savers).
MODULE_CANDIDATES = 3


def module_candidates(layer: nn.Module, cost: LayerCost) -> list[str]:
    """The submodules of ``layer`` worth timing recomputed alone, largest saver first.

    Walking down from the layer's children: a module whose forward saved more than
    ``MODULE_SHARE[1]`` of the layer's bytes is almost the layer, so its children are looked at instead;
    one that saved at least ``MODULE_SHARE[0]`` is a candidate. Containers without a forward of their
    own (``ModuleList``) are looked into; scripted modules, whose ``forward`` cannot be wrapped, are not
    candidates. Needs ``cost.storage_modules``; empty without it.
    """
    if cost.storage_modules is None or cost.saved_bytes == 0:
        return []
    under, low, high = _bytes_under(cost), MODULE_SHARE[0] * cost.saved_bytes, MODULE_SHARE[1] * cost.saved_bytes
    found, todo = [], [name for name, _ in layer.named_children()]
    while todo:
        name = todo.pop(0)
        module, saved = layer.get_submodule(name), under.get(name, 0)
        if isinstance(module, torch.jit.ScriptModule) or saved < low:
            continue
        if saved > high or type(module).forward is nn.Module.forward:
            todo[:0] = [f"{name}.{child}" for child, _ in module.named_children()]
        else:
            found.append(name)
    return sorted(found, key=lambda name: -under[name])[:MODULE_CANDIDATES]


class _SavingModules:
    """Which submodule of each layer first saved each storage the probe counts, from one step.

    Hooks around every submodule's forward note how many storages the probe engine had counted for the
    layer when the forward started and when it ended; a storage belongs to the innermost forward that
    was running when it was counted (of the calls that hold it, the one that started last), since the
    probe counts a storage when the forward first saves it. Build it with :meth:`from_step`.
    """

    def __init__(self, layers: Sequence[nn.Module], engine: OffloadEngine):
        self.engine = engine
        self.spans: list[list[tuple[int, int, int, str]]] = [[] for _ in layers]  # (first, end, call, name)
        self.sizes: list[list[int]] | None = None  # every layer's sizes counted in the hooked step
        self._open: list[list[tuple[str, int, int]]] = [[] for _ in layers]
        self._calls = 0
        self._handles = []
        try:
            for i, layer in enumerate(layers):
                for name, module in layer.named_modules():
                    if module is layer or isinstance(module, torch.jit.ScriptModule):  # takes no hooks
                        continue
                    self._handles.append(module.register_forward_pre_hook(functools.partial(self._enter, i, name)))
                    self._handles.append(module.register_forward_hook(functools.partial(self._leave, i, name),
                                                                      always_call=True))
        except BaseException:
            self.remove()
            raise

    @classmethod
    def from_step(cls, layers: Sequence[nn.Module], engine: OffloadEngine,
                  step: Callable[[], torch.Tensor]) -> _SavingModules | None:
        """Run ``step`` once with the hooks on (then off again), or ``None`` where that cannot be done
        without side effects: hooks on a compiled module change what its guards see, and without
        ``torch.compiler.set_stance`` (torch < 2.6) the step would compile the layers again."""
        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is None and any(type(m).__name__ == "OptimizedModule" for layer in layers for m in layer.modules()):
            return None
        sites = cls(layers, engine)
        try:
            # eager for this step: dynamo would guard on the hooks (and their layer index) and compile
            # each layer again, up to its recompile limit, after which it stops compiling them at all
            with set_stance("force_eager") if set_stance is not None else contextlib.nullcontext():
                step()
        finally:
            sites.remove()
        sites.sizes = [list(s.candidate_sizes) for s in engine.stats]
        return sites

    def _counted(self, i: int) -> int:
        return len(self.engine.stats[i].candidate_sizes)

    def _enter(self, i: int, name: str, module: nn.Module, args: object) -> None:
        self._calls += 1
        self._open[i].append((name, self._counted(i), self._calls))

    def _leave(self, i: int, name: str, module: nn.Module, args: object, output: object) -> None:
        if self._open[i] and self._open[i][-1][0] == name:
            _, first, call = self._open[i].pop()
            self.spans[i].append((first, self._counted(i), call, name))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def names(self, i: int, stats: Sequence[LayerStats]) -> tuple[str, ...] | None:
        """Layer ``i``'s module per storage, or ``None`` when the last step counted other storages for
        the layer than the hooked step did (then its names could belong to other storages)."""
        if self.sizes is None or list(stats[i].candidate_sizes) != self.sizes[i]:
            return None
        names = []
        for j in range(len(self.sizes[i])):
            inside = [(call, name) for first, end, call, name in self.spans[i] if first <= j < end]
            names.append(max(inside)[1] if inside else "")
        return tuple(names)


def _kind(layer: nn.Module, cost: LayerCost) -> tuple:
    """What makes two layers the same kind: class, parameters and buffers (name, shape, dtype), bytes."""
    tensors = itertools.chain(layer.named_parameters(), layer.named_buffers())
    return (type(layer), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors),
            cost.saved_bytes, cost.input_bytes)


def _kinds(costs: Sequence[LayerCost], layers: Sequence[nn.Module]) -> list[list[int]]:
    """The layers' indices grouped by kind (``_kind``), each group and the groups in layer order."""
    groups: dict[tuple, list[int]] = {}
    for i, (layer, cost) in enumerate(zip(layers, costs)):
        groups.setdefault(_kind(layer, cost), []).append(i)
    return list(groups.values())


def _pooled_by_kind(costs: Sequence[LayerCost], layers: Sequence[nn.Module]) -> list[LayerCost]:
    """``costs`` with every time replaced by its median over the layers of the same kind.

    Parameters
    ----------
    costs
        One measured cost per layer.
    layers
        The layers, in the same order: their kinds (``_kind``) group the costs.

    Returns
    -------
    list[LayerCost]
        The costs with each time field the median of that field over the layer's kind, ``None``
        values left out (``None`` where all of them are), unless the layer's own forward or backward
        time is further than :data:`POOL_TOLERANCE` from the kind's: layers alike in every parameter
        can still differ in what they compute (a sliding-window attention layer beside global ones),
        and those keep all their own times. The bytes stay each layer's own.

    Notes
    -----
    Identical layers cost the same, but on launch-bound layers (Transformer Engine's on a GPU) each
    one's measured times differ by noise of several percent. The planner's search is exact: given
    per-layer times it recomputes precisely the layers whose recomputation happened to measure low,
    and measured steps then came out 2-17 % above the prediction (12 TE layers, issue #17). One cost per kind
    gives it no noise to exploit.
    """
    pooled = list(costs)
    for members in _kinds(costs, layers):
        medians = {}
        for name in TIME_FIELDS:
            values = [getattr(costs[i], name) for i in members if getattr(costs[i], name) is not None]
            medians[name] = statistics.median(values) if values else None
        for i in members:  # a layer that computes differently keeps every time of its own
            if all(_near(getattr(costs[i], name), medians[name]) for name in ALIKE_FIELDS):
                pooled[i] = dataclasses.replace(costs[i], **medians)
    return pooled


#: How far (relative) a layer's time may be from its kind's median and still be taken as noise.
POOL_TOLERANCE = 0.25
#: The times that tell whether a layer computes what its kind computes: measured directly. The
#: others are differences of two runs (``recompute_ms``), whose relative noise is larger: a layer set
#: apart from its kind by such a difference alone (a recomputation measured a quarter below its kind's)
#: draws the exact search to it, and the plan's steps then miss their prediction.
ALIKE_FIELDS = ("forward_ms", "backward_ms")


def _near(value: float | None, median: float | None) -> bool:
    """Whether ``value`` is missing or within :data:`POOL_TOLERANCE` of ``median``: a layer whose time
    is further off differs in what it computes (sliding-window against global attention, say), which
    alike parameters cannot tell apart, and keeps its own time."""
    if value is None or median is None:
        return True
    return abs(value - median) <= POOL_TOLERANCE * abs(median)


def _medians(runs: list[tuple[list[float], list[float]]], n: int) -> tuple[list[float], list[float]]:
    return ([statistics.median(r[0][i] for r in runs) for i in range(n)],
            [statistics.median(r[1][i] for r in runs) for i in range(n)])


def _hook_free_step(layers: Sequence[nn.Module], x: torch.Tensor, offloaded: Sequence[int],
                    param_layers: Sequence[nn.Module]) -> tuple[Callable[[], list[Span]], OffloadEngine]:
    """A timed training step with the layers ``offloaded`` offloaded, and its engine (give its pool back).

    The engine's first step counts every layer; the later ones hook only the offloaded layers, as a
    plan's engine does, so a kept layer runs without hooks (on a launch-bound layer the probe's hooks
    lengthen each forward by about half again).
    """
    ctx = _hook_free_engine(offloaded, len(layers), x.device)

    def step() -> torch.Tensor:
        _zero(param_layers, x)
        return training_step(layers, x, ctx, ctx.sync)

    return (lambda: record_layer_timeline(step, ctx)), ctx


def _hook_free_engine(offloaded: Sequence[int], n: int, device: torch.device) -> OffloadEngine:
    """The engine of a timed run: offloads ``offloaded`` of ``n`` layers, hooks only those after its first
    step, and keeps its pinned buffers from step to step (the warm-up pins them)."""
    return OffloadEngine(offload_schedule(offloaded, n), device=device, retain_pinned_cpu_buffers=True,
                         count_every_layer=False)


#: At most this many layers of a kind are offloaded in the run that times offloading them: few
#: enough that their copies fit behind the compute, as in the plans that offload at all.
OFFLOAD_SAMPLE = 2
#: One layer in this many of a kind (at least one) is recomputed in the run that times recomputing
#: them. Not all: on Transformer Engine's layers the backward has host time to spare while most
#: layers are kept, and recomputing every layer uses it up, so each recomputed layer then costs more
#: than in a plan that recomputes a few.
RECOMPUTE_SHARE = 4


def _samples(costs: Sequence[LayerCost], layers: Sequence[nn.Module]) -> list[tuple[list[int], list[int], list[int]]]:
    """For each kind (``_kind``): its layers, those timed offloaded and those timed recomputed.

    The first :data:`OFFLOAD_SAMPLE` layers of the kind are offloaded (never the model's last layer),
    the first ``1 / RECOMPUTE_SHARE`` of them (at least one) recomputed.
    """
    n = len(layers)
    return [(members, [i for i in members if i < n - 1][:OFFLOAD_SAMPLE],
             members[:max(1, len(members) // RECOMPUTE_SHARE)]) for members in _kinds(costs, layers)]


def _module_names(costs: Sequence[LayerCost], layers: Sequence[nn.Module], members: Sequence[int],
                  asked: Sequence[str] | None) -> list[str]:
    """The submodules to time recomputed for a kind (its ``members``): ``asked`` where the kind has them."""
    first = members[0]
    if asked is None:
        return module_candidates(layers[first], costs[first])
    names = []
    for name in asked:
        try:
            layers[first].get_submodule(name)
        except AttributeError:
            continue
        names.append(name)
    return names


def _per_choice(costs: list[LayerCost], layers: Sequence[nn.Module], source: torch.Tensor | _Steps, steps: int,
                recompute_modules: Sequence[str] | None = None) -> list[LayerCost]:
    """``costs`` with each layer's times kept, offloaded and recomputed, from runs without the probe's
    hooks that take turns step by step. ``source``: how a step runs (``_Steps``), or the input ``x`` of
    a loop over ``layers``.

    The runs: every layer kept, and for each kind of layer (``_samples``) one run offloading a few of
    its layers and one recomputing a few. What a choice adds to one layer is what the whole step
    (its forwards, its backwards; the waits for copies left out) took more than the kept run's in the
    same round, divided by the layers the run changed: the median over the rounds. Taking turns
    exposes the runs to the same drift of the machine (on launch-bound layers the step time wanders
    by several percent within a minute).

    Why the whole step: on a launch-bound step (Transformer Engine's layers) what offloading costs
    shows up in the layers after the one offloaded, whose host work runs while its copies do, so that
    layer's own forward grows by much less than the step. Why a few layers: with every layer offloaded the copies
    take longer than the forward, the compute stream waits for them and falls behind the host, and
    the host work of the engine hides behind those waits, as it does not in a plan that offloads
    few; recomputing every layer used up host time the backward has to spare (:data:`RECOMPUTE_SHARE`).
    """
    n = len(layers)
    runner = _LayerLoop(layers, source) if isinstance(source, torch.Tensor) else source
    samples = _samples(costs, layers)
    if recompute_modules is not None and not isinstance(recompute_modules, (list, tuple)):
        raise TypeError(f"recompute_modules must be a list or tuple of submodule names, got {recompute_modules!r}")
    # each run: (the layers offloaded, {layer: None (recomputed whole) or the submodule recomputed})
    runs: dict[object, tuple[tuple[int, ...], dict[int, str | None]]] = {"kept": ((), {})}
    for g, (members, offloaded, recomputed) in enumerate(samples):
        if offloaded:
            runs["offloaded", g] = (tuple(offloaded), {})
        runs["recomputed", g] = ((), dict.fromkeys(recomputed))
        for module in _module_names(costs, layers, members, recompute_modules):
            runs["module", g, module] = ((), dict.fromkeys(recomputed, module))
    timed, engines, rounds, kept_bytes = {}, [], [], {}
    try:
        for name, (offloaded, recomputed) in runs.items():
            timed[name], engine = runner.timed(offloaded, recomputed)
            engines.append(engine)
            try:
                timed[name]()  # warm-up: pins the host buffers, which the next steps reuse
            except Exception as err:
                if name[0] == "recomputed":
                    raise RuntimeError(f"a step recomputing the layers {sorted(recomputed)} failed: a layer whose "
                                       "forward changes state (a key-value cache: train with use_cache=False) cannot "
                                       f"be recomputed. The error: {err!r}") from err
                if name[0] != "module":
                    raise
                warnings.warn(f"recomputing the submodule {name[2]!r} alone failed, so plans will not: {err!r}",
                              OffloadWarning)
                runner.zero()
                del timed[name]
                continue
            if name[0] == "module":  # what each sampled layer holds with the module recomputed (this step counted all)
                kept_bytes[name] = max(engine.stats[i].candidate_bytes for i in samples[name[1]][2])
        # Each round runs every step once, in the balanced orders taken in turn: a step can inherit
        # work from the one before it (the host's garbage, the allocator's state after an offloading
        # step), and in a fixed order the same run would always inherit it.
        names, orders = list(timed), balanced_orders(len(timed))
        for r in range(steps):
            order = [names[i] for i in orders[r % len(orders)]]
            rounds.append({name: _busy_ms(timed[name](), n) for name in order})
    finally:
        runner.zero()
        for engine in engines:
            engine.pool.release()
    kept_f, kept_b = _medians([r["kept"] for r in rounds], n)

    def per_round(run: object, phases: tuple[int, ...]) -> list[float]:
        return [sum(sum(r[run][p]) - sum(r["kept"][p]) for p in phases) for r in rounds]

    def added(run: object, phases: tuple[int, ...], layers_changed: int) -> float:
        # Neither choice makes compute faster: a shorter step is noise, which would make the
        # planner offload or recompute for speed, so nothing adds less than 0.
        return max(0.0, statistics.median(per_round(run, phases))) / layers_changed

    def spread(run: object, layers_changed: int) -> tuple[float, float]:
        # how far the rounds spread around ``added``: unclipped, so that noise as large as the
        # cost shows as a lower quartile below 0
        low, high = quartiles(per_round(run, (0, 1)))
        return low / layers_changed, high / layers_changed

    out = list(costs)
    for g, (members, offloaded, recomputed) in enumerate(samples):
        off = (added(("offloaded", g), (0,), len(offloaded)), added(("offloaded", g), (1,), len(offloaded))) \
            if offloaded else None
        rec = added(("recomputed", g), (0, 1), len(recomputed))
        rec_quartiles = spread(("recomputed", g), len(recomputed))
        first = costs[members[0]]
        under = _bytes_under(first)

        def again(module: str) -> int:  # held again during the backward: what the module saves (at most the layer's)
            return under.get(module, 0) if first.storage_modules is not None else first.saved_bytes
        modules = tuple(ModuleCost(run[2], kept_bytes[run], again(run[2]), added(run, (0, 1), len(recomputed)),
                                   spread(run, len(recomputed)))
                        for run in timed if run[0] == "module" and run[1] == g
                        and kept_bytes[run] < first.saved_bytes)  # one that frees nothing: never worth it
        for i in members:
            # the last layer, never offloaded, and a kind found only there, get no offloaded times
            timed_off = off is not None and i < n - 1
            out[i] = dataclasses.replace(
                costs[i], forward_ms=kept_f[i], backward_ms=kept_b[i], recompute_ms=rec, recompute_modules=modules,
                recompute_ms_quartiles=rec_quartiles,
                offloaded_forward_ms=kept_f[i] + off[0] if timed_off else None,
                offloaded_backward_ms=kept_b[i] + off[1] if timed_off else None)
    return out


def _busy_ms(spans: Sequence[Span], n: int) -> tuple[list[float], list[float]]:
    """:func:`per_layer_ms` without the waits for copies, which the planner's model adds itself.

    A release's wait is a span of its own; the wait for a reload is inside the backward that reads
    it, until the layer's last host-to-device copy ends, and is taken out of that backward here.
    The engine reloads what backward reads first ahead of the rest, so that backward may already compute
    during part of that window: then more than the wait comes out, and the caller never lets an
    offloaded backward come out shorter than the kept one.
    """
    fwd, bwd = per_layer_ms(spans, n)
    reloaded: dict[int, float] = {}
    for s in spans:
        if s.lane == "host-to-device" and s.layer is not None:
            reloaded[s.layer] = max(s.end, reloaded.get(s.layer, s.end))
    for s in spans:
        if s.lane == "compute" and s.name[:1] == "B" and s.layer in reloaded:
            bwd[s.layer] -= max(0.0, min(s.end, reloaded[s.layer]) - s.start)
    return fwd, bwd


def measure_link(device: torch.device | str | None = None, nbytes: int = 256 * 2**20) -> LinkCost:
    """The copy link's speed in GB/s: pinned copies on a GPU, host memory copies on a CPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        from offload_examples.instruments.bandwidth import link_bandwidth

        bw = link_bandwidth(nbytes)
        return LinkCost(bw["d2h"], bw["h2d"], bw["both"])
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    gb_per_s = nbytes / min(times) / 1e9
    return LinkCost(gb_per_s, gb_per_s, gb_per_s)
