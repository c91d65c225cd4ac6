"""What a user may change on an engine between steps: which modules offload, how the host pool grows.

:class:`~offload_examples.core.engine.OffloadEngine` derives from :class:`EngineSettings`. None of
these run during a step's copies; they set what the next steps do.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from .policy import ModuleSelection

__all__ = ["EngineSettings"]


class EngineSettings:
    """Settings of the engine that take effect from the next saved tensor or the next step."""

    #: The chosen submodules (:meth:`offload_modules`), or ``None``: every module of an offloaded layer.
    selection: ModuleSelection | None

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

    def offload_all_modules(self) -> None:
        """Offload what every module of an offloaded layer saves (the default)."""
        if self.selection is not None:
            self.selection.remove()
            self.selection = None

