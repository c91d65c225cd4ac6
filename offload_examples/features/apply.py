"""Offload the layers of a model you did not write, without editing its ``forward``.

A Hugging Face model, a torchvision backbone or any ``nn.Module`` runs its layers itself, so there is
no loop to put ``with ctx:`` and ``sync`` into. :func:`offload_layers` finds the layers (by type, by
class name, or by a test on their qualified names) and puts each chosen layer's *call* inside the
context, then passes its output through ``sync``. The engine is the same one; only how it is
entered differs::

    from offload_examples.features.apply import offload_layers

    handle = offload_layers(model, "GPT2Block", num_layers=4, modules=["attn", "mlp"])
    loss = model(input_ids, labels=input_ids).loss    # unchanged training code
    loss.backward()
    handle.remove()                                    # the model as it was

The context goes around the whole call, outside the module's hooks and outside any ``__call__`` a
layer class defines itself. That is where it must be for activation checkpointing that wraps the
call (transformers' ``gradient_checkpointing_enable()``): the checkpoint runs inside the context,
so the engine offloads what the checkpoint keeps (the layer's inputs) and leaves the layer's
internals to the checkpoint, and the recomputation in backward does not enter the context again.
To reach around ``__call__``, each chosen layer's class is swapped for a subclass of it with the same
name that defines only ``__call__`` (as FSDP2's ``fully_shard`` does); ``remove()`` puts the class
back. A ``with`` block closes the layer whatever happens in it, ``KeyboardInterrupt`` included.

``modules`` narrows what is offloaded inside each chosen layer to the tensors its named submodules
save (see :meth:`~offload_examples.OffloadEngine.offload_modules`), and
``max_offload_bytes_per_layer`` caps the bytes one layer offloads.
"""

from __future__ import annotations

import threading
import weakref
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

    The model itself is never one of them (its layers are inside it), and a chosen module's own
    submodules are not searched (a layer is never nested in another). A layer compiled on its own
    (``torch.compile(layer)``) is chosen through its compiled wrapper, which is what the model calls.
    The order is the order the model registered them, which is the order a sequential model runs them.
    """
    match, found = _matches(layers), []
    skip: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(prefix + ".") for prefix in skip):
            continue
        if match(name, module):
            if name.endswith("._orig_mod"):  # torch.compile's OptimizedModule around it
                name = name[: -len("._orig_mod")]
                module = model.get_submodule(name)
            found.append((name, module))
            skip.append(name)
    return found


def _first_tensor(output: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """The tensor ``sync`` should see in a layer's output, and how to put it back."""
    if isinstance(output, torch.Tensor):
        return output, lambda t: t
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        make = getattr(type(output), "_make", type(output))  # a namedtuple takes its fields one by one
        return output[0], lambda t: make([t, *output[1:]])
    raise TypeError(f"a chosen layer returned {type(output).__name__}; offload_layers needs a tensor, or a tuple "
                    "or list whose first element is the hidden state")


@dataclass
class OffloadedLayers:
    """What :func:`offload_layers` did: the context it built, the layers it chose, and how to undo it.

    It holds the layers weakly: a model dropped without :meth:`remove` takes its layers, this handle
    (unless kept) and the engine's pinned buffers with it.
    """

    ctx: OffloadEngine
    sync: Callable[[torch.Tensor], torch.Tensor]
    names: list[str]
    _layers: list[tuple[weakref.ref, type]] = field(default_factory=list, repr=False)
    _ran: dict[int, int] = field(default_factory=dict, repr=False)  # id(layer) -> the iteration it last entered
    _first: int | None = field(default=None, repr=False)  # id of the layer that began the current step

    def remove(self) -> None:
        """Take the context off every layer (their classes back, the submodules' hooks off); the model
        runs as before."""
        for ref, original in self._layers:
            layer = ref()
            if layer is None:
                continue
            _CHOSEN.pop(layer, None)
            if type(layer) is _WRAPPERS.get(original):  # a class swapped again on top of ours stays: it passes through
                layer.__class__ = original
        self._layers = []
        self.ctx.offload_all_modules()

    def _call(self, layer: nn.Module, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One call of a chosen layer: inside the context, its output through ``sync``."""
        ctx = self.ctx
        if id(layer) == self._first and not ctx.schedule.interleaved and torch.is_grad_enabled():
            ctx._step_begins_again()  # the layer that began the step begins the next (the last one failed)
        with ctx:
            entry = ctx.open_entry  # None: a pass-through (no_grad, or a recomputation in backward)
            if entry is not None and not ctx.schedule.interleaved:  # (with micro-batches a layer runs several times)
                self._check_once_per_step(layer, *entry)
            output = call(*args, **kwargs)
            if entry is None:
                return output
            hidden, rebuild = _first_tensor(output)  # an output it cannot sync abandons the step, as any failure
        return rebuild(self.sync(hidden))

    def _check_once_per_step(self, layer: nn.Module, iteration: int, entry: int) -> None:
        """The schedule counts entries: a layer called twice in one step would shift every later one.

        A second call in the same step is plain. One that begins a step while the last step still
        waits for its backward is a second call too, unless it is the layer that began the last step
        (a forward whose output was kept, then the next step).
        """
        first = entry == 0 and (not self.ctx.continued_without_backward or self._first == id(layer))
        if self._ran.get(id(layer)) == iteration or (entry == 0 and not first):
            name = next(n for n, (ref, _) in zip(self.names, self._layers) if ref() is layer)
            raise RuntimeError(f"layer {name!r} ran twice in one forward of the model; offload_layers needs each "
                               "chosen layer called once per step (put the context around the calls by hand otherwise)")
        self._ran[id(layer)] = iteration
        if entry == 0:
            self._first = id(layer)


# The layers offload_layers chose, each to its handle. Weak keys, and the handle holds the layers weakly
# too: a layer dropped takes its entry with it; a copy of one (deepcopy) gets its original class back.
_CHOSEN: weakref.WeakKeyDictionary[nn.Module, OffloadedLayers] = weakref.WeakKeyDictionary()
_WRAPPERS: dict[type, type] = {}  # a layer class -> its subclass that enters the context around __call__
_WRAPPED: dict[type, type] = {}  # and back
_CALLING = threading.local()  # ids of the layers whose call is inside our __call__ now, in this thread


def _unwrapped(cls: type) -> nn.Module:
    """A layer of ``cls`` made without ``__init__``: pickle and ``copy`` then set its state."""
    return cls.__new__(cls)


def _wrapper_class(cls: type) -> type:
    """``cls`` with a ``__call__`` that runs the original one inside the layer's offload context."""
    wrapper = _WRAPPERS.get(cls)
    if wrapper is None:
        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            call = super(wrapper, self).__call__
            handle = _CHOSEN.get(self)
            calling = _CALLING.__dict__.setdefault("ids", set())
            if handle is None or id(self) in calling:  # not chosen, or our class twice in its hierarchy
                return call(*args, **kwargs)
            calling.add(id(self))
            try:
                return handle._call(self, call, args, kwargs)
            finally:
                calling.discard(id(self))

        def __reduce_ex__(self: nn.Module, protocol: int) -> Any:
            # pickled and copied as the class it was: the swap belongs to this process's offload_layers
            return _unwrapped, (cls,), self.__getstate__()

        wrapper = type(cls.__name__, (cls,), {"__call__": __call__, "__reduce_ex__": __reduce_ex__,
                                              "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                              "__doc__": cls.__doc__})
        _WRAPPERS[cls], _WRAPPED[wrapper] = wrapper, cls
    return wrapper


def offload_layers(model: nn.Module, layers: LayerChoice, num_layers: int, *,
                   modules: Sequence[str] | None = None, **context_options: Any) -> OffloadedLayers:
    """Offload the saved activations of the first ``num_layers`` chosen layers of an unmodified model.

    Parameters
    ----------
    model:
        The model; its ``forward`` is not touched.
    layers:
        Which submodules are the layers: a module type (``LlamaDecoderLayer``), a class name
        (``"GPT2Block"``), or a function ``(qualified_name, module) -> bool``. Several kinds of layer
        (an encoder's and a decoder's) with a function or a common base class; the model itself is
        never chosen.
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
        No layer matches, a layer is offloaded by another :func:`offload_layers` already, or a name in
        ``modules`` is missing from a layer.
    """
    found = find_layers(model, layers)
    if not found:
        raise ValueError(f"no submodule of {type(model).__name__} matches layers={layers!r}")
    for name, layer in found:
        if any(m in _CHOSEN for m in layer.modules()) or any(layer in set(m.modules()) for m in list(_CHOSEN)):
            raise ValueError(f"layer {name!r} (or a module in it, or around it) is offloaded by another offload_layers "
                             "already: call its remove() first (contexts cannot be nested)")
    chosen = []
    if modules is not None:
        for name, layer in found:
            for sub in modules:
                try:
                    chosen.append(layer.get_submodule(sub))
                except AttributeError:
                    raise ValueError(f"layer {name!r} ({type(layer).__name__}) has no submodule {sub!r}") from None
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=num_layers, model_layers=len(found), **context_options)
    handle = OffloadedLayers(ctx, sync, [name for name, _ in found])
    if chosen:
        ctx.offload_modules(chosen)
    for _, layer in found:
        original = type(layer)
        if original in _WRAPPED:  # a copy of a layer chosen before (deepcopy keeps the class): unwrap first
            original = _WRAPPED[original]
        layer.__class__ = _wrapper_class(original)
        handle._layers.append((weakref.ref(layer), original))
        _CHOSEN[layer] = handle
    return handle
