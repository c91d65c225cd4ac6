"""The CUDA graph scenario's measuring and report: variants of one training step, side by side.

A *variant* is one way to run the step (eager, a whole-step graph, per-layer graphs), without and
with offloading; ``"X + offload"`` is ``"X"`` with offloading. Each variant has a row: its memory
(:func:`memory_row`), then its step times from :func:`time_in_turns`, where all variants take turns
step by step and each offloading variant's overhead is taken against its own variant without
offloading, round by round. :func:`format_report` prints the rows and the checks.
"""

from __future__ import annotations

import itertools
import statistics
from functools import partial
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch

from offload_examples.features.graphs import CapturedStep, _capture_stream, capture_step
from offload_examples.instruments.measure import (
    GradCheck, Measurement, Run, _zero_grads, balanced_rounds, compare_grads, free_memory, graph_pools_bytes,
    measure_round_robin, measure_steps, overhead_spread, snapshot, training_step,
)
from offload_examples.instruments.report import cpu_timing_note, format_bytes, format_table

__all__ = ["OFFLOAD", "TE_OFFLOAD", "TE_VARIANTS", "VARIANTS", "capture_training_step", "check_replays", "format_report",
           "graph_safe_checks", "graphed_copy_bound_ms", "graphed_copy_waits_ms", "graphed_layer_ms", "memory_row",
           "over_the_larger", "per_layer_step", "pool_growth", "replaying", "summarize_checks", "te_graph_context",
           "te_offload_variants", "time_in_turns", "warm_capture_stream"]

#: What an offloading variant's name ends with; the rest of the name is its variant without offloading.
OFFLOAD = " + offload"
#: The same for Transformer Engine's offloading, on its layers (:func:`te_offload_variants`).
TE_OFFLOAD = " + TE offload"
#: The variants, in the report's order.
VARIANTS = ("eager", "eager + offload", "graphed", "graphed + offload", "per-layer graphs",
            "per-layer graphs + offload")
#: Transformer Engine's offloading eagerly and in a whole-step graph (its context cannot run in per-layer
#: graphs: it starts a layer's copies in the next layer's forward and waits for them across graphs).
TE_VARIANTS = ("eager + TE offload", "graphed + TE offload")

T = TypeVar("T")


def memory_row(measured: int | None, reference: int | None = None, theory: int = 0, key: str = "peak_bytes"
               ) -> dict[str, Any]:
    """A variant's memory, and its saving against the same variant without offloading.

    Parameters
    ----------
    measured:
        The variant's memory (``None`` without CUDA).
    reference:
        The same measure of the variant without offloading; ``None`` for a variant that does not offload.
    theory:
        The schedule's saving, which ``saving_ratio`` divides by (``0``: no ratio).
    key:
        ``"peak_bytes"``, or ``"pool_bytes"`` for graphs whose memory is the pool they share (their
        ``peak_bytes`` is then ``None``).

    Returns
    -------
    dict
        ``peak_bytes`` (and ``pool_bytes``), ``saving_bytes`` and ``saving_ratio``, ``None`` where a
        value is missing.
    """
    saving = None if measured is None or reference is None else reference - measured
    return {"peak_bytes": None, key: measured, "saving_bytes": saving,
            "saving_ratio": None if saving is None or not theory else saving / theory}


def pool_growth(capture: Callable[[], T]) -> tuple[T, int]:
    """Run ``capture``; its result and how much the CUDA graphs' private pools grew across it
    (``graph_pools_bytes`` of :mod:`offload_examples.instruments.measure`).

    The pools alone are counted: the growth of all reserved memory would also count the eager warm-up
    before the capture, as much as the blocks left free by earlier work do not absorb it. The cache is
    emptied first (after a collection), since dead graphs' pools stay in the count until it is."""
    free_memory()  # collects, then empties the cache
    before = graph_pools_bytes()
    result = capture()
    torch.cuda.synchronize()
    return result, graph_pools_bytes() - before


def warm_capture_stream(model: torch.nn.Module, x: torch.Tensor) -> None:
    """One eager step without offloading on the stream that
    :func:`~offload_examples.features.graphs.make_graphed_layers` warms up and captures on.

    cuBLAS makes a workspace for each stream it first runs on, and keeps it: made here, before the pools
    are measured (:func:`pool_growth`), the first graphs captured there do not count it as their own.
    """
    model.zero_grad(set_to_none=True)  # a replay left its graph's gradients in .grad: a backward would add to them
    stream = _capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        training_step(model, x)
    torch.cuda.current_stream().wait_stream(stream)
    model.zero_grad(set_to_none=True)
    x.grad = None


def check_replays(refs: Sequence[Measurement], inputs: Sequence[torch.Tensor],
                  step: Callable[[torch.Tensor], Measurement]) -> GradCheck:
    """Run ``step`` on every input and compare its output and gradients, bit for bit, with the references."""
    checks = [compare_grads(ref, step(x)) for ref, x in zip(refs, inputs)]
    return GradCheck(all(c.equal for c in checks), sum(c.compared for c in checks),
                     max(c.max_abs_diff for c in checks), [m for c in checks for m in c.mismatched])


def summarize_checks(checks: Mapping[str, GradCheck]) -> dict[str, Any]:
    """The report's entries for the checks of several variants: all of them, and each one's verdict."""
    return {"grads_equal": all(c.equal for c in checks.values()),
            "grads_compared": sum(c.compared for c in checks.values()),
            "max_abs_diff": max(c.max_abs_diff for c in checks.values()),
            "grads_equal_by_variant": {name: c.equal for name, c in checks.items()}}


def replaying(captured: CapturedStep, inputs: Sequence[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A step for :func:`measure_round_robin`: replay ``captured`` on the next of ``inputs``, in turn (the
    copy of the input into the graph is part of the step, as it is of a training loop's)."""
    batches = itertools.cycle(inputs)
    return lambda: captured.replay(next(batches))


def time_in_turns(runs: Mapping[str, Run], rows: dict[str, dict[str, Any]], warmup: int, at_least: int) -> int:
    """Time the variants taking turns step by step (:func:`measure_round_robin`) and fill their rows.

    Parameters
    ----------
    runs:
        Each variant's step, by name (``"X + offload"`` is compared with ``"X"``).
    rows:
        The variants' rows, by name; each gets ``step_ms`` (the median) and ``step_ms_range``, and an
        offloading variant's also its :func:`overhead_spread` against its variant without offloading,
        from the steps of the same rounds.
    warmup:
        Rounds before the measured ones.
    at_least:
        The fewest measured rounds; they are rounded up to whole cycles of
        :func:`~offload_examples.instruments.measure.balanced_orders`, so that every variant takes every
        place, and follows every other, equally often, and drift falls on all alike.

    Returns
    -------
    int
        The measured rounds.
    """
    rounds = balanced_rounds(len(runs), at_least)
    timed = measure_round_robin(runs, steps=rounds, warmup=warmup)
    for name, m in timed.items():
        rows[name].update(step_ms=m.median_ms, step_ms_range=[min(m.step_ms), max(m.step_ms)])
        base = name.removesuffix(OFFLOAD).removesuffix(TE_OFFLOAD)
        if base != name and base in timed:
            rows[name].update(overhead_spread(m.step_ms, timed[base].step_ms))
        if name.endswith(OFFLOAD):  # the engine against Transformer Engine's offloading, round by round
            rows[name]["against"] = {te: overhead_spread(m.step_ms, timed[te].step_ms) for te in TE_VARIANTS
                                     if te in timed}
    return rounds


def graphed_layer_ms(graphed: Mapping[str, Sequence[Callable[[torch.Tensor], torch.Tensor]]], model: torch.nn.Module,
                     x: torch.Tensor, steps: int = 10) -> dict[str, tuple[list[float], list[float]]]:
    """Each layer's forward and backward ms in training steps through per-layer graphs (medians of ``steps``),
    for each set of layers in ``graphed`` (graphs of ``model``'s layers), the sets taking turns step by step.

    Each step is prepared and timed as :func:`~offload_examples.instruments.measure.measure_round_robin` times the
    steps it compares (gradients set to ``None``, the device idle, an event before the first replay is launched),
    so that the spans come close to adding up to such a step, in the same state of the device: the copy bound made
    from them (:func:`graphed_copy_bound_ms`) then counts what the step does besides the layers, and its compute
    runs at about the speed of the steps it is compared with. CUDA events go between the layers' forward replays,
    and into hooks on their outputs, which run as each backward graph before has ended: a graph replays its
    kernels back to back, so each span is the layer's GPU time, and any gap before its replay. The first layer's
    forward includes the step's start, the last layer's backward the loss's.
    """
    times: dict[str, list[tuple[list[float], list[float]]]] = {name: [] for name in graphed}
    for r in range(steps):
        for name in (list(graphed) if r % 2 == 0 else list(graphed)[::-1]):
            times[name].append(_layer_spans(graphed[name], model, x))
    return {name: ([statistics.median(t[0][i] for t in ts) for i in range(len(graphed[name]))],
                   [statistics.median(t[1][i] for t in ts) for i in range(len(graphed[name]))])
            for name, ts in times.items()}


def _layer_spans(graphed: Sequence[Callable[[torch.Tensor], torch.Tensor]], model: torch.nn.Module,
                 x: torch.Tensor) -> tuple[list[float], list[float]]:
    """One training step through ``graphed``: each layer's forward and backward span (ms)."""
    n = len(graphed)
    _zero_grads(model, x)  # as measure_round_robin clears them before each step it times
    torch.cuda.synchronize()
    marks, back = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)], {}
    marks[0].record()
    h = x
    for i, layer in enumerate(graphed):
        h = layer(h)
        marks[i + 1].record()
        if i < n - 1:
            h.register_hook(lambda g, i=i: back.setdefault(i, torch.cuda.Event(enable_timing=True)).record())
    h.float().square().mean().backward()
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    end.synchronize()
    ends = [marks[n]] + [back[i] for i in range(n - 2, -1, -1)] + [end]  # layers n-1 .. 0
    return ([marks[i].elapsed_time(marks[i + 1]) for i in range(n)],
            [ends[j].elapsed_time(ends[j + 1]) for j in range(n)][::-1])


def capture_training_step(model: torch.nn.ModuleList, x: torch.Tensor, ctx: Any = None, sync: Callable | None = None,
                          warmup: int = 3) -> CapturedStep:
    """The whole training step through ``ctx`` and ``sync`` (none: without offloading) captured in one
    CUDA graph (:func:`~offload_examples.features.graphs.capture_step`), from an input like ``x``."""
    return capture_step(lambda xi: training_step(model, xi, ctx, sync), x, model.parameters(), warmup=warmup)


def te_graph_context(k: int, n: int) -> tuple[Any, Callable]:
    """Transformer Engine's offload context for a captured step: ``k`` of ``n`` layers, its host buffers
    kept (a graph replays the buffers of its capture)."""
    import transformer_engine.pytorch as te

    return te.get_cpu_offload_context(True, k, n, True, False, retain_pinned_cpu_buffers=True)


def graphed_copy_bound_ms(engine: Any, forward_ms: Sequence[float], backward_ms: Sequence[float],
                          link: Mapping[str, float]) -> float:
    """The copy bound of what ``engine`` moved in its last step, beside graphs' compute: the shortest step its
    schedule allows with the copies at the link's speed
    (:meth:`~offload_examples.DefaultSchedule.predict_step_ms`)."""
    moved = [stats.offloaded_bytes for stats in engine.stats]
    return engine.schedule.predict_step_ms(forward_ms, backward_ms, moved, link["d2h"], link["h2d"])


def graphed_copy_waits_ms(bound_ms: float, forward_ms: Sequence[float], backward_ms: Sequence[float]) -> float:
    """How long a schedule keeps the graphs' compute waiting for copies at the link's speed: its copy bound
    (:func:`graphed_copy_bound_ms` over the same layers' spans) less the spans. Added to the timed graphed
    step without offloading, it estimates the step with offloading where the spans
    (:func:`graphed_layer_ms`), measured in other steps, add up to a little more or less than that step:
    an estimate, not a bound."""
    return max(0.0, bound_ms - sum(forward_ms) - sum(backward_ms))  # the sums' rounding, where nothing waits


def over_the_larger(step_ms: float, reference_ms: float, bound_ms: float | None) -> float:
    """``step_ms`` over the larger of ``reference_ms`` (the same graphs without offloading) and the copy bound
    (``None``: none), less one: what offloading costs beyond what its copies must."""
    return step_ms / max(reference_ms, bound_ms or 0.0) - 1


def te_offload_variants(model: torch.nn.ModuleList, inputs: Sequence[torch.Tensor], refs: Sequence[Measurement],
                        k: int, warmup: int, rows: Mapping[str, dict[str, Any]]
                        ) -> tuple[dict[str, dict[str, Any]], dict[str, Run], dict[str, GradCheck]]:
    """Transformer Engine's offloading of the first ``k`` layers, on the same (TE) layers and inputs: eagerly,
    as the benchmark runs it, and with the whole step captured, as TE documents its offloading under CUDA
    graphs. Their rows (memory, against ``rows``' eager and graphed peaks), their steps for
    :func:`time_in_turns` and their checks against eager steps without offloading."""
    import transformer_engine.pytorch as te

    n, x = len(model), inputs[0].clone().requires_grad_()
    ctx, sync = te.get_cpu_offload_context(True, k, n, True, False)
    eager = measure_steps(model, x, ctx, sync, steps=2, warmup=1)
    checks = {"eager + TE offload": check_replays(refs, inputs, lambda xi: measure_steps(
        model, xi.clone().requires_grad_(), ctx, sync, steps=1, warmup=0))}
    captured = capture_training_step(model, x, *te_graph_context(k, n), warmup=warmup)
    checks["graphed + TE offload"] = check_replays(
        refs, inputs, lambda xi: snapshot(model, captured.static_input, captured.replay(xi)))
    te_rows = {"eager + TE offload": memory_row(eager.peak_bytes, rows["eager"]["peak_bytes"]),
               "graphed + TE offload": memory_row(captured.peak_bytes, rows.get("graphed", {}).get("peak_bytes"))}
    runs = {"eager + TE offload": (model, x, partial(training_step, model, x, ctx, sync)),
            "graphed + TE offload": (model, captured.static_input, replaying(captured, inputs))}
    return te_rows, runs, checks


def per_layer_step(model: torch.nn.ModuleList, graphed: Sequence[Callable], x: torch.Tensor) -> Measurement:
    """A training step through per-layer graphs on a copy of ``x``: its output and gradients, on the host."""
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    return snapshot(model, x, training_step(graphed, x))


def graph_safe_checks(report: dict[str, Any], model: torch.nn.ModuleList, inputs: Sequence[torch.Tensor],
                      refs: Sequence[Measurement], ctx: Any, sync: Callable) -> dict[str, GradCheck]:
    """No CUDA: run the capture's rules eagerly (frozen host buffers) and check every gradient; the report
    gets how many buffers were pinned after the freeze (none, if the rules hold)."""
    ctx.freeze_host_buffers()
    pinned = ctx.pool.allocations
    check = check_replays(refs, inputs, lambda x: measure_steps(model, x.clone().requires_grad_(), ctx, sync,
                                                                 steps=1, warmup=0))
    report["pinned_allocations_after_freeze"] = ctx.pool.allocations - pinned
    return {"eager + offload, frozen buffers": check}


def _memory_cell(row: dict[str, Any]) -> str:
    if row.get("pool_bytes") is not None:
        return f"{format_bytes(row['pool_bytes'])} pool"
    return "n/a (no CUDA)" if row["peak_bytes"] is None else format_bytes(row["peak_bytes"])


def _overhead_cell(row: dict[str, Any]) -> str:
    if "overhead" not in row:
        return ""
    return "{:+.1%} ({:+.1%} .. {:+.1%})".format(row["overhead"], *row["overhead_quartiles"])


def _table(rows: Mapping[str, dict[str, Any]], header: tuple[str, ...],
           cells: Callable[[dict[str, Any]], tuple[str, ...]], missing: str) -> str:
    """One line per variant, in :data:`VARIANTS`' order; a variant without a row says ``missing``."""
    lines = [(name, *cells(rows[name])) if name in rows else (name, missing, *[""] * (len(header) - 2))
             for name in VARIANTS]
    lines += [(name, *cells(rows[name])) for name in TE_VARIANTS if name in rows]
    return format_table(lines, header=header)


def _memory_cells(row: dict[str, Any]) -> tuple[str, ...]:
    return _memory_cell(row), "" if row["saving_ratio"] is None else f"{row['saving_ratio']:.1%} of theory"


def _time_cells(row: dict[str, Any]) -> tuple[str, ...]:
    return f"{row['step_ms']:.1f} ms", _overhead_cell(row)


def _captured_lines(report: dict[str, Any]) -> list[str]:
    rows = report["rows"]
    lines = [f"per-layer graphs ({report['per_layer_backend']} backend): with offloading their pool is smaller by "
             f"{format_bytes(rows['per-layer graphs + offload']['saving_bytes'])};",
             f"the engine offloaded {format_bytes(report['per_layer_offloaded_bytes'])} a step"]
    if "d2h_busy_ms" in report:
        lines.append(f"device-to-host copies in a whole-step replay: {report['d2h_busy_ms']:.1f} ms, "
                     f"{report['d2h_overlapped_ms']:.1f} ms of it while kernels ran")
    if report.get("copy_bound_ms") is not None:
        link = report["link_gb_per_s"]
        lines += [f"copy bound: {report['copy_bound_ms']:.1f} ms (the schedule's copies at {link['d2h']:.1f} GB/s out "
                  f"and {link['h2d']:.1f} GB/s back, beside the per-layer graphs' compute);",
                  f"per-layer graphs + offload: {report['per_layer_over_reference']:+.1%} over the larger of it and "
                  "the per-layer graphs' step without offloading"]
    for name in VARIANTS:
        for te, spread in rows.get(name, {}).get("against", {}).items():
            lines.append("{} against {}: {:+.1%} ({:+.1%} .. {:+.1%})".format(
                name, te, spread["overhead"], *spread["overhead_quartiles"]))
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The six variants' memory, then their step times, how both were taken, then the checks."""
    c = report["config"]
    missing = "not run (skipped)" if report["captured"] else "needs CUDA"
    lines = [
        f"{report['device']} (torch {report['torch']}): {c['layers']} x Linear+transformer, hidden {c['hidden']}, "
        f"seq {c['seq']}, batch {c['batch']}, {c['dtype']}; offloading {c['offload']} layers",
        _table(report["rows"], ("variant", "peak memory", "saving"), _memory_cells, missing),
        "memory: eager, the peak of its own steps; graphed, the peak during the capture;",
        "per-layer graphs, what their shared pool grew by during the capture",
        _table(report["rows"], ("variant", "step time", "overhead of offloading (median, quartiles)"), _time_cells,
               missing),
        f"step times: {report['rounds']} rounds, the variants taking turns in each; overhead: round by",
        "round, the step with offloading over the same variant's without, less one",
        f"theoretical saving: {format_bytes(report['theoretical_saving_bytes'])}",
        f"output and gradients bitwise equal to eager without offloading: {report['grads_equal']} "
        f"({report['checks']} inputs, {report['grads_compared']} tensors, max |diff| {report['max_abs_diff']:.3g})",
    ]
    if report["captured"]:
        lines += _captured_lines(report)
    else:
        lines.append(f"capture needs CUDA; graph-safe path run eagerly: "
                     f"{report['pinned_allocations_after_freeze']} host buffers pinned after the warm-up")
    return "\n".join(lines + cpu_timing_note(report))
