"""Scenario 5, weight streaming: train layers whose weights live in host memory.

The same stack of layers runs three ways: resident (weights, gradients and activations on the
GPU), resident with activation recomputation (the same activation memory as streaming), and
streamed (:class:`~offload_examples.features.weight_stream.StreamedLayers`: weights loaded one layer ahead,
gradients written back one layer behind, at most two layers of each on the GPU). The report puts
side by side peak GPU memory, step time, the weight-and-gradient bytes each keeps on the GPU, and
whether the streamed gradients equal the resident ones bit for bit.

Run it::

    python -m offload_examples weight-streaming               # full size on a GPU
    python -m offload_examples weight-streaming --layers 24 --json results/weights.json

The loop to copy is :func:`train`, at the top of the module.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from offload_examples.features.weight_stream import StreamedLayers
from offload_examples.instruments.cli import Need, Stack
from offload_examples.instruments.measure import (
    Measurement, compare_grads, deterministic_kernels, measure_steps, training_step,
)
from offload_examples.instruments.models import Checkpointed, build_linear_stack
from offload_examples.instruments.report import cpu_timing_note, format_bytes, format_table, report_header
from offload_examples.instruments.scenario_cli import scenario_main
from offload_examples.instruments.sizes import ScenarioConfig, Timing
from offload_examples.instruments.timeline import overlap_ms, record_timeline

__all__ = ["WeightsConfig", "format_report", "main", "run", "train"]


def train(layers: nn.ModuleList, batches: Iterable[torch.Tensor], device: torch.device | str, lr: float = 1e-3) -> None:
    """The loop to copy: the layers' weights live in host memory and reach ``device`` one layer ahead of use."""
    model = StreamedLayers(list(layers), device)  # parameters move to pinned host memory
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # on the host, where every .grad is written back
    for x in batches:
        model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@dataclass
class WeightsConfig(Timing, ScenarioConfig):
    """Sizes of the weight-streaming scenario: ``layers`` blocks of Linear(width, 4 width), GELU,
    Linear(4 width, width), on ``batch x seq`` tokens. The defaults are the GPU size."""

    layers: int = 16
    width: int = 4096
    seq: int = 2048
    batch: int = 8
    dtype: str = "bfloat16"

    #: The small size, which runs in seconds on a CPU: what it changes here (the step counts have their own).
    SMALL = dict(layers=4, width=64, seq=16, batch=2, dtype="float32")

    def memory_need(self, device_type: str) -> Need:
        """The resident training step (streaming holds less on the GPU); on the host the layers as built
        (float32, then ``dtype``), or the host layers, the streamed copy's pinned weights and gradients
        and five steps' gradients."""
        s = Stack.linear(self.layers, self.width, self.batch * self.seq, self.dtype)
        return Need(s.step_bytes(), max(s.build_bytes + s.param_bytes, 3 * s.param_bytes + s.copies_bytes(5)))


def _by_position(m: Measurement) -> Measurement:
    """Name gradients by position, so models that nest their layers differently compare."""
    grads = {("input" if k == "input" else f"param {i}"): v for i, (k, v) in enumerate(m.grads.items())}
    return dataclasses.replace(m, grads=grads)


def run(config: WeightsConfig | None = None, device: torch.device | str | None = None,
        progress: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Run the scenario and return its report (see :func:`format_report`)."""
    config, device = WeightsConfig.for_run(config, device)
    say = progress or (lambda _: None)
    dtype = getattr(torch, config.dtype)
    host_layers = build_linear_stack(config.layers, config.width, dtype=dtype, seed=config.seed)
    gen = torch.Generator(device="cpu").manual_seed(config.seed + 1)
    x = torch.randn(config.batch, config.seq, config.width, generator=gen, dtype=dtype).to(device).requires_grad_()
    say(f"weight-streaming scenario on {device}: {config.layers} layers of width {config.width}")
    # A one-token step isolates the memory of weights and gradients: its activations are bytes.
    token = x[:1, :1].detach().clone().requires_grad_()
    outside = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0  # inputs, not the model
    steps = dict(steps=config.steps, warmup=config.warmup, progress=progress)
    with deterministic_kernels():
        resident = copy.deepcopy(host_layers).to(device)
        plain = measure_steps(resident, x, label="resident", **steps)
        plain_token = measure_steps(resident, token, steps=1, warmup=1)
        recompute = nn.ModuleList(Checkpointed(layer) for layer in resident)
        ckpt = measure_steps(recompute, x, label="resident + recompute", **steps)
        del resident, recompute
        if device.type == "cuda":
            torch.cuda.empty_cache()
        streamed = StreamedLayers(list(copy.deepcopy(host_layers)), device)
        model = nn.ModuleList([streamed])
        streamed.reset_peak()
        stream = measure_steps(model, x, label="streamed", **steps)
        check = compare_grads(_by_position(plain), _by_position(stream))
        streamed.reset_peak()
        stream_token = measure_steps(model, token, steps=1, warmup=1)
    weights = sum(streamed.weight_bytes)
    report = {
        **report_header("weight-streaming", device, config),
        "weight_bytes": weights,
        "offloaded_bytes": weights,
        "weight_bytes_per_layer": streamed.weight_bytes[0],
        # resident: every layer's weights and, by the end of backward, every gradient
        "resident_weight_grad_bytes": 2 * weights,
        "streamed_weight_grad_peak_bytes": streamed.peak_device_bytes,
        "streamed_bound_bytes": streamed.resident_bound(),
        "rows": {
            "resident": {"peak_bytes": plain.peak_bytes, "step_ms": plain.median_ms},
            "resident + recompute": {"peak_bytes": ckpt.peak_bytes, "step_ms": ckpt.median_ms},
            "streamed": {"peak_bytes": stream.peak_bytes, "step_ms": stream.median_ms},
        },
        # the pinned memory the host gives up: each buffer as PyTorch's pinned allocator rounds it (a power of two)
        "host_bytes": streamed.pool.pinned_bytes,
        "grads_equal": check.equal,
        "grads_compared": check.compared,
        "max_abs_diff": check.max_abs_diff,
    }
    if device.type == "cuda":
        # weights and gradients on the GPU, measured on the one-token step, against the theory:
        # resident ends backward holding every weight and gradient; streaming, what it counted
        measured = {"resident": plain_token.peak_bytes - outside, "streamed": stream_token.peak_bytes - outside}
        theory = report["resident_weight_grad_bytes"] - streamed.peak_device_bytes
        saving = measured["resident"] - measured["streamed"]
        report.update(weight_grad_measured_bytes=measured, saving_bytes=saving, theoretical_saving_bytes=theory,
                      saving_ratio=saving / theory)
        with deterministic_kernels():
            spans = record_timeline(lambda: training_step(model, x))
        model.zero_grad(set_to_none=True)
        report["timeline"] = spans
        for lane in ("host-to-device", "device-to-host"):
            busy, both = overlap_ms(spans, lane)
            report[f"{lane}_busy_ms"], report[f"{lane}_overlapped_ms"] = busy, both
    return report


def format_report(report: dict[str, Any]) -> str:
    """The three ways side by side, then the checks."""
    c = report["config"]
    rows = [(name, format_bytes(r["peak_bytes"]) if r["peak_bytes"] is not None else "n/a (no CUDA)",
             f"{r['step_ms']:.1f} ms") for name, r in report["rows"].items()]
    lines = [
        f"{report['device']} (torch {report['torch']}): {c['layers']} x [Linear {c['width']}->{4 * c['width']}, GELU, "
        f"Linear], {c['batch']} x {c['seq']} tokens, {c['dtype']}",
        format_table(rows, header=("variant", "peak GPU memory", "step time")),
        f"weights: {format_bytes(report['weight_bytes'])} in all, {format_bytes(report['weight_bytes_per_layer'])} "
        f"per layer; pinned host memory for weights and gradients: {format_bytes(report['host_bytes'])}",
        f"weights + gradients on the GPU: resident {format_bytes(report['resident_weight_grad_bytes'])}, streamed "
        f"at most {format_bytes(report['streamed_weight_grad_peak_bytes'])} "
        f"(bound: two layers of each, {format_bytes(report['streamed_bound_bytes'])})",
    ]
    if "saving_ratio" in report:
        m = report["weight_grad_measured_bytes"]
        lines.append(f"measured on a one-token step: resident {format_bytes(m['resident'])}, streamed "
                     f"{format_bytes(m['streamed'])}; saving {format_bytes(report['saving_bytes'])} vs "
                     f"{format_bytes(report['theoretical_saving_bytes'])} in theory ({report['saving_ratio']:.1%})")
        lines.append(f"copies overlapped with compute: loads {report['host-to-device_overlapped_ms']:.1f} of "
                     f"{report['host-to-device_busy_ms']:.1f} ms, write-backs {report['device-to-host_overlapped_ms']:.1f}"
                     f" of {report['device-to-host_busy_ms']:.1f} ms")
    lines.append(f"gradients bitwise equal to the resident run: {report['grads_equal']} "
                 f"({report['grads_compared']} tensors, max |diff| {report['max_abs_diff']:.3g})")
    return "\n".join(lines + cpu_timing_note(report))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m offload_examples weight-streaming``: run it from the command line (see :func:`.scenario_main`)."""
    return scenario_main("weight-streaming", __doc__, WeightsConfig, run, format_report, argv)
