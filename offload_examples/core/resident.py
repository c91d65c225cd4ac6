"""What a schedule predicts: the saved bytes on the device at the start of each phase of a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .orders import Phase

__all__ = ["ResidentTrace", "simulate_resident"]


@dataclass(frozen=True)
class ResidentTrace:
    """Resident saved bytes after each step of :meth:`DefaultSchedule.timeline`.

    Attributes
    ----------
    points:
        ``(phase, layer, offloaded_resident, total_resident)`` at the moment each phase starts,
        after that moment's releases and reloads; during a forward the layer's own bytes are
        added, during a backward they are still counted (they are freed when it ends).
    peak_with:
        Most bytes resident at once with this schedule.
    peak_without:
        Most bytes resident at once without offloading, along the same timeline (for "all
        forwards, then all backwards": every layer's bytes at the end of the forward).
    """

    points: list[tuple[Phase, int, int, int]]
    peak_with: int
    peak_without: int

    @property
    def saving(self) -> int:
        """Theoretical peak-memory saving in bytes."""
        return self.peak_without - self.peak_with


def simulate_resident(schedule, offloaded_bytes: Sequence[int], kept_bytes: Sequence[int] | None = None,
                      timeline: Sequence[tuple[Phase, int]] | None = None) -> ResidentTrace:
    """Walk ``timeline`` (default ``schedule.timeline()``) and count the saved bytes on the device.

    See :class:`ResidentTrace`; ``peak_without`` walks the same timeline with nothing offloaded.
    """
    timeline = schedule.timeline() if timeline is None else list(timeline)
    n = len(offloaded_bytes)
    kept = list(kept_bytes) if kept_bytes is not None else [0] * n
    if len(kept) != n:
        raise ValueError(f"offloaded_bytes has {n} layers but kept_bytes has {len(kept)}")
    on_device = [False] * n  # whether layer i's offloaded bytes are on the device
    offloaded = 0
    total = 0
    points = []
    peak_with = 0
    for phase, j in timeline:
        for action, i in schedule.actions(phase, j):
            if action == "release" and on_device[i]:
                on_device[i] = False
                offloaded -= offloaded_bytes[i]
                total -= offloaded_bytes[i]
            elif action == "reload" and not on_device[i]:
                on_device[i] = True
                offloaded += offloaded_bytes[i]
                total += offloaded_bytes[i]
        if phase == "forward":
            on_device[j] = True
            offloaded += offloaded_bytes[j]
            total += offloaded_bytes[j] + kept[j]
        points.append((phase, j, offloaded, total))
        peak_with = max(peak_with, total)
        if phase == "backward":
            # the layer's backward ends before the next phase starts: its saved bytes go
            if on_device[j]:
                offloaded -= offloaded_bytes[j]
                total -= offloaded_bytes[j]
                on_device[j] = False
            total -= kept[j]
    return ResidentTrace(points, peak_with, _peak_without(timeline, offloaded_bytes, kept))


def _peak_without(timeline, offloaded_bytes: Sequence[int], kept: Sequence[int]) -> int:
    total = peak = 0
    for phase, j in timeline:
        if phase == "forward":
            total += offloaded_bytes[j] + kept[j]
        peak = max(peak, total)
        if phase == "backward":
            total -= offloaded_bytes[j] + kept[j]
    return peak
