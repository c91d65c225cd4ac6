"""Scenario 4, CUDA graphs: capture a whole training step *with offloading* and replay it.

The same model runs four ways: eager and graphed, each without and with offloading of the first
``k`` layers. The report puts side by side peak memory, step time, the saving against the
schedule's theory, and whether every replay's output and gradients equal, bit for bit, an eager
step without offloading on the same input.

Run it::

    python -m offload_examples cuda-graphs                 # full size on a GPU
    python -m offload_examples cuda-graphs --offload 3 --json results/graphs.json

The loop to copy is :func:`train`, at the top of the module.

Capture itself needs CUDA. On a CPU the scenario runs the path a capture takes, eagerly: after
one warm-up step the engine's host buffers are frozen (:meth:`OffloadEngine.freeze_host_buffers`),
so every step reuses the same buffers and pins nothing, and each step's gradients are compared
with a step without offloading.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from offload_examples import get_cpu_offload_context
from offload_examples.features.graphs import CapturedStep, capture_step
from offload_examples.instruments.cli import Need
from offload_examples.instruments.measure import (
    GradCheck, Measurement, compare_grads, deterministic_kernels, measure_steps, resident_vs_theory, snapshot,
    training_step,
)
from offload_examples.instruments.models import build_basic_model
from offload_examples.instruments.report import cpu_timing_note, format_bytes, format_table, report_header
from offload_examples.instruments.scenario_cli import scenario_main
from offload_examples.instruments.sizes import ScenarioConfig, TransformerSize
from offload_examples.instruments.timeline import overlap_ms, record_timeline

__all__ = ["GraphsConfig", "format_report", "main", "run", "train"]


def train(layers: nn.ModuleList, batches: Sequence[torch.Tensor], offload: int, lr: float = 1e-3) -> None:
    """The loop to copy: a training step with offloading, captured once in a CUDA graph and replayed for
    every batch (on CUDA; every batch has the first one's shape)."""
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=offload, model_layers=len(layers),
                                        retain_pinned_cpu_buffers=True)  # a graph replays the same buffers
    # warm-up steps, then the capture of one step: the forward through ctx and sync, and the backward
    captured = capture_step(lambda x: training_step(layers, x, ctx, sync), batches[0], layers.parameters())
    optimizer = torch.optim.AdamW(layers.parameters(), lr=lr)
    for x in batches:
        captured.replay(x)  # the gradients land in each parameter's .grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

VARIANTS = ("eager", "eager + offload", "graphed", "graphed + offload")


@dataclass
class GraphsConfig(TransformerSize, ScenarioConfig):
    """Sizes of the CUDA graph scenario. The defaults are the GPU size."""

    layers: int = 12
    offload: int = 2
    seq: int = 1024
    batch: int = 8
    replays: int = 20
    checks: int = 5
    warmup: int = 3
    kind: str = "torch"

    #: The small size, which runs in seconds on a CPU: what it changes here (the shared sizes have their own).
    SMALL = dict(layers=4, ffn=128, seq=16, batch=2, replays=3, checks=3, warmup=1)

    def memory_need(self, device_type: str) -> Need:
        """An eager step, and the captured step's private pool holding a step's activations too, with
        ``checks`` inputs; on the host the pinned buffers and the gradients of ``checks`` references and
        three steps."""
        s = self.stack(self.layers, self.batch, device_type)
        device = s.step_bytes() + s.saved_bytes(self.layers + 1) + self.checks * s.io_bytes
        return Need(device, max(s.build_bytes, s.saved_bytes(self.offload) + s.copies_bytes(self.checks + 3)))


def _check_all(refs: list[Measurement], inputs: list[torch.Tensor], step: Callable[[torch.Tensor], Measurement]
               ) -> GradCheck:
    """Run ``step`` on every input and compare its output and gradients with the references."""
    checks = [compare_grads(ref, step(x)) for ref, x in zip(refs, inputs)]
    return GradCheck(all(c.equal for c in checks), sum(c.compared for c in checks),
                     max(c.max_abs_diff for c in checks), [m for c in checks for m in c.mismatched])


def _time_replays(captured: CapturedStep, inputs: list[torch.Tensor], replays: int) -> list[float]:
    """Milliseconds per replay (new input copied in, step replayed), timed with CUDA events."""
    times = []
    for i in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        captured.replay(inputs[i % len(inputs)])
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return times


def run(config: GraphsConfig | None = None, device: torch.device | str | None = None,
        progress: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Run the scenario and return its report (see :func:`format_report`)."""
    config, device = GraphsConfig.for_run(config, device)
    if config.checks < 1 or config.replays < 1:
        raise ValueError(f"need checks >= 1 and replays >= 1, got {config.checks} and {config.replays}")
    say = progress or (lambda _: None)
    dtype = getattr(torch, config.dtype)
    model = build_basic_model(config.layers, config.hidden, config.heads, config.ffn, device=device,
                              dtype=dtype, kind=config.kind, seed=config.seed)
    gen = torch.Generator(device="cpu").manual_seed(config.seed + 1)
    inputs = [torch.randn(config.batch, config.seq, config.hidden, generator=gen, dtype=dtype).to(device)
              for _ in range(config.checks)]
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=config.offload, model_layers=config.layers,
                                        retain_pinned_cpu_buffers=True, device=device)
    say(f"cuda-graphs scenario on {device}: {config.layers} layers, offloading {config.offload}")
    # Bitwise comparisons need deterministic kernels; eager and graphed steps both use them, so
    # their times compare like with like.
    with deterministic_kernels():
        x = inputs[0].clone().requires_grad_()
        refs = [measure_steps(model, xi.clone().requires_grad_(), steps=1, warmup=0) for xi in inputs]
        steps = dict(steps=config.replays, warmup=config.warmup, progress=progress)
        eager = measure_steps(model, x, label="eager", **steps)
        offloaded = measure_steps(model, x, ctx, sync, label="eager + offload", **steps)
        eager_theory = ctx.theoretical().saving
        report = _base_report(config, device, eager_theory, ctx)
        report["rows"] = {
            "eager": _row(eager.peak_bytes, eager.step_ms),
            "eager + offload": _row(offloaded.peak_bytes, offloaded.step_ms, eager.peak_bytes, eager_theory),
        }
        if device.type == "cuda":
            _graphed(report, config, model, inputs, refs, ctx, sync, say)
        else:
            _graph_safe_eager(report, model, inputs, refs, ctx, sync, say)
    # the engine's count of offloaded bytes on the device, phase by phase, against the schedule's,
    # for the last step it ran: the captured one (replays repeat it) or the last graph-safe step
    report["resident_matches_theory"] = all(got == want for _, _, got, want in resident_vs_theory(ctx))
    return report


def _base_report(config: GraphsConfig, device: torch.device, theory: int, ctx) -> dict[str, Any]:
    return {
        **report_header("cuda-graphs", device, config),
        "theoretical_saving_bytes": theory,
        "offloaded_bytes": ctx.offloaded_bytes,
        "captured": device.type == "cuda",
    }


def _row(peak: int | None, times: list[float], reference_peak: int | None = None, theory: int = 0) -> dict:
    saving = None if peak is None or reference_peak is None else reference_peak - peak
    return {
        "peak_bytes": peak,
        "step_ms": statistics.median(times),
        "saving_bytes": saving,
        "saving_ratio": None if saving is None or not theory else saving / theory,
    }


def _graphed(report, config, model, inputs, refs, ctx, sync, say) -> None:
    """Capture the step without and with offloading; time replays and check every gradient."""
    params = list(model.parameters())
    rows = report["rows"]
    say("  capturing the step without offloading")
    plain = capture_step(lambda x: training_step(model, x), inputs[0].clone().requires_grad_(), params,
                         warmup=config.warmup)
    rows["graphed"] = _row(plain.peak_bytes, _time_replays(plain, inputs, config.replays))
    plain_check = _check_all(refs, inputs, lambda x: snapshot(model, plain.static_input, plain.replay(x)))
    model.zero_grad(set_to_none=True)  # the gradients live in the graph's pool: let it go with the graph
    del plain
    torch.cuda.empty_cache()

    say("  capturing the step with offloading")
    graphed = capture_step(lambda x: training_step(model, x, ctx, sync), inputs[0].clone().requires_grad_(),
                           params, warmup=config.warmup)
    theory = ctx.theoretical().saving  # what the engine did during the capture: every replay repeats it
    times = _time_replays(graphed, inputs, config.replays)
    rows["graphed + offload"] = _row(graphed.peak_bytes, times, rows["graphed"]["peak_bytes"], theory)
    say(f"  replayed {config.replays} times: {statistics.median(times):.1f} ms per step; checking {config.checks} replays")
    check = _check_all(refs, inputs, lambda x: snapshot(model, graphed.static_input, graphed.replay(x)))
    spans = record_timeline(lambda: graphed.replay(inputs[0]))
    busy, both = overlap_ms(spans, "device-to-host")
    report.update(
        graph_theoretical_saving_bytes=theory,
        graph_pool_bytes=graphed.pool_bytes,
        graph_host_buffer_bytes=ctx.pool.graph_bytes,
        grads_equal=check.equal and plain_check.equal,
        grads_compared=check.compared,
        max_abs_diff=max(check.max_abs_diff, plain_check.max_abs_diff),
        checks=len(refs),
        d2h_busy_ms=busy,
        d2h_overlapped_ms=both,
        timeline=spans,
    )


def _graph_safe_eager(report, model, inputs, refs, ctx, sync, say) -> None:
    """No CUDA: run the capture's rules eagerly (frozen host buffers) and check every gradient."""
    say("  no CUDA: capture needs a GPU; running the graph-safe path eagerly (frozen host buffers)")
    ctx.freeze_host_buffers()
    pinned = ctx.pool.allocations
    check = _check_all(refs, inputs, lambda x: measure_steps(model, x.clone().requires_grad_(), ctx, sync,
                                                              steps=1, warmup=0))
    report.update(grads_equal=check.equal, grads_compared=check.compared, max_abs_diff=check.max_abs_diff,
                  checks=len(refs), pinned_allocations_after_freeze=ctx.pool.allocations - pinned)


def format_report(report: dict[str, Any]) -> str:
    """The four variants side by side, then the checks."""
    c = report["config"]
    rows = []
    for name in VARIANTS:
        r = report["rows"].get(name)
        if r is None:
            rows.append((name, "needs CUDA", "", ""))
            continue
        ratio = r["saving_ratio"]
        rows.append((name, format_bytes(r["peak_bytes"]) if r["peak_bytes"] is not None else "n/a (no CUDA)",
                     f"{r['step_ms']:.1f} ms", "" if ratio is None else f"{ratio:.1%} of theory"))
    table = format_table(rows, header=("variant", "peak memory", "step time", "saving"))
    lines = [
        f"{report['device']} (torch {report['torch']}): {c['layers']} x Linear+transformer, hidden {c['hidden']}, "
        f"seq {c['seq']}, batch {c['batch']}, {c['dtype']}; offloading {c['offload']} layers",
        table,
        f"theoretical saving: {format_bytes(report['theoretical_saving_bytes'])}",
        f"output and gradients bitwise equal to eager without offloading: {report['grads_equal']} "
        f"({report['checks']} inputs, {report['grads_compared']} tensors, max |diff| {report['max_abs_diff']:.3g})",
    ]
    if report["captured"]:
        lines.append(f"device-to-host copies inside the replayed graph: {report['d2h_busy_ms']:.1f} ms, "
                     f"{report['d2h_overlapped_ms']:.1f} ms of it while kernels ran")
    else:
        lines.append(f"capture needs CUDA; graph-safe path run eagerly: "
                     f"{report['pinned_allocations_after_freeze']} host buffers pinned after the warm-up")
    return "\n".join(lines + cpu_timing_note(report))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m offload_examples cuda-graphs``: run it from the command line (see :func:`.scenario_main`)."""
    return scenario_main("cuda-graphs", __doc__, GraphsConfig, run, format_report, argv)
