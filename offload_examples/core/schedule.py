"""When each offloaded layer is released and reloaded.

A schedule is pure bookkeeping: it never touches a tensor. The engine asks it, at the start
of each layer's forward and backward, which offloaded layers to *release* (wait for their
device-to-host copies, then drop the GPU memory) and which to *reload* (start the host-to-device
copies). Because it is plain data, the same object also predicts the memory a run should use
(:meth:`DefaultSchedule.simulate`), which the tests and reports compare with what was measured.

The orders a pipeline stage runs its phases in, and a ``synchronization_dict`` built for one, are
:mod:`~offload_examples.core.orders`'; the walk that predicts the resident bytes is
:mod:`~offload_examples.core.resident`'s. Both are importable from here too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

from .orders import Phase, one_f_one_b_order, parse_order, sync_dict_for_order
from .resident import ResidentTrace, simulate_resident

__all__ = [
    "Action",
    "DefaultSchedule",
    "ManualSchedule",
    "Phase",
    "RecordedSchedule",
    "ResidentTrace",
    "SyncDictSchedule",
    "one_f_one_b_order",
    "parse_order",
    "sync_dict_for_order",
]

#: ``("release", i)`` or ``("reload", i)``.
Action = tuple[Literal["release", "reload"], int]


@dataclass(frozen=True)
class DefaultSchedule:
    """Offload the first ``k`` of ``N`` layers, for "all forwards, then all backwards".

    - Layer ``i < k`` is released before the forward of layer ``N - k + i`` starts, so at most
      ``N - k`` layers' activations are on the GPU at once.
    - Its reload starts when the backward of layer ``i + max(1, N - 2 - k)`` starts. That leaves
      ``N - 2 - k`` layers of backward compute to hide the copy behind, and keeps at most
      ``N - 1 - k`` layers resident at any backward phase: one layer fewer than the forward's
      peak, which leaves room for the weight gradients the backward accumulates on top of the
      activations (without it the backward, not the forward, becomes the peak).
    - With ``early_first_reload=True`` the reload needed first (layer ``k - 1``) starts earlier,
      with the backward of layer ``N - 2`` (:meth:`reload_trigger`). By then the first backward
      has freed a layer, so the device holds ``N - k`` layers, as at the forward's peak, beside
      the last layer's weight gradients: the peak grows by about those. When the copies take
      longer than the compute they hide behind, the reloads run back to back, and the first
      one's start sets when the last one ends: starting it one layer earlier gives the whole
      chain one more layer of backward compute. When the copies hide behind compute anyway it
      gains nothing. (Transformer Engine 2.x starts every reload one layer earlier, at
      ``N - 1 - k + i``; only the first gains time, the others wait for it behind the first,
      and each one started early holds another layer beside more gradients.)

    Parameters
    ----------
    num_layers:
        ``k``, how many layers to offload (``0 <= k <= N - 1``).
    model_layers:
        ``N``, how many times the offload context is entered in one iteration.
    early_first_reload:
        Keyword-only. Start the first reload with the backward of layer ``N - 2``: faster when the
        copies take longer than the compute, at a peak higher by about one layer's gradients.
    """

    num_layers: int
    model_layers: int
    early_first_reload: bool = field(default=False, kw_only=True)

    #: Each iteration is N forwards then N backwards, so the first backward ends the forwards.
    interleaved = False
    #: Queue the layer's copies out when its forward ends (the manual schedule waits for its caller).
    offload_at_exit = True
    #: The synchronizer's methods may not drive it.
    hand_driven = False
    #: Its actions are skipped, not refused, when a layer is not where they expect it (a step that
    #: entered the context fewer or more times than ``model_layers``): the engine warns instead.
    strict = False
    #: What to do when a reload had to happen on demand.
    reload_hint = "pass each layer's output through sync() so reloads start ahead of time"

    @property
    def releases_before_backward(self) -> bool:
        """Whether an iteration that released nothing before its backward went wrong."""
        return self.num_layers > 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "model_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not isinstance(self.early_first_reload, bool):
            raise TypeError(f"early_first_reload must be a bool, got {type(self.early_first_reload).__name__}")
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

    def expects_reload(self, layer: int) -> bool:
        """Whether the backward of ``layer`` must find its reload started (never: it reloads on demand)."""
        return False

    def describe(self, layer: int) -> str:
        return f"layer {layer} (the first {self.num_layers} of model_layers={self.model_layers} are offloaded)"

    def predict(self, offloaded_bytes: Sequence[int], kept_bytes: Sequence[int],
                events: Sequence[tuple[str, int]]) -> ResidentTrace:
        """The engine's theory for one iteration (``events``: what the engine did; unused here)."""
        return self.simulate(offloaded_bytes, kept_bytes)

    def actions(self, phase: Phase, layer: int) -> list[Action]:
        """What to do when ``phase`` of ``layer`` starts, in order."""
        if phase == "forward":  # the j-th offloaded layer is released before the forward of N - k + j
            j = layer - (self.model_layers - self.num_layers)
            return [("release", self.offloaded_layers[j])] if 0 <= j < self.num_layers else []
        return [("reload", s) for s in self._reloads_by_trigger.get(layer, ())]

    @functools.cached_property
    def _reloads_by_trigger(self) -> dict[int, tuple[int, ...]]:
        """``{layer: offloaded layers whose reload its backward starts}``, the one needed first first.
        Worked out once: the engine asks at every phase of every step, and so does every prediction."""
        due: dict[int, list[int]] = {}
        for j, s in enumerate(self.offloaded_layers):
            due.setdefault(self.reload_trigger(j), []).append(s)
        return {layer: tuple(reversed(layers)) for layer, layers in due.items()}

    @property
    def offloaded_layers(self) -> Sequence[int]:
        """The offloaded layers in forward order (here the first ``k``)."""
        return range(self.num_layers)

    @property
    def reload_lead(self) -> int:
        """How many layers before its own backward an offloaded layer's reload starts (with
        ``early_first_reload``, all but the one needed first: see :meth:`reload_trigger`)."""
        return max(1, self.model_layers - 2 - self.num_layers)

    def reload_trigger(self, j: int) -> int:
        """The layer whose backward starts the reload of the ``j``-th offloaded layer (from 0).

        ``s + reload_lead`` for offloaded layer ``s``, but no later than the first backward; with
        ``early_first_reload``, the last offloaded layer, whose backward comes first among them,
        no later than the backward of ``N - 2``.
        """
        if not 0 <= j < self.num_layers:
            raise IndexError(f"j must be between 0 and num_layers - 1 = {self.num_layers - 1}, got {j}")
        n, s = self.model_layers, self.offloaded_layers[j]
        at = min(n - 1, s + self.reload_lead)
        return max(at, n - 2) if self.early_first_reload and j == self.num_layers - 1 else at

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

    def predict_step_ms(
        self,
        forward_ms: Sequence[float],
        backward_ms: Sequence[float],
        offloaded_bytes: Sequence[int],
        d2h_gb_per_s: float,
        h2d_gb_per_s: float,
    ) -> float:
        """The shortest step this schedule allows when copies run at the given bandwidths.

        Walks one iteration in order. Compute runs back to back except where the schedule makes
        it wait: a release waits for that layer's device-to-host copy, a backward for its
        host-to-device copy. Copies run one at a time per direction at full bandwidth; a layer's
        copy out starts, at best, when its forward ends (the engine queues a layer's copies then).
        This is the bound the copy bandwidth sets for an engine that keeps this schedule's memory
        and starts a layer's backward once all of it is back. The engine's backward waits for each
        tensor's own copy, and its reload copies first what backward reads first, so where the
        reloads are the bound its step can come in slightly under this one.

        Parameters
        ----------
        forward_ms, backward_ms:
            Measured compute time of each layer's forward and backward without offloading.
        offloaded_bytes:
            Bytes each layer copies out (and back).
        d2h_gb_per_s, h2d_gb_per_s:
            Measured pinned copy bandwidth in each direction (GB/s = 1e6 bytes per ms).
        """
        n = self.model_layers
        for name, seq in (("forward_ms", forward_ms), ("backward_ms", backward_ms), ("offloaded_bytes", offloaded_bytes)):
            if len(seq) != n:
                raise ValueError(f"{name} needs {n} entries (one per layer), got {len(seq)}")
        if d2h_gb_per_s <= 0 or h2d_gb_per_s <= 0:
            raise ValueError("bandwidths must be > 0 GB/s")
        t = d2h_free = h2d_free = 0.0
        copied_out: dict[int, float] = {}
        copied_in: dict[int, float] = {}
        for phase, j in self.timeline():
            for action, i in self.actions(phase, j):
                if action == "release":
                    t = max(t, copied_out[i])
                else:
                    h2d_free = max(h2d_free, t, copied_out[i]) + offloaded_bytes[i] / (h2d_gb_per_s * 1e6)
                    copied_in[i] = h2d_free
            if phase == "backward" and j in copied_in:
                t = max(t, copied_in[j])
            t += forward_ms[j] if phase == "forward" else backward_ms[j]
            if phase == "forward" and self.is_offloaded(j):
                d2h_free = max(d2h_free, t) + offloaded_bytes[j] / (d2h_gb_per_s * 1e6)
                copied_out[j] = d2h_free
        return t


#: ``{layer: (offload_fwd, offload_num, reload_fwd, reload_num)}``, as in Transformer Engine.
SyncDict = Mapping[int, tuple[bool, int, bool, int]]


@dataclass(frozen=True)
class SyncDictSchedule:
    """A schedule written as a ``synchronization_dict``, for any order of forwards and backwards.

    Entry ``i: (offload_fwd, offload_num, reload_fwd, reload_num)`` offloads layer ``i``: its
    device-to-host copy is queued when its forward ends; the copy must be finished, and the GPU
    memory is released, when ``offload_num`` starts its forward (``offload_fwd=True``) or its
    backward (``False``); the reload starts when ``reload_num`` starts its forward or backward.
    Layers are the successive entries of the context in one iteration, so one module run on 8
    micro-batches is 8 layers. Layers without an entry stay on the GPU.

    Parameters
    ----------
    sync_dict:
        The entries, checked here: indices in range, tuples of ``(bool, int, bool, int)``, no
        layer that triggers its own release or reload.
    model_layers:
        ``N``, the number of context entries per iteration.
    order:
        The order in which phases start, e.g. ``parse_order("0F 1F 0B 1B")``; needed only for
        predictions (:meth:`simulate`, plots). When given, the entries are also checked against
        it (the release comes after the forward, the reload after the release and before the
        backward).
    """

    sync_dict: SyncDict
    model_layers: int
    order: tuple[tuple[Phase, int], ...] | None = None

    #: Forwards and backwards may interleave: an iteration ends after ``N`` forwards.
    interleaved = True
    offload_at_exit = True
    hand_driven = True  # the dict drives the synchronizer
    strict = True  # a trigger that finds its layer elsewhere is a wrong dict: it raises
    releases_before_backward = False
    reload_hint = "pass each layer's output through sync() so backward triggers are seen"

    def __post_init__(self) -> None:
        n = self.model_layers
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"model_layers must be an int >= 1, got {n!r}")
        if not isinstance(self.sync_dict, Mapping):
            raise TypeError(f"synchronization_dict must be a dict, got {type(self.sync_dict).__name__}")
        for i, entry in self.sync_dict.items():
            _check_entry(i, entry, n)
        if self.order is not None:
            object.__setattr__(self, "order", tuple(self.order))
            _check_against_order(self, self.order)

    def is_offloaded(self, layer: int) -> bool:
        return layer in self.sync_dict

    def expects_reload(self, layer: int) -> bool:
        """An offloaded layer's backward must come after its reload trigger."""
        return layer in self.sync_dict

    def predict(self, offloaded_bytes: Sequence[int], kept_bytes: Sequence[int],
                events: Sequence[tuple[str, int]]) -> ResidentTrace:
        """Walk the schedule's order, or, without one, the order the phases ran in."""
        order = self.order or [(kind, j) for kind, j in events if kind in ("forward", "backward")]
        return self.simulate(offloaded_bytes, kept_bytes, order)

    def actions(self, phase: Phase, layer: int) -> list[Action]:
        """Releases then reloads triggered when ``phase`` of ``layer`` starts."""
        fwd = phase == "forward"
        out: list[Action] = []
        for i, (ofwd, onum, rfwd, rnum) in sorted(self.sync_dict.items()):
            if ofwd == fwd and onum == layer:
                out.append(("release", i))
        for i, (ofwd, onum, rfwd, rnum) in sorted(self.sync_dict.items()):
            if rfwd == fwd and rnum == layer:
                out.append(("reload", i))
        return out

    def describe(self, layer: int) -> str:
        """The entry of ``layer`` in words, for error messages."""
        ofwd, onum, rfwd, rnum = self.sync_dict[layer]
        return (f"synchronization_dict[{layer}] = {self.sync_dict[layer]!r} (release at the "
                f"{'forward' if ofwd else 'backward'} of layer {onum}, reload at the "
                f"{'forward' if rfwd else 'backward'} of layer {rnum})")

    def timeline(self) -> list[tuple[Phase, int]]:
        if self.order is None:
            raise ValueError("this SyncDictSchedule was built without an order; pass order= to predict")
        return list(self.order)

    def simulate(self, offloaded_bytes: Sequence[int], kept_bytes: Sequence[int] | None = None,
                 timeline: Sequence[tuple[Phase, int]] | None = None) -> ResidentTrace:
        """Predict resident saved bytes along ``timeline`` (default: the schedule's order)."""
        return simulate_resident(self, offloaded_bytes, kept_bytes, timeline)


@dataclass(frozen=True)
class RecordedSchedule:
    """The releases and reloads of one iteration as they happened (manual synchronization).

    Each action is attributed to the next phase that started after it, so a reload called
    between the forward of layer 4 and the backward of layer 1 counts from that backward on.
    """

    model_layers: int
    order: tuple[tuple[Phase, int], ...]
    triggered: Mapping[tuple[Phase, int], tuple[Action, ...]]

    interleaved = True

    @classmethod
    def from_events(cls, events: Sequence[tuple[str, int]], model_layers: int) -> RecordedSchedule:
        order, triggered, pending = [], {}, []
        for kind, j in events:
            if kind in ("forward", "backward"):
                order.append((kind, j))
                triggered[(kind, j)] = tuple(pending)
                pending = []
            elif kind in ("release", "reload_start"):
                pending.append(("release" if kind == "release" else "reload", j))
        return cls(model_layers, tuple(order), triggered)

    def actions(self, phase: Phase, layer: int) -> list[Action]:
        return list(self.triggered.get((phase, layer), ()))

    def timeline(self) -> list[tuple[Phase, int]]:
        return list(self.order)

    def simulate(self, offloaded_bytes: Sequence[int], kept_bytes: Sequence[int] | None = None) -> ResidentTrace:
        return simulate_resident(self, offloaded_bytes, kept_bytes)


@dataclass(frozen=True)
class ManualSchedule:
    """Manual synchronization: every layer's saved tensors are recorded, and nothing happens to
    them until the :class:`~offload_examples.OffloadSynchronizer`'s methods are called."""

    model_layers: int

    interleaved = True
    offload_at_exit = False
    hand_driven = True
    strict = True
    releases_before_backward = False
    reload_hint = "call start_reload_layer() before its backward"

    def __post_init__(self) -> None:
        n = self.model_layers
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"model_layers must be an int >= 1, got {n!r}")

    def is_offloaded(self, layer: int) -> bool:
        return True  # it may be: the caller decides, call by call

    def expects_reload(self, layer: int) -> bool:
        return False

    def actions(self, phase: Phase, layer: int) -> list[Action]:
        return []

    def describe(self, layer: int) -> str:
        return f"layer {layer} (manual synchronization, model_layers={self.model_layers})"

    def predict(self, offloaded_bytes: Sequence[int], kept_bytes: Sequence[int],
                events: Sequence[tuple[str, int]]) -> ResidentTrace:
        """Walk the releases and reloads as they were called."""
        return RecordedSchedule.from_events(events, self.model_layers).simulate(offloaded_bytes, kept_bytes)


def _check_entry(i: object, entry: object, n: int) -> None:
    where = f"synchronization_dict[{i!r}] = {entry!r}"
    if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
        raise ValueError(f"{where}: the layer index must be an int in [0, {n - 1}] (model_layers={n})")
    if not (isinstance(entry, tuple) and len(entry) == 4):
        raise ValueError(f"{where}: expected a tuple (offload_fwd, offload_num, reload_fwd, reload_num)")
    ofwd, onum, rfwd, rnum = entry
    for name, value, kind in (("offload_fwd", ofwd, bool), ("reload_fwd", rfwd, bool),
                              ("offload_num", onum, int), ("reload_num", rnum, int)):
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{where}: {name} must be a {kind.__name__}, got {value!r}")
    for name, num in (("offload_num", onum), ("reload_num", rnum)):
        if not 0 <= num < n:
            raise ValueError(f"{where}: {name}={num} is out of range [0, {n - 1}] (model_layers={n})")
    if onum == i or rnum == i:
        raise ValueError(f"{where}: a layer cannot trigger its own release or reload")
    if (ofwd, onum) == (rfwd, rnum):
        raise ValueError(f"{where}: the release and the reload cannot be triggered by the same phase")


def _check_against_order(schedule: SyncDictSchedule, order: Sequence[tuple[Phase, int]]) -> None:
    where = {p: pos for pos, p in enumerate(order)}
    for i in schedule.sync_dict:
        ofwd, onum, rfwd, rnum = schedule.sync_dict[i]
        need = [("forward", i), ("backward", i), ("forward" if ofwd else "backward", onum),
                ("forward" if rfwd else "backward", rnum)]
        missing = [p for p in need if p not in where]
        if missing:
            raise ValueError(f"{schedule.describe(i)}: the order has no {missing[0][0]} of layer {missing[0][1]}")
        fwd, bwd, rel, rel_load = (where[p] for p in need)
        if not fwd < rel < rel_load < bwd:
            raise ValueError(
                f"{schedule.describe(i)}: in the given order the forward of layer {i} must come "
                "before the release, the release before the reload, and the reload before its backward"
            )
