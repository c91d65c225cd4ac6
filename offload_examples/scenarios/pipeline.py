"""Scenario 2, pipeline order on one GPU: one layer, 8 micro-batches, forwards and backwards interleaved.

A pipeline stage runs its micro-batches in an order such as 1F1B, where backwards start before
all forwards are done. "Offload the first k layers" does not describe that; a
``synchronization_dict`` does: for each offloaded micro-batch, the phase at which its copy must be
finished (and its GPU memory released), and the phase at which its reload starts (:data:`SYNC_DICT`).
The loop to copy is :func:`train`, at the top of the module; :func:`manual_step` is the same schedule
written with the manual synchronizer. Run it::

    python -m offload_examples pipeline            # full size on a GPU, small on a CPU
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from offload_examples import get_cpu_offload_context
from offload_examples.core.orders import parse_order, sync_dict_for_order
from offload_examples.instruments.cli import Need
from offload_examples.instruments.measure import compare_grads, deterministic_kernels, measure_steps, resident_vs_theory
from offload_examples.instruments.models import build_basic_model
from offload_examples.instruments.report import cpu_timing_note, format_bytes, format_table, report_header
from offload_examples.instruments.scenario_cli import scenario_main
from offload_examples.instruments.sizes import MicroBatches, ScenarioConfig, Timing, TransformerSize

__all__ = ["ORDER", "SYNC_DICT", "PipelineConfig", "format_report", "main", "manual_step", "pipeline_step", "run",
           "train"]

#: One stage's order of phases: four warm-up forwards, then one backward and one forward, ...
ORDER = "0F 1F 2F 3F 0B 4F 1B 5F 2B 6F 3B 7F 4B 5B 6B 7B"

#: Offload micro-batches 1..6: ``{i: (offload_fwd, offload_num, reload_fwd, reload_num)}``.
SYNC_DICT = {
    1: (False, 0, True, 4),
    2: (False, 0, True, 5),
    3: (True, 4, True, 6),
    4: (True, 5, True, 7),
    5: (True, 6, False, 4),
    6: (True, 7, False, 5),
}


def train(layer: nn.Module, batches: Iterable[torch.Tensor], lr: float = 1e-3) -> None:
    """The loop to copy: one stage's layer on its 8 micro-batches in :data:`ORDER`, offloaded as
    :data:`SYNC_DICT` says (``batch[j]`` of each batch is micro-batch ``j``)."""
    ctx, sync = get_cpu_offload_context(enabled=True, model_layers=8, synchronization_dict=SYNC_DICT)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=lr)
    for batch in batches:
        pipeline_step(layer, batch, parse_order(ORDER), ctx, sync)  # each micro-batch's forward, then its backward
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def pipeline_step(layer: nn.Module, x: torch.Tensor, order: Sequence[tuple[str, int]], ctx=None,
                  sync: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  before: Callable[[str, int], None] | None = None,
                  after_forward: Callable[[int], None] | None = None) -> torch.Tensor:
    """Run micro-batch ``j`` = ``x[j]`` through ``layer`` in ``order``; return the outputs.

    ``before(phase, j)`` runs before each phase and ``after_forward(j)`` after each forward
    (where manual synchronization calls go).
    """
    outs: dict[int, torch.Tensor] = {}
    results = [None] * x.shape[0]
    for phase, j in order:
        if before is not None:
            before(phase, j)
        if phase == "forward":
            with ctx if ctx is not None else contextlib.nullcontext():
                out = layer(x[j])
            outs[j] = sync(out) if sync is not None else out
            if after_forward is not None:
                after_forward(j)
        else:
            out = outs.pop(j)
            out.float().square().mean().backward()
            results[j] = out.detach()
    return torch.stack(results)


def manual_step(layer: nn.Module, x: torch.Tensor, ctx, sync, synchronizer) -> torch.Tensor:
    """:data:`SYNC_DICT` written out as calls to the manual synchronizer.

    Each call sits where the dict's trigger would fire: releases and reloads just before the
    phase that triggers them, the start of each copy right after the micro-batch's forward.
    """
    release_before = {("backward", 0): [1, 2], ("forward", 4): [3], ("forward", 5): [4],
                      ("forward", 6): [5], ("forward", 7): [6]}
    reload_before = {("forward", 4): [1], ("forward", 5): [2], ("forward", 6): [3],
                     ("forward", 7): [4], ("backward", 4): [5], ("backward", 5): [6]}

    def before(phase: str, j: int) -> None:
        for i in release_before.get((phase, j), []):
            synchronizer.release_activation_forward_gpu_memory(i)  # compute waits for i's copy
        for i in reload_before.get((phase, j), []):
            synchronizer.start_reload_layer(i)  # host-to-device copy starts now

    def after_forward(j: int) -> None:
        if j in SYNC_DICT:
            synchronizer.start_offload_layer(j)  # device-to-host copy starts now

    return pipeline_step(layer, x, parse_order(ORDER), ctx, sync, before, after_forward)


@dataclass
class PipelineConfig(TransformerSize, MicroBatches, Timing, ScenarioConfig):
    """Sizes of the pipeline scenario. The defaults are the full GPU size."""

    kind: str = "auto"

    #: The small size, which runs in seconds on a CPU: what it changes here (the shared sizes have their own).
    SMALL = dict(kind="torch")

    def memory_need(self, device_type: str) -> Need:
        """One layer holding what every micro-batch saves (no offloading), plus one micro-batch's backward
        temporaries, and the inputs; on the host three engines' pinned buffers (each up to every
        micro-batch) and eight steps' gradients."""
        one = self.stack(1, self.micro_batch, device_type)
        every = self.stack(1, self.microbatches * self.micro_batch, device_type)
        device = 2 * every.param_bytes + every.saved_bytes() + one.saved_bytes() + 3 * every.io_bytes
        return Need(device, max(every.build_bytes, 3 * every.saved_bytes() + every.copies_bytes(8)))

    def check(self) -> None:
        if self.microbatches != 8:
            raise ValueError(f"the scenario's order and schedule are written for 8 micro-batches, got {self.microbatches}")


def run(config: PipelineConfig | None = None, device: torch.device | str | None = None,
        progress: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Run the order without offloading, with :data:`SYNC_DICT`, with the same schedule by hand,
    and with a schedule that also releases during the warm-up; return the report."""
    config, device = PipelineConfig.for_run(config, device)
    if config.microbatches != 8:
        raise ValueError("the scenario's order and schedule are written for 8 micro-batches")
    dtype = getattr(torch, config.dtype)
    say = progress or (lambda _: None)
    model = build_basic_model(1, config.hidden, config.heads, config.ffn, device=device, dtype=dtype,
                              kind=config.kind, seed=config.seed)
    layer = model[0]
    gen = torch.Generator(device="cpu").manual_seed(config.seed + 1)
    x = torch.randn(config.microbatches, config.micro_batch, config.seq, config.hidden, generator=gen, dtype=dtype)
    x = x.to(device).requires_grad_()
    order = parse_order(ORDER)
    say(f"pipeline scenario on {device}: 1 layer, {config.microbatches} micro-batches, order {ORDER}")

    def engine(**schedule: Any):  # a synchronization_dict, or manual_synchronization=True
        return get_cpu_offload_context(enabled=True, model_layers=8, retain_pinned_cpu_buffers=True, device=device,
                                       **schedule)

    early = sync_dict_for_order(order, offload=range(1, 7), release_after=2)
    cases: dict[str, tuple] = {
        "no offload": engine(synchronization_dict={}),  # the same hooks, nothing offloaded: the baseline
        "synchronization_dict": engine(synchronization_dict=SYNC_DICT),
        "manual synchronizer": engine(manual_synchronization=True),
        "early-release dict": engine(synchronization_dict=early),
    }

    def step_fn(name: str):
        tools = cases[name]
        if name == "manual synchronizer":
            return lambda: manual_step(layer, x, *tools)
        return lambda: pipeline_step(layer, x, order, *tools)

    steps = dict(steps=config.steps, warmup=config.warmup, progress=progress)
    rows = {}
    for name in cases:
        ctx = cases[name][0]
        m = measure_steps(model, x, label=name, step=step_fn(name), **steps)
        ctx.record_memory = True
        step_fn(name)()
        ctx.record_memory = False
        model.zero_grad(set_to_none=True)
        x.grad = None
        theory = ctx.theoretical()
        rows[name] = {
            "measurement": m,
            "theory_peak_saved_bytes": theory.peak_with,
            "theory_peak_without_bytes": theory.peak_without,
            "offloaded_bytes": ctx.offloaded_bytes,
            "saved_bytes_per_microbatch": [st.candidate_bytes for st in ctx.stats],
            "resident_matches_theory": all(g == w for _, _, g, w in resident_vs_theory(ctx)),
            "memory_trace": list(ctx.memory_trace),
            "phase_order": ctx.phase_order(),
            "events": list(ctx.events),
        }
    say("  gradient check: one more step each, with deterministic kernels")
    with deterministic_kernels():
        ref = measure_steps(model, x, steps=1, warmup=0, step=step_fn("no offload"))
        checks = {name: compare_grads(ref, measure_steps(model, x, steps=1, warmup=0, step=step_fn(name)))
                  for name in cases if name != "no offload"}
    base = rows["no offload"]["measurement"]
    report_cases = {}
    for name, r in rows.items():
        m = r["measurement"]
        saving = None if m.peak_bytes is None else base.activation_peak_bytes - m.activation_peak_bytes
        theory_saving = r["theory_peak_without_bytes"] - r["theory_peak_saved_bytes"]
        report_cases[name] = {
            "peak_bytes": m.peak_bytes,
            "activation_peak_bytes": m.activation_peak_bytes,
            "saving_bytes": saving,
            "theoretical_saving_bytes": theory_saving,
            "saving_ratio": None if saving is None or not theory_saving else saving / theory_saving,
            "theory_peak_saved_bytes": r["theory_peak_saved_bytes"],
            "offloaded_bytes": r["offloaded_bytes"],
            "step_ms": m.median_ms,
            "overhead": m.median_ms / base.median_ms - 1,
            "grads_equal": True if name == "no offload" else checks[name].equal,
            "resident_matches_theory": r["resident_matches_theory"],
            "memory_trace": r["memory_trace"],
            "phase_order": r["phase_order"],
            "events": r["events"],
        }
    return {
        **report_header("pipeline", device, config),
        "order": ORDER,
        "sync_dict": {str(k): v for k, v in SYNC_DICT.items()},
        "early_sync_dict": {str(k): v for k, v in early.items()},
        "saved_bytes_per_microbatch": rows["no offload"]["saved_bytes_per_microbatch"][0],
        "cases": report_cases,
        "grads_equal": all(c.equal for c in checks.values()),
        "order_followed": all(r["phase_order"] == order for r in rows.values()),
    }


def format_report(report: dict[str, Any]) -> str:
    """One row per case: peak memory, saving against theory, step time, gradients."""
    rows = []
    for name, c in report["cases"].items():
        ratio = "n/a" if c["saving_ratio"] is None else f"{c['saving_ratio']:.1%}"
        rows.append((name, format_bytes(c["peak_bytes"]), format_bytes(c["saving_bytes"]),
                     format_bytes(c["theoretical_saving_bytes"]), ratio, format_bytes(c["offloaded_bytes"]),
                     f"{c['step_ms']:.1f} ms", f"{c['overhead']:+.1%}", str(c["grads_equal"])))
    header = ("case", "peak", "saving", "theory", "ratio", "to host", "step", "overhead", "grads equal")
    return "\n".join([f"pipeline scenario on {report['device']}, order {report['order']}",
                      format_table(rows, header=header), *cpu_timing_note(report)])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m offload_examples pipeline``: run it from the command line (see :func:`.scenario_main`)."""
    # the order and schedule are written for these sizes: only --device, --small and --json
    return scenario_main("pipeline", __doc__, PipelineConfig, run, format_report, argv, sizes=False,
                         failure="gradients differ with offloading")

if __name__ == "__main__":
    main()
