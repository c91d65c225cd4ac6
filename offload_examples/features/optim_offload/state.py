"""The plain optimizer's face: each parameter's state where it lives, and checkpoints in the plain format.

``OptimizerOffload.state`` finds a parameter's state in the optimizer that holds it (``_StateView``),
and a checkpoint numbers the parameters as the plain ``optimizer_class(params)`` would, whichever
optimizer inside holds each one (``_state_dict``, ``_load_state_dict``). Each takes the wrapper,
an :class:`~offload_examples.OptimizerOffload`, as ``owner`` (typed as the optimizer it is: this
module sits below the wrapper's).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Iterator

import torch

__all__: list[str] = []

#: Keys of a param group that choose an implementation rather than the arithmetic.
_FLAGS = ("foreach", "fused", "capturable", "differentiable")


class _StateView(Mapping):
    """``OptimizerOffload.state``: each parameter's state in the optimizer that holds it (the
    device optimizer's, or its host optimizer's, whose tensors are on the CPU), read-only."""

    def __init__(self, owner: torch.optim.Optimizer):
        self._owner = weakref.ref(owner)

    def _lookup(self, p: torch.Tensor) -> tuple[torch.optim.Optimizer, torch.Tensor] | None:
        """The optimizer holding ``p``'s state and the tensor it is keyed by; None when closed."""
        owner = self._owner()
        i = owner._index_of.get(id(p)) if owner is not None and not owner._closed else None
        if i is None:
            return None
        on_host, j = owner._where[i]
        if on_host:
            return owner._slots[j].optimizer, owner._slots[j].master
        return owner.gpu_optimizer, p

    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        found = self._lookup(p)
        if found is None:
            raise KeyError(p)
        return found[0].state.get(found[1], {})  # {} before the first step, as torch's defaultdict gives

    def __iter__(self) -> Iterator[torch.Tensor]:
        owner = self._owner()
        params = owner.param_groups[0]["params"] if owner is not None and not owner._closed else []
        return iter([p for p in params if p in self])

    def __contains__(self, p: object) -> bool:
        found = self._lookup(p) if isinstance(p, torch.Tensor) else None
        return found is not None and found[1] in found[0].state

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _state_dict(owner: torch.optim.Optimizer) -> dict[str, Any]:
    """``owner.state_dict()``: one param group over the parameters ``0..n-1``, each one's state from its optimizer."""
    for pre_hook in owner._optimizer_state_dict_pre_hooks.values():  # registered as on any optimizer
        pre_hook(owner)
    state = {i: dict(owner.state[p]) for i, p in enumerate(owner.param_groups[0]["params"]) if p in owner.state}
    group = {k: v for k, v in owner.param_groups[0].items() if k != "params"}
    state_dict = {"state": state, "param_groups": [{**group, "params": list(range(len(owner._where)))}]}
    for post_hook in owner._optimizer_state_dict_post_hooks.values():
        state_dict = post_hook(owner, state_dict) or state_dict
    return state_dict


def _load_state_dict(owner: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """``owner.load_state_dict(state_dict)``: each parameter's state into the optimizer that holds it."""
    for pre_hook in owner._optimizer_load_state_dict_pre_hooks.values():
        state_dict = pre_hook(owner, state_dict) or state_dict
    group, state = _check_checkpoint(owner, state_dict)
    hyper = {k: v for k, v in group.items() if k not in ("params", "param_names") and k not in _FLAGS}
    owner.param_groups[0].update(hyper)
    if owner.gpu_optimizer is not None:
        kept = [i for i, (on_host, _) in enumerate(owner._where) if not on_host]
        owner.gpu_optimizer.load_state_dict({
            "state": {j: state[i] for j, i in enumerate(kept) if i in state},
            "param_groups": [{**owner.gpu_optimizer.param_groups[0], **hyper, "params": list(range(len(kept)))}],
        })
    for i, (on_host, j) in enumerate(owner._where):
        if on_host:
            optimizer = owner._slots[j].optimizer
            optimizer.load_state_dict({
                "state": {0: state[i]} if i in state else {},
                "param_groups": [{**optimizer.param_groups[0], **hyper, "params": [0]}],
            })
    for post_hook in owner._optimizer_load_state_dict_post_hooks.values():
        post_hook(owner)


def _check_checkpoint(owner: torch.optim.Optimizer, state_dict: Any) -> tuple[dict[str, Any], dict[int, Any]]:
    """The single group and the state of a checkpoint, or a ValueError that says what differs."""
    n = len(owner._where)
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups, list) or len(groups) != 1 or "state" not in state_dict:
        shape = f"{len(groups)} param groups" if isinstance(groups, list) else f"{type(state_dict).__name__}"
        raise ValueError(
            f"expected an optimizer state_dict with one param group over {n} parameters (what "
            f"state_dict() and a plain {owner.optimizer_class.__name__}(params) save), got {shape}"
        )
    params = list(groups[0].get("params", []))
    if sorted(params) != list(range(n)) or not set(state_dict["state"]) <= set(params):
        raise ValueError(
            f"the checkpoint's param group holds {len(params)} parameters and state for "
            f"{len(state_dict['state'])}; this optimizer has {n} parameters, numbered 0..{n - 1} "
            "in the order given to the constructor"
        )
    return groups[0], state_dict["state"]


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value
