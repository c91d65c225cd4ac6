"""Scenario 7, data parallelism: activation offloading inside FSDP2 (``fully_shard``) or DDP.

A stack of ``N`` transformer layers is trained on ``W`` processes (NCCL on GPUs, gloo on the CPU).
With ``--wrap fsdp`` every layer is its own FSDP2 unit (``torch.distributed.fsdp.fully_shard``,
torch >= 2.6) and the stack is the root; with ``--wrap ddp`` the stack is wrapped in
``DistributedDataParallel``. The offload context is entered once per layer, *around the call of
the sharded layer*, so a layer's all-gather, forward and everything it saves for backward belong
to one entry: :class:`OffloadedStack` and :func:`train`, at the top of this module, are all a
training script needs.

FSDP's unsharded parameters are ``nn.Parameter`` s, which the engine never offloads (they are
freed or kept by ``reshard_after_forward``, FSDP's own choice); only activations move.

Each rank trains two fresh copies of the same model on its own batch, one without and one with
offloading, whose timed steps take turns step by step (each first in half the rounds), and
reports peak memory, the saving against the engine's theory, the step times and the overhead
round by round, and whether the gradients and the parameters after the optimizer (AdamW) are
bitwise equal. The comparison is bitwise, with no tolerance, because both runs call the same
collectives on the same bytes in the same order: gloo on the CPU reduces in a fixed order (the CPU tests find every bit
equal), and one GPU reduces nothing. On several GPUs it relies on NCCL picking the same algorithm
for the same sizes in both runs; pin it with ``NCCL_ALGO`` if a run finds otherwise. Run it (one
rank per GPU, else 2 ranks on the CPU; ``--cpu-params`` adds FSDP's CPUOffloadPolicy on a GPU,
``--plan`` lets the planner keep, offload or recompute each layer)::

    python -m offload_examples fsdp
    python -m offload_examples fsdp --wrap ddp --checkpoint 2
    python -m offload_examples fsdp --no-reshard-after-forward --cpu-params
    python -m offload_examples fsdp --plan 0.5
    torchrun --nproc-per-node 8 -m offload_examples fsdp  # one rank per process
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from offload_examples import OffloadEngine, get_cpu_offload_context
from offload_examples.features.planner import Plan, apply_plan
from offload_examples.instruments.cli import default_device
from offload_examples.instruments.fsdp.cli import PLACEMENT, add_options, on_rank_zero
from offload_examples.instruments.fsdp.config import FsdpConfig
from offload_examples.instruments.fsdp.measure import (
    CHECK_STEPS, Case, build_layers, compare_runs, make_plan, measure_cases,
)
from offload_examples.instruments.fsdp.report import format_report
from offload_examples.instruments.fsdp.trace import (
    paired_prefetch, prefetch_comparison, stream_activity, timeline_figure, timeline_figure_from_traces, trace_paths,
)
from offload_examples.instruments.measure import free_memory
from offload_examples.instruments.models import Checkpointed
from offload_examples.instruments.report import report_header
from offload_examples.instruments.scenario_cli import scenario_main
from offload_examples.instruments.spawn import Launch, default_world, run_ranks, under_torchrun

__all__ = [
    "CHECK_STEPS", "FsdpConfig", "Launch", "OffloadedStack", "build_model", "default_world", "format_report", "main",
    "make_plan", "paired_prefetch",
    "prefetch_comparison", "run", "stream_activity", "timeline_figure", "timeline_figure_from_traces", "trace_paths",
    "train", "under_torchrun",
]


class OffloadedStack(nn.Module):
    """Layers run one after another, each in the offload context (one entry per layer).

    ``ctx`` and ``sync`` are ``get_cpu_offload_context``'s pair; the defaults do
    nothing, which is the run without offloading.
    """

    def __init__(self, layers: nn.ModuleList):
        super().__init__()
        self.layers = layers
        self.ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.sync: Callable[[torch.Tensor], torch.Tensor] = lambda t: t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            with self.ctx:  # the sharded layer's all-gather and forward: one entry
                x = layer(x)
            x = self.sync(x)
        return x


def train(layers: nn.ModuleList, batches: Iterable[torch.Tensor], offload: int, lr: float = 1e-3) -> None:
    """The loop to copy: each layer its own FSDP2 unit, what the first ``offload`` layers save on the host.

    Every rank calls it, in an initialised process group, on its own batches.
    """
    from torch.distributed.fsdp import fully_shard  # torch >= 2.6

    stack = OffloadedStack(layers)
    for layer in layers:  # one FSDP unit per layer, then the root
        fully_shard(layer)
    fully_shard(stack)
    stack.ctx, stack.sync = get_cpu_offload_context(enabled=True, num_layers=offload, model_layers=len(layers))
    optimizer = torch.optim.AdamW(stack.parameters(), lr=lr)
    for x in batches:
        stack(x).float().square().mean().backward()  # reloads, re-all-gathers and reduce-scatters overlap
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def build_model(
    config: FsdpConfig, device: torch.device, chosen: Plan | None = None
) -> tuple[nn.Module, OffloadedStack, OffloadEngine | None]:
    """The model to call, the stack inside it, and the plan's engine, with weights drawn
    from ``config.seed``.

    The last ``config.checkpoint`` layers, or the layers ``chosen`` recomputes, are
    wrapped in :class:`Checkpointed` *before* ``fully_shard``, so FSDP gathers their
    parameters once for backward and the recomputation reuses them; a plan's engine
    offloads the layers it chose
    (:func:`~offload_examples.features.planner.apply_plan`). With ``wrap="fsdp"`` the
    model is the stack itself (each layer and the root sharded); with ``"ddp"`` it is a
    ``DistributedDataParallel`` around the stack.
    """
    layers, engine = build_layers(config, device), None
    if chosen is not None:
        engine, _, wrapped = apply_plan(
            chosen, layers, device, retain_pinned_cpu_buffers=True
        )
        layers = nn.ModuleList(wrapped)
    for i in range(config.layers - (config.checkpoint or 0), config.layers):
        layers[i] = Checkpointed(layers[i])
    stack = OffloadedStack(layers)
    if config.wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(stack, device_ids=device_ids)
        return ddp, stack, engine
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    options: dict[str, Any] = {"reshard_after_forward": config.reshard_after_forward}
    if config.cpu_params:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(stack, **options)
    return stack, stack, engine


def _case(config: FsdpConfig, device: torch.device, offload: bool, chosen: Plan | None = None) -> Case:
    """A fresh model to train, with its optimizer and, with ``offload``, its engine: the plan's where
    there is one, else the first ``config.offload`` layers (the run without runs every layer plainly)."""
    model, stack, engine = build_model(config, device, chosen if offload else None)
    optimizer = torch.optim.AdamW(stack.parameters(), lr=1e-3)
    if offload and engine is None:
        engine, _ = get_cpu_offload_context(enabled=True, num_layers=config.offload, model_layers=config.layers,
                                            retain_pinned_cpu_buffers=True, device=device)
    if engine is not None:
        stack.ctx, stack.sync = engine, engine.sync
    return Case("offload" if offload else "no offload", model, stack, engine, optimizer)


def _run_rank(rank: int, device: torch.device, config: FsdpConfig, verbose: bool,
              trace_dir: str | None) -> dict[str, Any]:
    """Both runs on this rank, their steps taking turns, compared."""
    say = (lambda s: print(f"  rank {rank} {s}", flush=True)) if verbose and rank == 0 else (lambda s: None)
    gen = torch.Generator().manual_seed(config.seed + 1 + rank)  # each rank its own batch
    x = torch.randn(config.batch, config.seq, config.hidden, generator=gen, dtype=getattr(torch, config.dtype)).to(device)
    without, with_ = trace_paths(trace_dir, rank) if trace_dir else (None, None)
    chosen, keep_all = (None, 0) if config.plan is None else make_plan(config, device, x)
    if chosen is not None:
        say(f"plan: {chosen.summary()}")
    cases = [_case(config, device, False), _case(config, device, True, chosen)]
    measured = measure_cases(cases, x, config, device, say, {"no offload": without, "offload": with_})
    del cases  # the models, their optimizers and the engine, before the next run in this process
    free_memory()
    return compare_runs(rank, config, measured["no offload"], measured["offload"], chosen, keep_all, trace_dir)


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
    ranks = run_ranks(_run_rank, (config, verbose, trace_dir), config.world, launch, timeout_s)
    return {
        **report_header("fsdp", torch.device(launch.device_type), config),
        "backend": launch.backend,
        "world": config.world,
        "ranks": ranks,
        "resident_matches_theory": all(r["resident_matches_theory"] for r in ranks),
        # the scenario's verdict: gradients *and* updated parameters bitwise equal on every rank
        "grads_equal": all(r["grads_equal"] and r["params_equal"] for r in ranks),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m offload_examples fsdp [options]``: check the options, run, print the report.

    Exits with code 2 (one line on standard error) for a value that cannot run, and with code 1
    when gradients or updated parameters differ with offloading on any rank.
    """
    return scenario_main("fsdp", __doc__, FsdpConfig, on_rank_zero(run), format_report, argv,
                         extra=add_options, placement=PLACEMENT,
                         failure="gradients or updated parameters differ with offloading")


if __name__ == "__main__":
    main()
