"""A failure that leaves the device unusable, and giving memory back between runs."""

from __future__ import annotations

from typing import Any

import torch

from offload_examples.instruments.measure import free_memory

__all__ = ["DeviceLost", "device_usable"]


class DeviceLost(Exception):
    """A run's failure left the device unusable for the rest of the process.

    CUDA reports an illegal memory access and similar faults to every later call in the process
    (a "sticky" error), so no later run could measure anything. :func:`run` starts the model again in a
    fresh process with ``strategy`` (a strategy, or one of the runs ``HEAD_TO_HEAD_RUN`` and
    ``PLAN_PAIRS_RUN``) left out, and its rows say why (the model's ``left_out``).
    """

    def __init__(self, strategy: str, k: int, reason: str) -> None:
        super().__init__(f"{strategy}{f' at k={k}' if k else ''} left the device unusable: {reason}")
        self.strategy, self.k, self.reason = strategy, k, reason

    def __reduce__(self) -> tuple:  # it travels from a model's process to the parent
        return type(self), (self.strategy, self.k, self.reason)

    def why(self, model: str) -> str:
        """The reason the restarted model's rows give for leaving the strategy out."""
        at = f"at k={self.k} " if self.k else ""
        return f"left out: {at}on model {model} it failed and left the device unusable for the process ({self.reason})"


def _reason(err: BaseException) -> str:
    """An error in one line, for a table row: CUDA's errors go on with lines of advice."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _raise_if_lost(device: torch.device, run: str, k: int, err: Exception) -> None:
    """Raise :class:`DeviceLost` for ``run`` if its failure ``err`` left ``device`` unusable: every
    later run would fail too, so the model starts again in a fresh process without it."""
    if not device_usable(device):
        raise DeviceLost(run, k, _reason(err)) from err


def device_usable(device: torch.device) -> bool:
    """Whether ``device`` still runs work: ``False`` after a sticky CUDA error (always ``True`` off CUDA)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:  # the sticky error comes back from any call
        return False


def _free(*engines: Any, run: str = "", k: int = 0) -> None:
    """Give ``engines``' pinned buffers and the allocators' caches back after ``run`` (at ``k``).

    :func:`~offload_examples.instruments.measure.free_memory` synchronizes the device first, so a fault
    of work that ``run`` queued last (CUDA reports it at the next synchronizing call) surfaces here,
    not in the next run: it raises :class:`DeviceLost` for ``run``, which would otherwise keep an "ok"
    row while the next strategy took the blame. Without ``run`` the error is left to the next call.
    """
    try:
        for e in engines:
            if e is not None and hasattr(e, "release_buffers"):
                e.release_buffers()
        free_memory()
    except RuntimeError as err:  # after a sticky CUDA error every call raises it again
        if not torch.cuda.is_initialized() or device_usable(torch.device("cuda", torch.cuda.current_device())):
            raise
        if run:
            raise DeviceLost(run, k, f"{_reason(err)}, reported when its memory was freed") from err


def _failed(device: torch.device, run: str, k: int, err: Exception) -> dict[str, Any]:
    """The report of ``run`` at ``k`` that raised ``err``; raises :class:`DeviceLost` instead when the
    device is no longer usable (the model then runs again in a fresh process without ``run``)."""
    _raise_if_lost(device, run, k, err)
    return {"k": k, "status": "failed", "reason": _reason(err)}


def _tidy(model: torch.nn.Module, x: torch.Tensor, *engines: Any, run: str, k: int) -> None:
    """After ``run``: no gradient left in the model or the input, ``engines``' buffers and the caches back."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    _free(*engines, run=run, k=k)
