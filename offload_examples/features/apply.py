"""Offload the layers of a model you did not write, without editing its ``forward``.

A Hugging Face model, a torchvision backbone or any ``nn.Module`` runs its layers itself, so there is
no loop to put ``with ctx:`` and ``sync`` into. :func:`offload_layers` finds the layers (by type, by
class name, or by a test on their qualified names), and puts the context around each layer's
forward with module hooks: a pre-hook enters it, a forward hook leaves it and passes the layer's
output through ``sync``. The engine is the same one; only how it is entered differs::

    from offload_examples.features.apply import offload_layers

    handle = offload_layers(model, "GPT2Block", num_layers=4, modules=["attn", "mlp"])
    loss = model(input_ids, labels=input_ids).loss    # unchanged training code
    loss.backward()
    handle.remove()                                    # the model as it was

``modules`` narrows what is offloaded inside each chosen layer to the tensors its named submodules
save (see :meth:`~offload_examples.OffloadEngine.offload_modules`), and
``max_offload_bytes_per_layer`` caps the bytes one layer offloads.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

import torch
from torch import nn

from offload_examples.core.api import get_cpu_offload_context
from offload_examples.core.engine import OffloadEngine

__all__ = ["OffloadedLayers", "find_layers", "offload_layers"]

#: How layers are chosen: a module type, a class name, or a test on ``(qualified name, module)``.
LayerChoice = Union[type, str, Callable[[str, nn.Module], bool]]


def _matches(choice: LayerChoice) -> Callable[[str, nn.Module], bool]:
    if isinstance(choice, type):
        return lambda name, m: isinstance(m, choice)
    if isinstance(choice, str):
        return lambda name, m: type(m).__name__ == choice
    if callable(choice):
        return choice
    raise TypeError(f"layers must be a module type, a class name or a function (name, module) -> bool, got {choice!r}")


def find_layers(model: nn.Module, layers: LayerChoice) -> list[tuple[str, nn.Module]]:
    """The outermost submodules of ``model`` that ``layers`` chooses, in registration order.

    A chosen module's own submodules are not searched (a layer is never nested in another). The
    order is the order the model registered them, which is the order a sequential model runs them.
    """
    match, found = _matches(layers), []
    skip: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in skip):
            continue
        if match(name, module):
            found.append((name, module))
            skip.append(name)
    return found


def _first_tensor(output: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """The tensor ``sync`` should see in a layer's output, and how to put it back."""
    if isinstance(output, torch.Tensor):
        return output, lambda t: t
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0], lambda t: type(output)([t, *output[1:]])
    raise TypeError(f"a chosen layer returned {type(output).__name__}; offload_layers needs a tensor, or a tuple "
                    "or list whose first element is the hidden state")


@dataclass
class OffloadedLayers:
    """What :func:`offload_layers` did: the context it built, the layers it hooked, and how to undo it."""

    ctx: OffloadEngine
    sync: Callable[[torch.Tensor], torch.Tensor]
    names: list[str]
    _handles: list[Any] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Take every hook off (the layers and the chosen submodules); the model runs as before."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.ctx.offload_all_modules()


def offload_layers(model: nn.Module, layers: LayerChoice, num_layers: int, *,
                   modules: Sequence[str] | None = None, **context_options: Any) -> OffloadedLayers:
    """Offload the saved activations of the first ``num_layers`` chosen layers of an unmodified model.

    Parameters
    ----------
    model:
        The model; its ``forward`` is not touched.
    layers:
        Which submodules are the layers: a module type (``LlamaDecoderLayer``), a class name
        (``"GPT2Block"``), or a function ``(qualified_name, module) -> bool``.
    num_layers:
        ``k``: the first ``k`` layers found are offloaded (the ``num_layers`` of
        :func:`~offload_examples.get_cpu_offload_context`); the others still enter the context, which
        is how the schedule counts layers.
    modules:
        Names of submodules inside each layer (``"attn"``, ``"mlp.c_fc"``): only what they save is
        offloaded. ``None``: everything the layer saves.
    context_options:
        Keyword arguments of :func:`~offload_examples.get_cpu_offload_context` (for example
        ``retain_pinned_cpu_buffers``, ``max_offload_bytes_per_layer``, ``device``).

    Raises
    ------
    ValueError
        No layer matches, or a name in ``modules`` is missing from a layer.
    """
    found = find_layers(model, layers)
    if not found:
        raise ValueError(f"no submodule of {type(model).__name__} matches layers={layers!r}")
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=num_layers, model_layers=len(found), **context_options)
    handle = OffloadedLayers(ctx, sync, [name for name, _ in found])
    if modules is not None:
        chosen = []
        for name, layer in found:
            for sub in modules:
                try:
                    chosen.append(layer.get_submodule(sub))
                except AttributeError:
                    raise ValueError(f"layer {name!r} ({type(layer).__name__}) has no submodule {sub!r}") from None
        ctx.offload_modules(chosen)

    ran: set[int] = set()  # layers entered in the model's current forward
    inside: set[int] = set()  # layers whose entry this hook made (a pre-hook before it may raise first)

    def new_forward(module: nn.Module, args: Any) -> None:
        ran.clear()

    def enter(module: nn.Module, args: Any) -> None:
        if id(module) in ran:  # the schedule counts entries: a second call would shift every later layer
            raise RuntimeError(f"layer {names[id(module)]!r} ran twice in one forward of the model; offload_layers "
                               "needs each chosen layer called once per forward (use the context by hand otherwise)")
        ctx.__enter__()
        ran.add(id(module))
        inside.add(id(module))

    def leave(module: nn.Module, args: Any, output: Any) -> Any:
        if id(module) not in inside:
            return None
        inside.discard(id(module))
        error = sys.exc_info()
        if output is None and error[0] is not None:  # the layer raised: leave as a with-block would
            ctx.__exit__(*error)
            return None
        try:
            hidden, rebuild = _first_tensor(output)
        except TypeError as err:
            ctx.__exit__(TypeError, err, err.__traceback__)  # the step is abandoned, as for any failure inside
            raise
        ctx.__exit__(None, None, None)
        return rebuild(sync(hidden))

    names = {id(layer): name for name, layer in found}
    handle._handles.append(model.register_forward_pre_hook(new_forward))
    for _, layer in found:
        handle._handles.append(layer.register_forward_pre_hook(enter))
        handle._handles.append(layer.register_forward_hook(leave, always_call=True))
    return handle
