"""Scenario 7, data parallelism: activation offloading inside FSDP2 (``fully_shard``) or DDP.

A stack of ``N`` transformer layers is trained on ``W`` processes (NCCL on GPUs, gloo on the CPU).
With ``--wrap fsdp`` every layer is its own FSDP2 unit (``torch.distributed.fsdp.fully_shard``,
torch >= 2.6) and the stack is the root; with ``--wrap ddp`` the stack is wrapped in
``DistributedDataParallel``. The offload context is entered once per layer, *around the call of
the sharded layer*, so a layer's all-gather, forward and everything it saves for backward belong
to one entry. The heart of it::

    for layer in stack.layers:          # one FSDP unit per layer, then the root
        fully_shard(layer)
    fully_shard(stack)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=len(stack.layers))

    # stack.forward
    for layer in self.layers:
        with ctx:                       # what layer i < k saves goes to host memory
            x = layer(x)
        x = sync(x)                     # its gradient hook starts the reloads ahead of time

    loss(stack(batch)).backward()       # reloads, re-all-gathers and reduce-scatters overlap
    optimizer.step()

FSDP's unsharded parameters are ``nn.Parameter`` s, which the engine never offloads (they are
freed or kept by ``reshard_after_forward``, FSDP's own choice); only activations move.

Each rank trains a fresh copy of the same model on its own batch twice, without and with
offloading, and reports peak memory, the saving against the engine's theory, step time, and
whether the gradients and the parameters after the optimizer (AdamW) are bitwise equal. The
comparison is bitwise, with no tolerance, because both runs call the same collectives on the same
bytes in the same order: gloo on the CPU reduces in a fixed order (the CPU tests find every bit
equal), and one GPU reduces nothing. On several GPUs it relies on NCCL picking the same algorithm
for the same sizes in both runs; pin it with ``NCCL_ALGO`` if a run finds otherwise. Run it::

    python -m offload_examples fsdp                              # one rank per GPU, else 2 ranks on the CPU
    python -m offload_examples fsdp --wrap ddp --checkpoint 2
    python -m offload_examples fsdp --no-reshard-after-forward --cpu-params   # a GPU: FSDP's CPUOffloadPolicy too
    python -m offload_examples fsdp --plan 0.5                   # the planner: keep, offload or recompute per layer
    torchrun --nproc-per-node 8 -m offload_examples fsdp         # under torchrun: one rank per process
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import torch
import torch.distributed as dist
from torch import nn

from offload_examples import OffloadEngine, get_cpu_offload_context
from offload_examples.features.planner import KEEP, OFFLOAD, RECOMPUTE, Plan, apply_plan, plan, simulate_plan
from offload_examples.instruments.cli import (
    Need, SizeError, add_device, check_memory, default_device, nonnegative_int, positive_int,
)
from offload_examples.instruments.measure import deterministic_kernels, resident_vs_theory
from offload_examples.instruments.models import Checkpointed, build_basic_model
from offload_examples.instruments.plan_costs import measure_costs, measure_link
from offload_examples.instruments.report import cpu_timing_note, format_bytes, format_table
from offload_examples.instruments.timeline import (
    Span,
    StreamLane,
    overlap_ms,
    prefetch_summary,
    stream_spans_from_trace,
)
from offload_examples.scenarios.cli import (
    Placement, free_port, make_config, rank_results, report_header, scenario_main, size_hint, spawn_ranks,
)
from offload_examples.scenarios.sizes import ScenarioConfig, Timing, TransformerSize

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "CHECK_STEPS", "FsdpConfig", "Launch", "OffloadedStack", "build_model", "default_world", "format_report", "main",
    "make_plan",
    "prefetch_comparison", "run", "stream_activity", "timeline_figure", "timeline_figure_from_traces", "trace_paths",
    "under_torchrun",
]

Wrap = Literal["fsdp", "ddp"]
#: Steps each run takes under deterministic kernels before it is timed: the gradients of the last
#: one and the parameters after its optimizer step are compared (the second step uses AdamW's state).
CHECK_STEPS = 2


@dataclass
class FsdpConfig(TransformerSize, Timing, ScenarioConfig):
    """Sizes of the data-parallel scenario; the defaults are the full GPU size (per rank).

    Attributes
    ----------
    world:
        Processes, one per GPU (NCCL) or on the CPU (gloo); ``None``: every visible GPU, else 2.
    wrap:
        ``"fsdp"``: ``fully_shard`` on every layer and the root; ``"ddp"``: ``DistributedDataParallel``.
    layers:
        ``N``, the transformer layers of the stack; each enters the offload context once per step.
    offload:
        ``k``: the saved activations of the first ``offload`` layers go to host memory.
    batch:
        Sequences per rank and step (each rank draws its own).
    checkpoint:
        Recompute the last ``checkpoint`` layers in backward (``torch.utils.checkpoint``);
        ``None`` (or 0 on the command line): none.
    reshard_after_forward:
        FSDP2's option: free each layer's all-gathered parameters after its forward and gather
        them again for its backward (FSDP only).
    cpu_params:
        FSDP2's ``CPUOffloadPolicy``: sharded parameters, gradients and the optimizer step on the
        host, on top of activation offloading (FSDP on GPUs only).
    plan:
        Let the planner choose keep, offload or recompute for each layer (instead of ``offload``
        and ``checkpoint``): the fastest plan whose predicted peak of saved activations is at most
        this fraction of keeping them all (0 < plan <= 1), see :func:`make_plan`; or a given
        plan, one letter per layer: ``K`` keep, ``O`` offload, ``R`` recompute (``"OORK"``).
    """

    world: int | None = None
    wrap: Wrap = "fsdp"
    layers: int = 12
    offload: int = 4
    batch: int = 16
    checkpoint: int | None = None
    reshard_after_forward: bool = True
    cpu_params: bool = False
    plan: float | str | None = None

    #: The small size, which runs in seconds on a CPU: what it changes here (the shared sizes have their own).
    SMALL = dict(world=2, layers=4, offload=2, batch=2)

    def memory_need(self, device_type: str) -> Need:
        """Per rank: the layers as built whole, then their shards of parameters, gradients and AdamW's
        two moments (whole, and DDP's buckets, with ``ddp``), two layers gathered, and a training step's
        activations; with a fraction ``plan`` rank 0 first measures a step of the whole layers. On the
        host the layers as built (float32), or the pinned buffers and both runs' gradients and updated
        parameters (and the optimizer's state with ``cpu_params``)."""
        s = self.stack(self.layers, self.batch, device_type)
        world = self.world or 1
        shard = s.param_bytes if self.wrap == "ddp" else s.param_bytes // world
        weights = 5 * shard if self.wrap == "ddp" else s.param_bytes + 4 * shard + 2 * s.param_bytes // self.layers
        device = max(weights + s.saved_bytes(self.layers + 1) + 3 * s.io_bytes,
                     s.step_bytes() if isinstance(self.plan, float) else 0)
        host = s.saved_bytes(self.offload) + 4 * shard + (4 * shard if self.cpu_params else 0)
        return Need(device, max(s.build_bytes, host), world)

    def check(self) -> None:
        if self.wrap not in ("fsdp", "ddp"):
            raise ValueError(f"wrap must be 'fsdp' or 'ddp', got {self.wrap!r}")
        if self.checkpoint is not None and self.checkpoint > self.layers:
            raise SizeError(f"checkpoint ({self.checkpoint}) must be at most layers ({self.layers})",
                            checkpoint=self.checkpoint, layers=self.layers)
        if self.wrap == "ddp" and not self.reshard_after_forward:
            raise ValueError("--no-reshard-after-forward is an FSDP option: DDP keeps whole parameters (use --wrap fsdp)")
        if self.wrap == "ddp" and self.cpu_params:
            raise ValueError("--cpu-params is FSDP's CPUOffloadPolicy: it needs --wrap fsdp")
        if isinstance(self.plan, str):
            if len(self.plan) != self.layers or set(self.plan) - set("KOR") or self.plan[-1] == "O":
                raise SizeError(f"plan {self.plan!r}: one letter per layer ({self.layers}) of K (keep), O (offload) "
                                "and R (recompute), the last not O", plan=self.plan, layers=self.layers)
        elif self.plan is not None and not 0 < self.plan <= 1:
            raise ValueError(f"plan is a fraction of the saved activations' peak, 0 < plan <= 1; got {self.plan}")
        if self.plan is not None and self.checkpoint is not None:
            raise ValueError("--plan chooses the recomputed layers itself: leave out --checkpoint")


@dataclass(frozen=True)
class Launch:
    """Where the ranks run: ``device_type`` ``"cuda"`` (NCCL, one GPU per rank) or ``"cpu"`` (gloo);
    ``torchrun``: this process is one rank started by torchrun, else the ranks are spawned here."""

    device_type: str = "cpu"
    torchrun: bool = False

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"


class OffloadedStack(nn.Module):
    """Layers run one after another, each inside the offload context (one entry per layer).

    ``ctx`` and ``sync`` are ``get_cpu_offload_context``'s pair; the defaults do nothing, which
    is the run without offloading.
    """

    def __init__(self, layers: nn.ModuleList):
        super().__init__()
        self.layers = layers
        self.ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.sync: Callable[[torch.Tensor], torch.Tensor] = lambda t: t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            with self.ctx:  # around the sharded layer: its all-gather and forward are one entry
                x = layer(x)
            x = self.sync(x)
        return x


def _layers(config: FsdpConfig, device: torch.device) -> nn.ModuleList:
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
        layers = _layers(config, device)
        costs, _ = measure_costs(layers, x.detach().requires_grad_())
        link = measure_link(device)
        keep_all, _ = simulate_plan([KEEP] * len(costs), costs, link)
        box[0] = plan(costs, link, budget_bytes=int(config.plan * keep_all)), keep_all
        del layers
        _free(device)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def build_model(config: FsdpConfig, device: torch.device, chosen: Plan | None = None
                ) -> tuple[nn.Module, OffloadedStack, OffloadEngine | None]:
    """The model to call, the stack inside it, and the plan's engine, with weights drawn from ``config.seed``.

    The last ``config.checkpoint`` layers, or the layers ``chosen`` recomputes, are wrapped in
    :class:`Checkpointed` *before* ``fully_shard``, so FSDP gathers their parameters once for
    backward and the recomputation reuses them; a plan's engine offloads the layers it chose
    (:func:`~offload_examples.features.planner.apply_plan`). With ``wrap="fsdp"`` the model is
    the stack itself (each layer and the root sharded); with ``"ddp"`` it is a
    ``DistributedDataParallel`` around the stack.
    """
    layers, engine = _layers(config, device), None
    if chosen is not None:
        engine, _, wrapped = apply_plan(chosen, layers, device, retain_pinned_cpu_buffers=True)
        layers = nn.ModuleList(wrapped)
    for i in range(config.layers - (config.checkpoint or 0), config.layers):
        layers[i] = Checkpointed(layers[i])
    stack = OffloadedStack(layers)
    if config.wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(stack, device_ids=[device.index] if device.type == "cuda" else None)
        return ddp, stack, engine
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    options: dict[str, Any] = {"reshard_after_forward": config.reshard_after_forward}
    if config.cpu_params:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(stack, **options)
    return stack, stack, engine


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


# ---------------------------------------------------------------------------- streams of one profiled step
def _work_kind(event: dict) -> str | None:
    cat, name = event.get("cat", ""), event.get("name", "").lower().replace("_", "")
    if cat == "kernel":
        if "nccl" not in name:
            return "compute"
        for key, kind in (("allgather", "all-gather"), ("reducescatter", "reduce-scatter"), ("allreduce", "all-reduce")):
            if key in name:
                return kind
        return "collective"
    if cat == "gpu_memcpy":
        for key, kind in (("dtoh", "device-to-host"), ("htod", "host-to-device"), ("dtod", "device-to-device")):
            if key in name:
                return kind
    return None  # memsets and host-side events


def stream_activity(trace: dict) -> tuple[list[dict[str, Any]], dict[str, tuple[float, float]]]:
    """What each CUDA stream ran in a ``torch.profiler`` Chrome trace, and how much copying overlapped compute.

    Returns
    -------
    tuple
        ``[{"stream": id, "busy_ms": {kind: ms}}, ...]`` sorted by stream, where a kind is
        ``compute``, ``all-gather``, ``reduce-scatter``, ``all-reduce``, ``collective``,
        ``device-to-host``, ``host-to-device`` or ``device-to-device``; and, for the two copy
        directions, ``(busy ms, ms overlapped by compute kernels)``.
    """
    spans: list[Span] = []
    streams: dict[int, dict[str, list[Span]]] = {}
    for e in trace.get("traceEvents", []):
        kind = _work_kind(e)
        if kind is None:
            continue
        span = Span(kind, e["ts"] / 1e3, (e["ts"] + e.get("dur", 0)) / 1e3, e.get("name", ""))
        spans.append(span)
        streams.setdefault(int(e.get("args", {}).get("stream", -1)), {}).setdefault(kind, []).append(span)
    activity = [{"stream": s, "busy_ms": {k: round(overlap_ms(v, k)[0], 3) for k, v in sorted(kinds.items())}}
                for s, kinds in sorted(streams.items())]
    return activity, {lane: overlap_ms(spans, lane) for lane in ("device-to-host", "host-to-device")}


def _profile(step: Callable[[], None], path: Path | None) -> dict:
    """Run ``step`` once under the CUDA profiler; return its Chrome trace (also written to ``path``)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        out = path or Path(tmp, "trace.json")
        prof.export_chrome_trace(str(out))
        return json.loads(Path(out).read_text())


# ---------------------------------------------------------------------------- one rank
def _run_case(config: FsdpConfig, device: torch.device, x: torch.Tensor, offload: bool,
              say: Callable[[str], None], trace_path: Path | None, chosen: Plan | None = None) -> dict[str, Any]:
    """Train a fresh model: checked steps, then warm-up and measured steps; what each showed.
    With ``offload`` and a plan, the plan runs (the run without runs every layer plainly)."""
    cuda = device.type == "cuda"
    model, stack, engine = build_model(config, device, chosen if offload else None)
    optimizer = torch.optim.AdamW(stack.parameters(), lr=1e-3)
    if offload and engine is None:
        engine, _ = get_cpu_offload_context(enabled=True, num_layers=config.offload, model_layers=config.layers,
                                            retain_pinned_cpu_buffers=True, device=device)
    if engine is not None:
        stack.ctx, stack.sync = engine, engine.sync

    def forward_backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()

    with deterministic_kernels():  # bit-reproducible kernels for the comparison; the timed steps use the fast ones
        for _ in range(CHECK_STEPS):
            forward_backward()
            grads = {_plain(n): _local(p.grad) for n, p in stack.named_parameters() if p.grad is not None}
            optimizer.step()
    params = {_plain(n): _local(p) for n, p in stack.named_parameters()}

    label = "offload" if offload else "no offload"
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
    return out  # the model, its optimizer and the engine go with this frame


def _free(device: torch.device) -> None:
    """Give the last case's memory back before the next one is measured."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _run_rank(rank: int, config: FsdpConfig, device: torch.device, verbose: bool,
              trace_dir: str | None) -> dict[str, Any]:
    """Both runs on this rank, compared."""
    say = (lambda s: print(f"  rank {rank} {s}", flush=True)) if verbose and rank == 0 else (lambda s: None)
    gen = torch.Generator().manual_seed(config.seed + 1 + rank)  # each rank its own batch
    x = torch.randn(config.batch, config.seq, config.hidden, generator=gen, dtype=getattr(torch, config.dtype)).to(device)
    without, with_ = trace_paths(trace_dir, rank) if trace_dir else (None, None)
    chosen, keep_all = (None, 0) if config.plan is None else make_plan(config, device, x)
    if chosen is not None:
        say(f"plan: {chosen.summary()}")
    base = _run_case(config, device, x, False, say, without)
    _free(device)
    dist.barrier()
    off = _run_case(config, device, x, True, say, with_, chosen)
    _free(device)
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
    out["recomputes"] = bool(config.checkpoint) or (chosen is not None and RECOMPUTE in chosen.choices)
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


def trace_paths(trace_dir: str | os.PathLike, rank: int = 0) -> tuple[Path, Path]:
    """Where a rank writes its Chrome traces of one profiled step: without and with offloading."""
    return Path(trace_dir, f"fsdp_trace_no_offload_rank{rank}.json"), Path(trace_dir, f"fsdp_trace_rank{rank}.json")


def prefetch_comparison(without: list[StreamLane], with_: list[StreamLane]) -> dict[str, Any]:
    """Whether the engine's copies delay FSDP's all-gathers: one profiled step without and one with offloading.

    Both steps are summarised by :func:`~offload_examples.instruments.timeline.prefetch_summary`.
    Two differences answer the question:

    - ``median_delay_ms``: the median all-gather (copy-in and collective of one FSDP unit) with
      offloading minus without. Positive when the copies slow the all-gathers down, by sharing
      memory bandwidth or copy engines with them.
    - ``wait_delay_ms``: the time the compute stream waited for all-gathers, with minus without.
      Positive when prefetches finish later than compute needs them, for instance because the
      host, held up by the engine, issued them late. A prefetch that still finishes in time adds
      nothing here even if it is slower.

    With one rank there is no all-gather stream to delay: FSDP2 gathers with a device-to-device
    copy on the compute stream. ``note`` then says so, and ``local_copy_delay_ms`` (that copy's
    time per step, with minus without) is what the engine's copies could have slowed.
    """
    a, b = prefetch_summary(without), prefetch_summary(with_)
    median = None if a["median_ms"] is None or b["median_ms"] is None else round(b["median_ms"] - a["median_ms"], 4)
    note = None if a["bursts"] or b["bursts"] else (
        "no all-gather stream ran: with one rank FSDP2 gathers by a device-to-device copy on the compute "
        "stream, so no prefetch overlaps anything; that copy's time is compared instead")
    return {"no_offload": a, "offload": b, "median_delay_ms": median,
            "wait_delay_ms": round(b["compute_waited_ms"] - a["compute_waited_ms"], 4),
            "local_copy_delay_ms": round(b["local_copy_ms"] - a["local_copy_ms"], 4), "note": note}


def timeline_figure(runs: dict[str, list[StreamLane]], title: str = "") -> Figure:
    """A matplotlib figure: one panel per run (its stream lanes), on one time axis.

    ``runs`` maps a label to :func:`~offload_examples.instruments.timeline.stream_spans_from_trace`'s
    lanes. Needs matplotlib (the ``plots`` extra); uses no pyplot, so it draws in any process.
    """
    from matplotlib.figure import Figure

    from offload_examples.instruments.plots import plot_stream_timeline

    heights = [max(len(lanes), 1) for lanes in runs.values()]
    fig = Figure(figsize=(12, 1.2 * len(runs) + 0.45 * sum(heights)), layout="constrained")
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (label, lanes) in zip(axes, runs.items()):
        plot_stream_timeline(lanes, ax=ax, title=label)
    if title:
        fig.suptitle(title)
    return fig


def timeline_figure_from_traces(trace_dir: str | os.PathLike, rank: int = 0, wrap: Wrap = "fsdp") -> Figure:
    """:func:`timeline_figure` of the two traces a run with ``trace_dir`` wrote for ``rank`` (for a notebook)."""
    without, with_ = (stream_spans_from_trace(json.loads(p.read_text()), fsdp=wrap == "fsdp")
                      for p in trace_paths(trace_dir, rank))
    return timeline_figure({"without offloading": without, "with offloading": with_},
                           title=f"rank {rank}: one profiled step, per CUDA stream")


def _init(backend: str, rank: int, world: int, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:  # CPU ranks share the cores (as torchrun's default of 1 thread does)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=300),
                            **({"device_id": device} if device.type == "cuda" else {}))


def _worker(rank: int, config: FsdpConfig, launch: Launch, out_dir: str, port: int, verbose: bool,
            trace_dir: str | None) -> None:
    """One spawned rank: join the group, run, write the result for the parent to read."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if launch.device_type == "cuda" else torch.device("cpu")
    _init(launch.backend, rank, config.world, device)
    try:
        result = _run_rank(rank, config, device, verbose, trace_dir)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def under_torchrun() -> bool:
    """Whether this process is one rank that torchrun (or another launcher setting its variables) started."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def default_world(device_type: str) -> int:
    """Ranks when none is asked for: ``WORLD_SIZE`` under torchrun, every visible GPU, or 2 on the CPU."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return max(1, torch.cuda.device_count()) if device_type == "cuda" else 2


def run(config: FsdpConfig | None = None, launch: Launch | None = None,
        progress: Callable[[str], None] | None = print, trace_dir: str | Path | None = None,
        timeout_s: float = 900.0) -> dict[str, Any]:
    """Run the scenario on ``config.world`` ranks and gather their results.

    Parameters
    ----------
    config:
        The sizes; default: the full size on CUDA, the small one on the CPU.
    launch:
        Where the ranks run; default: CUDA when available, spawned here (or this process's rank
        under torchrun).
    progress:
        Called with progress lines (rank 0's; spawned ranks print them themselves when it is set).
    trace_dir:
        On CUDA, a folder for each rank's Chrome traces of one profiled step without and with
        offloading (:func:`trace_paths`) and, with matplotlib, its picture of both, one lane per
        CUDA stream (``fsdp_timeline_rank0.png``, :func:`timeline_figure`).
    timeout_s:
        Spawned ranks that have not finished by then are stopped, and :class:`TimeoutError` is raised.

    Returns
    -------
    dict
        The report (see :func:`format_report`); ``ranks`` holds one entry per rank.
    """
    launch = launch or Launch(default_device().type, under_torchrun())
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read by cuBLAS in each rank: bitwise checks
    config = config or FsdpConfig.for_device(torch.device(launch.device_type))
    if config.world is None:
        config = dataclasses.replace(config, world=default_world(launch.device_type))
    if launch.torchrun and config.world != int(os.environ["WORLD_SIZE"]):
        raise ValueError(f"world {config.world}, but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} ranks")
    if launch.device_type == "cuda" and not launch.torchrun and config.world > torch.cuda.device_count():
        raise RuntimeError(f"world {config.world} needs one GPU per rank; {torch.cuda.device_count()} visible")
    verbose = progress is not None
    if progress is not None:
        what = (f"offloading {config.offload}" if config.plan is None else f"plan {config.plan}"
                if isinstance(config.plan, str) else f"planned at {config.plan:.0%} of the saved peak")
        progress(f"fsdp scenario: {config.world} rank(s), {launch.backend}, {config.wrap}, {config.layers} layers, {what}")
    if trace_dir is not None:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        trace_dir = str(trace_dir)
    if launch.torchrun:
        rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local) if launch.device_type == "cuda" else torch.device("cpu")
        _init(launch.backend, rank, config.world, device)
        try:
            ranks: list[Any] = [None] * config.world
            dist.all_gather_object(ranks, _run_rank(rank, config, device, verbose, trace_dir))
        finally:
            dist.destroy_process_group()
    else:
        with tempfile.TemporaryDirectory() as out_dir:
            spawn_ranks(_worker, (config, launch, out_dir, free_port(), verbose, trace_dir), config.world, timeout_s)
            ranks = rank_results(out_dir, config.world)
    ranks = [json.loads(json.dumps(r)) for r in ranks]  # the same plain types however they were gathered
    return {
        **report_header("fsdp", torch.device(launch.device_type), config),
        "backend": launch.backend,
        "world": config.world,
        "ranks": ranks,
        "resident_matches_theory": all(r["resident_matches_theory"] for r in ranks),
        # the scenario's verdict: gradients *and* updated parameters bitwise equal on every rank
        "grads_equal": all(r["grads_equal"] and r["params_equal"] for r in ranks),
    }


# ---------------------------------------------------------------------------- the report
def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _ratio_cell(rank: dict[str, Any]) -> str:
    """Measured saving over theory, or why there is none: no peak without CUDA, a saving that recomputation
    adds to (the theory counts offloads only; a plan's own prediction is on its line), nothing offloaded."""
    if rank["saving_ratio"] is not None:
        return f"{rank['saving_ratio']:.1%}"
    if rank["saving_bytes"] is None:
        return "n/a (no CUDA)"
    return "n/a (recomputes too)" if rank.get("recomputes") else "n/a (nothing offloaded)"


def format_report(report: dict[str, Any]) -> str:
    """A memory table, a time-and-correctness table, and on CUDA what rank 0's streams ran."""
    c = report["config"]
    ranks = report["ranks"]
    wrap = ("FSDP2 fully_shard per layer" + ("" if c["reshard_after_forward"] else ", no reshard after forward")
            + (", CPUOffloadPolicy" if c["cpu_params"] else "")) if c["wrap"] == "fsdp" else "DDP"
    head = (f"{wrap} on {report['world']} rank(s) ({report['backend']}, {report['device']}, torch {report['torch']}): "
            f"{c['layers']} layers, " + (f"first {c['offload']} offloaded" if c.get("plan") is None else
                                          f"plan {c['plan']}" if isinstance(c["plan"], str) else
                                          f"planned ({c['plan']:.0%} of the saved peak)")
            + (f", last {c['checkpoint']} checkpointed" if c["checkpoint"] else "")
            + f"; hidden {c['hidden']}, seq {c['seq']}, batch {c['batch']} per rank, {c['dtype']}")
    memory = format_table(
        [(r["rank"], format_bytes(r["peak_without_bytes"]), format_bytes(r["peak_with_bytes"]),
          format_bytes(r["saving_bytes"]), format_bytes(r["theoretical_saving_bytes"]),
          _ratio_cell(r),
          format_bytes(r["offloaded_bytes"]), format_bytes(r["host_pinned_bytes"]),
          format_bytes(r["host_param_bytes"])) for r in ranks],
        header=("rank", "peak without", "peak with", "saving", "theory", "measured / theory", "to host per step",
                "host buffers (engine)", "host params+grads (FSDP)"))
    timing = format_table(
        [(r["rank"], f"{_ms(r['step_ms_without'])} / {_ms(r['step_ms_with'])}", f"{r['overhead']:+.1%}",
          f"{r['grads_equal']} ({r['grads_compared']})", f"{r['params_equal']} ({r['params_compared']})",
          f"{r['max_abs_diff']:.3g}") for r in ranks],
        header=("rank", "step without / with", "overhead", "grads bitwise equal", "params after AdamW equal",
                "max |diff|"))
    lines = [head, memory, "", timing]
    if ranks and ranks[0].get("plan"):
        lines += ["", *_plan_lines(ranks[0]["plan"])]
    if ranks and ranks[0].get("streams"):
        roles = ranks[0].get("stream_roles", {})
        lines += ["", "rank 0, one step with offloading: busy time per CUDA stream"]
        lines.append(format_table(
            [(s["stream"], roles.get(str(s["stream"]), "?"),
              ", ".join(f"{k} {ms:.2f} ms" for k, ms in s["busy_ms"].items())) for s in ranks[0]["streams"]],
            header=("stream", "role", "work")))
        for lane, (busy, hidden) in ranks[0]["copy_overlap_ms"].items():
            if busy:
                lines.append(f"{lane} copies: {busy:.2f} ms, {hidden / busy:.0%} of it under compute kernels")
    if ranks:
        lines += _prefetch_lines(ranks[0])
    return "\n".join(lines + cpu_timing_note(report))


def _plan_lines(p: dict[str, Any]) -> list[str]:
    mib, measured = 2**20, p["measured_saving_bytes"]
    return [f"plan (rank 0 measured, every rank runs it): {Plan.from_dict(p).summary()}"
            + ("" if p["feasible"] else f"; infeasible: {p['why']}"),
            ("given plan" if p["predicted_saving_bytes"] is None else
             f"predicted saving of saved activations {p['predicted_saving_bytes'] / mib:.1f} MiB") + ", measured peak saving "
            + ("n/a (no CUDA)" if measured is None else f"{measured / mib:.1f} MiB")
            + f"; step {p['measured_step_ratio']:.2f} x the run without the plan"]


def _prefetch_lines(r: dict[str, Any]) -> list[str]:
    """Rank 0's all-gathers without and with offloading, and where its picture went."""
    p = r.get("prefetch")
    lines = [""]
    if p is None:
        lines.append(f"FSDP prefetch: not measured ({r.get('prefetch_note') or 'no trace'})")
    elif p.get("note"):
        a, b = p["no_offload"], p["offload"]
        lines.append(f"FSDP prefetch: {p['note']}: {a['local_copy_ms']:.2f} ms without offloading, "
                     f"{b['local_copy_ms']:.2f} ms with ({p['local_copy_delay_ms']:+.3f} ms)")
    else:
        a, b = p["no_offload"], p["offload"]
        lines.append(format_table(
            [(label, x["bursts"], _ms(x["median_ms"]), f"{x['exposed_ms']:.2f} ms", f"{x['compute_waited_ms']:.2f} ms")
             for label, x in (("without offloading", a), ("with offloading", b))],
            header=("rank 0, FSDP all-gathers in one step", "count", "median", "not under compute",
                    "compute waited for them")))
        median = "n/a" if p["median_delay_ms"] is None else f"{p['median_delay_ms']:+.3f} ms"
        lines.append(f"delay from offloading: median all-gather {median}, compute's wait {p['wait_delay_ms']:+.3f} ms")
    picture = r.get("timeline_png")
    lines.append(f"timeline picture: {Path(picture).name if picture else r.get('timeline_note') or 'none'}")
    return lines


# ---------------------------------------------------------------------------- the command line
def _plan_arg(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text.upper()


def _placement_options(parser: argparse.ArgumentParser) -> None:
    add_device(parser)
    parser.add_argument("--small", action="store_true", help="use the small CPU-sized model on any device "
                        "(the default on a CPU)")
    parser.add_argument("--world", type=positive_int, metavar="N",
                        help="ranks, one process each (default: every visible GPU; 2 on a CPU; WORLD_SIZE under torchrun)")


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wrap", choices=["fsdp", "ddp"],
                        help="fsdp: fully_shard on every layer and the root; ddp: DistributedDataParallel (default: fsdp)")
    parser.add_argument("--checkpoint", type=lambda text: nonnegative_int(text) or None, metavar="N",
                        help="recompute the last N layers in backward, torch.utils.checkpoint (default: 0, none)")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                        help="FSDP frees each layer's gathered parameters after its forward (default: on)")
    parser.add_argument("--plan", type=_plan_arg, metavar="FRACTION|LETTERS",
                        help="let the planner keep, offload or recompute each layer so that the saved activations' "
                             "predicted peak is at most FRACTION of keeping them all, or give the plan, one letter "
                             "per layer of K, O, R (e.g. OORK); instead of --offload/--checkpoint (default: none)")
    parser.add_argument("--cpu-params", action="store_true", default=None,
                        help="FSDP's CPUOffloadPolicy as well: sharded parameters and the optimizer on the host "
                             "(needs CUDA and --wrap fsdp)")


def _choose(parser, args: argparse.Namespace, config_cls: type[FsdpConfig], changes: dict[str, Any]
            ) -> tuple[FsdpConfig, Launch]:
    """The config and where the ranks run; every refusal is one line (``parser.error``)."""
    device = args.device or default_device()
    if device.index is not None:
        parser.error(f"--device {device}: the ranks use GPUs 0 to world - 1; give --device cuda")
    torchrun = under_torchrun()
    if torchrun and args.world not in (None, int(os.environ["WORLD_SIZE"])):
        parser.error(f"--world {args.world} but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} ranks")
    if args.plan is not None and args.offload is not None:
        parser.error("--plan chooses which layers to offload itself: leave out --offload (or --plan)")
    if args.wrap == "ddp" and args.reshard_after_forward:
        parser.error("--reshard-after-forward is an FSDP option: DDP keeps whole parameters (use --wrap fsdp)")
    small = args.small or device.type != "cuda"
    config = make_config(parser, config_cls, {"world": default_world(device.type), **changes}, small)
    if device.type == "cuda" and not torchrun and config.world > torch.cuda.device_count():
        parser.error(f"--world {config.world} needs one GPU per rank; {torch.cuda.device_count()} visible")
    if device.type == "cpu" and config.world > (most := max(4, os.cpu_count() or 1)):
        parser.error(f"--world {config.world} on the CPU: at most {most} ranks here (the cores, or 4)")
    if config.cpu_params and device.type != "cuda":
        parser.error("--cpu-params needs CUDA: FSDP's CPUOffloadPolicy moves parameters out of GPU memory, "
                     "which a CPU run does not have")
    if not dist.is_available():
        parser.error("this torch is built without torch.distributed")
    if config.wrap == "fsdp":
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: F401
        except ImportError:
            parser.error(f"--wrap fsdp needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); this is "
                         f"{torch.__version__} (use --wrap ddp)")
    need = config.memory_need(device.type)
    if torchrun:  # this process is one rank on its own GPU; the host is shared by this node's ranks
        local = int(os.environ["LOCAL_RANK"])
        gpus = [torch.device("cuda", local)] if device.type == "cuda" else []
        need = need.per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", config.world)))
    else:
        gpus = [torch.device("cuda", r) for r in range(config.world)] if device.type == "cuda" else []
    check_memory(parser, need, gpus, here=torchrun, hint=size_hint(args, small))
    return config, Launch(device.type, torchrun)


def _run_and_end_other_ranks(config: FsdpConfig, launch: Launch, progress=print) -> dict[str, Any]:
    """``run``; under torchrun only rank 0 goes on to print the report and write the JSON."""
    other_rank = launch.torchrun and int(os.environ["RANK"]) != 0
    report = run(config, launch, progress=None if other_rank else progress)
    if other_rank:
        sys.exit(0)
    return report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m offload_examples fsdp [options]``: check the options, run, print the report.

    Exits with code 2 (one line on standard error) for a value that cannot run, and with code 1
    when gradients or updated parameters differ with offloading on any rank.
    """
    return scenario_main("fsdp", __doc__, FsdpConfig, _run_and_end_other_ranks, format_report, argv,
                         extra=_options, placement=Placement(_placement_options, _choose),
                         failure="gradients or updated parameters differ with offloading")


if __name__ == "__main__":
    main()
