"""Manual control of when each layer is offloaded, released and reloaded.

Transformer Engine calls this object ``ManualOffloadSynchronizer``; :func:`get_cpu_offload_context`
returns it as the third element with ``manual_synchronization=True``. Each method is one legal move
of :class:`~offload_examples.core.engine.LayerState`; a call out of order raises at once.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from .layer_state import LayerState

if TYPE_CHECKING:
    from .engine import OffloadEngine

__all__ = ["OffloadSynchronizer"]


class OffloadSynchronizer:
    """Start offloads, releases and reloads by hand.

    A layer is one entry of the context in the current iteration; a layer never touched stays on
    the GPU. Backward waits for each reloaded tensor's own copy.
    """

    def __init__(self, engine: OffloadEngine):
        self._engine = weakref.proxy(engine)

    def start_offload_layer(self, layer_id: int) -> None:
        """Queue layer ``layer_id``'s device-to-host copies (its forward must have ended)."""
        e = self._check(layer_id, "start_offload_layer")
        if e.layer_state[layer_id] is LayerState.RUNNING:  # __exit__ moves it on, not the caller
            raise RuntimeError(f"start_offload_layer({layer_id}): layer {layer_id} {LayerState.RUNNING.value}")
        with e._lock:
            e._move(layer_id, LayerState.OFFLOADING, f"start_offload_layer({layer_id}) was called")
            e._start_offload(layer_id)

    def release_activation_forward_gpu_memory(self, layer_id: int) -> None:
        """Make the compute stream wait for the layer's copies, then drop its GPU memory."""
        e = self._check(layer_id, "release_activation_forward_gpu_memory")
        with e._lock:
            e._release(layer_id, f"release_activation_forward_gpu_memory({layer_id}) was called")

    def start_reload_layer(self, layer_id: int) -> None:
        """Queue layer ``layer_id``'s host-to-device copies (it must have been released)."""
        e = self._check(layer_id, "start_reload_layer")
        with e._lock:
            e._reload_layer(layer_id, f"start_reload_layer({layer_id}) was called")

    def _check(self, layer_id: int, what: str) -> OffloadEngine:
        e = self._engine
        if not e.schedule.hand_driven:
            raise RuntimeError(f"{what}: this context follows {type(e.schedule).__name__}; "
                               "build it with manual_synchronization=True to drive it by hand")
        n = e.model_layers
        if not isinstance(layer_id, int) or isinstance(layer_id, bool) or not 0 <= layer_id < n:
            raise IndexError(f"{what}({layer_id!r}): layer index out of range [0, {n - 1}] (model_layers={n})")
        return e
