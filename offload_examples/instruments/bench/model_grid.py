"""One model's grid: its run without offloading, then every strategy at every ``k``.

The run without offloading is the baseline every strategy's steps pair with; a probe through an
engine that offloads nothing gives each layer's compute time and saved bytes, from which the
schedule's theory (the saving) and the copy bound (the step time) are predicted for every ``k``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Sequence

import torch
from torch import nn

from offload_examples import DefaultSchedule, get_cpu_offload_context
from offload_examples.core import te_path
from offload_examples.features.planner import LinkCost
from offload_examples.instruments.bench import planner_bench, strategies
from offload_examples.instruments.bench.faults import _free, _raise_if_lost, _reason
from offload_examples.instruments.bench.graphed import GRAPHED_RUN, graphed_run
from offload_examples.instruments.bench.grid import MODELS, BenchConfig
from offload_examples.instruments.bench.planner_bench import (
    PLAN_PAIRS_RUN, PLANNER_BUDGETS, PlannerSetup, _pair_plans_with_rivals, _planner_budgets, _run_planner,
)
from offload_examples.instruments.bench.protocol import (
    HEAD_TO_HEAD, HEAD_TO_HEAD_RUN, _curve_json, _head_to_head, _result, _run_strategy, _spans_json,
)
from offload_examples.instruments.bench.strategies import TE_CONTEXT_ONLY, TE_DEFAULT_PATH, _through, available
from offload_examples.instruments.measure import measure_steps
from offload_examples.instruments.memory_history import record_memory_curve
from offload_examples.instruments.models import TE_LAYER, build_basic_model, layer_kind
from offload_examples.instruments.report import ProgressBar
from offload_examples.instruments.timeline import Span, per_layer_ms, record_layer_timeline

__all__: list[str] = []


def _layer_times(spans: Sequence[Span], n: int, total_ms: float) -> tuple[list[float], list[float]]:
    """Per-layer forward and backward ms of a run without offloading, scaled to ``total_ms``."""
    fwd, bwd = per_layer_ms(spans, n)
    traced = sum(fwd) + sum(bwd)
    scale = total_ms / traced if traced > 0 else 1.0
    return [t * scale for t in fwd], [t * scale for t in bwd]


def _first(per_layer: Sequence[int], k: int) -> list[int]:
    """``per_layer`` for the first ``k`` layers, 0 for the others."""
    return [b if i < k else 0 for i, b in enumerate(per_layer)]


def _theoretical_saving(per_layer: Sequence[int], k: int) -> int:
    """The saving the default schedule predicts when the first ``k`` layers' bytes are offloaded."""
    offloaded = _first(per_layer, k)
    kept = [b - o for b, o in zip(per_layer, offloaded)]
    return DefaultSchedule(k, len(per_layer)).simulate(offloaded, kept).saving


def _held_bytes(model: nn.ModuleList, x: torch.Tensor) -> list[int] | None:
    """The bytes each layer's forward keeps for backward, as the CUDA allocator sees them in one forward
    without offloading (``None`` off CUDA): every tensor kept, whoever saved it, not one engine's count.

    After layer ``i`` the allocator holds what the layers so far keep plus layer ``i``'s output, the
    next layer's input: what grew apart from that output is layer ``i``'s. A layer's input thus counts
    once, for the layer whose graph keeps it (the model's input, which the caller keeps anyway, for none).
    """
    if x.device.type != "cuda":
        return None
    held, h = [], x
    before = torch.cuda.memory_allocated(x.device)
    for layer in model:
        h = layer(h)
        after = torch.cuda.memory_allocated(x.device) - h.untyped_storage().nbytes()
        held.append(after - before)
        before = after
    return held


def _copy_bound(k: int, fwd_ms: Sequence[float], bwd_ms: Sequence[float], offloaded: Sequence[int], link: dict,
                compute_scale: float) -> float:
    """The copy bound of the first ``k`` layers with every compute time multiplied by ``compute_scale``."""
    return DefaultSchedule(k, len(fwd_ms)).predict_step_ms([t * compute_scale for t in fwd_ms],
                                                          [t * compute_scale for t in bwd_ms], offloaded,
                                                          link["d2h"], link["h2d"])


def _predictions(n: int, fwd: list[float], bwd: list[float], per_layer: list[int], link: dict | None,
                 base_ms: float) -> dict[str, Any] | None:
    """The copy bound for every k, and the first k at which the copies no longer fit behind compute."""
    if not link:
        return None
    bounds = {k: _copy_bound(k, fwd, bwd, _first(per_layer, k), link, 1.0) for k in range(1, n)}
    stop = next((k for k, ms in bounds.items() if ms > 1.01 * base_ms), None)
    return {"bound_ms": bounds, "copies_stop_fitting_at_k": stop}


def _bench_model(name: str, config: BenchConfig, device: torch.device, link: dict | None,
                 bar: ProgressBar, detail: bool, plan_link: LinkCost | None = None,
                 left_out: dict[str, str] | None = None) -> dict[str, Any]:
    """One model's grid. ``left_out``: strategies not to run, with why (see :class:`DeviceLost`)."""
    kind = layer_kind(MODELS[name].kind)  # what "auto" builds here
    # On TE's layers every run takes TE's offload path (see TE_DEFAULT_PATH)
    with te_path.offload_path() if kind == TE_LAYER else contextlib.nullcontext():
        return _bench_model_on_path(name, config, device, link, bar, detail, plan_link, kind, dict(left_out or {}))


def _bench_model_on_path(name: str, config: BenchConfig, device: torch.device, link: dict | None,
                         bar: ProgressBar, detail: bool, plan_link: LinkCost | None, kind: str,
                         left_out: dict[str, str]) -> dict[str, Any]:
    spec = MODELS[name].small() if config.small else MODELS[name]
    dtype = getattr(torch, config.dtype)
    n = config.layers
    model = build_basic_model(n, spec.hidden, spec.heads, spec.ffn, device=device, dtype=dtype, kind=spec.kind,
                              seed=config.seed, activation=spec.activation, dropout=spec.dropout)
    gen = torch.Generator(device="cpu").manual_seed(config.seed + 1)
    x = torch.randn(spec.batch, config.seq, spec.hidden, generator=gen, dtype=dtype).to(device).requires_grad_()
    steps = dict(steps=config.steps, warmup=config.warmup)
    out: dict[str, Any] = {"model": name, "layer_kind": kind, "spec": dataclasses.asdict(spec), "runs": [],
                           "left_out": left_out}

    bar.show(f"model {name}: no offload")
    forward, _ = strategies.make_forward("no offload", model, 0, device)
    base = measure_steps(model, x, step=strategies._step(forward, x), label="no offload", **steps)
    # the same step through an engine that offloads nothing: per-layer compute time and saved bytes
    probe, sync = get_cpu_offload_context(enabled=True, num_layers=0, model_layers=n, device=device)
    probe_step = strategies._step(lambda h: _through(model, h, lambda i: probe, sync), x)
    probe_step()
    spans = record_layer_timeline(probe_step, probe)
    fwd_ms, bwd_ms = _layer_times(spans, n, base.median_ms)
    per_layer = [s.candidate_bytes for s in probe.stats]  # what the engine copies: the copy bound's bytes
    held = _held_bytes(model, x)  # what the layers hold: the theory's bytes, where the allocator can tell
    out.update(forward_ms=fwd_ms, backward_ms=bwd_ms, saved_bytes_per_layer=per_layer, held_bytes_per_layer=held,
               theory_source="engine candidates" if held is None else "measured allocator")
    out["predicted"] = _predictions(n, fwd_ms, bwd_ms, per_layer, link, base.median_ms)
    if detail:
        out["memory_curves"] = {"no offload": _curve_json(record_memory_curve(strategies._step(forward, x)))}
        out["timelines"] = {"no offload": _spans_json(spans)}
    model.zero_grad(set_to_none=True)
    _free(probe)
    out["runs"].append(_result("no offload", 0, base, base, None))
    bar.advance()
    if kind == TE_LAYER and available(TE_DEFAULT_PATH, device, kind) is None:
        bar.show(f"model {name}: {TE_DEFAULT_PATH}")
        out["runs"].append(_run_strategy(TE_DEFAULT_PATH, model, x, 0, device, kind, steps, base, None, None,
                                         None, False, out, reference=strategies._step(forward, x)))
    setup: PlannerSetup | str | None = None
    if "planner" in config.strategies:
        bar.show(f"model {name}: the planner's costs")
        try:
            setup = left_out.get("planner") or planner_bench._planner_setup(model, x, base, plan_link, config)
            if not isinstance(setup, str):
                out["planner"] = setup.to_json()
        except Exception as err:  # the planner's runs report it; the other strategies still run
            _raise_if_lost(device, "planner", 0, err)
            setup = f"measuring the planner's costs failed: {_reason(err)}"
    planned: dict[tuple, dict[str, Any]] = {}  # plan -> its run: one measurement per distinct plan
    if "transformer_engine" in config.strategies:
        if available(TE_CONTEXT_ONLY, device, kind) is None:  # else TE's own rows say why
            bar.show(f"model {name}: {TE_CONTEXT_ONLY}")
            out["runs"].append(_run_strategy(TE_CONTEXT_ONLY, model, x, 0, device, kind, steps, base, None, None,
                                             None, False, out, reference=strategies._step(forward, x)))
        bar.advance()

    for k in config.ks:
        theory = _theoretical_saving(per_layer if held is None else held, k)
        bound = functools.partial(_copy_bound, k, fwd_ms, bwd_ms, _first(per_layer, k), link) if link else None
        for strategy in config.strategies:
            if strategy == "no offload":
                continue
            bar.show(f"model {name}, k={k}: {strategy}")
            if strategy == "planner":
                if isinstance(setup, str):
                    status = "skipped" if "planner" in left_out else "failed"
                    out["runs"] += [{"strategy": strategy, "k": k, "status": status, "reason": setup,
                                     "budget_from": source} for source in PLANNER_BUDGETS]
                    for _ in PLANNER_BUDGETS:
                        bar.advance()
                    continue
                for budget_from, budget in _planner_budgets(setup, k):
                    out["runs"].append(_run_planner(setup, budget_from, budget, model, x, k, device, kind, steps, base,
                                                    reference=strategies._step(forward, x), planned=planned))
                    bar.advance()
                continue
            target = name == "A" and k in (2, 4) and strategy in HEAD_TO_HEAD
            run_steps = dict(steps, steps=max(config.steps, config.target_steps)) if target else steps
            out["runs"].append(_run_strategy(strategy, model, x, k, device, kind, run_steps, base, theory, bound, link,
                                             detail and k in (2, 4) and strategy == "engine", out,
                                             reference=strategies._step(forward, x)))
            bar.advance()
        if name == "A" and k in (2, 4) and _both_ran(out["runs"], k):
            bar.show(f"model {name}, k={k}: engine against Transformer Engine, pair by pair")
            steps_h2h = dict(steps, steps=max(config.steps, config.target_steps))
            h2h = ({"k": k, "status": "skipped", "reason": left_out[HEAD_TO_HEAD_RUN]} if HEAD_TO_HEAD_RUN in left_out
                   else _head_to_head(model, x, k, device, steps_h2h))
            out.setdefault("head_to_head", []).append(h2h)
        if config.graphed and k in (2, 4):  # the graphed column: the engine where no host work paces the step
            bar.show(f"model {name}, k={k}: {GRAPHED_RUN}")
            steps_g = dict(steps, steps=max(config.steps, config.target_steps)) if name == "A" else steps
            out.setdefault("graphed", []).append(
                {"k": k, "status": "skipped", "reason": left_out[GRAPHED_RUN]} if GRAPHED_RUN in left_out
                else graphed_run(model, x, k, device, kind, steps_g, link))
    if "planner" in config.strategies:  # every pure run has run: each plan meets its best rival
        if PLAN_PAIRS_RUN not in left_out:  # else the checks fall back on the separate overheads
            _pair_plans_with_rivals(out["runs"], model, x, device, steps, bar)
        bar.advance()
    del model, x
    _free()
    return out


def _both_ran(runs: list[dict[str, Any]], k: int) -> bool:
    ran = {r["strategy"] for r in runs if r["k"] == k and r["status"] == "ok"}
    return set(HEAD_TO_HEAD) <= ran
