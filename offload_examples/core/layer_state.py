"""What happens to a layer (one entry of the offload context) in one iteration: its states and its counts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["ALLOWED_FROM", "LayerState", "LayerStats"]


class LayerState(enum.Enum):
    """Where a layer (one entry of the context) is in its life during the current iteration."""

    NOT_RUN = "has not run its forward in this iteration"
    RUNNING = "is still running its forward"
    SAVED = "has not started its offload"
    OFFLOADING = "has not been released (its release trigger has not come)"
    RELEASED = "has not started its reload (its reload trigger has not come)"
    RELOADING = "has already started its reload"


#: The one table of legal moves: target state -> the states it may be entered from.
ALLOWED_FROM = {
    LayerState.RUNNING: {LayerState.NOT_RUN},
    LayerState.SAVED: {LayerState.RUNNING},
    LayerState.OFFLOADING: {LayerState.RUNNING, LayerState.SAVED},
    LayerState.RELEASED: {LayerState.OFFLOADING},
    LayerState.RELOADING: {LayerState.RELEASED},
}


@dataclass
class LayerStats:
    """What the engine did with one layer's saved tensors in the current iteration."""

    saved_tensors: int = 0
    """Tensors autograd saved for backward inside the layer's context."""
    candidate_bytes: int = 0
    """Bytes of the distinct storages that could be offloaded (whether or not this layer is)."""
    candidate_sizes: list[int] = field(default_factory=list)
    """The bytes of each of those storages, in the order the forward first saved them (as counted then:
    one found held elsewhere at the layer's end leaves ``candidate_bytes`` but not this list). A byte cap
    (``max_offload_bytes_per_layer``) takes them in this order; the planner reads the probe's to choose one."""
    offloaded_tensors: int = 0
    """Saved tensors that live in host memory between forward and backward."""
    offloaded_storages: int = 0
    """Distinct storages copied to host memory (views of one storage are copied once)."""
    offloaded_bytes: int = 0
    """Bytes copied to host memory."""
    held_bytes: int = 0
    """Offloaded bytes that something besides the engine still referenced at the layer's release
    (a framework's cache, a tensor the caller keeps): dropping them freed no memory then, and
    backward reads them in place, without a reload, if they are still alive."""
    kept_tensors: int = 0
    """Saved tensors left on the device (weights, small tensors, layers not offloaded)."""
