"""Scenario 1, basic: offload the first ``k`` of ``N`` layers and compare with no offloading.

The model is ``N`` layers of ``nn.Linear`` followed by a transformer layer. The same model and
input run twice, without and with offloading, and the report puts side by side: peak memory,
the saving measured against the saving the schedule predicts, step time, and whether output and
gradients are bit-for-bit equal.

Run it::

    python -m offload_examples basic                 # full size on a GPU, small on a CPU
    python -m offload_examples basic --offload 2 --json results/basic.json

The loop to copy is :func:`train`, at the top of the module: all a training loop needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from offload_examples import get_cpu_offload_context
from offload_examples.instruments.cli import Need
from offload_examples.instruments.measure import compare_grads, deterministic_kernels, measure_steps, resident_vs_theory
from offload_examples.instruments.models import build_basic_model
from offload_examples.instruments.report import cpu_timing_note, format_bytes, format_table, report_header
from offload_examples.instruments.scenario_cli import scenario_main
from offload_examples.instruments.sizes import ScenarioConfig, Timing, TransformerSize

__all__ = ["BasicConfig", "format_report", "main", "run", "train"]


def train(layers: nn.ModuleList, batches: Iterable[torch.Tensor], offload: int, lr: float = 1e-3) -> None:
    """The loop to copy: what the first ``offload`` layers save for backward waits in host memory."""
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=offload, model_layers=len(layers))
    optimizer = torch.optim.AdamW(layers.parameters(), lr=lr)
    for x in batches:
        for layer in layers:
            with ctx:  # one entry per layer: the first `offload` are copied out, released, reloaded in time
                x = layer(x)
            x = sync(x)  # in the backward, starts the reloads ahead of time
        x.float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@dataclass
class BasicConfig(TransformerSize, Timing, ScenarioConfig):
    """Sizes of the basic scenario. The defaults are the full GPU size (about 19 GiB peak)."""

    layers: int = 20
    offload: int = 3
    batch: int = 16
    kind: str = "auto"
    retain_pinned: bool = True

    #: The small size, which runs in seconds on a CPU: what it changes here (the shared sizes have their own).
    SMALL = dict(layers=6, offload=2, batch=4, kind="torch")

    def memory_need(self, device_type: str) -> Need:
        """A training step; on the host the model as built (float32), or the offloaded layers' pinned
        buffers and four steps' gradients (two measured runs and the gradient check)."""
        s = self.stack(self.layers, self.batch, device_type)
        return Need(s.step_bytes(), max(s.build_bytes, s.saved_bytes(self.offload) + s.copies_bytes(4)))


def run(config: BasicConfig | None = None, device: torch.device | str | None = None,
        progress: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Run the scenario and return its report (see :func:`format_report`)."""
    # also fixes cuBLAS's workspace, so that both runs reduce in the same order (bitwise check)
    config, device = BasicConfig.for_run(config, device)
    dtype = getattr(torch, config.dtype)
    say = progress or (lambda _: None)
    say(f"basic scenario on {device}: {config.layers} layers, offloading {config.offload}")
    model = build_basic_model(
        config.layers, config.hidden, config.heads, config.ffn, device=device, dtype=dtype, kind=config.kind,
        seed=config.seed,
    )
    gen = torch.Generator(device="cpu").manual_seed(config.seed + 1)
    x = torch.randn(config.batch, config.seq, config.hidden, generator=gen, dtype=dtype).to(device).requires_grad_()

    steps = dict(steps=config.steps, warmup=config.warmup, progress=progress)
    without = measure_steps(model, x, label="no offload", **steps)
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=config.offload, model_layers=config.layers,
        retain_pinned_cpu_buffers=config.retain_pinned, device=device,
    )
    with_ = measure_steps(model, x, ctx, sync, label=f"offload {config.offload}/{config.layers}", **steps)
    # read what the engine did in the last measured step before the gradient check runs another
    theory, resident, stats, events = ctx.theoretical(), resident_vs_theory(ctx), ctx.stats, ctx.events
    say("  gradient check: one more step each, with deterministic kernels")
    with deterministic_kernels():
        grads = compare_grads(measure_steps(model, x, steps=1, warmup=0),
                              measure_steps(model, x, ctx, sync, steps=1, warmup=0))

    saving = None if without.peak_bytes is None else without.activation_peak_bytes - with_.activation_peak_bytes
    return {
        **report_header("basic", device, config),
        "peak_without_bytes": without.peak_bytes,
        "peak_with_bytes": with_.peak_bytes,
        "saving_bytes": saving,
        "theoretical_saving_bytes": theory.saving,
        "saving_ratio": None if saving is None or not theory.saving else saving / theory.saving,
        "offloaded_bytes": sum(s.offloaded_bytes for s in stats),
        "offloaded_tensors": sum(s.offloaded_tensors for s in stats),
        "offloaded_bytes_per_layer": [s.offloaded_bytes for s in stats],
        "saved_bytes_per_layer": [s.candidate_bytes for s in stats],
        "step_ms_without": without.median_ms,
        "step_ms_with": with_.median_ms,
        "overhead": with_.median_ms / without.median_ms - 1,
        "grads_equal": grads.equal,
        "grads_compared": grads.compared,
        "max_abs_diff": grads.max_abs_diff,
        "resident_matches_theory": all(got == want for _, _, got, want in resident),
        "pinned_allocations": ctx.pool.allocations,
        "events": events,
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as a two-column table."""
    c = report["config"]
    ratio = report["saving_ratio"]
    rows = [
        ("device", f"{report['device']} (torch {report['torch']})"),
        ("model", f"{c['layers']} x Linear+transformer, hidden {c['hidden']}, seq {c['seq']}, "
                  f"batch {c['batch']}, {c['dtype']}"),
        ("offloaded layers", f"{c['offload']} of {c['layers']}"),
        ("peak memory without offloading", format_bytes(report["peak_without_bytes"])),
        ("peak memory with offloading", format_bytes(report["peak_with_bytes"])),
        ("saving (measured)", format_bytes(report["saving_bytes"])),
        ("saving (theoretical)", format_bytes(report["theoretical_saving_bytes"])),
        ("measured / theoretical", "n/a (no CUDA)" if ratio is None else f"{ratio:.1%}"),
        ("bytes copied to host per step", format_bytes(report["offloaded_bytes"])),
        ("step time without / with", f"{report['step_ms_without']:.1f} ms / {report['step_ms_with']:.1f} ms"),
        ("overhead", f"{report['overhead']:+.1%}"),
        ("output and gradients bitwise equal",
         f"{report['grads_equal']} ({report['grads_compared']} tensors, max |diff| {report['max_abs_diff']:.3g})"),
        ("resident bytes follow the schedule", str(report["resident_matches_theory"])),
    ]
    return "\n".join([format_table(rows, header=("basic scenario", "")), *cpu_timing_note(report)])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m offload_examples basic``: run it from the command line (see :func:`.scenario_main`)."""
    return scenario_main("basic", __doc__, BasicConfig, run, format_report, argv,
                         extra=lambda p: p.add_argument("--no-retain-pinned", dest="retain_pinned", action="store_false",
                                                        default=None, help="empty the pinned host buffers after "
                                                        "every step (default: keep them for the next step)"))
