"""One profiled step of the FSDP scenario: what each CUDA stream ran, whether the engine's copies delayed
FSDP's all-gathers, and a picture of both runs' streams."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from offload_examples.instruments.fsdp.config import Wrap
from offload_examples.instruments.timeline import (
    Span,
    StreamLane,
    overlap_ms,
    prefetch_summary,
    stream_spans_from_trace,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["DELAYS", "paired_prefetch", "prefetch_comparison", "stream_activity", "timeline_figure",
           "timeline_figure_from_traces", "trace_paths"]

#: What :func:`prefetch_comparison` subtracts, with offloading minus without: the keys
#: :func:`paired_prefetch` takes the median and the range of over the pairs.
DELAYS = ("median_delay_ms", "wait_delay_ms", "local_copy_delay_ms")

def _work_kind(event: dict) -> str | None:
    cat, name = event.get("cat", ""), event.get("name", "").lower().replace("_", "")
    if cat == "kernel":
        if "nccl" not in name:
            return "compute"
        for key, kind in (("allgather", "all-gather"), ("reducescatter", "reduce-scatter"), ("allreduce", "all-reduce")):
            if key in name:
                return kind
        return "collective"
    if cat == "gpu_memcpy":
        for key, kind in (("dtoh", "device-to-host"), ("htod", "host-to-device"), ("dtod", "device-to-device")):
            if key in name:
                return kind
    return None  # memsets and host-side events


def stream_activity(trace: dict) -> tuple[list[dict[str, Any]], dict[str, tuple[float, float]]]:
    """What each CUDA stream ran in a ``torch.profiler`` Chrome trace, and how much copying overlapped compute.

    Returns
    -------
    tuple
        ``[{"stream": id, "busy_ms": {kind: ms}}, ...]`` sorted by stream, where a kind is
        ``compute``, ``all-gather``, ``reduce-scatter``, ``all-reduce``, ``collective``,
        ``device-to-host``, ``host-to-device`` or ``device-to-device``; and, for the two copy
        directions, ``(busy ms, ms overlapped by compute kernels)``.
    """
    spans: list[Span] = []
    streams: dict[int, dict[str, list[Span]]] = {}
    for e in trace.get("traceEvents", []):
        kind = _work_kind(e)
        if kind is None:
            continue
        span = Span(kind, e["ts"] / 1e3, (e["ts"] + e.get("dur", 0)) / 1e3, e.get("name", ""))
        spans.append(span)
        streams.setdefault(int(e.get("args", {}).get("stream", -1)), {}).setdefault(kind, []).append(span)
    activity = [{"stream": s, "busy_ms": {k: round(overlap_ms(v, k)[0], 3) for k, v in sorted(kinds.items())}}
                for s, kinds in sorted(streams.items())]
    return activity, {lane: overlap_ms(spans, lane) for lane in ("device-to-host", "host-to-device")}


def _profile(step: Callable[[], None], path: Path | None) -> dict:
    """Run ``step`` once under the CUDA profiler; return its Chrome trace (also written to ``path``)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        out = path or Path(tmp, "trace.json")
        prof.export_chrome_trace(str(out))
        return json.loads(Path(out).read_text())


def trace_paths(trace_dir: str | os.PathLike, rank: int = 0) -> tuple[Path, Path]:
    """Where a rank writes its Chrome traces of one profiled step: without and with offloading."""
    return Path(trace_dir, f"fsdp_trace_no_offload_rank{rank}.json"), Path(trace_dir, f"fsdp_trace_rank{rank}.json")


def prefetch_comparison(without: list[StreamLane], with_: list[StreamLane]) -> dict[str, Any]:
    """Whether the engine's copies delay FSDP's all-gathers: one profiled step without and one with offloading.

    Both steps are summarised by :func:`~offload_examples.instruments.timeline.prefetch_summary`.
    Two differences answer the question:

    - ``median_delay_ms``: the median all-gather (copy-in and collective of one FSDP unit) with
      offloading minus without. Positive when the copies slow the all-gathers down, by sharing
      memory bandwidth or copy engines with them.
    - ``wait_delay_ms``: the time the compute stream waited for all-gathers, with minus without.
      Positive when prefetches finish later than compute needs them, for instance because the
      host, held up by the engine, issued them late. A prefetch that still finishes in time adds
      nothing here even if it is slower.

    With one rank there is no all-gather stream to delay: FSDP2 gathers with a device-to-device
    copy on the compute stream. ``note`` then says so, and ``local_copy_delay_ms`` (that copy's
    time per step, with minus without) is what the engine's copies could have slowed.
    """
    a, b = prefetch_summary(without), prefetch_summary(with_)
    median = None if a["median_ms"] is None or b["median_ms"] is None else round(b["median_ms"] - a["median_ms"], 4)
    note = None if a["bursts"] or b["bursts"] else (
        "no all-gather stream ran: with one rank FSDP2 gathers by a device-to-device copy on the compute "
        "stream, so no prefetch overlaps anything; that copy's time is compared instead")
    return {"no_offload": a, "offload": b, "median_delay_ms": median,
            "wait_delay_ms": round(b["compute_waited_ms"] - a["compute_waited_ms"], 4),
            "local_copy_delay_ms": round(b["local_copy_ms"] - a["local_copy_ms"], 4), "note": note}


def _median_fields(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Field by field, the median of :func:`~offload_examples.instruments.timeline.prefetch_summary`'s
    readings of several steps (``None`` where no step has the field)."""
    out: dict[str, Any] = {}
    for key in summaries[0]:
        values = [s[key] for s in summaries if s[key] is not None]
        out[key] = round(statistics.median(values), 4) if values else None
    return out


def paired_prefetch(pairs: Sequence[tuple[list[StreamLane], list[StreamLane]]]) -> dict[str, Any]:
    """:func:`prefetch_comparison` of profiled steps taken in pairs, without and with offloading.

    The steps of a pair ran one right after the other; the pairs take turns at which goes first
    (without, with, with, without), so that what a step leaves to the next falls on both sides alike.

    Parameters
    ----------
    pairs:
        ``(lanes without, lanes with)`` of each pair, from
        :func:`~offload_examples.instruments.timeline.stream_spans_from_trace`.

    Returns
    -------
    dict
        ``no_offload`` and ``offload``: each side's summaries, field by field the median over its
        steps; for each of :data:`DELAYS`, the median over the pairs of that pair's difference (with
        minus without; ``None`` where no pair has one) and, as ``<key>_range``, the lowest and highest
        pair; ``note`` as :func:`prefetch_comparison` gives it for the first pair, and ``pairs``.
    """
    if not pairs:
        raise ValueError("paired_prefetch needs at least one pair of profiled steps")
    each = [prefetch_comparison(without, with_) for without, with_ in pairs]
    out: dict[str, Any] = {"no_offload": _median_fields([p["no_offload"] for p in each]),
                           "offload": _median_fields([p["offload"] for p in each]),
                           "note": each[0]["note"], "pairs": len(each)}
    for key in DELAYS:
        values = [p[key] for p in each if p[key] is not None]
        out[key] = round(statistics.median(values), 4) if values else None
        out[f"{key}_range"] = [min(values), max(values)] if values else None
    return out


def timeline_figure(runs: dict[str, list[StreamLane]], title: str = "") -> Figure:
    """A matplotlib figure: one panel per run (its stream lanes), on one time axis.

    ``runs`` maps a label to :func:`~offload_examples.instruments.timeline.stream_spans_from_trace`'s
    lanes. Needs matplotlib (the ``plots`` extra); uses no pyplot, so it draws in any process.
    """
    from matplotlib.figure import Figure

    from offload_examples.instruments.plots import plot_stream_timeline

    heights = [max(len(lanes), 1) for lanes in runs.values()]
    fig = Figure(figsize=(12, 1.2 * len(runs) + 0.45 * sum(heights)), layout="constrained")
    axes = fig.subplots(len(runs), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (label, lanes) in zip(axes, runs.items()):
        plot_stream_timeline(lanes, ax=ax, title=label)
    if title:
        fig.suptitle(title)
    return fig


def timeline_figure_from_traces(trace_dir: str | os.PathLike, rank: int = 0, wrap: Wrap = "fsdp") -> Figure:
    """:func:`timeline_figure` of the two traces a run with ``trace_dir`` wrote for ``rank`` (for a notebook)."""
    without, with_ = (stream_spans_from_trace(json.loads(p.read_text()), fsdp=wrap == "fsdp")
                      for p in trace_paths(trace_dir, rank))
    return timeline_figure({"without offloading": without, "with offloading": with_},
                           title=f"rank {rank}: one profiled step, per CUDA stream")
