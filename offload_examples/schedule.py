"""When each offloaded layer is released and reloaded.

A schedule is pure bookkeeping: it never touches a tensor. The engine asks it, at the start
of each layer's forward and backward, which offloaded layers to *release* (wait for their
device-to-host copies, then drop the GPU memory) and which to *reload* (start the host-to-device
copies). Because it is plain data, the same object also predicts the memory a run should use
(:meth:`DefaultSchedule.simulate`), which the tests and reports compare with what was measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

__all__ = ["Action", "DefaultSchedule", "Phase", "ResidentTrace"]

Phase = Literal["forward", "backward"]
#: ``("release", i)`` or ``("reload", i)``.
Action = tuple[Literal["release", "reload"], int]


@dataclass(frozen=True)
class DefaultSchedule:
    """Offload the first ``k`` of ``N`` layers, for "all forwards, then all backwards".

    - Layer ``i < k`` is released before the forward of layer ``N - k + i`` starts, so at most
      ``N - k`` layers' activations are on the GPU at once.
    - Its reload starts when the backward of layer ``N - 1 - k + i`` starts, which leaves
      ``N - k`` layers of backward compute (at most) to hide the copy behind, and again keeps at
      most ``N - k`` layers resident.

    Parameters
    ----------
    num_layers:
        ``k``, how many layers to offload (``0 <= k <= N - 1``).
    model_layers:
        ``N``, how many times the offload context is entered in one iteration.
    """

    num_layers: int
    model_layers: int

    #: Each iteration is N forwards then N backwards, so the first backward ends the forwards.
    interleaved = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "model_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.model_layers < 1:
            raise ValueError(f"model_layers must be >= 1, got {self.model_layers}")
        if not 0 <= self.num_layers <= self.model_layers - 1:
            raise ValueError(
                f"num_layers must be between 0 and model_layers - 1 = {self.model_layers - 1} "
                f"(the last layer is never offloaded: its backward runs first), "
                f"got num_layers={self.num_layers}, model_layers={self.model_layers}"
            )

    def is_offloaded(self, layer: int) -> bool:
        """Whether the saved tensors of ``layer`` are copied to host memory."""
        return 0 <= layer < self.num_layers

    def actions(self, phase: Phase, layer: int) -> list[Action]:
        """What to do when ``phase`` of ``layer`` starts, in order."""
        n, k = self.model_layers, self.num_layers
        if phase == "forward":
            i = layer - (n - k)
            return [("release", i)] if 0 <= i < k else []
        i = layer - (n - 1 - k)
        return [("reload", i)] if 0 <= i < k else []

    def timeline(self) -> list[tuple[Phase, int]]:
        """The order in which layer phases start in one iteration."""
        n = self.model_layers
        return [("forward", j) for j in range(n)] + [("backward", j) for j in reversed(range(n))]

    def simulate(self, offloaded_bytes: Sequence[int], kept_bytes: Sequence[int] | None = None) -> ResidentTrace:
        """Predict the saved bytes resident on the device over one iteration.

        Parameters
        ----------
        offloaded_bytes:
            For each layer, the bytes the engine offloads (0 for layers not offloaded).
        kept_bytes:
            For each layer, saved bytes that stay on the device (parameters' views, small or
            marked tensors, and every tensor of a layer that is not offloaded).
        """
        return simulate_resident(self, offloaded_bytes, kept_bytes)


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
        Most bytes resident at once without offloading (every layer's bytes at the end of the
        forward).
    """

    points: list[tuple[Phase, int, int, int]]
    peak_with: int
    peak_without: int

    @property
    def saving(self) -> int:
        """Theoretical peak-memory saving in bytes."""
        return self.peak_without - self.peak_with


def simulate_resident(schedule, offloaded_bytes: Sequence[int], kept_bytes: Sequence[int] | None = None) -> ResidentTrace:
    """Walk ``schedule.timeline()`` and count the saved bytes on the device (see :class:`ResidentTrace`)."""
    n = len(offloaded_bytes)
    kept = list(kept_bytes) if kept_bytes is not None else [0] * n
    if len(kept) != n:
        raise ValueError(f"offloaded_bytes has {n} layers but kept_bytes has {len(kept)}")
    on_device = [False] * n  # whether layer i's offloaded bytes are on the device
    offloaded = 0
    total = 0
    points = []
    peak_with = 0
    for phase, j in schedule.timeline():
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
    return ResidentTrace(points, peak_with, sum(offloaded_bytes) + sum(kept))
