"""What a user sets on an engine: its checked arguments, which modules offload, how the host pool grows.

:class:`~offload_examples.core.engine.OffloadEngine` derives from :class:`EngineSettings`. None of
these run during a step's copies; they set what the next steps do, and which saved tensor may go.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from .policy import ModuleSelection
from .schedule import DefaultSchedule, ManualSchedule, SyncDictSchedule

__all__ = ["EngineSettings", "checked_settings"]

Schedule = DefaultSchedule | SyncDictSchedule | ManualSchedule


#: One cap for every offloaded layer, one per layer (layers not named have none), or none at all.
Caps = int | Mapping[int, int] | None


def checked_settings(schedule: Schedule | None, model_layers: int | None, min_offload_bytes: int,
                     max_offload_bytes_per_layer: Caps) -> Schedule:
    """Refuse bad engine arguments with one clear error each; returns the schedule to follow
    (a :class:`ManualSchedule` of ``model_layers`` when none is given)."""
    if not isinstance(min_offload_bytes, int) or min_offload_bytes < 0:
        raise ValueError(f"min_offload_bytes must be an int >= 0, got {min_offload_bytes!r}")
    if schedule is None:
        schedule = ManualSchedule(model_layers)
    elif model_layers is not None and model_layers != schedule.model_layers:
        raise ValueError(f"model_layers={model_layers} disagrees with the schedule's {schedule.model_layers}")
    _check_caps(max_offload_bytes_per_layer, schedule.model_layers)
    return schedule


def _check_caps(caps: Caps, n: int) -> None:
    def positive(cap: object) -> bool:
        return isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1

    if caps is None or positive(caps):
        return
    if not isinstance(caps, Mapping):
        raise ValueError(f"max_offload_bytes_per_layer must be an int >= 1, a mapping {{layer: int >= 1}} or None, "
                         f"got {caps!r}")
    for layer, cap in caps.items():
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < n:
            raise ValueError(f"max_offload_bytes_per_layer: layer {layer!r} is not an entry of the context "
                             f"(0 .. {n - 1})")
        if not positive(cap):
            raise ValueError(f"max_offload_bytes_per_layer[{layer}] must be an int >= 1, got {cap!r}")


class EngineSettings:
    """Settings of the engine that take effect from the next saved tensor or the next step."""

    #: The chosen submodules (:meth:`offload_modules`), or ``None``: every module of an offloaded layer.
    selection: ModuleSelection | None
    #: What one CUDA graph capture holds: ``"step"`` (a whole step, or a whole model's forward and its
    #: backward) or ``"layer"`` (one layer's forward, or its backward); see :meth:`set_capture_scope`.
    capture_scope: str = "step"
    #: Per-layer graphs: ``"inside"`` (a layer's copies to the host run in the later layers' graphs) or
    #: ``"between"`` (the replays of
    #: :func:`~offload_examples.features.graphs.make_graphed_layers` queue them between the graphs).
    copies_out: str = "inside"

    def set_capture_scope(self, scope: str) -> None:
        """Say how captures cut the step: ``"layer"`` when each layer is captured in a graph of its own
        (``make_graphed_callables`` with one callable per layer;
        :func:`~offload_examples.features.graphs.make_graphed_layers` sets it).

        Per layer, a layer's copies to the host are spread over the entries of the layers after it, up
        to the one that releases it, and each of those joins its share at its exit: they run beside the
        later layers' forwards inside their graphs, and no graph ends with a copy still forked from it.
        Its reload is spread the same way over the backwards from the one that starts it to the one
        before its own, each joined as its backward call ends. With ``"step"`` (the default) the copies
        start as each layer's forward ends, and the release of their layer joins them, as in an eager
        step. Eager steps behave the same under both.
        """
        if scope not in ("step", "layer"):
            raise ValueError(f"capture scope must be 'step' or 'layer', got {scope!r}")
        if scope == "layer" and (not self.schedule.offload_at_exit or self.schedule.interleaved):
            raise ValueError("capture scope 'layer' needs the default schedule (all forwards, then the backward; "
                             "copies that start as a layer's forward ends): a layer's copies wait for the next "
                             "entry, which an interleaved or manual schedule may not bring before its release")
        self.capture_scope, self.copies_out = scope, "inside"
        self._between = {}  # copies planned by a capture and not taken (a failed one) are no one's to replay

    def _copy_between_replays(self) -> None:
        """Per-layer captures from here on leave a layer's copies to the host out of the graphs: they only plan
        them, for :meth:`_take_copies_between`. For :func:`~offload_examples.features.graphs.make_graphed_layers`,
        whose layers queue the copies after the layer's forward graph and wait for them before the graph that
        releases it; graphs captured so and replayed without that would reload host buffers nobody filled."""
        if self.capture_scope != "layer":
            raise RuntimeError("copies between replays need the capture scope 'layer' (set_capture_scope)")
        self.copies_out = "between"

    def _take_copies_between(self) -> tuple[dict[int, list[tuple[int, int, torch.Tensor]]], dict[int, list[int]]]:
        """Per-layer graphs captured with ``copies_out="between"``, taken once after the capture: ``({layer:
        [(device address, bytes, host buffer)]}, {entry: [layers]})``, the storages to copy to the host once a
        layer's forward graph has been replayed, and the layers whose copies must have ended before each
        entry's forward graph (the one that releases them: their memory is another layer's from there on)."""
        planned, self._between = self._between, {}
        waits: dict[int, list[int]] = {}
        for layer in planned:
            waits.setdefault(self._release_entry(layer), []).append(layer)
        copies = {layer: [(rec.address, rec.nbytes, data) for rec, data in records]
                  for layer, records in planned.items()}
        return copies, waits

    def release_buffers(self) -> None:
        """Free the pinned host buffers that are not in use (those of captured graphs stay)."""
        self.pool.release()

    def freeze_host_buffers(self) -> None:
        """Allocate no more host buffers: later steps reuse the ones made so far.

        A CUDA graph capture needs exactly this, and the engine behaves so by itself while
        capturing. Calling it after an eager warm-up step of a context built with
        ``retain_pinned_cpu_buffers=True`` (without it, buffers go back to PyTorch's cache as soon
        as they are free) runs that graph-safe path eagerly, on a CPU too: buffers stay fixed,
        nothing is pinned per step, and a step that would need a new buffer raises
        :class:`~offload_examples.GraphCaptureError` during its forward.
        """
        self.pool.frozen = True

    def offload_modules(self, modules: Iterable[nn.Module]) -> None:
        """Offload only the tensors saved while one of ``modules`` runs its forward (any depth).

        Give the submodules of the offloaded layers that hold the activations worth moving (the
        attention block, the MLP's first projection...); everything else those layers save stays on
        the device. Call it again to choose others; :meth:`offload_all_modules` undoes it.
        """
        self.offload_all_modules()
        self.selection = ModuleSelection(modules)

    def _chosen(self, t: torch.Tensor, layer: int) -> bool:
        """Whether ``t`` may be offloaded: saved inside a chosen module, and within the layer's byte cap
        (a storage already offloaded rides along; a new one counts whole)."""
        if self.selection is not None and not self.selection.active:
            return False
        cap = self.max_offload_bytes_per_layer
        if cap is not None and not isinstance(cap, int):  # one cap per layer
            cap = cap.get(layer)
        if cap is None or not self.schedule.is_offloaded(layer):
            return True
        storage = t.untyped_storage()
        known = storage.data_ptr() in self._by_storage[layer]
        return known or self.stats[layer].candidate_bytes + storage.nbytes() <= cap

    def offload_all_modules(self) -> None:
        """Offload what every module of an offloaded layer saves (the default)."""
        if self.selection is not None:
            self.selection.remove()
            self.selection = None

