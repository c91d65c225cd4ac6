"""Scenario 4, CUDA graphs: capture training steps *with offloading* and replay them.

The same model runs six ways: eager, graphed as a whole step, and graphed layer by layer (each
layer's forward and backward in graphs of their own, the rest of the step eager), each without and
with offloading of the first ``k`` layers. The report puts side by side peak memory (for per-layer
graphs, the pool they share), step time with all six taking turns step by step, the saving against
the schedule's theory, each offloading variant's overhead against the same variant without it,
round by round with its spread, and whether every replay's output and gradients equal, bit for
bit, an eager step without offloading on the same input.

Run it::

    python -m offload_examples cuda-graphs                 # full size on a GPU
    python -m offload_examples cuda-graphs --offload 3 --json results/graphs.json

The loops to copy are :func:`train` (the whole step in one graph) and :func:`train_per_layer`
(one graph per layer), at the top of the module.

Capture itself needs CUDA. On a CPU the scenario runs the path a capture takes, eagerly: after
one warm-up step the engine's host buffers are frozen (:meth:`OffloadEngine.freeze_host_buffers`),
so every step reuses the same buffers and pins nothing, and each step's gradients are compared
with a step without offloading.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import nn

from offload_examples import get_cpu_offload_context
from offload_examples.features.graphs import capture_step, make_graphed_layers
from offload_examples.instruments.cli import Need
from offload_examples.instruments.bandwidth import link_bandwidth
from offload_examples.instruments.graph_variants import (
    VARIANTS, capture_training_step, check_replays, format_report, graph_safe_checks, graphed_copy_bound_ms,
    graphed_layer_ms, memory_row, over_the_larger, per_layer_step, pool_growth, replaying, summarize_checks,
    te_offload_variants, time_in_turns, warm_capture_stream,
)
from offload_examples.instruments.measure import (
    GradCheck, Run, deterministic_kernels, measure_steps, resident_vs_theory, snapshot, training_step,
)
from offload_examples.instruments.models import build_basic_model
from offload_examples.instruments.report import report_header
from offload_examples.instruments.scenario_cli import scenario_main
from offload_examples.instruments.sizes import ScenarioConfig, TransformerSize
from offload_examples.instruments.timeline import overlap_ms, record_timeline

__all__ = ["GraphsConfig", "format_report", "main", "run", "train", "train_per_layer"]


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


def train_per_layer(layers: nn.ModuleList, batches: Sequence[torch.Tensor], offload: int, lr: float = 1e-3) -> None:
    """The loop to copy for per-layer graphs: each layer's forward and backward captured in graphs of
    their own, with offloading; the loss, the call of the backward and the optimizer run eagerly (on
    CUDA; every batch has the first one's shape)."""
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=offload, model_layers=len(layers),
                                        retain_pinned_cpu_buffers=True)  # the graphs replay the same buffers
    # whole warm-up steps, then each layer's graphs; ctx and sync are inside them: call them in place of the layers
    graphed = make_graphed_layers(list(layers), batches[0], ctx, sync)
    optimizer = torch.optim.AdamW(layers.parameters(), lr=lr)
    for x in batches:
        h = x
        for layer in graphed:
            h = layer(h)
        h.float().square().mean().backward()  # replays the backward graphs, last layer first
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


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
    #: ``"graphed"`` leaves the whole-step graphs out (their pools are the largest), else ``""``.
    skip: str = field(default="", metadata={"choices": ("", "graphed")})

    #: The small size, which runs in seconds on a CPU: what it changes here (the shared sizes have their own).
    SMALL = dict(layers=4, ffn=128, seq=16, batch=2, replays=3, checks=3, warmup=1)

    def check(self) -> None:
        if self.skip not in ("", "graphed"):
            raise ValueError(f"skip must be 'graphed' or empty, got {self.skip!r}")

    def memory_need(self, device_type: str) -> Need:
        """An eager step, and on CUDA four graphs' private pools (a whole step's and per-layer ones, without
        and with offloading), each holding a step's activations and gradients, with ``checks`` inputs; on the
        host the pinned buffers of the offloading contexts and the gradients of ``checks`` references, of two
        measured steps and of every variant's last timed step."""
        s = self.stack(self.layers, self.batch, device_type)
        pools, contexts = (4, 3) if device_type == "cuda" else (1, 2)
        device = s.step_bytes() + pools * (s.saved_bytes(self.layers + 1) + s.param_bytes) + self.checks * s.io_bytes
        copies = s.copies_bytes(self.checks + 2 + len(VARIANTS))
        return Need(device, max(s.build_bytes, contexts * s.saved_bytes(self.offload) + copies))


def _offload_context(config: GraphsConfig, device: torch.device) -> tuple[Any, Callable]:
    """A context offloading the first ``config.offload`` layers; a graph replays the buffers it kept."""
    return get_cpu_offload_context(enabled=True, num_layers=config.offload, model_layers=config.layers,
                                   retain_pinned_cpu_buffers=True, device=device)


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
    ctx, sync = _offload_context(config, device)
    say(f"cuda-graphs scenario on {device}: {config.layers} layers, offloading {config.offload}")
    # Bitwise comparisons need deterministic kernels; every variant runs them, in its timed steps too,
    # so that their times compare like with like.
    with deterministic_kernels():
        x = inputs[0].clone().requires_grad_()
        refs = [measure_steps(model, xi.clone().requires_grad_(), steps=1, warmup=0) for xi in inputs]
        # the eager peaks, each over steps of its own before any graph exists; the times come from the turns
        steps = dict(steps=config.replays, warmup=config.warmup, progress=progress)
        eager = measure_steps(model, x, label="eager", **steps)
        offloaded = measure_steps(model, x, ctx, sync, label="eager + offload", **steps)
        report = {**report_header("cuda-graphs", device, config), "theoretical_saving_bytes": ctx.theoretical().saving,
                  "offloaded_bytes": ctx.offloaded_bytes, "captured": device.type == "cuda"}
        report["rows"] = {"eager": memory_row(eager.peak_bytes), "eager + offload": memory_row(
            offloaded.peak_bytes, eager.peak_bytes, report["theoretical_saving_bytes"])}
        # the eager steps with offloading take turns through a context of their own: the host buffers of
        # ctx go to the graph captured with it (or are frozen, on a CPU)
        eager_ctx, eager_sync = _offload_context(config, device)
        runs = {"eager": (model, x, partial(training_step, model, x)),
                "eager + offload": (model, x, partial(training_step, model, x, eager_ctx, eager_sync))}
        if device.type == "cuda":
            checks = {} if config.skip else _graphed(report, config, model, inputs, refs, (ctx, sync), runs, say)
            checks |= _per_layer(report, config, model, inputs, refs, runs, say)
            if config.kind == "te":  # Transformer Engine's own offloading, on its layers
                say("  Transformer Engine's offloading: eager, and the whole step captured")
                rows, te_runs, te_checks = te_offload_variants(model, inputs, refs, config.offload, config.warmup,
                                                               report["rows"])
                report["rows"].update(rows)
                runs.update(te_runs)
                checks |= te_checks
        else:
            say("  no CUDA: capture needs a GPU; running the graph-safe path eagerly (frozen host buffers)")
            checks = graph_safe_checks(report, model, inputs, refs, ctx, sync)
        report.update(summarize_checks(checks), checks=len(refs))
        say(f"  timing: the {len(runs)} variants take turns step by step")
        report["rounds"] = time_in_turns(runs, report["rows"], config.warmup, config.replays)
        if device.type == "cuda":
            rows = report["rows"]
            report["per_layer_over_reference"] = over_the_larger(rows["per-layer graphs + offload"]["step_ms"],
                                                                 rows["per-layer graphs"]["step_ms"],
                                                                 report["copy_bound_ms"])
    # the engine's count of offloaded bytes on the device, phase by phase, against the schedule's,
    # for the last step ctx ran: the captured one (replays repeat it) or the last graph-safe step
    report["resident_matches_theory"] = all(got == want for _, _, got, want in resident_vs_theory(ctx))
    return report


def _graphed(report, config, model, inputs, refs, offload, runs, say) -> dict[str, GradCheck]:
    """Capture the whole step without and with offloading, each one's peak taken alone; check their
    replays; add them to ``runs``."""
    def capture(ctx=None, sync=None):
        return capture_training_step(model, inputs[0].clone().requires_grad_(), ctx, sync, warmup=config.warmup)

    rows = report["rows"]
    say("  capturing the step without offloading")
    rows["graphed"] = memory_row(capture().peak_bytes)
    # its gradients and output, in its pool, would count in the next capture's peak: it goes at once
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    say("  capturing the step with offloading")
    graphed = capture(*offload)
    theory = offload[0].theoretical().saving  # what the engine did during the capture: every replay repeats it
    rows["graphed + offload"] = memory_row(graphed.peak_bytes, rows["graphed"]["peak_bytes"], theory)
    say("  capturing the step without offloading again, to replay it beside the others")
    captured = {"graphed": capture(), "graphed + offload": graphed}
    checks = {name: check_replays(refs, inputs, lambda x, g=g: snapshot(model, g.static_input, g.replay(x)))
              for name, g in captured.items()}
    runs.update({name: (model, g.static_input, replaying(g, inputs)) for name, g in captured.items()})
    spans = record_timeline(lambda: graphed.replay(inputs[0]))
    busy, both = overlap_ms(spans, "device-to-host")
    report.update(graph_theoretical_saving_bytes=theory, graph_pool_bytes=graphed.pool_bytes,
                  graph_host_buffer_bytes=offload[0].pool.graph_bytes, d2h_busy_ms=busy, d2h_overlapped_ms=both,
                  timeline=spans)
    return checks


def _per_layer(report, config, model, inputs, refs, runs: dict[str, Run], say) -> dict[str, GradCheck]:
    """Capture each layer in graphs of its own without and with offloading, each one's pool measured;
    check their replays; add them to ``runs``."""
    backend = "te" if config.kind == "te" else "torch"
    x = inputs[0].clone().requires_grad_()
    warm_capture_stream(model, x)  # cuBLAS's workspace for its stream: in neither pool
    pools, checks, offload = {}, {}, _offload_context(config, x.device)
    for name, (ctx, sync) in (("per-layer graphs", get_cpu_offload_context(enabled=False)),
                              ("per-layer graphs + offload", offload)):
        say(f"  capturing each layer in graphs of its own ({name}, {backend} backend)")
        graphed, pools[name] = pool_growth(partial(make_graphed_layers, list(model), x, ctx, sync, backend=backend,
                                                   warmup=config.warmup))
        checks[name] = check_replays(refs, inputs, partial(per_layer_step, model, graphed))
        runs[name] = (model, x, partial(training_step, graphed, x))
        if ctx is not offload[0]:  # the layers' compute, which the copies hide behind
            layer_ms = graphed_layer_ms({name: graphed}, model, x)[name]
    theory = offload[0].theoretical().saving  # what the engine did during the capture: every replay repeats it
    report["link_gb_per_s"] = link_bandwidth()
    report["copy_bound_ms"] = graphed_copy_bound_ms(offload[0], *layer_ms, report["link_gb_per_s"])
    plain, offloaded = pools["per-layer graphs"], pools["per-layer graphs + offload"]
    report["rows"].update({"per-layer graphs": memory_row(plain, key="pool_bytes"),
                           "per-layer graphs + offload": memory_row(offloaded, plain, theory, key="pool_bytes")})
    report.update(per_layer_backend=backend, per_layer_offloaded_bytes=offload[0].offloaded_bytes,
                  per_layer_theoretical_saving_bytes=theory)
    return checks


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m offload_examples cuda-graphs``: run it from the command line (see :func:`.scenario_main`)."""
    return scenario_main("cuda-graphs", __doc__, GraphsConfig, run, format_report, argv)
