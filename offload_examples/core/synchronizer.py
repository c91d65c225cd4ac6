"""Manual control of when each layer is offloaded, released and reloaded.

Transformer Engine calls this object ``ManualOffloadSynchronizer``; :func:`get_cpu_offload_context`
returns it as the third element with ``manual_synchronization=True``. Each method is one legal move
of :class:`~offload_examples.core.engine.LayerState`; a call out of order raises at once.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from .layer_state import LayerState

__all__ = ["OffloadSynchronizer"]


class OffloadSynchronizer:
    """Start offloads, releases and reloads by hand.

    A layer is one entry of the context in the current iteration; a layer never touched stays on
    the GPU. Backward waits for each reloaded tensor's own copy.
    """

    def __init__(self, engine: Any):  # the OffloadEngine it drives (the engine imports this module, not back)
        self._engine = weakref.proxy(engine)

    def start_offload_layer(self, layer_id: int) -> None:
        """Queue layer ``layer_id``'s device-to-host copies (its forward must have ended)."""
        with self._move(layer_id, "start_offload_layer") as e:
            if e.layer_state[layer_id] is LayerState.RUNNING:  # __exit__ moves it on, not the caller
                raise RuntimeError(f"start_offload_layer({layer_id}): layer {layer_id} {LayerState.RUNNING.value}")
            e._move(layer_id, LayerState.OFFLOADING, f"start_offload_layer({layer_id}) was called")
            e._start_offload(layer_id)

    def release_activation_forward_gpu_memory(self, layer_id: int) -> None:
        """Make the compute stream wait for the layer's copies, then drop its GPU memory."""
        with self._move(layer_id, "release_activation_forward_gpu_memory") as e:
            e._release(layer_id, f"release_activation_forward_gpu_memory({layer_id}) was called")

    def start_reload_layer(self, layer_id: int) -> None:
        """Queue layer ``layer_id``'s host-to-device copies (it must have been released)."""
        with self._move(layer_id, "start_reload_layer") as e:
            e._reload_layer(layer_id, f"start_reload_layer({layer_id}) was called")

    @contextlib.contextmanager
    def _move(self, layer_id: int, what: str) -> Iterator[Any]:
        """One call's move, under the engine's lock. A call that fails abandons the step, as a failure
        inside the context does: the next entry begins a new one, and no ``reset()`` is needed."""
        e = self._engine
        if not e.schedule.hand_driven:
            raise RuntimeError(f"{what}: this context follows {type(e.schedule).__name__}; "
                               "build it with manual_synchronization=True to drive it by hand")
        n = e.model_layers
        if not isinstance(layer_id, int) or isinstance(layer_id, bool) or not 0 <= layer_id < n:
            raise IndexError(f"{what}({layer_id!r}): layer index out of range [0, {n - 1}] (model_layers={n})")
        with e._lock:
            try:
                yield e
            except BaseException:
                e._abort()
                raise
