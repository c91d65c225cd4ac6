"""The CUDA graph scenario's measuring and report: variants of one training step, side by side.

A *variant* is one way to run the step (eager, a whole-step graph, per-layer graphs), without and
with offloading; ``"X + offload"`` is ``"X"`` with offloading. Each variant has a row: its memory
(:func:`memory_row`), then its step times from :func:`time_in_turns`, where all variants take turns
step by step and each offloading variant's overhead is taken against its own variant without
offloading, round by round. :func:`format_report` prints the rows and the checks.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch

from offload_examples.features.graphs import CapturedStep, _capture_stream
from offload_examples.instruments.measure import (
    GradCheck, Measurement, Run, balanced_rounds, compare_grads, free_memory, measure_round_robin, overhead_spread,
    training_step,
)
from offload_examples.instruments.report import cpu_timing_note, format_bytes, format_table

__all__ = ["OFFLOAD", "VARIANTS", "check_replays", "format_report", "memory_row", "pool_growth", "replaying",
           "summarize_checks", "time_in_turns", "warm_capture_stream"]

#: What an offloading variant's name ends with; the rest of the name is its variant without offloading.
OFFLOAD = " + offload"
#: The variants, in the report's order.
VARIANTS = ("eager", "eager + offload", "graphed", "graphed + offload", "per-layer graphs",
            "per-layer graphs + offload")

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
    """Run ``capture`` from an emptied cache; its result and how much CUDA memory it reserved.

    The cache is emptied first because blocks cached by earlier steps would hold part of what a graph's
    pool takes, and the growth would miss it."""
    free_memory()
    reserved = torch.cuda.memory_reserved()
    result = capture()
    return result, torch.cuda.memory_reserved() - reserved


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
        if name.endswith(OFFLOAD) and name.removesuffix(OFFLOAD) in timed:
            rows[name].update(overhead_spread(m.step_ms, timed[name.removesuffix(OFFLOAD)].step_ms))
    return rounds


def _memory_cell(row: dict[str, Any]) -> str:
    if row.get("pool_bytes") is not None:
        return f"{format_bytes(row['pool_bytes'])} pool"
    return "n/a (no CUDA)" if row["peak_bytes"] is None else format_bytes(row["peak_bytes"])


def _overhead_cell(row: dict[str, Any]) -> str:
    if "overhead" not in row:
        return ""
    return "{:+.1%} ({:+.1%} .. {:+.1%})".format(row["overhead"], *row["overhead_quartiles"])


def _table(rows: Mapping[str, dict[str, Any]], header: tuple[str, ...],
           cells: Callable[[dict[str, Any]], tuple[str, ...]]) -> str:
    """One line per variant, in :data:`VARIANTS`' order; a variant without a row needs CUDA."""
    lines = [(name, *cells(rows[name])) if name in rows else (name, "needs CUDA", *[""] * (len(header) - 2))
             for name in VARIANTS]
    return format_table(lines, header=header)


def _memory_cells(row: dict[str, Any]) -> tuple[str, ...]:
    return _memory_cell(row), "" if row["saving_ratio"] is None else f"{row['saving_ratio']:.1%} of theory"


def _time_cells(row: dict[str, Any]) -> tuple[str, ...]:
    return f"{row['step_ms']:.1f} ms", _overhead_cell(row)


def _captured_lines(report: dict[str, Any]) -> list[str]:
    pooled = report["rows"]["per-layer graphs + offload"]
    return [
        f"per-layer graphs ({report['per_layer_backend']} backend): with offloading their pool is smaller by "
        f"{format_bytes(pooled['saving_bytes'])};",
        f"the engine offloaded {format_bytes(report['per_layer_offloaded_bytes'])} a step",
        f"device-to-host copies in a whole-step replay: {report['d2h_busy_ms']:.1f} ms, "
        f"{report['d2h_overlapped_ms']:.1f} ms of it while kernels ran",
    ]


def format_report(report: dict[str, Any]) -> str:
    """The six variants' memory, then their step times, how both were taken, then the checks."""
    c = report["config"]
    lines = [
        f"{report['device']} (torch {report['torch']}): {c['layers']} x Linear+transformer, hidden {c['hidden']}, "
        f"seq {c['seq']}, batch {c['batch']}, {c['dtype']}; offloading {c['offload']} layers",
        _table(report["rows"], ("variant", "peak memory", "saving"), _memory_cells),
        "memory: eager, the peak of its own steps; graphed, the peak during the capture;",
        "per-layer graphs, what their shared pool reserved during the capture",
        _table(report["rows"], ("variant", "step time", "overhead of offloading (median, quartiles)"), _time_cells),
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
