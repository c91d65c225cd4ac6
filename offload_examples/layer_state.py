"""The states a layer (one entry of the offload context) goes through in one iteration."""

from __future__ import annotations

import enum

__all__ = ["ALLOWED_FROM", "LayerState"]


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
