"""Pictures of schedules, memory and copies (matplotlib, imported only when drawing)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..core.schedule import DefaultSchedule

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "plot_bench_memory_time", "plot_bench_overhead", "plot_bench_saving", "plot_fraction_tradeoff",
    "plot_longest_sequence", "plot_memory_by_phase", "plot_memory_curves", "plot_overlap", "plot_peaks_by_length",
    "plot_schedule", "plot_stream_timeline", "plot_sweep", "plot_timeline", "plot_variants",
]

GiB = 2**30


def _axes(ax: Axes | None, size: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size, layout="constrained")[1]


def _phase_labels(n: int) -> list[str]:
    return [f"F{j}" for j in range(n)] + [f"B{j}" for j in reversed(range(n))]


def plot_schedule(schedule: DefaultSchedule, ax: Axes | None = None) -> Axes:
    """Where each layer's saved activations live over one iteration.

    One row per layer, one column per phase (``F j``: forward of layer j starts, ``B j``: its
    backward). Dark: on the GPU; light: only on the host; the copy out starts as soon as the
    forward saves them and the reload starts at the column marked with an arrow.
    """
    n = schedule.model_layers
    ax = _axes(ax, (max(6.0, 0.32 * 2 * n), max(2.5, 0.3 * n + 1)))
    timeline = schedule.timeline()
    col = {step: c for c, step in enumerate(timeline)}
    for i in range(n):
        start, end = col[("forward", i)], col[("backward", i)] + 1
        on_gpu = [(start, end)]
        if schedule.is_offloaded(i):
            release = next(c for (p, j), c in col.items() for a in schedule.actions(p, j) if a == ("release", i))
            reload = next(c for (p, j), c in col.items() for a in schedule.actions(p, j) if a == ("reload", i))
            on_gpu = [(start, release), (reload, end)]
            ax.broken_barh([(release, reload - release)], (i - 0.35, 0.7), color="#9ecae1")
            ax.annotate("", xy=(reload, i), xytext=(reload - 0.8, i), arrowprops=dict(arrowstyle="->", lw=1))
        ax.broken_barh([(a, b - a) for a, b in on_gpu], (i - 0.35, 0.7), color="#08519c")
    ax.set_yticks(range(n), [f"layer {i}" for i in range(n)])
    ax.set_xticks([c + 0.5 for c in range(len(timeline))], _phase_labels(n), fontsize=7)
    ax.set_xlim(0, len(timeline))
    ax.invert_yaxis()
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="#08519c", label="on the GPU"), Patch(color="#9ecae1", label="on the host only")],
              loc="lower left", fontsize=8)
    ax.set_title(f"First {schedule.num_layers} of {n} layers offloaded")
    return ax


def plot_memory_by_phase(traces: Mapping[str, Sequence[tuple[str, int, int]]], ax: Axes | None = None) -> Axes:
    """Device memory at the start of each phase, one line per run (``(phase, layer, bytes)``)."""
    ax = _axes(ax, (9, 3.5))
    for label, trace in traces.items():
        ax.plot(range(len(trace)), [b / GiB for *_, b in trace], marker=".", label=label)
    first = next(iter(traces.values()))
    ax.set_xticks(range(len(first)), [f"{p[0].upper()}{j}" for p, j, _ in first], fontsize=7)
    ax.set_ylabel("GiB allocated")
    ax.set_xlabel("phase start (F: forward, B: backward)")
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def plot_overlap(runs: Mapping[str, Mapping[str, tuple[float, float]]], ax: Axes | None = None) -> Axes:
    """Timelines from :func:`offload_examples.instruments.bandwidth.overlap_timeline`, one block per run."""
    ax = _axes(ax, (9, 1 + 1.1 * len(runs)))
    colors = {"compute": "#31a354", "d2h": "#3182bd", "h2d": "#e6550d"}
    rows = []
    for r, (label, spans) in enumerate(runs.items()):
        for k, name in enumerate(("compute", "d2h", "h2d")):
            y = r * 4 + k
            start, end = spans[name]
            ax.broken_barh([(start, end - start)], (y - 0.4, 0.8), color=colors[name])
            rows.append((y, f"{label}: {name}"))
    ax.set_yticks([y for y, _ in rows], [t for _, t in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    return ax


def plot_sweep(rows: Sequence[Mapping[str, float]], ax: Axes | None = None) -> Axes:
    """Saving (GiB) and step-time overhead (%) against the number of offloaded layers."""
    ax = _axes(ax, (6, 3.5))
    ks = [r["offload"] for r in rows]
    ax.plot(ks, [r["saving_bytes"] / GiB for r in rows], "o-", label="measured saving")
    ax.plot(ks, [r["theoretical_saving_bytes"] / GiB for r in rows], "k--", label="theoretical saving")
    ax.set_xlabel("offloaded layers k")
    ax.set_ylabel("GiB saved")
    twin = ax.twinx()
    twin.plot(ks, [100 * r["overhead"] for r in rows], "s-", color="#e6550d", label="step-time overhead")
    twin.set_ylabel("overhead (%)", color="#e6550d")
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], loc="upper left")
    ax.grid(alpha=0.3)
    return ax


def plot_timeline(spans: Sequence, ax: Axes | None = None, title: str = "") -> Axes:
    """Compute, device-to-host and host-to-device activity, one lane each.

    Takes the spans of :func:`offload_examples.instruments.timeline.record_layer_timeline` (per layer: the
    compute lane alternates shades from layer to layer and is labelled ``F3``/``B3``, red marks
    where the compute stream waited for copies, copies are coloured and labelled by layer) or of
    :func:`offload_examples.instruments.timeline.record_timeline` (every kernel and copy, unlabelled).
    Where a copy's bar sits above a stretch of green, it ran while the GPU computed.
    """
    from .timeline import LANES

    ax = _axes(ax, (11, 2.6))
    lane_colors = {"compute": "#31a354", "device-to-host": "#3182bd", "host-to-device": "#e6550d"}
    total = max((sp.end for sp in spans), default=1.0) or 1.0
    for y, lane in enumerate(LANES):
        mine = [sp for sp in spans if sp.lane == lane]
        if not any(sp.layer is not None for sp in mine):
            bars = [(sp.start, max(sp.end - sp.start, 1e-3)) for sp in mine]
            ax.broken_barh(bars, (y - 0.4, 0.8), color=lane_colors[lane], linewidth=0)
            continue
        if lane == "compute":
            for sp in mine:
                stall = sp.name == "wait"
                color = "#de2d26" if stall else ("#31a354" if sp.layer % 2 == 0 else "#a1d99b")
                ax.broken_barh([(sp.start, max(sp.end - sp.start, 1e-3))], (y - 0.4, 0.8), color=color, linewidth=0)
                if not stall and sp.end - sp.start > 0.018 * total:
                    ax.text((sp.start + sp.end) / 2, y, sp.name, ha="center", va="center", fontsize=6)
            continue
        _copy_lane(ax, mine, y, total)
    ax.set_yticks(range(len(LANES)), LANES)
    ax.set_ylim(len(LANES) - 0.5, -0.5)
    ax.set_xlim(0, total)
    ax.set_xlabel("ms")
    if any(sp.name == "wait" for sp in spans):
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color="#de2d26", label="compute waits for a copy")], loc="upper right", fontsize=7)
    if title:
        ax.set_title(title)
    return ax


def _copy_lane(ax: Axes, spans: Sequence, y: int, total: float) -> None:
    """Copies coloured by layer, each layer labelled once in the middle of its copies."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    by_layer: dict[int, list] = {}
    for sp in spans:
        by_layer.setdefault(sp.layer, []).append(sp)
    for layer, group in by_layer.items():
        bars = [(sp.start, max(sp.end - sp.start, 1e-3)) for sp in group]
        ax.broken_barh(bars, (y - 0.4, 0.8), color=cmap(layer % 10), linewidth=0)
        lo, hi = min(sp.start for sp in group), max(sp.end for sp in group)
        if hi - lo > 0.025 * total:
            ax.text((lo + hi) / 2, y, f"L{layer}", ha="center", va="center", fontsize=7, color="white")


def plot_memory_curves(curves: Mapping[str, object], ax: Axes | None = None, title: str = "") -> Axes:
    """GPU memory over one step, one curve per run (:func:`offload_examples.instruments.memory_history.record_memory_curve`).

    Each curve is shaded down to zero, so where two runs are drawn the band between them is
    the memory one saves over the other, moment by moment; the peaks are marked. The time is the
    host's, when the allocator saw each event, which runs ahead of the GPU's.
    """
    ax = _axes(ax, (9, 3.5))
    colors = ["#3182bd", "#e6550d", "#31a354", "#756bb1"]
    for c, (label, curve) in enumerate(curves.items()):
        color = colors[c % len(colors)]
        gib = [b / GiB for b in curve.allocated]
        ax.step(curve.ms, gib, where="post", color=color, lw=1.2,
                label=f"{label} (peak {curve.peak / GiB:.2f} GiB, weights and input included)")
        ax.fill_between(curve.ms, gib, step="post", color=color, alpha=0.15)
    ax.set_xlabel("ms into the step (host time of allocator events)")
    ax.set_ylabel("GiB allocated")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    if title:
        ax.set_title(title)
    return ax


def plot_variants(rows: Mapping[str, Mapping[str, Any]], title: str = "") -> Figure:
    """Peak memory and step time of a few ways to run the same step, side by side.

    ``rows`` maps a label to a dict with ``peak_bytes`` (``None`` without CUDA) and ``step_ms``,
    as the CUDA-graph and weight-streaming scenarios report them. A row whose memory is a graph pool
    (``pool_bytes``, with ``peak_bytes`` ``None``) shows the pool, hatched.
    """
    import matplotlib.pyplot as plt

    fig, (mem, ms) = plt.subplots(1, 2, figsize=(10, 0.5 + 0.45 * len(rows)), layout="constrained")
    labels = list(rows)[::-1]
    colors = ["#3182bd" if "offload" in k or "stream" in k else "#969696" for k in labels]
    pooled = [rows[k]["peak_bytes"] is None and rows[k].get("pool_bytes") is not None for k in labels]
    peaks = [(rows[k]["pool_bytes"] if pool else rows[k]["peak_bytes"] or 0) / GiB for k, pool in zip(labels, pooled)]
    times = [rows[k]["step_ms"] for k in labels]
    memory = "peak GPU memory (GiB)" + ("; hatched: the graphs' pool" if any(pooled) else "")
    for ax, values, unit in ((mem, peaks, memory), (ms, times, "step time (ms)")):
        bars = ax.barh(labels, values, color=colors, hatch=["//" if pool and ax is mem else "" for pool in pooled])
        ax.bar_label(bars, fmt="%.2f" if ax is mem else "%.1f", padding=3, fontsize=8)
        ax.set_xlabel(unit)
        ax.margins(x=0.15)
        ax.grid(axis="x", alpha=0.3)
    ms.set_yticks([])
    if title:
        fig.suptitle(title)
    return fig


def plot_longest_sequence(report: Mapping[str, Any], ax: Axes | None = None) -> Axes:
    """Tokens per second against sequence length, one line per strategy, each ending (with an ``x``) at
    the longest length that strategy ran.

    Takes the report of :mod:`offload_examples.scenarios.long_context`: each strategy's probes that ran.
    """
    ax = _axes(ax, (7, 4))
    for name, result in report["strategies"].items():
        runs = sorted((p["seq"], p["tokens_per_s"]) for p in result["probes"] if p["ok"])
        if not runs:
            continue
        line = ax.plot([s for s, _ in runs], [t for _, t in runs], "o-", markersize=3, label=name)[0]
        end = max(runs)
        ax.plot(*end, "x", color=line.get_color(), markersize=9, markeredgewidth=2)
    ax.set_xscale("log", base=2)
    return _by_length(ax, "tokens per second", "where each line ends (x), the next length ran out of memory")


def _by_length(ax: Axes, ylabel: str, title: str) -> Axes:
    """Labels, title, legend and grid of a long-context plot against the sequence length."""
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax


def plot_peaks_by_length(report: Mapping[str, Any], ax: Axes | None = None) -> Axes:
    """Peak GPU memory against sequence length, one line per strategy through the steps that ran, the cost
    model's prediction of each step beside it (hollow; the engine, the planner and checkpointing with
    offloaded inputs), a step that ran out of memory as an ``x`` at the memory limit (dashed).

    Takes the report of :mod:`offload_examples.scenarios.long_context` (its ``memory_limit_bytes``: the line).
    """
    ax = _axes(ax, (7, 4))
    limit, any_predicted = report.get("memory_limit_bytes"), False
    for name, result in report["strategies"].items():
        ran = sorted((p["seq"], p["peak_bytes"] / GiB) for p in result["probes"] if p["ok"] and p["peak_bytes"])
        if not ran:
            continue
        line = ax.plot(*zip(*ran), "o-", markersize=4, label=name)[0]
        predicted = sorted((p["seq"], p["predicted_peak_bytes"] / GiB) for p in result["probes"]
                           if p["ok"] and p.get("predicted_peak_bytes"))
        if predicted:
            ax.plot(*zip(*predicted), "o", markersize=9, markerfacecolor="none", color=line.get_color())
            any_predicted = True
        failed = [p["seq"] for p in result["probes"] if not p["ok"]]
        if failed and limit:
            ax.plot(failed, [limit / GiB] * len(failed), "x", color=line.get_color(), markersize=8, markeredgewidth=2)
    if limit:
        ax.axhline(limit / GiB, color="0.4", ls="--", lw=0.8, label="memory limit")
    if any_predicted:  # one legend entry for every strategy's hollow markers
        ax.plot([], [], "o", markersize=9, markerfacecolor="none", color="0.3", label="predicted by the cost model")
    return _by_length(ax, "peak GPU memory (GiB)", "each step that ran (filled) and its prediction (hollow); "
                      "x: out of memory")


def plot_fraction_tradeoff(report: Mapping[str, Any], ax: Axes | None = None) -> Axes:
    """GPU memory and step time as the offloaded fraction of optimizer state goes from 0 to 1.

    Takes the report of :mod:`offload_examples.scenarios.optimizer_offload`; the plain optimizer
    is drawn as dashed lines.
    """
    ax = _axes(ax, (7, 3.6))
    rows = sorted(report["rows"], key=lambda r: r["fraction"])
    xs = [r["offloaded_fraction"] for r in rows]
    if report["plain"]["gpu_bytes"] is not None:
        ax.plot(xs, [r["gpu_bytes"] / GiB for r in rows], "o-", color="#3182bd", label="GPU memory")
        ax.axhline(report["plain"]["gpu_bytes"] / GiB, color="#3182bd", ls="--", lw=0.8, label="plain optimizer")
    ax.set_xlabel("fraction of parameter bytes whose optimizer state is on the host")
    ax.set_ylabel("GiB allocated after the step", color="#3182bd")
    twin = ax.twinx()
    twin.plot(xs, [r["step_ms"] for r in rows], "s-", color="#e6550d", label="step time")
    twin.axhline(report["plain"]["step_ms"], color="#e6550d", ls="--", lw=0.8)
    twin.set_ylabel("ms per step", color="#e6550d")
    twin.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], loc="lower left", fontsize=8)
    ax.grid(alpha=0.3)
    return ax


#: Colour, marker and legend label of each strategy of the benchmark.
_STRATEGY_STYLE = {
    "no offload": ("#252525", "*", "no offload"), "engine": ("#08519c", "o", "engine"),
    "engine (fresh pinned)": ("#6baed6", "o", "engine, fresh pinned"), "save_on_cpu": ("#e6550d", "s", "save_on_cpu"),
    "torchtune": ("#756bb1", "D", "torchtune"), "transformer_engine": ("#31a354", "^", "TE's offload"),
    "checkpoint": ("#969696", "v", "recompute"),
}
#: Width of a figure with one or two panels: the text column of the docs (736 px at their 110 dpi),
#: so that a figure is shown at the size it is drawn and its 9 pt text stays 9 pt.
COLUMN_INCHES = 6.7
#: Font size of every text of the benchmark's figures.
BENCH_FONT = 9


def _model_panels(results: Mapping[str, Any], models: Sequence[str] | None = None,
                  height: float = 3.2) -> tuple[Figure, list[Axes], list[Mapping[str, Any]]]:
    """A figure with one panel per model (``models``: those, in that order; all by default)."""
    import matplotlib.pyplot as plt

    by_name = {m["model"]: m for m in results["models"]}
    chosen = [by_name[name] for name in models] if models is not None else list(results["models"])
    width = COLUMN_INCHES if len(chosen) <= 2 else COLUMN_INCHES / 2 * len(chosen)
    fig, axes = plt.subplots(1, len(chosen), figsize=(width, height), layout="constrained", squeeze=False)
    for ax, model in zip(axes[0], chosen):
        ax.set_title(f"model {model['model']}: " + ("Transformer Engine's layers" if model.get("layer_kind", "")
                                                     .startswith("te.") else "PyTorch's layers"), fontsize=BENCH_FONT)
        ax.tick_params(labelsize=BENCH_FONT)
        ax.grid(alpha=0.3)
    return fig, list(axes[0]), chosen


def _figure_legend(fig: Figure, axes: Sequence[Axes]) -> None:
    """One legend below the panels with every line any panel draws, each label once."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    if seen:  # as many columns as fit the figure's width, an entry about 0.55 em a character and 4 em of line
        entry = max((0.55 * len(label) + 4) * BENCH_FONT / 72 for label in seen)
        ncols = max(1, min(len(seen), int(fig.get_figwidth() // entry)))
        fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncols=ncols,
                   fontsize=BENCH_FONT, frameon=False)


def _k_axis(ax: Axes) -> None:
    """An x axis of treated layers: whole numbers only, however few values of ``k`` the run has."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("layers treated (k)", fontsize=BENCH_FONT)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _ok_runs(model: Mapping[str, Any], strategy: str) -> list[Mapping[str, Any]]:
    return sorted((r for r in model["runs"] if r["strategy"] == strategy and r["status"] == "ok"),
                  key=lambda r: r["k"])


def _strategies(strategies: Sequence[str] | None) -> list[str]:
    return list(_STRATEGY_STYLE) if strategies is None else list(strategies)


def _no_memory(ax: Axes) -> None:
    ax.text(0.5, 0.5, "no memory measured\n(it is measured on CUDA only)", ha="center", va="center",
            transform=ax.transAxes, fontsize=BENCH_FONT)


def plot_bench_saving(results: Mapping[str, Any], models: Sequence[str] | None = None,
                      strategies: Sequence[str] | None = None) -> Figure:
    """The share of the predicted saving each strategy freed, against the number of treated layers.

    One panel per model, one line per strategy. The saving is the row's activation peak below the
    run without offloading's; the prediction is what the engine's schedule frees for the same ``k``
    from the bytes each layer saves (``saving / theory`` in the tables), the same for every strategy.
    """
    fig, axes, chosen = _model_panels(results, models)
    for ax, model in zip(axes, chosen):
        for strategy in _strategies(strategies):
            color, marker, label = _STRATEGY_STYLE[strategy]
            runs = [r for r in _ok_runs(model, strategy) if r["k"] and r.get("saving_ratio") is not None]
            if runs:
                ax.plot([r["k"] for r in runs], [100 * r["saving_ratio"] for r in runs], marker=marker, color=color,
                        ms=5, label=label)
        if not ax.lines:
            _no_memory(ax)
        _k_axis(ax)
        ax.set_ylabel("freed, % of the prediction", fontsize=BENCH_FONT)
    _figure_legend(fig, axes)
    return fig


def plot_bench_memory_time(results: Mapping[str, Any], models: Sequence[str] | None = None,
                           strategies: Sequence[str] | None = None) -> Figure:
    """Memory freed against step time added, one panel per model, one line per strategy through its ``k``.

    Both are measured against the run without offloading: the saving from the activation peaks, the
    overhead from steps alternating with no-offload steps (the median of their ratios), so that the
    drift of the GPU and the host falls on both alike. Up is more memory freed, left is less time
    added; the numbers are the layers treated.
    """
    fig, axes, chosen = _model_panels(results, models)
    for ax, model in zip(axes, chosen):
        for i, strategy in enumerate(_strategies(strategies)):
            color, marker, label = _STRATEGY_STYLE[strategy]
            runs = [r for r in _ok_runs(model, strategy) if r["k"] and r["saving_bytes"] is not None]
            if not runs:
                continue
            xs, ys = [100 * r["overhead"] for r in runs], [r["saving_bytes"] / GiB for r in runs]
            ax.plot(xs, ys, marker=marker, color=color, ms=5, label=label)
            for r, x, y in zip(runs, xs, ys):  # the first strategy's numbers below right, the others' above left
                ax.annotate(str(r["k"]), (x, y), textcoords="offset points", xytext=(4, -11) if i == 0 else (-10, 3),
                            fontsize=BENCH_FONT, color=color)
        if not ax.lines:
            _no_memory(ax)
        ax.set_xlabel("step time added (%)", fontsize=BENCH_FONT)
        ax.set_ylabel("GiB freed", fontsize=BENCH_FONT)
        ax.set_ylim(bottom=0)
    _figure_legend(fig, axes)
    return fig


def plot_bench_overhead(results: Mapping[str, Any], models: Sequence[str] | None = None,
                        strategies: Sequence[str] | None = None, bound: bool = True) -> Figure:
    """Step-time overhead against the number of treated layers, one panel per model.

    With ``bound``, the dashed line is the copy bound of the engine's schedule (the fastest step the
    measured bandwidth allows) and the dotted vertical line marks where the copies stop fitting
    behind compute.
    """
    fig, axes, chosen = _model_panels(results, models)
    strategies = _strategies(strategies)
    for ax, model in zip(axes, chosen):
        base = next((r["step_ms"] for r in model["runs"] if r["strategy"] == "no offload"), None)
        for strategy in strategies:
            color, marker, label = _STRATEGY_STYLE[strategy]
            runs = _ok_runs(model, strategy)
            if strategy != "no offload" and runs:
                ax.plot([r["k"] for r in runs], [100 * r["overhead"] for r in runs], marker=marker, color=color,
                        ms=5, label=label)
        pred = model.get("predicted")
        if pred and base and bound:
            top = max([r["k"] for r in model["runs"] if r["k"]], default=0)
            ks = [k for k in sorted(int(k) for k in pred["bound_ms"]) if k <= top]
            ax.plot(ks, [100 * (pred["bound_ms"][str(k) if str(k) in pred["bound_ms"] else k] / base - 1) for k in ks],
                    "k--", lw=1, label="copy bound")
            if pred.get("copies_stop_fitting_at_k"):
                ax.axvline(pred["copies_stop_fitting_at_k"], color="k", ls=":", lw=1, label="copies stop fitting")
        _k_axis(ax)
        ax.set_ylabel("step time added (%)", fontsize=BENCH_FONT)
    _figure_legend(fig, axes)
    return fig


#: Colours of :func:`plot_stream_timeline`, one per stream role.
STREAM_ROLE_COLORS = {
    "compute": "#31a354", "fsdp all-gather": "#756bb1", "fsdp reduce-scatter": "#d6616b", "all-reduce": "#e7969c",
    "engine device-to-host": "#3182bd", "engine host-to-device": "#e6550d", "other": "#969696",
}


def plot_stream_timeline(lanes: Sequence, ax: Axes | None = None, title: str = "") -> Axes:
    """One lane per CUDA stream, coloured by what the stream is for.

    Takes the lanes of :func:`offload_examples.instruments.timeline.stream_spans_from_trace`:
    compute, FSDP's all-gather and reduce-scatter streams, the engine's device-to-host and
    host-to-device streams. Each lane is labelled with its stream id and role; where an
    all-gather bar sits above green, FSDP's prefetch ran while the GPU computed.
    """
    ax = _axes(ax, (11, 0.6 + 0.45 * max(len(lanes), 1)))
    total = max((sp.end for lane in lanes for sp in lane.spans), default=1.0) or 1.0
    for y, lane in enumerate(lanes):
        bars = [(sp.start, max(sp.end - sp.start, 1e-3)) for sp in lane.spans]
        ax.broken_barh(bars, (y - 0.4, 0.8), color=STREAM_ROLE_COLORS.get(lane.role, "#969696"), linewidth=0)
    ax.set_yticks(range(len(lanes)), [lane.label for lane in lanes], fontsize=8)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, total)
    ax.set_xlabel("ms from the first GPU activity")
    from matplotlib.patches import Patch

    roles = list(dict.fromkeys(lane.role for lane in lanes))  # the roles present, in lane order
    ax.legend(handles=[Patch(color=STREAM_ROLE_COLORS.get(r, "#969696"), label=r) for r in roles],
              loc="upper right", fontsize=7, ncols=min(len(roles), 3) or 1)
    if title:
        ax.set_title(title)
    return ax


def _pareto_line(ax: Axes, points: list[tuple[float, float]], **style: Any) -> None:
    """Points ``(ms, GiB)`` joined in order of memory, so each line reads as a memory-vs-time curve."""
    points = sorted(set(points), key=lambda p: (p[1], p[0]))
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], **style)


def plot_bench_pareto(results: Mapping[str, Any]) -> Figure:
    """Measured peak against step time for offload-only, recompute-only and the planner, one panel per model.

    Offload-only is the bench's ``engine`` at each ``k``, recompute-only its ``checkpoint``, and the
    planner its runs under each budget; the baseline is the star. Hollow circles are the planner's
    predictions (the predicted step at the no-offload steps it ran beside), each joined to its
    measurement by a thin line. Down is less memory, left is faster.
    """
    fig, axes, chosen = _model_panels(results)
    styles = {"engine": ("offload only (engine, k layers)", "#08519c", "o"),
              "checkpoint": ("recompute only (checkpoint, k layers)", "#969696", "v"),
              "planner": ("planner (a budget per k)", "#e6550d", "D")}
    for ax, model in zip(axes, chosen):
        runs = [r for r in model["runs"] if r["status"] == "ok" and r.get("peak_bytes") is not None]
        for r in runs:
            if r["strategy"] == "no offload":
                ax.plot(r["step_ms"], r["peak_bytes"] / GiB, "*", color="#252525", ms=10, label="no offload")
        for strategy, (label, color, marker) in styles.items():
            _pareto_line(ax, [(r["step_ms"], r["peak_bytes"] / GiB) for r in runs if r["strategy"] == strategy],
                         marker=marker, color=color, ms=5, label=label)
        planner = [r for r in runs if r["strategy"] == "planner"]
        for r in planner:
            measured = (r["step_ms"], r["peak_bytes"] / GiB)
            predicted = (r["predicted_step_ms_paired"], r["predicted_peak_bytes"] / GiB)
            ax.plot(*zip(measured, predicted), "-", color="#e6550d", lw=0.6, alpha=0.6)
        if planner:
            ax.plot([r["predicted_step_ms_paired"] for r in planner], [r["predicted_peak_bytes"] / GiB for r in planner],
                    "o", mfc="none", color="#e6550d", ms=7, label="planner, predicted")
        if not ax.lines:
            _no_memory(ax)
        ax.set_xlabel("step time (ms, median)", fontsize=BENCH_FONT)
        ax.set_ylabel("peak GiB allocated", fontsize=BENCH_FONT)
    _figure_legend(fig, axes)
    fig.suptitle("Memory vs time: offload only, recompute only and the planner", fontsize=BENCH_FONT + 1)
    return fig
