"""The measurement protocol: one strategy's run, its steps paired with steps without offloading.

Step-to-step noise on a GPU (a few percent) is larger than some differences the benchmark resolves,
so no run's time is compared with another run's measured minutes apart: a strategy's steps
alternate with no-offload steps, and its overhead is the median of the pairs' ratios
(:func:`~offload_examples.instruments.measure.measure_paired`). Two strategies compared directly
alternate with each other the same way (``_alternating``). Each run also checks one step's output
and gradients against a plain step, bit for bit, and, for the engine, times its copies against the
copy bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from typing import Any, Callable, Sequence

import torch
from torch import nn

from offload_examples.features.planner import Plan
from offload_examples.instruments.bench import faults, strategies
from offload_examples.instruments.bench.faults import _failed, _reason, _tidy
from offload_examples.instruments.bench.strategies import Forward, available
from offload_examples.instruments.measure import (
    Measurement, compare_grads, deterministic_kernels, measure_paired, measure_steps, paired_overhead,
    resident_vs_theory,
)
from offload_examples.instruments.memory_history import MemoryCurve, record_memory_curve
from offload_examples.instruments.models import TE_LAYER
from offload_examples.instruments.timeline import Span, achieved_gb_per_s, record_layer_timeline

__all__ = ["HEAD_TO_HEAD", "HEAD_TO_HEAD_RUN"]


#: The strategies also measured against each other, step by step (model A, k = 2 and 4).
HEAD_TO_HEAD = ("engine", "transformer_engine")


#: The names under which the step-by-step runs are left out after one left the device unusable.
HEAD_TO_HEAD_RUN = "engine against Transformer Engine, pair by pair"


def _run_strategy(strategy: str, model: nn.ModuleList, x: torch.Tensor, k: int, device: torch.device, kind: str,
                  steps: dict, base, theory: int, bound: Callable[[float], float] | None, link: dict | None, detail: bool,
                  out: dict[str, Any], reference: Callable[[], torch.Tensor], chosen: Plan | None = None) -> dict[str, Any]:
    skipped = out.get("left_out", {}).get(strategy) or available(strategy, device, kind)
    if skipped:
        return {"strategy": strategy, "k": k, "status": "skipped", "reason": skipped}
    engine = None
    try:
        inputs = _host_copies(model, x)  # to tell whether the strategy changed the input or a weight
        # the plan goes positionally only when there is one: wrappers of make_forward take (strategy, *args)
        forward, engine = strategies.make_forward(strategy, model, k, device, *([chosen] if chosen is not None else []))
        step = strategies._step(forward, x)
        # steps alternate with no-offload steps: the overhead is the median of the pairs' ratios
        measured, reference_ms = measure_paired(model, x, reference, step, label=strategy, **steps)
        result = _result(strategy, k, measured, base, theory)
        pairs = sorted(t / r - 1 for t, r in zip(measured.step_ms, reference_ms))
        result.update(reference_ms=statistics.median(reference_ms), reference_ms_all=reference_ms,
                      overhead=paired_overhead(measured.step_ms, reference_ms), pairs=len(pairs),
                      overhead_quartiles=_quartiles(pairs))
        if engine is not None:
            result["pinned_allocations"] = engine.pool.allocations
            # the bound's compute times come from the first no-offload run: rescale them (not the
            # copies' times) to the no-offload steps that ran alongside this one
            scaled = bound(result["reference_ms"] / base.median_ms) if bound else None
            result.update(_copy_figures(step, engine, scaled, measured.median_ms, link, detail, out, k))
            # the engine's count of offloaded bytes on the device, phase by phase, against its schedule
            result["resident_matches_theory"] = all(got == want for _, _, got, want in resident_vs_theory(engine))
        # last: its deterministic kernels save other tensors, which the engine's pool would pin for the trace
        result["grads"] = _grads_check(model, x, reference, step, device, kind, inputs)
        return result
    except Exception as err:  # one failing strategy must not end the benchmark; its memory is freed below
        return {"strategy": strategy, **_failed(device, strategy, k, err)}
    finally:
        _tidy(model, x, engine, run=strategy, k=k)


def _result(strategy: str, k: int, m, base, theory: int | None) -> dict[str, Any]:
    saving = None if m.peak_bytes is None else base.activation_peak_bytes - m.activation_peak_bytes
    return {
        "strategy": strategy, "k": k, "status": "ok",
        "peak_bytes": m.peak_bytes,
        "saving_bytes": saving,
        "theoretical_saving_bytes": theory,
        "saving_ratio": saving / theory if saving is not None and theory else None,
        "step_ms": m.median_ms,
        "step_ms_all": m.step_ms,
        "overhead": m.median_ms / base.median_ms - 1,
    }


def _alternating(model: nn.ModuleList, x: torch.Tensor, reference: Forward, candidate: Forward, label: str,
                 steps: dict) -> dict[str, Any]:
    """``candidate``'s steps alternating with ``reference``'s: the median over the pairs of candidate /
    reference - 1 (``ratio``), its quartiles, and each one's median step (ms)."""
    return _paired(*measure_paired(model, x, strategies._step(reference, x), strategies._step(candidate, x),
                                   label=label, **steps))


def _paired(measured: Measurement, reference_ms: Sequence[float]) -> dict[str, Any]:
    """What :func:`measure_paired` measured, as the reports give it: the median over the pairs of candidate /
    reference - 1 (``ratio``), its quartiles, the pairs, and each one's median step (ms)."""
    pairs = sorted(c / r - 1 for c, r in zip(measured.step_ms, reference_ms))
    return {"ratio": statistics.median(pairs), "quartiles": _quartiles(pairs), "pairs": len(pairs),
            "candidate_ms": measured.median_ms, "reference_ms": statistics.median(reference_ms)}


def _quartiles(ordered: Sequence[float]) -> list[float]:
    """The first and third quartile of values already sorted (as the reports have always taken them)."""
    return [ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]]


def _head_to_head(model: nn.ModuleList, x: torch.Tensor, k: int, device: torch.device,
                  steps: dict) -> dict[str, Any]:
    """The engine's step against Transformer Engine's, both offloading the first ``k`` layers.

    Each strategy's overhead is a median of pairs with no-offload steps, so comparing two of them
    adds the noise of two measurements, and on a launch-bound step that noise (a few %) is larger
    than the difference. Here the two alternate step by step: the median of the pairs' ratios
    answers "which is faster" directly.
    """
    engine = None
    try:
        te_forward, _ = strategies.make_forward("transformer_engine", model, k, device)
        engine_forward, engine = strategies.make_forward("engine", model, k, device)
        a = _alternating(model, x, te_forward, engine_forward, "engine vs TE", steps)
        return {"k": k, "status": "ok", "pairs": a["pairs"], "engine_vs_te": a["ratio"], "quartiles": a["quartiles"],
                "engine_ms": a["candidate_ms"], "te_ms": a["reference_ms"]}
    except Exception as err:  # reported in the targets; the benchmark goes on
        return _failed(device, HEAD_TO_HEAD_RUN, k, err)
    finally:
        _tidy(model, x, engine, run=HEAD_TO_HEAD_RUN, k=k)


def _host_copies(model: nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().to("cpu", copy=True) for t in (x, *model.parameters())]


def _grads_check(model: nn.ModuleList, x: torch.Tensor, reference: Callable[[], torch.Tensor],
                 step: Callable[[], torch.Tensor], device: torch.device, kind: str,
                 inputs: list[torch.Tensor]) -> dict[str, Any]:
    """One step of ``step`` against one no-offload step: the output and every gradient, bit for bit.

    Both start from the same random state (dropout draws alike). On PyTorch's layers they run under
    :func:`~offload_examples.instruments.measure.deterministic_kernels` (attention's default kernels
    accumulate with atomics, so two plain steps already differ); Transformer Engine's layers are asked
    for deterministic kernels when TE is imported. ``inputs``: host copies of the input and the weights
    taken before the strategy first ran; if it changed any, both steps ran on the changed values, so the
    row says so (``changed``) and is not equal. ``equal`` is ``None`` where the steps could not be compared
    (a kernel with no deterministic form, say; ``reason`` says why).
    """
    def once(run: Callable[[], torch.Tensor]):
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            return measure_steps(model, x, step=run, steps=1, warmup=0)

    try:
        with contextlib.nullcontext() if kind == TE_LAYER else deterministic_kernels():
            plain, treated = once(reference), once(step)
        changed = sum(not torch.equal(a, b) for a, b in zip(inputs, _host_copies(model, x)))
        if plain.grads.keys() != treated.grads.keys():  # a gradient missing (or extra) is a difference too
            missing = sorted(plain.grads.keys() ^ treated.grads.keys())
            return {"equal": False, "compared": len(plain.grads) + 1, "mismatched": len(missing),
                    "max_abs_diff": float("inf"), "first_mismatched": missing[:3], "changed": changed}
        check = compare_grads(plain, treated)
    except Exception as err:  # the row keeps its timings; a lost device goes up as DeviceLost
        if not faults.device_usable(device):
            raise
        return {"equal": None, "reason": _reason(err)}
    return {"equal": check.equal and not changed, "compared": check.compared, "mismatched": len(check.mismatched),
            "max_abs_diff": check.max_abs_diff, "first_mismatched": check.mismatched[:3], "changed": changed}


def _copy_figures(step, engine, bound: float | None, median_ms: float, link: dict | None, detail: bool,
                  out: dict[str, Any], k: int) -> dict[str, Any]:
    """Bound, achieved copy bandwidth and stalls of the engine, from one traced step."""
    spans = record_layer_timeline(step, engine)
    fig: dict[str, Any] = {
        "bound_ms": bound,
        "step_over_bound": median_ms / bound if bound else None,
        "stall_ms": sum(s.end - s.start for s in spans if s.name == "wait"),
    }
    for lane, key in (("device-to-host", "d2h"), ("host-to-device", "h2d")):
        achieved = achieved_gb_per_s(spans, lane) if link else None
        fig[f"{key}_gb_per_s"] = achieved
        fig[f"{key}_of_link"] = achieved / link[key] if achieved and link else None
    if detail:
        label = f"engine k={k}"
        out.setdefault("timelines", {})[label] = _spans_json(spans)
        out.setdefault("memory_curves", {})[label] = _curve_json(record_memory_curve(step))
    return fig


def _spans_json(spans: Sequence[Span]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(s) for s in spans]


def _curve_json(curve: MemoryCurve) -> dict[str, list]:
    return {"ms": [round(t, 4) for t in curve.ms], "allocated": curve.allocated}
