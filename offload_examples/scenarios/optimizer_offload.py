"""Scenario 6, optimizer-state offload: Adam's moments of a fraction of the parameters on the host.

The same model trains for a few steps with the plain optimizer and with
:class:`~offload_examples.features.optim_offload.OptimizerOffload` at fractions from 0 to 1. For each the
report gives the GPU memory after the steps (weights, optimizer state), the saving against the
state bytes the offloaded parameters would hold on the GPU, the step time, and how far the
parameters are from the plain optimizer's.

Run it::

    python -m offload_examples optimizer-offload  # full size on a GPU
    python -m offload_examples optimizer-offload --fractions 0,0.5,1 \\
        --json results/optim.json

The loop to copy is :func:`train`, at the top of the module.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from offload_examples.features.optim_offload import OptimizerOffload
from offload_examples.instruments.cli import Need, Stack, fractions_arg
from offload_examples.instruments.measure import StepReport, training_step
from offload_examples.instruments.models import build_linear_stack
from offload_examples.instruments.report import cpu_timing_note, format_bytes, format_table, report_header
from offload_examples.instruments.scenario_cli import scenario_main
from offload_examples.instruments.sizes import ScenarioConfig, Timing

__all__ = ["OptimizerConfig", "format_report", "main", "run", "train"]


def train(layers: nn.ModuleList, batches: Iterable[torch.Tensor], fraction: float = 0.5, lr: float = 1e-3) -> None:
    """The loop to copy: Adam's state of the first ``fraction`` of the parameter bytes lives, and is updated,
    on the host."""
    # closed at the end: the hooks removed, the pinned buffers given back
    with OptimizerOffload(layers.parameters(), torch.optim.Adam, fraction, lr=lr) as optimizer:
        for x in batches:
            for layer in layers:
                x = layer(x)
            x.float().square().mean().backward()  # each offloaded gradient is copied out as soon as it is ready
            optimizer.step()  # the host updates its part while the device updates the rest
            optimizer.zero_grad(set_to_none=True)


@dataclass
class OptimizerConfig(Timing, ScenarioConfig):
    """Sizes of the optimizer scenario: ``layers`` blocks of Linear(width, 4 width), GELU,
    Linear(4 width, width) in fp32, trained with Adam. The defaults are the GPU size."""

    layers: int = 8
    width: int = 2048
    seq: int = 1024
    batch: int = 4
    fractions: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    lr: float = 1e-3
    steps: int = 10

    #: The small size, which runs in seconds on a CPU: what it changes here (the step counts have their own).
    SMALL = dict(layers=3, width=32, seq=8, batch=2, steps=4)

    def memory_need(self, device_type: str) -> Need:
        """A training step with Adam's two moments and four inputs; on the host the parameters after the
        first and the last step of every run, and Adam's moments and the gradients of the offloaded part."""
        s = Stack.linear(self.layers, self.width, self.batch * self.seq, "float32")
        kept = 2 * (1 + len(self.fractions)) * s.param_bytes
        return Need(s.step_bytes(states=2) + 3 * s.io_bytes, max(s.build_bytes, kept + 3 * s.param_bytes))

    def check(self) -> None:
        if not self.fractions or not all(math.isfinite(f) and 0.0 <= f <= 1.0 for f in self.fractions):
            raise ValueError(f"fractions must be one or more numbers between 0 and 1, got {self.fractions}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr}")


def _train(config: OptimizerConfig, device: torch.device, fraction: float | None,
           progress: Callable[[str], None] | None) -> dict[str, Any]:
    """Train ``warmup + steps`` steps; memory, time, and the parameters after the first and last step."""
    model = build_linear_stack(config.layers, config.width, device=device, seed=config.seed)
    gen = torch.Generator(device="cpu").manual_seed(config.seed + 1)
    xs = [torch.randn(config.batch, config.seq, config.width, generator=gen).to(device) for _ in range(4)]
    if fraction is None:
        opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    else:
        opt = OptimizerOffload(model.parameters(), torch.optim.Adam, fraction, lr=config.lr)
    cuda = device.type == "cuda"
    times, first = [], None
    label = "plain Adam" if fraction is None else f"fraction {fraction:g}"
    steps = StepReport(progress, label, config.warmup, config.steps)
    for i in range(config.warmup + config.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        training_step(model, xs[i % len(xs)])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        if i >= config.warmup:
            times.append(ms)
        steps.step(i, ms, times)
        if i == 0:
            first = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    out = {
        "label": label,
        "fraction": fraction,
        "step_ms": statistics.median(times),
        "gpu_bytes": torch.cuda.memory_allocated(device) if cuda else None,
        "first": first,
        "last": [p.detach().to("cpu", copy=True) for p in model.parameters()],
    }
    if fraction is not None:
        out.update(offloaded_fraction=opt.offloaded_fraction, state_bytes=opt.state_bytes(),
                   theoretical_saving_bytes=opt.theoretical_device_saving(), late_grad_copies=opt.late_grad_copies)
        opt.close()
    del model, opt
    return out


def _difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, Any]:
    """How far two parameter lists are apart: bitwise, worst element, worst relative L2 per tensor."""
    return {
        "bitwise": all(torch.equal(x, y) for x, y in zip(a, b)),
        "max_abs": max((x - y).abs().max().item() for x, y in zip(a, b)),
        "max_rel_l2": max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b)),
    }


def run(config: OptimizerConfig | None = None, device: torch.device | str | None = None,
        progress: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Run the scenario and return its report (see :func:`format_report`)."""
    config, device = OptimizerConfig.for_run(config, device)
    say = progress or (lambda _: None)
    say(f"optimizer-offload scenario on {device}: {config.layers} layers of width {config.width}, Adam")
    torch.use_deterministic_algorithms(True, warn_only=True)  # the same gradients in every run
    try:
        plain = _train(config, device, None, progress)
        runs = [_train(config, device, f, progress) for f in config.fractions]
    finally:
        torch.use_deterministic_algorithms(False)
    rows = []
    for r in runs:
        saving = None if plain["gpu_bytes"] is None else plain["gpu_bytes"] - r["gpu_bytes"]
        theory = r["theoretical_saving_bytes"]
        rows.append({
            "fraction": r["fraction"], "offloaded_fraction": r["offloaded_fraction"], "step_ms": r["step_ms"],
            "gpu_bytes": r["gpu_bytes"], "saving_bytes": saving, "theoretical_saving_bytes": theory,
            "saving_ratio": None if saving is None or not theory else saving / theory,
            "state_bytes": r["state_bytes"], "late_grad_copies": r["late_grad_copies"],
            "after_first_step": _difference(r["first"], plain["first"]),
            "after_last_step": _difference(r["last"], plain["last"]),
        })
    zero = [r for r in rows if r["fraction"] == 0.0]
    return {
        **report_header("optimizer-offload", device, config),
        "plain": {"step_ms": plain["step_ms"], "gpu_bytes": plain["gpu_bytes"]},
        "rows": rows,
        "offloaded_bytes": max(r["state_bytes"]["host"] for r in rows),
        # fraction 0 must be the plain optimizer exactly; on a CPU every fraction must be
        "grads_equal": all(r["after_last_step"]["bitwise"] for r in (rows if device.type == "cpu" else zero)),
    }


def format_report(report: dict[str, Any]) -> str:
    """One row per fraction, with the plain optimizer first."""
    c = report["config"]
    table = [("plain Adam", "", format_bytes(report["plain"]["gpu_bytes"]) if report["plain"]["gpu_bytes"] else "n/a",
              "", f"{report['plain']['step_ms']:.1f} ms", "", "")]
    for r in report["rows"]:
        ratio = "" if r["saving_ratio"] is None else f"{r['saving_ratio']:.1%}"
        first, last = r["after_first_step"], r["after_last_step"]
        table.append((
            f"fraction {r['fraction']:g}", f"{r['offloaded_fraction']:.2f}",
            format_bytes(r["gpu_bytes"]) if r["gpu_bytes"] is not None else "n/a (no CUDA)",
            f"{format_bytes(r['theoretical_saving_bytes'])} ({ratio})" if ratio else format_bytes(
                r["theoretical_saving_bytes"]),
            f"{r['step_ms']:.1f} ms",
            "bitwise" if first["bitwise"] else f"{first['max_abs']:.1e}",
            "bitwise" if last["bitwise"] else f"{last['max_abs']:.1e} (L2 {last['max_rel_l2']:.1e})",
        ))
    header = ("optimizer", "offloaded", "GPU memory", "state off the GPU (measured/theory)", "step time",
              "vs plain after step 1", f"after step {c['warmup'] + c['steps']}")
    return "\n".join([
        f"{report['device']} (torch {report['torch']}): {c['layers']} x [Linear {c['width']}->{4 * c['width']}, GELU, "
        f"Linear], fp32, Adam lr {c['lr']:g}",
        format_table(table, header=header),
        f"fraction 0 (and, on a CPU, every fraction) bitwise equal to plain Adam: {report['grads_equal']}",
        *cpu_timing_note(report),
    ])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m offload_examples optimizer-offload``: run it from the command line (see :func:`.scenario_main`)."""
    def fractions(parser):
        parser.add_argument("--fractions", type=fractions_arg, metavar="F,F,...",
                            help="fractions of the parameters whose state is offloaded, comma-separated "
                                 "(default: 0,0.25,0.5,0.75,1)")

    return scenario_main("optimizer-offload", __doc__, OptimizerConfig, run, format_report, argv, extra=fractions,
                         failure="parameters differ from the plain optimizer where they must be equal")
