"""What the results say: the targets, and the Markdown tables of every model, the targets and the planner."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from offload_examples.instruments.bench.planner_bench import PLANNER_PREDICTION_ERROR, PLANNER_TIME_NOISE
from offload_examples.instruments.bench.strategies import TE_CONTEXT_ONLY, TE_DEFAULT_PATH
from offload_examples.instruments.report import CPU_TIMING_NOTE, format_bytes, format_markdown_table

__all__ = ["COLUMNS", "GiB", "check_targets", "markdown", "model_table"]


GiB = 2**30


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for model A at k=2 (copies fit) and k=4 (they do not), met or missed."""
    model = next((m for m in results["models"] if m["model"] == "A"), None)
    if model is None or not results.get("link_gb_per_s"):
        return []
    engine = {r["k"]: r for r in model["runs"] if r["strategy"] == "engine" and r["status"] == "ok"}
    checks = []
    if 2 in engine:
        r = engine[2]
        q1, q3 = r.get("overhead_quartiles", (None, None))
        spread = f"median of {r['pairs']} pairs; quartiles {q1:+.2%} .. {q3:+.2%}" if q1 is not None else ""
        default = _ok_run(model["runs"], TE_DEFAULT_PATH)
        if default is not None:  # the baseline ran on TE's offload path: say what the default path takes
            spread += f"; TE's default path without offloading: {default['overhead']:+.1%}"
        checks += [("model A, k=2: saving >= 99% of theoretical", r["saving_ratio"], 0.99, ">=", ""),
                   ("model A, k=2: overhead <= 1%", r["overhead"], 0.01, "<=", spread)]
    te = {r["k"]: r for r in model["runs"] if r["strategy"] == "transformer_engine" and r["status"] == "ok"}
    alone = _ok_run(model["runs"], TE_CONTEXT_ONLY)
    pairs = {h["k"]: h for h in model.get("head_to_head", ())}
    for k in sorted(set(engine) & set(te) & {2, 4}):
        apart = f"separate runs: engine {engine[k]['overhead']:+.1%}, TE {te[k]['overhead']:+.1%}"
        apart += f"; TE's context alone: {alone['overhead']:+.1%}" if alone else ""
        checks.append((f"model A, k={k}: saving >= Transformer Engine's (GiB)", engine[k]["saving_bytes"] / GiB,
                       te[k]["saving_bytes"] / GiB, ">=", ""))
        h = pairs.get(k)
        if h is None:  # no step-by-step run: the two separate overheads
            checks.append((f"model A, k={k}: overhead <= Transformer Engine's", engine[k]["overhead"],
                           te[k]["overhead"], "<=", apart))
        elif h["status"] != "ok":
            checks.append((f"model A, k={k}: step <= Transformer Engine's (alternating pairs)", None, 0.0, "<=",
                           h["reason"]))
        else:
            q1, q3 = h["quartiles"]
            checks.append((f"model A, k={k}: step <= Transformer Engine's (alternating pairs)", h["engine_vs_te"],
                           0.0, "<=", f"engine / TE - 1, median of {h['pairs']} pairs; quartiles {q1:+.2%} .. "
                                      f"{q3:+.2%}; {apart}"))
    if 4 in engine:
        r = engine[4]
        bound = f"{r['step_ms']:.1f} ms measured, {r['bound_ms']:.1f} ms bound" if r.get("bound_ms") else ""
        checks += [("model A, k=4: step time within 5% of the copy bound", r["step_over_bound"], 1.05, "<=", bound),
                   ("model A, k=4: device-to-host bandwidth >= 90% of measured", r["d2h_of_link"], 0.90, ">=", ""),
                   ("model A, k=4: host-to-device bandwidth >= 90% of measured", r["h2d_of_link"], 0.90, ">=", "")]
    return [{"target": t, "value": v, "limit": lim, "detail": detail,
             "met": v is not None and (v >= lim if op == ">=" else v <= lim)} for t, v, lim, op, detail in checks]


def _ok_run(runs: Sequence[dict[str, Any]], strategy: str) -> dict[str, Any] | None:
    return next((r for r in runs if r["strategy"] == strategy and r["status"] == "ok"), None)


def _note(runs: Sequence[dict[str, Any]], lead: str, render: Callable[[dict[str, Any]], str]) -> list[str]:
    """One sentence: ``lead``, then each ``k``'s run as ``render`` says it (or why it did not run)."""
    said = [render(r) if r["status"] == "ok" else f"k = {r['k']}: {r['status']} ({r['reason']})" for r in runs]
    return [lead + "; ".join(said) + "."] if said else []


def _head_to_head_note(runs: Sequence[dict[str, Any]]) -> list[str]:
    """One sentence on the engine's and Transformer Engine's steps measured alternately."""
    def render(h: dict[str, Any]) -> str:
        q1, q3 = h["quartiles"]
        return (f"k = {h['k']}: engine {h['engine_ms']:.1f} ms, TE {h['te_ms']:.1f} ms; engine / TE "
                f"{h['engine_vs_te']:+.1%} (median of {h['pairs']} pairs, quartiles {q1:+.1%} .. {q3:+.1%})")
    return _note(runs, "The engine and Transformer Engine's offload, alternating step by step (the most direct "
                       "comparison of the two): ", render)


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


def _pct(x: float | None, signed: bool = False) -> str:
    return "n/a" if x is None else (f"{x:+.1%}" if signed else f"{x:.1%}")


def _grads_cell(r: dict[str, Any]) -> str:
    g = r.get("grads")
    if g is None:
        return ""
    if g["equal"] is None:
        return "not compared: " + g["reason"]
    if g.get("changed"):
        return f"changed {g['changed']} of the input and weights"
    return "bitwise equal" if g["equal"] else f"{g['mismatched']} of {g['compared']} differ (max {g['max_abs_diff']:.3g})"


def _bandwidth(r: dict[str, Any], key: str) -> str:
    return "" if r.get(f"{key}_gb_per_s") is None else f"{r[f'{key}_gb_per_s']:.1f} ({r[f'{key}_of_link']:.0%})"


def _ms(x: float | None, decimals: int = 1) -> str:
    return "" if x is None else f"{x:.{decimals}f}"


#: The columns of a model's table, each a header and what a run shows there. ``baseline ms`` is the
#: median of the no-offload steps the row's steps alternated with, which its overhead is measured
#: against (the median of the pairs' ratios, so not quite step ms / baseline ms - 1).
COLUMNS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "k": lambda r: r["k"] or "-",
    "strategy": lambda r: r["strategy"] + (f" ({r['budget_from']}'s budget)" if r.get("budget_from") else ""),
    "peak GiB": lambda r: _gib(r["peak_bytes"]),
    "saving GiB": lambda r: _gib(r["saving_bytes"]),
    "saving / theory": lambda r: _pct(r["saving_ratio"]),
    "baseline ms": lambda r: _ms(r.get("reference_ms")) or "-",
    "step ms": lambda r: _ms(r["step_ms"]),
    "overhead": lambda r: _pct(r["overhead"], True),
    "copy bound ms": lambda r: _ms(r.get("bound_ms")),
    "step / bound": lambda r: _ms(r.get("step_over_bound"), 3),
    "d2h GB/s (of link)": lambda r: _bandwidth(r, "d2h"),
    "h2d GB/s (of link)": lambda r: _bandwidth(r, "h2d"),
    "output and gradients": _grads_cell,
}


def model_table(model: dict[str, Any], columns: Sequence[str] = tuple(COLUMNS),
                strategies: Sequence[str] | None = None, failed: bool = True) -> str:
    """One model's runs as a Markdown table: ``columns`` of :data:`COLUMNS`, the runs of ``strategies``
    (all by default), and with ``failed`` the runs that failed or were skipped, with why."""
    rows = []
    for r in model["runs"]:
        if strategies is not None and r["strategy"] not in strategies:
            continue
        if r["status"] == "ok":
            rows.append([COLUMNS[c](r) for c in columns])
        elif failed:
            rows.append([COLUMNS[c](r) for c in columns[:2]] + [r["status"] + ": " + r["reason"]]
                        + [""] * (len(columns) - 3))
    return format_markdown_table(rows, columns)


def _graphed_note(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Sentences on the engine inside CUDA graphs: per-layer graphs with it against without, the copy
    bound, and (Transformer Engine's layers) the whole step captured with it against with TE's offload."""
    def render(g: dict[str, Any]) -> str:
        q1, q3 = g["per_layer_quartiles"]
        text = (f"k = {g['k']}: per-layer graphs {g['per_layer_ms']:.1f} ms without offloading, "
                f"{g['per_layer_offload_ms']:.1f} ms with, {g['per_layer_overhead']:+.1%} (median of "
                f"{g['per_layer_pairs']} pairs, quartiles {q1:+.1%} .. {q3:+.1%})")
        if g["bound_ms"] is not None:
            text += (f"; copy bound {g['bound_ms']:.1f} ms, the step with offloading {g['over_reference']:+.1%} "
                     "against the larger of the two")
        if g.get("waits_ms") is not None:
            text += (f"; the schedule's waits for copies at the link's speed {g['waits_ms']:.1f} ms, the step with "
                     f"offloading {g['over_reference_and_waits']:+.1%} against the step without plus them")
        if "offload_forward_ms" in g:  # each layer's graphs timed in steps: which ones the copies lengthen
            text += (f"; the layers' graphs in steps taken in turns, forwards {g['offload_forward_ms']:.1f} ms "
                     f"with offloading against {g['forward_ms']:.1f} ms, backwards {g['offload_backward_ms']:.1f} "
                     f"against {g['backward_ms']:.1f} ms, {g['moved_bytes'] / 1e9:.2f} GB copied each way")
        if "whole_step_vs_te" in g:
            w1, w3 = g["whole_step_quartiles"]
            text += (f"; the whole step captured, engine {g['whole_step_ms']:.1f} ms, TE's offload "
                     f"{g['te_whole_step_ms']:.1f} ms, engine / TE {g['whole_step_vs_te']:+.1%} (quartiles "
                     f"{w1:+.1%} .. {w3:+.1%})")
        return text
    return _note(runs, "The engine inside CUDA graphs, alternating step by step: ", render)


def markdown(results: dict[str, Any]) -> str:
    """The results as Markdown: the link, one table per model, the targets."""
    link = results["link_gb_per_s"]
    parts = [f"Device: {results['device']}, torch {results['torch']}."]
    if results.get("device_type") == "cpu":
        parts.append(CPU_TIMING_NOTE)
    if link:
        parts.append(f"Pinned copy bandwidth measured in this run: host-to-device {link['h2d']:.1f} GB/s, "
                     f"device-to-host {link['d2h']:.1f} GB/s, both at once {link['both']:.1f} GB/s in total.")
    for m in results["models"]:
        spec = m["spec"]
        pred = m.get("predicted") or {}
        stop = pred.get("copies_stop_fitting_at_k")
        kind = m.get("layer_kind", "transformer layer")
        saved = f"the engine's candidates {format_bytes(max(m['saved_bytes_per_layer']))}"
        if m.get("held_bytes_per_layer"):
            saved = f"{format_bytes(max(m['held_bytes_per_layer']))} held (measured by the allocator), {saved}"
        parts.append(f"### Model {m['model']}: {kind}\n\n{results['config']['layers']} layers of Linear + {kind}, "
                     f"hidden {spec['hidden']}, ffn {spec['ffn']}, {spec['heads']} heads, batch {spec['batch']}, "
                     f"sequence {results['config']['seq']}, {results['config']['dtype']}; {spec['note']}. "
                     f"Saved for backward per layer: {saved}."
                     + (f" The copies stop fitting behind compute at k = {stop} (copy bound > 1.01 x baseline)."
                        if stop else ""))
        parts.append(model_table(m))
        parts += _te_path_note(m["runs"])
        parts += _head_to_head_note(m.get("head_to_head", ()))
        parts += _graphed_note(m.get("graphed", ()))
    if results.get("targets"):
        rows = [[t["target"], "n/a" if t["value"] is None else f"{t['value']:.3f}", f"{t['limit']:.3g}",
                 "met" if t["met"] else "**missed**", t["detail"]] for t in results["targets"]]
        parts.append("### Targets\n\n" + format_markdown_table(rows, ["target", "value", "limit", "result", "detail"]))
    if results.get("planner_checks"):
        parts.append(_planner_markdown(results["planner_checks"]))
    if results["skipped"]:
        parts.append("Skipped: " + "; ".join(f"{s} ({why})" for s, why in results["skipped"].items()) + ".")
    return "\n\n".join(parts) + "\n"


def _te_path_note(runs: list[dict[str, Any]]) -> list[str]:
    """Sentences on Transformer Engine's paths, when the model's layers are TE's."""
    default = _ok_run(runs, TE_DEFAULT_PATH)
    alone = _ok_run(runs, TE_CONTEXT_ONLY)
    said = []
    if default is not None:
        said.append(f"On Transformer Engine's layers every run here takes the path TE's layers take inside an "
                    f"offload context, the engine's or TE's (TE's attention slices q, k and v off the fused "
                    f"projection instead of passing the packed buffer), \"no offload\" and \"checkpoint\" "
                    f"included, so that all runs compute the same thing. Outside any offload context (TE's "
                    f"default path) a step took {default['overhead']:+.1%} against \"no offload\" (median of "
                    f"{default['pairs']} pairs).")
    if alone is not None:
        said.append(f"TE's context with nothing offloaded (its hooks on every layer): {alone['overhead']:+.1%}.")
    return [" ".join(said)] if said else []


def _planner_markdown(checks: list[dict[str, Any]]) -> str:
    """The planner's checks as a Markdown section: one row per model and budget, misses in bold."""
    def verdict(met: bool | None) -> str:
        return "n/a" if met is None else ("met" if met else "**missed**")

    rows = []
    for c in checks:
        if "reason" in c:
            rows.append([c["model"], f"{c['budget_from']} k={c['k']}", c["reason"]] + [""] * 8 + [verdict(c["met"])])
            continue
        best = c["best"]
        vs, q = c.get("vs_best"), c.get("vs_best_quartiles")
        rows.append([c["model"], f"{c['budget_from']} k={c['k']}", c["plan"], _gib(c["peak_bytes"]),
                     _pct(c["overhead"], True),
                     "none" if best is None else f"{best['strategy']} k={best['k']}: {_gib(best['peak_bytes'])} GiB, "
                                                 f"{best['overhead']:+.1%}",
                     (f"failed: {c['vs_best_failed']}" if c.get("vs_best_failed") else "n/a") if vs is None
                     else f"{vs:+.1%} ({q[0]:+.1%} .. {q[1]:+.1%})",
                     verdict(c["time_met"]), _pct(c["peak_error"], True), _pct(c["step_error"], True),
                     verdict(c["within_budget_run"]), verdict(c["met"])])
    header = ["model", "budget of", "plan", "peak GiB", "overhead", "best pure run at >= its peak, within budget",
              "plan / best - 1, alternating (quartiles)", f"step <= best + {PLANNER_TIME_NOISE:.0%}", "peak error",
              "step error", "peak <= budget's run", "result"]
    return (f"### Planner\n\nPer budget (the predicted peak of offloading, or recomputing, the first k layers): "
            f"the plan, its measured peak and paired overhead, the fastest engine or checkpoint run whose measured "
            f"peak is between the planner's and that of the run the budget came from, the plan's steps against "
            f"that run's, alternating step by step (what the time check reads), and the prediction errors "
            f"(measured / predicted - 1, limit {PLANNER_PREDICTION_ERROR:.0%}). The planner's costs are calibrated "
            f"on the no-offload run (see `PlannerSetup`).\n\n" + format_markdown_table(rows, header))
