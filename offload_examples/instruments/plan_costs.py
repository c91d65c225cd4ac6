"""What the planner needs, measured on this machine: each layer's costs and the copy link's speed.

:func:`measure_costs` runs training steps through an engine that offloads nothing (a probe: its
hooks count what every layer saves) with timing marks on the compute stream, and returns one
:class:`~offload_examples.features.planner.LayerCost` per layer: forward and backward time (median
over the steps), the bytes its forward keeps for backward, and the bytes of its input (what
recomputation keeps instead). It then times the layers kept, offloaded (one of each kind) and
recomputed without the probe's hooks, in three more runs that take turns step by step, and the times
it returns are theirs: where a step is launch bound (the GPU waits for the host, as on Transformer Engine's layers), hooks,
copies and the checkpoint's host work lengthen it, and only timing them tells by how much; the probe's
hooks on every layer would lengthen every forward, where a plan's engine hooks only the layers it
offloads. Layers of one kind (same class, same parameter and buffer shapes and dtypes, same saved and
input bytes) then share one cost: each time is the median over the kind's layers, since timings of
identical layers differ only by noise, which an exact search would exploit (``pool_kinds=False`` keeps
each layer's own). :func:`measure_link` times pinned copies each way and both at once
on a GPU; on a CPU, where the engine's copies are host-to-host memory copies, it times those.

Typical use::

    costs, base = measure_costs(layers, x)
    chosen = plan(costs, measure_link(), budget_bytes=budget, base_bytes=base)
    ctx, sync, run_layers = apply_plan(chosen, layers)
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn

from offload_examples.core.api import get_cpu_offload_context
from offload_examples.core.engine import OffloadEngine
from offload_examples.features.planner import TIME_FIELDS, Checkpointed, LayerCost, LinkCost, offload_schedule
from offload_examples.instruments.measure import training_step
from offload_examples.instruments.timeline import Span, per_layer_ms, record_layer_timeline

__all__ = ["measure_costs", "measure_link"]


def _zero(layers: Sequence[nn.Module], x: torch.Tensor) -> None:
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    x.grad = None


def measure_costs(layers: Sequence[nn.Module], x: torch.Tensor, steps: int = 5,
                  per_choice: bool = True, pool_kinds: bool = True) -> tuple[list[LayerCost], int]:
    """One :class:`~offload_examples.features.planner.LayerCost` per layer, and the base bytes.

    The base bytes are what is allocated on the device before the step (weights, the input): the
    planner adds them to every predicted peak. The steps clear the ``.grad`` of the layers' parameters
    and of ``x`` (also when one fails): call it before accumulating gradients, not in the middle.
    ``steps`` timed steps follow one warm-up step; each
    layer's times are the median over them. On a CPU the times are host times of a CPU run: right
    for planning a CPU run, not a prediction for a GPU.

    With ``per_choice`` (the default) three more runs, taking turns step by step, time every layer
    kept, the first layer of each kind offloaded (the last layer never is) and every layer
    recomputed, with hooks only where a plan's engine has them. Then ``forward_ms`` and
    ``backward_ms`` are the kept run's; ``offloaded_forward_ms`` and ``offloaded_backward_ms`` are
    the kept ones plus what offloading added to the forward and to the backward of the layer's kind
    (the waits for copies left out: ``_busy_ms``; the planner's model adds its own), and ``recompute_ms``
    what the recomputed run's forward and backward took more than the kept run's (each the median
    over the rounds of the difference within a round, never below 0). The offloading run pins host
    memory for the layers it offloads, and gives it back when it ends.

    With ``pool_kinds`` (the default) layers of one kind share their times (``_pooled_by_kind``):
    each is the median over the kind's layers. The last layer, never timed offloaded, then gets its
    kind's offloaded times too (the planner never offloads it, so nothing reads them); with
    ``pool_kinds=False`` every layer keeps its own times (offloaded: its own kept times plus what
    offloading added to its kind's) and the last one's offloaded times stay ``None``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n = len(layers)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=0, model_layers=n, device=x.device)
    inputs: list[int] = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: inputs.append(args[0].untyped_storage().nbytes()))
             for layer in layers]

    def step() -> torch.Tensor:
        _zero(layers, x)
        inputs.clear()
        return training_step(layers, x, ctx, sync)

    try:
        step()  # warm-up: workspaces, caches, the allocator's blocks
        cuda = x.is_cuda
        if cuda:
            torch.cuda.synchronize(x.device)
        base = torch.cuda.memory_allocated(x.device) if cuda else 0
        runs = [per_layer_ms(record_layer_timeline(step, ctx), n) for _ in range(steps)]
    finally:
        for h in hooks:
            h.remove()
        _zero(layers, x)
    fwd, bwd = _medians(runs, n)
    costs = [LayerCost(f, b, s.candidate_bytes, inp) for f, b, s, inp in zip(fwd, bwd, ctx.stats, inputs)]
    if per_choice:
        costs = _per_choice(costs, layers, x, steps)
    return (_pooled_by_kind(costs, layers) if pool_kinds else costs), base


def _kind(layer: nn.Module, cost: LayerCost) -> tuple:
    """What makes two layers the same kind: class, parameters and buffers (name, shape, dtype), bytes."""
    tensors = itertools.chain(layer.named_parameters(), layer.named_buffers())
    return (type(layer), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors),
            cost.saved_bytes, cost.input_bytes)


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
    groups: dict[tuple, list[int]] = {}
    for i, (layer, cost) in enumerate(zip(layers, costs)):
        groups.setdefault(_kind(layer, cost), []).append(i)
    pooled = list(costs)
    for members in groups.values():
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
#: others are differences of two runs (``recompute_ms``), whose relative noise is larger: on 12 TE
#: layers one layer's recomputation measured 27 % below its kind's and the search recomputed exactly
#: that layer (bench of session 8, step errors up to +20 %).
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
    plan's engine does, so a kept layer runs without hooks (the probe's hooks on every layer lengthened
    each forward of a launch-bound layer by half again: prof19, session 10).
    """
    ctx = OffloadEngine(offload_schedule(offloaded, len(layers)), device=x.device, retain_pinned_cpu_buffers=True,
                        count_every_layer=False)

    def step() -> torch.Tensor:
        _zero(param_layers, x)
        return training_step(layers, x, ctx, ctx.sync)

    return (lambda: record_layer_timeline(step, ctx)), ctx


def _representatives(costs: Sequence[LayerCost], layers: Sequence[nn.Module]) -> dict[tuple, int]:
    """The first layer of each kind (``_kind``), the last layer left out: the ones timed offloaded."""
    reps: dict[tuple, int] = {}
    for i in range(len(layers) - 1):
        reps.setdefault(_kind(layers[i], costs[i]), i)
    return reps


def _per_choice(costs: list[LayerCost], layers: Sequence[nn.Module], x: torch.Tensor, steps: int) -> list[LayerCost]:
    """``costs`` with each layer's times kept, offloaded and recomputed, from runs without the probe's
    hooks that take turns step by step.

    Taking turns exposes the runs to the same drift of the machine (on launch-bound layers the
    step time wanders by several percent within a minute), and every added cost is the median, over
    the rounds, of a difference taken within one round: recomputation from a run recomputing every
    layer, offloading from a run offloading one layer of each kind (``_representatives``).

    Why one layer of each kind and not every layer but the last: with every layer offloaded the copies
    take longer than the forward, the compute stream waits for them at each release and falls behind
    the host, and the host work of the engine's hooks then hides behind those waits; in a plan that
    offloads a few layers it does not. On Transformer Engine's layers (launch bound) the forward of an
    offloaded layer timed no longer than a kept one in that run, while the host time of its forward
    grew by about 2 ms (diag19, session 10) and plans offloading two layers measured 5 % slower than
    predicted (planner bench, session 10).
    """
    n = len(layers)
    reps = _representatives(costs, layers)
    runs = {"kept": (layers, ()), "recomputed": ([Checkpointed(layer) for layer in layers], ())}
    if reps:
        runs["offloaded"] = (layers, tuple(sorted(reps.values())))
    timed, engines, rounds = {}, [], []
    try:
        for name, (run_layers, offloaded) in runs.items():
            timed[name], engine = _hook_free_step(run_layers, x, offloaded, layers)
            engines.append(engine)
            timed[name]()  # warm-up: pins the host buffers, which the next steps reuse
        for _ in range(steps):
            rounds.append({name: _busy_ms(step(), n) for name, step in timed.items()})
    finally:
        _zero(layers, x)
        for engine in engines:
            engine.pool.release()
    kept_f, kept_b = _medians([r["kept"] for r in rounds], n)

    def added(run: str, i: int, phases: tuple[int, ...]) -> float:
        # Neither choice makes a layer's compute faster: a shorter time is noise, which would make
        # the planner offload or recompute for speed, so nothing adds less than 0.
        return max(0.0, statistics.median(sum(r[run][p][i] - r["kept"][p][i] for p in phases) for r in rounds))

    by_kind = {kind: (added("offloaded", i, (0,)), added("offloaded", i, (1,))) for kind, i in reps.items()}

    def offloaded(i: int, phase: int, kept: list[float]) -> float | None:
        # A layer of a kind timed offloaded gets what offloading added to its kind's forward (or
        # backward); the last layer, never offloaded, and a kind found only there, get None.
        kind = _kind(layers[i], costs[i])
        return kept[i] + by_kind[kind][phase] if i < n - 1 and kind in by_kind else None

    return [dataclasses.replace(
        c, forward_ms=kept_f[i], backward_ms=kept_b[i], offloaded_forward_ms=offloaded(i, 0, kept_f),
        offloaded_backward_ms=offloaded(i, 1, kept_b), recompute_ms=added("recomputed", i, (0, 1)),
    ) for i, c in enumerate(costs)]


def _busy_ms(spans: Sequence[Span], n: int) -> tuple[list[float], list[float]]:
    """:func:`per_layer_ms` without the waits for copies, which the planner's model adds itself.

    A release's wait is a span of its own; the wait for a reload is inside the backward that reads
    it, until the layer's last host-to-device copy ends, and is taken out of that backward here.
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
