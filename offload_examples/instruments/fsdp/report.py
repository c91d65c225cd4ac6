"""The FSDP scenario's report: a memory table, a time-and-correctness table, and what rank 0's streams ran."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offload_examples.features.planner import Plan
from offload_examples.instruments.report import cpu_timing_note, format_bytes, format_table

__all__ = ["format_report"]


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _pct_range(pair: list[float]) -> str:
    return "{:+.1%} .. {:+.1%}".format(*pair)


def _timing_table(ranks: list[dict[str, Any]]) -> list[str]:
    """Per rank: the median steps, their spread, the paired overhead with its spread, and the bitwise checks;
    then a line that says how the overhead is taken."""
    table = format_table(
        [(r["rank"], f"{_ms(r['step_ms_without'])} / {_ms(r['step_ms_with'])}",
          "{:.1f}–{:.1f} / {:.1f}–{:.1f} ms".format(*r["step_ms_without_range"], *r["step_ms_with_range"]),
          f"{r['overhead']:+.1%}", _pct_range(r["overhead_quartiles"]), _pct_range(r["overhead_range"]),
          f"{r['grads_equal']} ({r['grads_compared']})", f"{r['params_equal']} ({r['params_compared']})",
          f"{r['max_abs_diff']:.3g}") for r in ranks],
        header=("rank", "step without / with", "fastest–slowest", "overhead", "quartiles", "min–max",
                "grads bitwise equal", "params after AdamW equal", "max |diff|"))
    rounds = ranks[0]["rounds"] if ranks else 0
    return [table, f"steps without and with offloading taken in turns, {rounds} rounds; overhead: the median over "
                   "the rounds of with / without - 1; quartiles, min–max: of that ratio over the rounds"]


def _ratio_cell(rank: dict[str, Any]) -> str:
    """Measured saving over theory, or why there is none: no peak without CUDA, a saving that recomputation
    adds to (the theory counts offloads only; a plan's own prediction is on its line), nothing offloaded."""
    if rank["saving_ratio"] is not None:
        return f"{rank['saving_ratio']:.1%}"
    if rank["saving_bytes"] is None:
        return "n/a (no CUDA)"
    return "n/a (recomputes too)" if rank.get("recomputes") else "n/a (nothing offloaded)"


def format_report(report: dict[str, Any]) -> str:
    """A memory table, a time-and-correctness table, and on CUDA what rank 0's streams ran."""
    c = report["config"]
    ranks = report["ranks"]
    wrap = ("FSDP2 fully_shard per layer" + ("" if c["reshard_after_forward"] else ", no reshard after forward")
            + (", CPUOffloadPolicy" if c["cpu_params"] else "")) if c["wrap"] == "fsdp" else "DDP"
    head = (f"{wrap} on {report['world']} rank(s) ({report['backend']}, {report['device']}, torch {report['torch']}): "
            f"{c['layers']} layers, " + (f"first {c['offload']} offloaded" if c.get("plan") is None else
                                          f"plan {c['plan']}" if isinstance(c["plan"], str) else
                                          f"planned ({c['plan']:.0%} of the saved peak)")
            + (f", last {c['checkpoint']} checkpointed" if c["checkpoint"] else "")
            + f"; hidden {c['hidden']}, seq {c['seq']}, batch {c['batch']} per rank, {c['dtype']}")
    memory = format_table(
        [(r["rank"], format_bytes(r["peak_without_bytes"]), format_bytes(r["peak_with_bytes"]),
          format_bytes(r["saving_bytes"]), format_bytes(r["theoretical_saving_bytes"]),
          _ratio_cell(r),
          format_bytes(r["offloaded_bytes"]), format_bytes(r["host_pinned_bytes"]),
          format_bytes(r["host_param_bytes"])) for r in ranks],
        header=("rank", "peak without", "peak with", "saving", "theory", "measured / theory", "to host per step",
                "host buffers (engine)", "host params+grads (FSDP)"))
    lines = [head, memory, "", *_timing_table(ranks)]
    if ranks and ranks[0].get("plan"):
        lines += ["", *_plan_lines(ranks[0]["plan"])]
    if ranks and ranks[0].get("streams"):
        roles = ranks[0].get("stream_roles", {})
        lines += ["", "rank 0, one step with offloading: busy time per CUDA stream"]
        lines.append(format_table(
            [(s["stream"], roles.get(str(s["stream"]), "?"),
              ", ".join(f"{k} {ms:.2f} ms" for k, ms in s["busy_ms"].items())) for s in ranks[0]["streams"]],
            header=("stream", "role", "work")))
        for lane, (busy, hidden) in ranks[0]["copy_overlap_ms"].items():
            if busy:
                lines.append(f"{lane} copies: {busy:.2f} ms, {hidden / busy:.0%} of it under compute kernels")
    if ranks:
        lines += _prefetch_lines(ranks[0])
    return "\n".join(lines + cpu_timing_note(report))


def _plan_lines(p: dict[str, Any]) -> list[str]:
    mib, measured = 2**20, p["measured_saving_bytes"]
    return [f"plan (rank 0 measured, every rank runs it): {Plan.from_dict(p).summary()}"
            + ("" if p["feasible"] else f"; infeasible: {p['why']}"),
            ("given plan" if p["predicted_saving_bytes"] is None else
             f"predicted saving of saved activations {p['predicted_saving_bytes'] / mib:.1f} MiB") + ", measured peak saving "
            + ("n/a (no CUDA)" if measured is None else f"{measured / mib:.1f} MiB")
            + f"; step {p['measured_step_ratio']:.2f} x the run without the plan (median over the rounds)"]


def _delay(p: dict[str, Any], key: str) -> str:
    """A delay of :func:`~offload_examples.instruments.fsdp.trace.paired_prefetch`: median over the pairs,
    and the lowest and highest pair."""
    if p[key] is None:
        return "n/a"
    return "{:+.3f} ms (pairs {:+.3f} .. {:+.3f} ms)".format(p[key], *p[f"{key}_range"])


def _prefetch_lines(r: dict[str, Any]) -> list[str]:
    """Rank 0's all-gathers without and with offloading (profiled steps in pairs), and where its picture went."""
    p = r.get("prefetch")
    lines = [""]
    if p is None:
        lines.append(f"FSDP prefetch: not measured ({r.get('prefetch_note') or 'no trace'})")
    elif p.get("note"):
        a, b = p["no_offload"], p["offload"]
        lines.append(f"FSDP prefetch: {p['note']}: {a['local_copy_ms']:.2f} ms without offloading, "
                     f"{b['local_copy_ms']:.2f} ms with (medians); with minus without, median over the pairs: "
                     f"{_delay(p, 'local_copy_delay_ms')} ({p['pairs']} profiled pairs)")
    else:
        a, b = p["no_offload"], p["offload"]
        lines.append(format_table(
            [(label, f"{x['bursts']:g}", _ms(x["median_ms"]), f"{x['exposed_ms']:.2f} ms",
              f"{x['compute_waited_ms']:.2f} ms") for label, x in (("without offloading", a), ("with offloading", b))],
            header=("rank 0, FSDP all-gathers per profiled step (median)", "count", "median", "not under compute",
                    "compute waited for them")))
        lines.append(f"delay from offloading, median over the pairs: median all-gather "
                     f"{_delay(p, 'median_delay_ms')}, compute's wait {_delay(p, 'wait_delay_ms')} "
                     f"({p['pairs']} profiled pairs)")
    picture = r.get("timeline_png")
    lines.append(f"timeline picture: {Path(picture).name if picture else r.get('timeline_note') or 'none'}")
    return lines
