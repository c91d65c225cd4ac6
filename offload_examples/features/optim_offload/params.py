"""Which optimizers and which parameters: the arguments checked, and the parameters split between host and device."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from ...core.host_pool import HostBuffer

__all__ = ["SUPPORTED_OPTIMIZERS"]


#: Optimizer classes (and their subclasses) whose state is per parameter and elementwise, so that
#: the parameters can be split between optimizers without changing the result.
SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
)


def _check_optimizer_class(cls: Any) -> None:
    supported = ", ".join(c.__name__ for c in SUPPORTED_OPTIMIZERS)
    if not isinstance(cls, type):
        raise TypeError(
            "optimizer_class must be an optimizer class such as torch.optim.Adam (not an instance or a "
            f"name), got an object of type {type(cls).__name__}. Supported: {supported} (and their subclasses)."
        )
    if issubclass(cls, SUPPORTED_OPTIMIZERS):
        return
    raise TypeError(
        f"optimizer_class {cls.__qualname__} is not supported. OptimizerOffload splits the parameters between "
        "several optimizers, which computes the same update only when the state is per parameter "
        f"and elementwise. Supported: {supported} (and their subclasses)."
    )


def _has_fused_cpu(cls: type[torch.optim.Optimizer]) -> bool:
    """Whether ``cls`` accepts ``fused=True`` for CPU tensors (Adam, AdamW, SGD, Adagrad in torch >= 2.4)."""
    probe = torch.zeros(1, requires_grad=True)
    try:
        cls([probe], fused=True)
    except (TypeError, RuntimeError, ValueError):
        return False
    return True


def _check_fraction(fraction: Any) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise TypeError(f"fraction must be a real number in [0, 1], got {fraction!r} ({type(fraction).__name__})")
    value = float(fraction)
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
    return value


def _collect_params(params: Any) -> list[torch.nn.Parameter]:
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors, got a single tensor; wrap it in a list")
    if isinstance(params, dict):
        raise ValueError("param groups (dicts) are not supported: pass one flat list of parameters")
    try:
        items = list(params)
    except TypeError:
        raise TypeError(f"params must be an iterable of tensors, got {type(params).__name__}") from None
    if not items:
        raise ValueError("params is empty: OptimizerOffload needs at least one parameter")
    for i, p in enumerate(items):
        if isinstance(p, dict):
            raise ValueError(
                f"params[{i}] is a dict: param groups are not supported, pass one flat list of parameters"
            )
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"params[{i}] is a {type(p).__name__}, expected a tensor (pass model.parameters(), "
                "not named_parameters())"
            )
        if not p.requires_grad:
            raise ValueError(f"params[{i}] (shape {tuple(p.shape)}) does not require grad; leave it out")
        if not p.is_leaf:
            raise ValueError(f"params[{i}] (shape {tuple(p.shape)}) is not a leaf tensor; optimizers update leaves")
    devices = {p.device for p in items}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(str(d) for d in devices)}")
    if len({id(p) for p in items}) != len(items):
        raise ValueError("params contains the same parameter more than once")
    return items


def _partition(sizes: list[int], fraction: float) -> list[bool]:
    """Which parameters go to the host: while the bytes offloaded so far are < fraction x total."""
    if fraction == 1.0:
        return [True] * len(sizes)
    budget = fraction * sum(sizes)
    offloaded, out = 0, []
    for n in sizes:
        take = offloaded < budget
        offloaded += n if take else 0
        out.append(take)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _typed_view(buf: HostBuffer, like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of ``like``'s dtype and shape over the buffer's bytes."""
    return buf.data[: _nbytes(like)].view(like.dtype).view(like.shape)
