"""What the FSDP scenario measures on each rank: the planner's costs, the two models it trains (without and
with offloading) checked bit for bit and timed taking turns step by step, and the two compared."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from offload_examples import OffloadEngine
from offload_examples.features.planner import KEEP, OFFLOAD, RECOMPUTE, Plan, plan, simulate_plan
from offload_examples.instruments.fsdp.config import FsdpConfig
from offload_examples.instruments.fsdp.trace import _profile, paired_prefetch, stream_activity, timeline_figure
from offload_examples.instruments.measure import (Measurement, balanced_orders, balanced_rounds, compare_tensors,
                                                  deterministic_kernels, free_memory, host_copy, local_part,
                                                  measure_round_robin, overhead_spread, resident_vs_theory)
from offload_examples.instruments.models import build_basic_model
from offload_examples.instruments.plan_costs import measure_costs, measure_link
from offload_examples.instruments.timeline import StreamLane, stream_spans_from_trace

__all__ = ["CHECK_STEPS", "PROFILED_ROUNDS", "Case", "build_layers", "check_steps", "compare_runs", "make_plan",
           "measure_cases", "profile_in_turns", "time_in_turns"]

#: Steps each run takes under deterministic kernels before it is timed: the gradients of the last
#: one and the parameters after its optimizer step are compared (the second step uses AdamW's state).
CHECK_STEPS = 2

#: Rounds of profiled steps on CUDA, one step of each run a round, in the orders of
#: :func:`~offload_examples.instruments.measure.balanced_orders` (without, with, with, without).
PROFILED_ROUNDS = 2


def build_layers(config: FsdpConfig, device: torch.device) -> nn.ModuleList:
    """The scenario's layers on ``device``, with weights drawn from ``config.seed``."""
    return build_basic_model(config.layers, config.hidden, config.heads, config.ffn, device=device,
                             dtype=getattr(torch, config.dtype), kind="torch", seed=config.seed)


def make_plan(config: FsdpConfig, device: torch.device, x: torch.Tensor) -> tuple[Plan, int]:
    """The planner's choice for ``config.plan``, the same on every rank, and the predicted peak of
    keeping every layer (the budget is ``config.plan`` times it).

    Rank 0 measures the layers before sharding (each rank holds whole layers and its own batch of
    the same size, so one rank's costs stand for all; FSDP's collectives are not in them) and
    plans; the plan is broadcast, because every rank must wrap the same layers for recomputation.
    """
    if isinstance(config.plan, str):  # given: nothing to measure, nothing predicted
        letters = {"K": KEEP, "O": OFFLOAD, "R": RECOMPUTE}
        return Plan(tuple(letters[c] for c in config.plan), 0, 0.0, why="given"), 0
    box: list[tuple[Plan, int] | None] = [None]
    if dist.get_rank() == 0:
        layers = build_layers(config, device)
        costs, _ = measure_costs(layers, x.detach().requires_grad_())
        link = measure_link(device)
        keep_all, _ = simulate_plan([KEEP] * len(costs), costs, link)
        box[0] = plan(costs, link, budget_bytes=int(config.plan * keep_all)), keep_all
        del layers
        free_memory()
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class Case:
    """One of the models a rank trains: ``model`` is what is called (``DistributedDataParallel`` may wrap
    ``stack``, which holds the parameters), ``engine`` its offload context (``None`` without
    offloading), ``optimizer`` its AdamW; ``label`` names it in progress lines and results."""

    label: str
    model: nn.Module
    stack: nn.Module
    engine: OffloadEngine | None
    optimizer: torch.optim.Optimizer

    def forward_backward(self, x: torch.Tensor) -> torch.Tensor:
        """The forward and the backward of one step on ``x``; the output, detached."""
        out = self.model(x)
        out.float().square().mean().backward()
        return out.detach()

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """A training step whose gradients were cleared before: forward, backward, AdamW's step."""
        out = self.forward_backward(x)
        self.optimizer.step()
        return out


def check_steps(case: Case, x: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """:data:`CHECK_STEPS` steps of ``case`` under deterministic kernels.

    Returns
    -------
    dict
        ``grads``: the last step's gradients, ``params``: the parameters after its optimizer step
        (this rank's parts, on the host, named as in the plain stack).
    """
    with deterministic_kernels():  # bit-reproducible kernels for the comparison; the timed steps use the fast ones
        for _ in range(CHECK_STEPS):
            case.optimizer.zero_grad(set_to_none=True)
            case.forward_backward(x)
            grads = {_plain(n): host_copy(p.grad) for n, p in case.stack.named_parameters() if p.grad is not None}
            case.optimizer.step()
    return {"grads": grads, "params": {_plain(n): host_copy(p) for n, p in case.stack.named_parameters()}}


def time_in_turns(cases: Sequence[Case], x: torch.Tensor, config: FsdpConfig,
                  say: Callable[[str], None]) -> dict[str, Measurement]:
    """Time the cases' training steps taking turns step by step
    (:func:`~offload_examples.instruments.measure.measure_round_robin`): ``config.warmup`` rounds, then
    ``config.steps`` rounds, rounded up to a multiple of the orders' cycle so that each case goes first
    equally often. Each case's memory is what one of its steps added to what was allocated before it."""
    rounds = balanced_rounds(len(cases), config.steps)
    runs = {case.label: (case.stack, x, partial(case.step, x)) for case in cases}
    measured = measure_round_robin(runs, steps=rounds, warmup=config.warmup)
    for label, m in measured.items():
        say(f"[{label}] {rounds} steps taking turns, median {m.median_ms:.1f} ms "
            f"({min(m.step_ms):.1f} to {max(m.step_ms):.1f})")
    return measured


def profile_in_turns(cases: Sequence[Case], x: torch.Tensor, trace_files: Mapping[str, Path | None],
                     rounds: int = PROFILED_ROUNDS) -> dict[str, list[dict]]:
    """On CUDA, ``rounds`` rounds of one profiled step of each case, in balanced orders; each case's Chrome
    traces, the first of them also written to ``trace_files[label]`` where given."""
    orders, traces = balanced_orders(len(cases)), {case.label: [] for case in cases}
    for r in range(rounds):
        for case in (cases[i] for i in orders[r % len(orders)]):
            case.stack.zero_grad(set_to_none=True)
            path = None if traces[case.label] else trace_files.get(case.label)
            traces[case.label].append(_profile(partial(case.step, x), path))
    return traces


def _engine_readings(engine: OffloadEngine, layers: int) -> dict[str, Any]:
    """What the engine did in its last step (read before anything else runs through it). ``host_pinned_bytes``:
    the most pinned memory its pool reserved, each buffer rounded up as PyTorch's pinned allocator does."""
    return dict(stats=list(engine.stats), theory=engine.theoretical(), resident=resident_vs_theory(engine),
                host_pinned_bytes=engine.pool.peak_pinned_bytes, iterations=engine.iteration + 1,
                offloaded=[engine.schedule.is_offloaded(j) for j in range(layers)])


def measure_cases(cases: Sequence[Case], x: torch.Tensor, config: FsdpConfig, device: torch.device,
                  say: Callable[[str], None], trace_files: Mapping[str, Path | None]) -> dict[str, dict[str, Any]]:
    """Check each case bit for bit (:func:`check_steps`), time them taking turns (:func:`time_in_turns`)
    and, on CUDA, profile them taking turns (:func:`profile_in_turns`); what each showed, by label.

    Each result holds ``grads`` and ``params`` (of the checked steps), ``step_ms`` (the median of its
    timed steps) and ``step_ms_rounds`` (each round's), ``activation_peak_bytes`` (``None`` off CUDA);
    with an engine, what it did in its last timed step; on CUDA ``lanes`` (each profiled step's
    streams) and, with an engine, ``streams`` and ``copy_overlap_ms`` of its first profiled step;
    with ``cpu_params``, ``host_param_bytes`` (FSDP's pinned shards and their gradients).
    """
    out = {case.label: check_steps(case, x) for case in cases}
    for label, m in time_in_turns(cases, x, config, say).items():
        out[label].update(step_ms=m.median_ms, step_ms_rounds=m.step_ms, activation_peak_bytes=m.activation_peak_bytes)
    for case in cases:
        if case.engine is not None:
            out[case.label].update(_engine_readings(case.engine, config.layers))
    if device.type == "cuda":  # the prefetch comparison needs both runs' streams
        for label, traces in profile_in_turns(cases, x, trace_files).items():
            out[label]["lanes"] = [stream_spans_from_trace(t, fsdp=config.wrap == "fsdp") for t in traces]
            if next(c for c in cases if c.label == label).engine is not None:
                out[label]["streams"], out[label]["copy_overlap_ms"] = stream_activity(traces[0])
    if config.cpu_params:  # what FSDP keeps in (pinned) host memory: this rank's shards and their gradients
        for case in cases:
            out[case.label]["host_param_bytes"] = sum(local_part(t).nbytes for p in case.stack.parameters()
                                                      for t in (p, p.grad) if t is not None)
    return out


def _plain(name: str) -> str:
    """A parameter's name as in the plain stack (a plan wraps some layers in ``Checkpointed``)."""
    return name.replace(".layer.", ".", 1) if name.startswith("layers.") else name


def compare_runs(rank: int, config: FsdpConfig, base: dict[str, Any], off: dict[str, Any], chosen: Plan | None,
                 keep_all: int, trace_dir: str | None) -> dict[str, Any]:
    """One rank's result: the runs without (``base``) and with offloading (``off``) of
    :func:`measure_cases` side by side, their steps compared round by round,
    and the plan ``chosen`` (``keep_all``: the predicted peak of keeping every layer) with its
    predictions against the measurement."""
    grads, params = compare_tensors(base["grads"], off["grads"]), compare_tensors(base["params"], off["params"])
    stats, theory = off["stats"], off["theory"]
    out: dict[str, Any] = {
        "rank": rank,
        "peak_without_bytes": base["activation_peak_bytes"],
        "peak_with_bytes": off["activation_peak_bytes"],
        "saving_bytes": None,
        "theoretical_saving_bytes": theory.saving,
        "saving_ratio": None,
        "offloaded_bytes": sum(s.offloaded_bytes for s in stats),
        # offloaded bytes something else still held at their release (the rank's input batch): no saving
        "held_bytes": sum(s.held_bytes for s in stats),
        # what the schedule offloads: every candidate storage of the offloaded layers
        "expected_offloaded_bytes": sum(s.candidate_bytes for j, s in enumerate(stats) if off["offloaded"][j]),
        "offloaded_bytes_per_layer": [s.offloaded_bytes for s in stats],
        "saved_bytes_per_layer": [s.candidate_bytes for s in stats],
        "resident_matches_theory": all(got == want for _, _, got, want in off["resident"]),
        "iterations": off["iterations"],
        "host_pinned_bytes": off["host_pinned_bytes"],
        "host_param_bytes": off.get("host_param_bytes"),
        **_timing_results(base, off),
        "grads_equal": grads.equal,
        "params_equal": params.equal,
        "grads_compared": len(base["grads"]),
        "params_compared": len(base["params"]),
        "max_abs_diff": max(grads.max_abs_diff, params.max_abs_diff),
    }
    # recomputed layers free bytes too, which the engine's theory (its offloads) does not count
    out["recomputes"] = bool(config.checkpoint) or (chosen is not None and bool(chosen.recomputed))
    if base["activation_peak_bytes"] is not None:
        saving = base["activation_peak_bytes"] - off["activation_peak_bytes"]
        ratio = saving / theory.saving if theory.saving and not out["recomputes"] else None
        out.update(saving_bytes=saving, saving_ratio=ratio)
    if chosen is not None:
        out["plan"] = _plan_results(chosen, keep_all, base, off, out["overhead"])
    if "streams" in off:
        out.update(streams=off["streams"], copy_overlap_ms=off["copy_overlap_ms"],
                   stream_roles={str(lane.stream): lane.role for lane in off["lanes"][0]})
    out.update(_timeline_results(config, base.get("lanes"), off.get("lanes"), trace_dir, rank))
    return out


def _timing_results(base: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """The two runs' steps, taken in turns: each one's median and fastest and slowest step, and the step
    with offloading over the step without in the same round, less one (``overhead``, the median over
    the rounds, with its quartiles and extremes: :func:`~offload_examples.instruments.measure.overhead_spread`)."""
    a, b = base["step_ms_rounds"], off["step_ms_rounds"]
    return {"step_ms_without": base["step_ms"], "step_ms_with": off["step_ms"],
            "step_ms_without_range": [min(a), max(a)], "step_ms_with_range": [min(b), max(b)],
            "rounds": len(b), **overhead_spread(b, a)}


def _plan_results(chosen: Plan, keep_all: int, base: dict[str, Any], off: dict[str, Any],
                  overhead: float) -> dict[str, Any]:
    """The plan, and its predicted saving and step-time ratio next to the measured ones (the ratio:
    one plus the paired ``overhead``)."""
    measured = None if base["activation_peak_bytes"] is None else base["activation_peak_bytes"] - off["activation_peak_bytes"]
    predicted = keep_all - chosen.predicted_peak_bytes if keep_all else None  # None: a given plan
    return {**chosen.to_dict(), "predicted_saving_bytes": predicted,
            "measured_saving_bytes": measured, "measured_step_ratio": 1 + overhead}


def _timeline_results(config: FsdpConfig, without: list[list[StreamLane]] | None,
                      with_: list[list[StreamLane]] | None, trace_dir: str | None, rank: int) -> dict[str, Any]:
    """The prefetch comparison over the profiled pairs (:func:`paired_prefetch`) and the picture of the
    first pair, or ``None`` for each with the reason."""
    out: dict[str, Any] = {"prefetch": None, "prefetch_note": None, "timeline_png": None, "timeline_note": None}
    if without is None or with_ is None:
        out["prefetch_note"] = out["timeline_note"] = "no CUDA profiler trace (CPU ranks, gloo)"
        return out
    if config.wrap == "fsdp":
        out["prefetch"] = paired_prefetch(list(zip(without, with_)))
    else:
        out["prefetch_note"] = "DDP gathers no parameters: no prefetch to measure"
    if trace_dir is None:
        out["timeline_note"] = "no trace_dir given: no picture written"
        return out
    try:
        fig = timeline_figure({"without offloading": without[0], "with offloading": with_[0]},
                              title=f"rank {rank}: one profiled step, per CUDA stream")
    except ImportError:
        out["timeline_note"] = "matplotlib is not installed (the plots extra): no picture"
        return out
    path = Path(trace_dir, f"fsdp_timeline_rank{rank}.png")
    fig.savefig(path, dpi=120)
    out["timeline_png"] = str(path)
    return out
