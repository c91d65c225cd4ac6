"""What the FSDP scenario measures on each rank: the planner's costs, a training run's checked and timed
steps, and the runs without and with offloading compared."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from offload_examples import OffloadEngine
from offload_examples.features.planner import KEEP, OFFLOAD, RECOMPUTE, Plan, plan, simulate_plan
from offload_examples.instruments.fsdp.config import FsdpConfig
from offload_examples.instruments.fsdp.trace import _profile, prefetch_comparison, stream_activity, timeline_figure
from offload_examples.instruments.measure import deterministic_kernels, free_memory, resident_vs_theory
from offload_examples.instruments.models import build_basic_model
from offload_examples.instruments.plan_costs import measure_costs, measure_link
from offload_examples.instruments.timeline import StreamLane, stream_spans_from_trace

__all__ = ["CHECK_STEPS", "build_layers", "compare_runs", "make_plan", "measure_training"]

#: Steps each run takes under deterministic kernels before it is timed: the gradients of the last
#: one and the parameters after its optimizer step are compared (the second step uses AdamW's state).
CHECK_STEPS = 2


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


def measure_training(model: nn.Module, stack: nn.Module, engine: OffloadEngine | None, optimizer: torch.optim.Optimizer,
                     x: torch.Tensor, config: FsdpConfig, device: torch.device, label: str,
                     say: Callable[[str], None], trace_path: Path | None) -> dict[str, Any]:
    """Train ``model`` on ``x``: :data:`CHECK_STEPS` checked steps, then warm-up and measured steps; what each showed.

    ``stack`` holds the parameters (``model`` may wrap it), ``engine`` is the offload context (``None``
    without offloading); ``label`` names the run in ``say``'s line. On CUDA one more step runs under the
    profiler, its Chrome trace written to ``trace_path`` when given.
    """
    cuda = device.type == "cuda"

    def forward_backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()

    with deterministic_kernels():  # bit-reproducible kernels for the comparison; the timed steps use the fast ones
        for _ in range(CHECK_STEPS):
            forward_backward()
            grads = {_plain(n): _local(p.grad) for n, p in stack.named_parameters() if p.grad is not None}
            optimizer.step()
    params = {_plain(n): _local(p) for n, p in stack.named_parameters()}

    times, baseline = [], 0
    for i in range(config.warmup + config.steps):
        optimizer.zero_grad(set_to_none=True)
        if cuda and i == config.warmup:
            torch.cuda.synchronize(device)
            baseline = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        forward_backward()
        optimizer.step()
        if cuda:
            end.record()
            end.synchronize()
            ms = begin.elapsed_time(end)
        else:
            ms = (time.perf_counter() - start) * 1e3
        if i >= config.warmup:
            times.append(ms)
    say(f"[{label}] {len(times)} steps, median {statistics.median(times):.1f} ms")
    out: dict[str, Any] = {
        "grads": grads, "params": params, "step_ms": statistics.median(times),
        "activation_peak_bytes": torch.cuda.max_memory_allocated(device) - baseline if cuda else None,
    }
    if engine is not None:  # the last measured step, before anything else runs through the engine
        stats = list(engine.stats)
        out.update(
            stats=stats, theory=engine.theoretical(), resident=resident_vs_theory(engine),
            host_pinned_bytes=engine.pool.peak_bytes, iterations=engine.iteration + 1,
            offloaded=[engine.schedule.is_offloaded(j) for j in range(config.layers)],
        )
    if cuda:  # one more step under the profiler, in both runs: the prefetch comparison needs the two
        optimizer.zero_grad(set_to_none=True)
        trace = _profile(lambda: (forward_backward(), optimizer.step()), trace_path)
        out["lanes"] = stream_spans_from_trace(trace, fsdp=config.wrap == "fsdp")
        if engine is not None:
            out["streams"], out["copy_overlap_ms"] = stream_activity(trace)
    if config.cpu_params:  # what FSDP keeps in (pinned) host memory: this rank's shards and their gradients
        out["host_param_bytes"] = sum(_local(t).nbytes for p in stack.parameters() for t in (p, p.grad) if t is not None)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (FSDP's parameters and gradients are sharded DTensors), on the host."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach().to("cpu", copy=True)


def _plain(name: str) -> str:
    """A parameter's name as in the plain stack (a plan wraps some layers in ``Checkpointed``)."""
    return name.replace(".layer.", ".", 1) if name.startswith("layers.") else name


def _compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[bool, float]:
    """Bitwise equality of two dicts of tensors, and the largest absolute difference."""
    if a.keys() != b.keys():
        return False, float("inf")
    worst = max(((x.float() - y.float()).abs().max().item() for x, y in zip(a.values(), b.values()) if x.numel()),
                default=0.0)
    return all(torch.equal(a[k], b[k]) for k in a), worst


def compare_runs(rank: int, config: FsdpConfig, base: dict[str, Any], off: dict[str, Any], chosen: Plan | None,
                 keep_all: int, trace_dir: str | None) -> dict[str, Any]:
    """One rank's result: the runs without (``base``) and with offloading (``off``) of
    :func:`measure_training` side by side, and the plan ``chosen`` (``keep_all``: the predicted peak of
    keeping every layer) with its predictions against the measurement."""
    grads_equal, grad_diff = _compare(base["grads"], off["grads"])
    params_equal, param_diff = _compare(base["params"], off["params"])
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
        "step_ms_without": base["step_ms"],
        "step_ms_with": off["step_ms"],
        "overhead": off["step_ms"] / base["step_ms"] - 1,
        "grads_equal": grads_equal,
        "params_equal": params_equal,
        "grads_compared": len(base["grads"]),
        "params_compared": len(base["params"]),
        "max_abs_diff": max(grad_diff, param_diff),
    }
    # recomputed layers free bytes too, which the engine's theory (its offloads) does not count
    out["recomputes"] = bool(config.checkpoint) or (chosen is not None and bool(chosen.recomputed))
    if base["activation_peak_bytes"] is not None:
        saving = base["activation_peak_bytes"] - off["activation_peak_bytes"]
        ratio = saving / theory.saving if theory.saving and not out["recomputes"] else None
        out.update(saving_bytes=saving, saving_ratio=ratio)
    if chosen is not None:
        out["plan"] = _plan_results(chosen, keep_all, base, off)
    if "streams" in off:
        out.update(streams=off["streams"], copy_overlap_ms=off["copy_overlap_ms"],
                   stream_roles={str(lane.stream): lane.role for lane in off["lanes"]})
    out.update(_timeline_results(config, base.get("lanes"), off.get("lanes"), trace_dir, rank))
    return out


def _plan_results(chosen: Plan, keep_all: int, base: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """The plan, and its predicted saving and step-time ratio next to the measured ones."""
    measured = None if base["activation_peak_bytes"] is None else base["activation_peak_bytes"] - off["activation_peak_bytes"]
    predicted = keep_all - chosen.predicted_peak_bytes if keep_all else None  # None: a given plan
    return {**chosen.to_dict(), "predicted_saving_bytes": predicted,
            "measured_saving_bytes": measured, "measured_step_ratio": off["step_ms"] / base["step_ms"]}


def _timeline_results(config: FsdpConfig, without: list[StreamLane] | None, with_: list[StreamLane] | None,
                      trace_dir: str | None, rank: int) -> dict[str, Any]:
    """The prefetch comparison and the picture, or ``None`` for each with the reason."""
    out: dict[str, Any] = {"prefetch": None, "prefetch_note": None, "timeline_png": None, "timeline_note": None}
    if without is None or with_ is None:
        out["prefetch_note"] = out["timeline_note"] = "no CUDA profiler trace (CPU ranks, gloo)"
        return out
    if config.wrap == "fsdp":
        out["prefetch"] = prefetch_comparison(without, with_)
    else:
        out["prefetch_note"] = "DDP gathers no parameters: no prefetch to measure"
    if trace_dir is None:
        out["timeline_note"] = "no trace_dir given: no picture written"
        return out
    try:
        fig = timeline_figure({"without offloading": without, "with offloading": with_},
                              title=f"rank {rank}: one profiled step, per CUDA stream")
    except ImportError:
        out["timeline_note"] = "matplotlib is not installed (the plots extra): no picture"
        return out
    path = Path(trace_dir, f"fsdp_timeline_rank{rank}.png")
    fig.savefig(path, dpi=120)
    out["timeline_png"] = str(path)
    return out
