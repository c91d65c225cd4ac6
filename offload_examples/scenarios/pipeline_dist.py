"""Scenario 3, real pipeline parallelism: stages on several processes, 1F1B, each stage offloading.

The model (``stages x layers_per_stage`` layers) is cut into one stage per process with
``torch.distributed.pipelining``, run with its ``Schedule1F1B`` on ``M`` micro-batches. Inside
each stage every layer enters the offload context, so the context sees ``M x layers_per_stage``
entries per step, in the order 1F1B gives the stage. A ``synchronization_dict`` built from that
order offloads the first ``offload`` layers of every micro-batch: each is released while the
stage's later layers run their forward and reloaded one layer ahead of its backward.

Each rank runs the same steps without and with offloading, taking turns step by step, then compares
its gradients and peak memory. The loop to copy is :func:`train`, with the stage it runs (:class:`OffloadedStage`). Run it::

    # 2 ranks: nccl on 2 GPUs, else gloo on the CPU
    python -m offload_examples pipeline-dist
    python -m offload_examples pipeline-dist --backend gloo --small
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from offload_examples import get_cpu_offload_context, mark_not_offload
from offload_examples.core.orders import one_f_one_b_order, sync_dict_for_order
from offload_examples.instruments.cli import Need
from offload_examples.instruments.measure import measure_stage_steps, overhead_spread
from offload_examples.instruments.models import build_basic_model
from offload_examples.instruments.report import format_bytes, format_table
from offload_examples.instruments.scenario_cli import STAGES, scenario_main
from offload_examples.instruments.sizes import MicroBatches, ScenarioConfig, TransformerSize
from offload_examples.instruments.spawn import Launch, run_ranks

__all__ = ["DistConfig", "OffloadedStage", "expand_order", "format_report", "main", "run", "train"]


class OffloadedStage(nn.Module):
    """A pipeline stage whose layers each enter the offload context (one entry per layer)."""

    def __init__(self, layers: nn.ModuleList, ctx=None, sync=None):
        super().__init__()
        self.layers = layers
        self.ctx, self.sync = ctx, sync
        #: Off while the pipeline stage infers shapes: that extra forward is not an entry of a step.
        self.offloading = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx is not None and self.offloading:
            # The stage keeps its input until the backward sends its gradient upstream, so
            # copying it out would free nothing: keep it where it is.
            mark_not_offload(x)
        for layer in self.layers:
            if self.ctx is None or not self.offloading:
                x = layer(x)
                continue
            with self.ctx:
                x = layer(x)
            x = self.sync(x)
        return x


def train(layers: nn.ModuleList, batches: Iterable[torch.Tensor], cfg: DistConfig, rank: int, device: torch.device,
          lr: float = 1e-3) -> None:
    """The loop to copy: this rank's stage of a 1F1B pipeline, the first ``cfg.offload`` of its layers
    offloaded in every micro-batch. Every rank calls it, in an initialised process group, with as many
    batches as the others (only the first stage reads them: the others get their inputs from the stage before)."""
    order, sync_dict = _stage_schedule(rank, cfg)
    ctx, sync = get_cpu_offload_context(enabled=True, model_layers=len(order) // 2, synchronization_dict=sync_dict,
                                        device=device)  # one entry per layer and micro-batch: half the order
    stage = OffloadedStage(layers, ctx, sync)
    schedule = _make_schedule(stage, rank, cfg.stages, cfg, device)
    optimizer = torch.optim.AdamW(layers.parameters(), lr=lr)
    for i, x in enumerate(batches):
        stage.offloading = i > 0  # the first step infers shapes with one more forward, which is no entry
        _pipeline_step(schedule, rank, cfg.stages, cfg, device, x, x.dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _stage_schedule(rank: int, cfg: DistConfig) -> tuple[list[tuple[str, int]], dict[int, tuple]]:
    """This stage's context entries in 1F1B order, and the ``synchronization_dict`` that offloads the first
    ``cfg.offload`` layers of every micro-batch: released two entries after their forward, reloaded one
    entry ahead of their backward."""
    order = expand_order(one_f_one_b_order(rank, cfg.stages, cfg.microbatches), cfg.layers_per_stage)
    offload = [j * cfg.layers_per_stage + l for j in range(cfg.microbatches) for l in range(cfg.offload)]
    return order, sync_dict_for_order(order, offload=offload, release_after=2, reload_before=1)


def expand_order(order: Sequence[tuple[str, int]], layers: int) -> list[tuple[str, int]]:
    """Micro-batch phases -> context entries: micro-batch ``j``'s layer ``l`` is entry ``j * layers + l``.

    A forward runs the stage's layers first to last, a backward last to first.
    """
    out = []
    for phase, j in order:
        ls = range(layers) if phase == "forward" else reversed(range(layers))
        out += [(phase, j * layers + l) for l in ls]
    return out


def _make_schedule(stage_module, rank, world, cfg, device):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage = PipelineStage(stage_module, rank, world, device)
    return Schedule1F1B(stage, n_microbatches=cfg.microbatches, loss_fn=_loss)


def _pipeline_step(schedule, rank, world, cfg, device, x, dtype) -> None:
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=torch.zeros(cfg.microbatches * cfg.micro_batch, dtype=dtype, device=device))
    else:
        schedule.step()


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


@dataclass
class DistConfig(TransformerSize, MicroBatches, ScenarioConfig):
    """Sizes of the multi-rank scenario; the defaults are the full GPU size."""

    stages: int = 2
    layers_per_stage: int = 6
    offload: int = 2
    microbatches: int = 4
    steps: int = 6

    #: The small size, which runs in seconds on a CPU: what it changes here (the shared sizes have their own).
    SMALL = dict(layers_per_stage=3, offload=1, steps=2)
    OFFLOAD_OF = "layers_per_stage"

    def memory_need(self, device_type: str) -> Need:
        """Per stage (one rank each): the whole model as every rank builds it before keeping its stage, or a
        training step of its layers on every micro-batch; on the host the whole model as built (float32),
        or its pinned buffers and two steps' gradients."""
        s = self.stack(self.layers_per_stage, self.microbatches * self.micro_batch, device_type)
        host = max(self.stages * s.build_bytes, s.saved_bytes(self.offload) + s.copies_bytes(2))
        return Need(max(self.stages * s.param_bytes, s.step_bytes()), host, self.stages)

    def check(self) -> None:
        if self.stages < 2:
            raise ValueError(f"a pipeline needs at least 2 stages, got {self.stages}")


def _run_rank(rank: int, device: torch.device, cfg: DistConfig) -> dict[str, Any]:
    world, dtype = cfg.stages, getattr(torch, cfg.dtype)
    model = build_basic_model(cfg.stages * cfg.layers_per_stage, cfg.hidden, cfg.heads, cfg.ffn,
                              device=device, dtype=dtype, kind="torch", seed=cfg.seed)
    mine = nn.ModuleList(model[rank * cfg.layers_per_stage:(rank + 1) * cfg.layers_per_stage])
    del model
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.microbatches * cfg.micro_batch, cfg.seq, cfg.hidden, generator=gen, dtype=dtype).to(device)

    order, sync_dict = _stage_schedule(rank, cfg)
    entries = cfg.microbatches * cfg.layers_per_stage  # context entries per step: one per layer per micro-batch
    ctx, sync = get_cpu_offload_context(enabled=True, model_layers=entries, synchronization_dict=sync_dict,
                                        retain_pinned_cpu_buffers=True, device=device)
    # the baseline goes through the same hooks with nothing to offload, so only offloading differs
    base_ctx, base_sync = get_cpu_offload_context(enabled=True, model_layers=entries, synchronization_dict={},
                                                  device=device)
    cases = {"no offload": OffloadedStage(mine, base_ctx, base_sync), "offload": OffloadedStage(mine, ctx, sync)}
    out: dict[str, Any] = {"rank": rank, "order": order, "sync_dict": {str(k): v for k, v in sync_dict.items()}}
    steps = measure_stage_steps(
        {name: (partial(_pipeline_step, _make_schedule(stage_module, rank, world, cfg, device), rank, world, cfg,
                        device, x, dtype), stage_module) for name, stage_module in cases.items()},
        mine, cfg.steps, device)
    grads = {name: steps[name]["grads"] for name in cases}
    theory, stats = steps["offload"]["theory"], steps["offload"]["stats"]
    for name in cases:
        out[name] = {key: steps[name][key] for key in ("memory_trace", "activation_peak_bytes", "step_ms")}
    if device.type == "cuda":  # the steps took turns: round by round, offloading's over the baseline's
        out.update(overhead_spread(steps["offload"]["step_ms_by_round"], steps["no offload"]["step_ms_by_round"]))
    out.update(
        offloaded_bytes=sum(st.offloaded_bytes for st in stats),
        offloaded_bytes_per_entry=[st.offloaded_bytes for st in stats],
        saved_bytes_per_entry=[st.candidate_bytes for st in stats],
        theoretical_saving_bytes=theory.saving,
        grads_compared=len(grads["no offload"]),
        grads_equal=grads["no offload"].keys() == grads["offload"].keys()
        and all(torch.equal(grads["no offload"][n], grads["offload"][n]) for n in grads["no offload"]),
        order_followed=ctx.phase_order() == order,
        phase_order_seen=ctx.phase_order(),
        iterations=ctx.iteration + 1,  # one per step: proves model_layers matched the entries per step
    )
    if device.type == "cuda":
        saving = out["no offload"]["activation_peak_bytes"] - out["offload"]["activation_peak_bytes"]
        out.update(saving_bytes=saving, saving_ratio=saving / theory.saving if theory.saving else None)
    return out


def run(config: DistConfig | None = None, backend: str = "auto") -> dict[str, Any]:
    """Spawn one process per stage, run the scenario, and gather the ranks' results."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < (config.stages if config else 2):
        raise RuntimeError(f"backend nccl needs one GPU per stage; {torch.cuda.device_count()} visible")
    config = config or (DistConfig() if backend == "nccl" else DistConfig.small())
    launch = Launch("cuda" if backend == "nccl" else "cpu")
    # a collective waits two minutes at most, and every rank keeps all the cores
    ranks = run_ranks(_run_rank, (config,), config.stages, launch, collective_timeout_s=120, share_cores=False)
    device = torch.cuda.get_device_name(0) if backend == "nccl" else "cpu"
    return {"scenario": "pipeline-dist", "backend": backend, "device_type": "cuda" if backend == "nccl" else "cpu",
            "device": device, "torch": torch.__version__,
            "config": dataclasses.asdict(config), "ranks": ranks,
            "grads_equal": all(r["grads_equal"] for r in ranks)}


def format_report(report: dict[str, Any]) -> str:
    """The report as a table: one row per rank, peaks with and without offloading, the saving
    against the theory, step times, and whether the gradients were equal."""
    rows = []
    for r in report["ranks"]:
        ratio = r.get("saving_ratio")
        rows.append((r["rank"], format_bytes(r["no offload"]["activation_peak_bytes"]),
                     format_bytes(r["offload"]["activation_peak_bytes"]), format_bytes(r.get("saving_bytes")),
                     format_bytes(r["theoretical_saving_bytes"]), "n/a" if ratio is None else f"{ratio:.1%}",
                     format_bytes(r["offloaded_bytes"]),
                     "n/a" if r["offload"]["step_ms"] is None else
                     f"{r['no offload']['step_ms']:.1f} / {r['offload']['step_ms']:.1f} ms",
                     "n/a" if "overhead" not in r else
                     "{:+.1%} ({:+.1%} .. {:+.1%})".format(r["overhead"], *r["overhead_quartiles"]),
                     f"{r['grads_equal']} ({r['grads_compared']})"))
    c = report["config"]
    head = (f"{c['stages']}-stage 1F1B pipeline ({report['backend']}, {report['device']}), "
            f"{c['layers_per_stage']} layers per stage, first {c['offload']} offloaded, {c['microbatches']} micro-batches")
    table = format_table(rows, header=("rank", "peak without", "peak with", "saving", "theory", "ratio", "to host",
                                       "step without / with", "overhead (quartiles)", "grads equal"))
    if not any("overhead" in r for r in report["ranks"]):
        return head + "\n" + table  # no step times on a CPU (n/a), so no note that they measure nothing
    return (head + "\n" + table + "\nsteps: medians; overhead: round by round, the step with offloading over the "
            "one without it that took turns with it, less one (median and quartiles over the rounds)")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m offload_examples pipeline-dist``: run it from the command line (see :func:`.scenario_main`)."""
    # the sizes are fixed (full, or small with --small or gloo); --backend/--device say where it runs
    return scenario_main("pipeline-dist", __doc__, DistConfig, run, format_report, argv, sizes=False,
                         placement=STAGES,
                         failure="gradients differ with offloading")


if __name__ == "__main__":
    main()
