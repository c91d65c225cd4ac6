"""Pictures of schedules, memory and copies (matplotlib, imported only when drawing)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from .schedule import DefaultSchedule

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["plot_memory_by_phase", "plot_overlap", "plot_schedule", "plot_sweep", "plot_timeline"]

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
    """Timelines from :func:`offload_examples.bandwidth.overlap_timeline`, one block per run."""
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
    """Compute, device-to-host and host-to-device activity from :func:`offload_examples.timeline.record_timeline`.

    One lane per kind of work; where a copy's bar sits above a stretch of green, it ran while
    the GPU computed.
    """
    from .timeline import LANES

    ax = _axes(ax, (10, 2.2))
    colors = {"compute": "#31a354", "device-to-host": "#3182bd", "host-to-device": "#e6550d"}
    for y, lane in enumerate(LANES):
        bars = [(s.start, max(s.end - s.start, 1e-3)) for s in spans if s.lane == lane]
        ax.broken_barh(bars, (y - 0.4, 0.8), color=colors[lane], linewidth=0)
    ax.set_yticks(range(len(LANES)), LANES)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    if title:
        ax.set_title(title)
    return ax
