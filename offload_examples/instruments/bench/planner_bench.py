"""The planner as a strategy: its budgets, its runs, and its check against pure offloading and recomputation.

For each ``k`` the planner plans under two budgets, the predicted peaks of offloading and of
recomputing the first ``k`` layers, with costs measured once per model and calibrated on its
no-offload run (:class:`PlannerSetup`). Each plan runs like any strategy; at the end of the model each
plan also meets its best rival step by step, and :func:`check_planner` reads the verdicts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from offload_examples.features.planner import KEEP, OFFLOAD, RECOMPUTE, LayerCost, LinkCost, Plan, plan, simulate_plan
from offload_examples.instruments.bench import protocol, strategies
from offload_examples.instruments.bench.faults import _free, _raise_if_lost, _reason
from offload_examples.instruments.bench.grid import BenchConfig
from offload_examples.instruments.bench.protocol import _run_strategy
from offload_examples.instruments.plan_costs import measure_costs, measure_link
from offload_examples.instruments.report import ProgressBar

__all__ = [
    "PLANNER_BUDGETS", "PLANNER_PEAK_NOISE", "PLANNER_PREDICTION_ERROR", "PLANNER_TIME_NOISE", "PLAN_PAIRS_RUN",
    "PlannerSetup", "check_planner",
]


#: The pure strategies whose budgets the planner runs under (its offload-only and recompute-only curves).
PLANNER_BUDGETS = ("engine", "checkpoint")


#: :func:`check_planner`'s limits: the plan's step may exceed the best pure run's by this much (the median of
#: their alternating steps' ratios; step-to-step noise), and its predicted peak and step may miss the
#: measured ones by this much.
PLANNER_TIME_NOISE = 0.02


PLANNER_PREDICTION_ERROR = 0.05


#: Measured peaks this close (relative) count as the same: a plan equal in bytes to a pure run also has
#: the engine's bookkeeping (about a KiB more than ``checkpoint``).
PLANNER_PEAK_NOISE = 0.001


PLAN_PAIRS_RUN = "plans against their rivals, pair by pair"


def _plan_link(device: torch.device, link: dict[str, float] | None) -> LinkCost:
    """The link the planner plans with: the run's pinned bandwidths on a GPU; on a CPU, where the
    engine's copies are host memory copies, those timed once for the whole run."""
    if link:
        return LinkCost(link["d2h"], link["h2d"], link["both"])
    return measure_link(device, nbytes=16 * 2**20)


@dataclass
class PlannerSetup:
    """One model's planner inputs, calibrated on its no-offload run.

    ``measure_costs`` times each layer between marks on the compute stream, and its base bytes are
    what is allocated between steps. The measured step has more: the loss, launches between layers,
    and at its peak whatever the backward has allocated by then (gradients, workspaces). So that
    predicted and measured mean the same thing, two constants are fitted to the no-offload run,
    which the planner then predicts exactly: every layer's times are scaled by one factor so that
    keeping every layer predicts the measured median step, and the base bytes are the measured peak
    minus the saved bytes that plan predicts at its peak. Every other plan's prediction is then a
    prediction. Without a peak to fit (a CPU), the base bytes are ``measure_costs``'s.
    """

    costs: list[LayerCost]
    link: LinkCost
    base_bytes: int
    keep_peak_bytes: int  # predicted peak of keeping every layer (= the no-offload peak on a GPU)
    keep_step_ms: float  # predicted step of keeping every layer (= the no-offload median)
    time_scale: float  # what multiplied the measured layer times
    idle_base_bytes: int  # measure_costs's base: allocated between steps

    def to_json(self) -> dict[str, Any]:
        return {"costs": [dataclasses.asdict(c) for c in self.costs], "base_bytes": self.base_bytes,
                "keep_peak_bytes": self.keep_peak_bytes, "keep_step_ms": self.keep_step_ms,
                "time_scale": self.time_scale, "idle_base_bytes": self.idle_base_bytes}


def _planner_setup(model: nn.ModuleList, x: torch.Tensor, base, link: LinkCost, config: BenchConfig) -> PlannerSetup:
    """Measure ``model``'s costs once and calibrate them on the no-offload measurement ``base``."""
    costs, idle = measure_costs(list(model), x, steps=max(1, min(40, 2 * config.steps)))
    keep = (KEEP,) * len(costs)
    saved_peak, raw_ms = simulate_plan(keep, costs, link)
    scale = base.median_ms / raw_ms if raw_ms > 0 else 1.0
    costs = [c.scaled(scale) for c in costs]
    base_bytes = idle if base.peak_bytes is None else max(0, base.peak_bytes - saved_peak)
    peak, ms = simulate_plan(keep, costs, link, base_bytes)
    return PlannerSetup(costs, link, base_bytes, peak, ms, scale, idle)


def _pure_plan(setup: PlannerSetup, choice, k: int) -> tuple:
    """The choices of a pure strategy: ``choice`` for the first ``k`` layers, KEEP for the others."""
    return (choice,) * k + (KEEP,) * (len(setup.costs) - k)


def _planner_budgets(setup: PlannerSetup, k: int) -> list[tuple[str, int]]:
    """The planner's budgets at ``k``, one per strategy of :data:`PLANNER_BUDGETS`: the peak the model
    predicts for offloading (``engine``) or recomputing (``checkpoint``) the first ``k`` layers.

    Predicted rather than measured peaks: the planner compares plans under its own model, so the
    pure plan itself always fits its budget and the planner can only do as well or better there.
    """
    choice = {"engine": OFFLOAD, "checkpoint": RECOMPUTE}
    return [(s, simulate_plan(_pure_plan(setup, choice[s], k), setup.costs, setup.link, setup.base_bytes)[0])
            for s in PLANNER_BUDGETS]


def _run_planner(setup: PlannerSetup, budget_from: str, budget: int, model: nn.ModuleList, x: torch.Tensor, k: int,
                 device: torch.device, kind: str, steps: dict, base, reference: Callable[[], torch.Tensor],
                 planned: dict[tuple, dict[str, Any]]) -> dict[str, Any]:
    """Plan under ``budget``, run the plan paired with no-offload steps, and compare with its prediction.

    A plan already run for this model (another budget chose it too) is not measured again: its run is
    reported under this budget as well, with ``same_run_as``.
    """
    chosen = plan(setup.costs, setup.link, budget, setup.base_bytes)
    figures = {
        "budget_from": budget_from, "budget_bytes": budget, "plan": chosen.summary(),
        "choices": [c.value for c in chosen.choices], "caps": list(chosen.caps), "parts": list(chosen.parts),
        "modules": list(chosen.modules),
        "feasible": chosen.feasible,
        "predicted_peak_bytes": chosen.predicted_peak_bytes, "predicted_step_ms": chosen.predicted_step_ms,
        # as a ratio to keeping every layer: the measured overhead's counterpart
        "predicted_overhead": chosen.predicted_step_ms / setup.keep_step_ms - 1,
    }
    key = (chosen.choices, chosen.caps, chosen.modules)
    if key in planned:
        first = planned[key]
        return {**first, **figures, "k": k, "same_run_as": {"budget_from": first["budget_from"], "k": first["k"]}}
    theory = setup.keep_peak_bytes - chosen.predicted_peak_bytes
    result = _run_strategy("planner", model, x, k, device, kind, steps, base, theory, None, None, False, {},
                           reference=reference, chosen=chosen)
    result.update(figures)
    if result["status"] == "ok":
        result.update(_prediction_errors(result))
        planned[key] = result
    return result


def _prediction_errors(r: dict[str, Any]) -> dict[str, float | None]:
    """``peak_error`` and ``step_error``: measured over predicted, minus 1.

    The step is compared as a ratio to the no-offload steps: the measured paired overhead against
    the predicted overhead, so drift between the calibrating run and this one does not count as error.
    """
    peak = None if r["peak_bytes"] is None else r["peak_bytes"] / r["predicted_peak_bytes"] - 1
    return {"peak_error": peak, "step_error": (1 + r["overhead"]) / (1 + r["predicted_overhead"]) - 1,
            # the prediction at the steps it ran beside, for plotting next to the measured step
            "predicted_step_ms_paired": r["reference_ms"] * (1 + r["predicted_overhead"])}


def _best_rival(run: dict[str, Any], runs: list[dict[str, Any]]) -> tuple[dict | None, dict | None]:
    """``(best, source)``: the fastest pure run that fits a planner run's budget (see :func:`check_planner`),
    and the pure run its budget came from (``None`` when that run did not succeed)."""
    pure = [r for r in runs if r["strategy"] in PLANNER_BUDGETS and r["status"] == "ok"]
    source = next((r for r in pure if r["strategy"] == run["budget_from"] and r["k"] == run["k"]), None)
    peak = run["peak_bytes"]
    if peak is None or source is None or source["peak_bytes"] is None:
        rivals = [source] if source else []  # no measured peaks: the run the budget came from
    else:
        low, high = peak * (1 - PLANNER_PEAK_NOISE), source["peak_bytes"] * (1 + PLANNER_PEAK_NOISE)
        rivals = [r for r in pure if r["peak_bytes"] is not None and low <= r["peak_bytes"] <= high]
        rivals = rivals or [source]  # the planner's peak is above its budget's run: a miss, shown against that run
    return min(rivals, key=lambda r: r["overhead"], default=None), source


def _pair_plans_with_rivals(runs: list[dict[str, Any]], model: nn.ModuleList, x: torch.Tensor,
                            device: torch.device, steps: dict, bar: ProgressBar) -> None:
    """Run each plan step by step against its best rival; the result goes into the run's ``vs_best``.

    Each run's overhead is a median of pairs with no-offload steps, so comparing a plan's overhead with a
    rival's adds the noise of two measurements made minutes apart; on launch-bound layers (model A with
    Transformer Engine's) that spread is several per cent, more than the 2 % the check allows. Alternating
    the plan's steps with the rival's answers "is the plan as fast" directly, as :func:`_head_to_head`
    does for the engine and Transformer Engine. One measurement per distinct plan and rival.
    """
    measured: dict[tuple, dict[str, Any]] = {}
    for run in runs:
        if run["strategy"] != "planner" or run["status"] != "ok":
            continue
        best, _ = _best_rival(run, runs)
        if best is None:
            continue
        key = (tuple(run["choices"]), tuple(run["caps"]), tuple(run.get("modules") or ()), best["strategy"], best["k"])
        if key not in measured:
            bar.show(f"plan of {run['budget_from']} k={run['k']} against {best['strategy']} k={best['k']}, "
                     "pair by pair")
            measured[key] = _plan_against(run, best, model, x, device, steps)
        run["vs_best"] = measured[key]


def _plan_against(run: dict[str, Any], best: dict[str, Any], model: nn.ModuleList, x: torch.Tensor,
                  device: torch.device, steps: dict) -> dict[str, Any]:
    """The planner ``run``'s plan, its steps alternating with those of the pure run ``best``: the median of
    plan / best - 1 (``status`` "failed" and the ``reason`` when it could not run)."""
    engines = []
    try:
        chosen = Plan(tuple(run["choices"]), run["predicted_peak_bytes"], run["predicted_step_ms"],
                      caps=tuple(run["caps"]), modules=tuple(run.get("modules") or ()))
        plan_forward, engine = strategies.make_forward("planner", model, run["k"], device, chosen)
        engines.append(engine)
        best_forward, engine = strategies.make_forward(best["strategy"], model, best["k"], device)
        engines.append(engine)
        a = protocol._alternating(model, x, best_forward, plan_forward, f"plan vs {best['strategy']}", steps)
        return {"strategy": best["strategy"], "k": best["k"], "status": "ok", "ratio": a["ratio"],
                "quartiles": a["quartiles"], "pairs": a["pairs"], "plan_ms": a["candidate_ms"],
                "best_ms": a["reference_ms"]}
    except Exception as err:  # the check falls back on the separate overheads, and its table says why
        _raise_if_lost(device, PLAN_PAIRS_RUN, run["k"], err)
        return {"strategy": best["strategy"], "k": best["k"], "status": "failed",
                "reason": _reason(err)}
    finally:
        model.zero_grad(set_to_none=True)
        x.grad = None
        _free(*engines, run=PLAN_PAIRS_RUN, k=run["k"])


def _planner_check(run: dict[str, Any], runs: list[dict[str, Any]], timed: bool) -> dict[str, Any]:
    """One planner run against the pure runs at its budget (see :func:`check_planner`); ``timed``: whether
    step times mean anything here (not on a CPU, whose copies are memory copies)."""
    best, source = _best_rival(run, runs)
    peak = run["peak_bytes"]
    vs = run.get("vs_best")
    failed = vs["reason"] if vs is not None and vs["status"] != "ok" else None
    if vs is not None and (best is None or failed or (vs["strategy"], vs["k"]) != (best["strategy"], best["k"])):
        vs = None
    check = {
        "k": run["k"], "budget_from": run["budget_from"], "budget_bytes": run["budget_bytes"], "plan": run["plan"],
        "peak_bytes": peak, "overhead": run["overhead"],
        "best": None if best is None else {key: best[key] for key in ("strategy", "k", "peak_bytes", "overhead")},
        "within_budget_run": None if peak is None or source is None or source["peak_bytes"] is None
        else peak <= source["peak_bytes"] * (1 + PLANNER_PEAK_NOISE),
        # plan / best - 1 from their alternating steps (None where they did not run so)
        "vs_best": None if vs is None else vs["ratio"],
        "vs_best_quartiles": None if vs is None else vs["quartiles"],
        "vs_best_failed": failed,  # why the alternating steps did not run (then the separate overheads decide)
        "time_met": None if best is None or not timed
        else (vs["ratio"] if vs is not None else run["overhead"] - best["overhead"]) <= PLANNER_TIME_NOISE,
        "peak_error": run["peak_error"], "step_error": run["step_error"],
    }
    for key in ("peak_error", "step_error"):
        known = run[key] is not None and (timed or key == "peak_error")
        check[f"{key}_met"] = abs(run[key]) <= PLANNER_PREDICTION_ERROR if known else None
    parts = [check[key] for key in ("within_budget_run", "time_met", "peak_error_met", "step_error_met")]
    check["met"] = None if None in parts else all(parts)
    return check


def check_planner(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The planner against pure offloading and pure recomputation, and its predictions against measurement.

    For each model and planner run (a budget), the *rivals* are the ``engine`` and ``checkpoint`` runs
    of that model whose measured peak is at least the planner's and at most that of the run the budget
    came from (the pure runs that fit the same budget and use no less memory), peaks compared within
    ``PLANNER_PEAK_NOISE``. The planner passes when

    - its measured peak is at most that of the run its budget came from,
    - its step is at most the best rival's plus ``PLANNER_TIME_NOISE``: the median of plan / rival - 1
      over their alternating steps (``vs_best``, measured after all runs of the model); where those did not
      run, its paired overhead against the rival's, and
    - ``|peak_error|`` and ``|step_error|`` are at most ``PLANNER_PREDICTION_ERROR``.

    On a CPU there are no measured peaks and its step times say nothing about a GPU: the rival is the
    run the budget came from, the values are reported, and every verdict (``met`` too) is ``None``.
    Runs that failed are reported with ``met`` False.
    """
    timed = results.get("device_type") == "cuda"
    checks = []
    for model in results["models"]:
        for run in model["runs"]:
            if run["strategy"] != "planner":
                continue
            if run["status"] != "ok":
                checks.append({"model": model["model"], "k": run["k"], "budget_from": run.get("budget_from"),
                               "met": False, "reason": f"{run['status']}: {run['reason']}"})
                continue
            checks.append({"model": model["model"], **_planner_check(run, model["runs"], timed)})
    return checks
