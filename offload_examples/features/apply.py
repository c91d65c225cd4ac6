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

The same wrapper also recomputes: a handle may checkpoint some of its layers, whole or one named
submodule of them (:func:`checkpointed_call`, :func:`checkpointed_module`), inside the context. The
planner applies its plans to a model that way
(:func:`~offload_examples.features.planner.apply_plan_to_model`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, Union

import torch
from torch import nn

from offload_examples.core.api import get_cpu_offload_context
from offload_examples.core.engine import OffloadEngine
from offload_examples.core.policy import outer_hooks
from offload_examples.core.te_path import recompute_on_same_path

__all__ = ["OffloadedLayers", "checkpointed_call", "checkpointed_module", "find_layers", "offload_layers"]

#: How layers are chosen: a module type, a class name, a tuple of these (an encoder's layers and a
#: decoder's), or a test on ``(qualified name, module)``.
LayerChoice = Union[type, str, tuple, Callable[[str, nn.Module], bool]]


def _matches(choice: LayerChoice) -> Callable[[str, nn.Module], bool]:
    if isinstance(choice, type):
        return lambda name, m: isinstance(m, choice)
    if isinstance(choice, str):
        return lambda name, m: type(m).__name__ == choice
    if isinstance(choice, tuple) and choice and all(isinstance(c, (type, str)) for c in choice):
        tests = [_matches(c) for c in choice]
        return lambda name, m: any(test(name, m) for test in tests)
    if callable(choice):
        return choice
    raise TypeError("layers must be a module type, a class name, a non-empty tuple of these or a function "
                    f"(name, module) -> bool, got {choice!r}")


def find_layers(model: nn.Module, layers: LayerChoice) -> list[tuple[str, nn.Module]]:
    """The outermost submodules of ``model`` that ``layers`` chooses, in registration order.

    The model itself is never one of them (its layers are inside it), and a chosen module's own
    submodules are not searched (a layer is never nested in another). A tuple chooses a module that
    any of its entries chooses. A layer compiled on its own
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


# Run eagerly inside a compiled model: torch.compile traces checkpoint() only with its default
# context_fn, and the recomputation must take the path the first call took (recompute_on_same_path).
# Dynamo breaks the graph here and runs this layer, or submodule, as it would without compile.
@torch.compiler.disable
def checkpointed_call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` under non-reentrant checkpointing, each tensor passed once.

    Every positional tensor goes to the checkpoint as one of its inputs, and so does every keyword
    tensor that requires grad (a hidden state passed by name, as transformers passes it to an
    attention module): the checkpoint saves its inputs where a context around it sees them, so the
    engine counts them as what the layer holds. Keyword tensors that do not require grad (an
    attention mask, position ids: the same tensors for every layer, held by the model anyway) reach
    ``function`` as they are, as in transformers' own checkpointing; all keyword arguments reach it
    by name. The recomputation gets each tensor the checkpoint kept as a new object: a module that tests its
    arguments for identity would then compute something else than the first time
    (``nn.MultiheadAttention`` projects ``query is key is value`` in one matmul, else in three), and
    checkpointing refuses what it recomputes. So a tensor given in several places goes in once. The
    recomputation takes the path Transformer Engine's layers took the first time
    (:func:`~offload_examples.core.te_path.recompute_on_same_path`).
    """
    from torch.utils.checkpoint import checkpoint

    named = [v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    unique = list({id(a): a for a in (*args, *named) if isinstance(a, torch.Tensor)}.values())  # each once
    where = {id(t): j for j, t in enumerate(unique)}

    def spec(a: Any) -> tuple[int | None, Any]:  # (input index, None) for an input, (None, value) otherwise
        return (where[id(a)], None) if isinstance(a, torch.Tensor) and id(a) in where else (None, a)

    arg_spec, kw_spec = [spec(a) for a in args], {k: spec(v) for k, v in kwargs.items()}

    def run(*tensors: torch.Tensor) -> Any:
        def get(s: tuple[int | None, Any]) -> Any:
            return s[1] if s[0] is None else tensors[s[0]]
        return function(*map(get, arg_spec), **{k: get(s) for k, s in kw_spec.items()})

    # the layer's keyword arguments never reach checkpoint() itself: one named like its own
    # (``debug``, ``context_fn``) would change the checkpoint instead
    return checkpoint(run, *unique, use_reentrant=False, context_fn=recompute_on_same_path)


@contextlib.contextmanager
def checkpointed_module(layer: nn.Module, module: str) -> Iterator[None]:
    """While inside, the forward of ``layer.get_submodule(module)`` runs under :func:`checkpointed_call`.

    The submodule itself is not changed: its ``forward`` is replaced on the instance only for the
    block, so its parameters, hooks and ``state_dict`` keys stay as they are, and the recomputation
    calls the original ``forward`` (its hooks ran once, around the first call).

    Called inside a region that another checkpoint already recomputes (the layer's own, as
    transformers' ``gradient_checkpointing_enable()`` puts around it), the submodule runs as it is:
    that checkpoint keeps only its own inputs, so a second one frees nothing, and its recomputation
    in the backward, which runs after this block, calls the submodule unchanged and must find the
    tensors the first run saved.
    """
    sub = layer.get_submodule(module)
    own = sub.__dict__.get("forward")  # a forward someone set on the instance: put back afterwards
    original = sub.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if outer_hooks() == "checkpoint":
            return original(*args, **kwargs)
        return checkpointed_call(original, *args, **kwargs)

    sub.forward = forward
    try:
        yield
    finally:
        if own is None:
            del sub.forward
        else:
            sub.forward = own


@dataclass
class OffloadedLayers:
    """What :func:`offload_layers` did: the context it built, the layers it chose, and how to undo it.

    It holds the layers weakly: a model dropped without :meth:`remove` takes its layers, this handle
    (unless kept) and the engine's pinned buffers with it. ``names`` are the layers' qualified names,
    in the order of the engine's layers where that order is fixed (a plan's: the order the model
    calls them).
    """

    ctx: OffloadEngine
    sync: Callable[[torch.Tensor], torch.Tensor]
    names: list[str]
    _layers: list[tuple[weakref.ref, type]] = field(default_factory=list, repr=False)
    _ran: dict[int, int] = field(default_factory=dict, repr=False)  # id(layer) -> the iteration it last entered
    _first: int | None = field(default=None, repr=False)  # id of the layer that began the current step
    # id(layer) -> what it recomputes: the whole layer (None) or a submodule's name; absent: nothing
    _recompute: dict[int, str | None] = field(default_factory=dict, repr=False)
    # id of the layer expected at each entry of a step; empty: any order (offload_layers counts entries)
    _order: list[int] = field(default_factory=list, repr=False)

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
        self._layers, self._recompute, self._order = [], {}, []
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
            if entry is None:
                return call(*args, **kwargs)
            self._check_order(layer, entry[1])
            output = self._run(layer, call, args, kwargs)
            hidden, rebuild = _first_tensor(output)  # an output it cannot sync abandons the step, as any failure
        return rebuild(self.sync(hidden))

    def _run(self, layer: nn.Module, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The layer's call, checkpointed where this handle recomputes it: inside the context, so the
        engine counts what the checkpoint keeps as the layer's (as with transformers' checkpointing)."""
        if id(layer) not in self._recompute:
            return call(*args, **kwargs)
        module = self._recompute[id(layer)]
        if module is None:
            return checkpointed_call(call, *args, **kwargs)  # the recomputation calls the layer's hooks again too
        with checkpointed_module(layer, module):
            return call(*args, **kwargs)

    def _check_order(self, layer: nn.Module, entry: int) -> None:
        """A plan is per layer in the order the model calls them; the engine numbers entries in that
        order, so a layer arriving elsewhere would take another layer's choice."""
        if self._order and (entry >= len(self._order) or self._order[entry] != id(layer)):
            name = self._name(layer)
            expected = repr(self.names[entry]) if entry < len(self.names) else "no layer"
            raise RuntimeError(f"layer {name!r} ran as layer {entry} of the step, where the plan has {expected}: "
                               "give the layers in the order the model calls them (measure_model_costs finds it)")

    def _name(self, layer: nn.Module) -> str:
        return next(n for n, (ref, _) in zip(self.names, self._layers) if ref() is layer)

    def _check_once_per_step(self, layer: nn.Module, iteration: int, entry: int) -> None:
        """The schedule counts entries: a layer called twice in one step would shift every later one.

        A second call in the same step is plain. One that begins a step while the last step still
        waits for its backward is a second call too, unless it is the layer that began the last step
        (a forward whose output was kept, then the next step).
        """
        first = entry == 0 and (not self.ctx.continued_without_backward or self._first == id(layer))
        if self._ran.get(id(layer)) == iteration or (entry == 0 and not first):
            name = self._name(layer)
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
    found = _chosen_layers(model, layers)
    _check_free(found)
    chosen = []
    if modules is not None:
        for name, layer in found:
            for sub in modules:
                try:
                    chosen.append(layer.get_submodule(sub))
                except AttributeError:
                    raise ValueError(f"layer {name!r} ({type(layer).__name__}) has no submodule {sub!r}") from None
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=num_layers, model_layers=len(found), **context_options)
    if chosen:
        ctx.offload_modules(chosen)
    return _attach(OffloadedLayers(ctx, sync, [name for name, _ in found]), found)


def _chosen_layers(model: nn.Module, layers: LayerChoice) -> list[tuple[str, nn.Module]]:
    """:func:`find_layers`, or ``ValueError`` when nothing matches, or when an entry of a tuple matches
    nothing (a misspelt class name would otherwise leave those layers quietly unoffloaded)."""
    found = find_layers(model, layers)
    if not found:
        raise ValueError(f"no submodule of {type(model).__name__} matches layers={layers!r}")
    if isinstance(layers, tuple):
        unmatched = [entry for entry in layers if not find_layers(model, entry)]
        if unmatched:
            raise ValueError(f"no submodule of {type(model).__name__} matches {unmatched!r} of layers={layers!r}")
    return found


def _check_free(found: Sequence[tuple[str, nn.Module]]) -> None:
    """``ValueError`` when a layer, a module in it or one around it is another handle's already."""
    for name, layer in found:
        if any(m in _CHOSEN for m in layer.modules()) or any(layer in set(m.modules()) for m in list(_CHOSEN)):
            raise ValueError(f"layer {name!r} (or a module in it, or around it) is offloaded by another offload_layers "
                             "already: call its remove() first (contexts cannot be nested)")


def _attach(handle: OffloadedLayers, found: Sequence[tuple[str, nn.Module]],
            recompute: dict[int, str | None] | None = None, ordered: bool = False) -> OffloadedLayers:
    """Put each layer of ``found`` under ``handle``: its class swapped for the wrapper that enters
    ``handle.ctx`` around its call; returns ``handle``.

    ``recompute``: ``{index in found: None (the whole layer) or a submodule's name}``, checkpointed
    inside the context. ``ordered``: ``found`` is in the order the model calls the layers, and a
    layer arriving at another entry of a step is an error (a plan's choices are per entry).
    Call ``_check_free`` first where the layers may be another handle's.
    """
    for i, (_, layer) in enumerate(found):
        original = type(layer)
        if original in _WRAPPED:  # a copy of a layer chosen before (deepcopy keeps the class): unwrap first
            original = _WRAPPED[original]
        layer.__class__ = _wrapper_class(original)
        handle._layers.append((weakref.ref(layer), original))
        _CHOSEN[layer] = handle
        if recompute is not None and i in recompute:
            handle._recompute[id(layer)] = recompute[i]
        if ordered:
            handle._order.append(id(layer))
    return handle
