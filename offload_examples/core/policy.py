"""Which saved tensors the engine offloads: every activation, never the model's weights.

A tensor saved for backward is worth copying to the host only if dropping the engine's reference
can give its GPU memory back. That is never so for

- parameters, and any other leaf that requires grad (a layer's input made with
  ``requires_grad=True``, a weight passed as a plain tensor): the model holds the first, and the
  graph's ``AccumulateGrad`` node holds each of them for as long as the graph lives, so a copy would
  free nothing. Nor do their views, autocast's casts of them (its cache holds those), or what an op
  returns on their own memory;
- tensors marked with :func:`mark_not_offload`, on another device, or too small to pay for a copy;
- tensor subclasses, nested, sparse, quantized, conjugated or negated views (kept, with a warning
  for subclasses and nested tensors).

Everything else is offloaded: activations, the intermediates of a custom ``autograd.Function``
(Transformer Engine's modules, fused kernels, which carry no ``grad_fn``), and data the caller
passed in (a layer's input that needs no grad). Some of it may still be held by someone else when
the engine releases it (an input the caller keeps): then dropping it frees nothing, the engine counts
those bytes as held (:attr:`~offload_examples.LayerStats.held_bytes`), and backward reads the
original in place, without a reload. Had the caller let go of it by then, its memory is freed, as
Transformer Engine's offload frees it. One exception: a *slice* of such data that someone else
still holds when the layer ends (a micro-batch of a batch the caller keeps) stays, because the
engine copies whole storages and would move the whole buffer for nothing.
"""

from __future__ import annotations

import threading
from typing import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .errors import in_place_error

__all__ = ["OUTSIDE_SELECTION", "KeptTensor", "ModuleSelection", "StorageWeakRef", "held_elsewhere",
           "is_weight_like", "keep_reason", "mark_not_offload", "outer_hooks", "version_witness"]

_KEEP_ATTR = "_offload_examples_keep"
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def mark_not_offload(*tensors: torch.Tensor) -> None:
    """Keep these tensors on the device even when they are saved inside an offloaded layer.

    Use it for tensors that stay alive anyway (a cache the caller holds), where copying them
    out would cost bandwidth and save no memory.
    """
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mark_not_offload expects tensors, got {type(t).__name__}")
        setattr(t, _KEEP_ATTR, True)


_Parameter = torch.nn.Parameter
_AccumulateGrad = torch._C._functions.AccumulateGrad  # the node of a leaf; it carries ``.variable``


def _plain(x: torch.Tensor) -> bool:
    """A tensor whose sizes and storage can be read: not a subclass, not nested."""
    return (type(x) is torch.Tensor or type(x) is _Parameter) and not x.is_nested


def is_weight_like(t: torch.Tensor) -> bool:
    """Parameters, leaves that require grad, their views, and autocast's casts of them."""
    base = t._base
    if base is not None:
        if not _plain(base):  # a view of a nested tensor or a subclass: no weight of ours
            return False
        # A view is judged by its base (a weight, or autocast's cast of one, seen through `.t()`):
        # views made inside a custom Function's forward carry requires_grad without a grad_fn,
        # yet their base is an activation.
        return is_weight_like(base)
    # A Parameter, even one written in place (a frozen cache filled from an activation has a grad_fn).
    # The isinstance, a metaclass hook, is the slow part: a plain tensor is no Parameter.
    if type(t) is not torch.Tensor and isinstance(t, _Parameter):
        return True
    fn = t.grad_fn
    if fn is None:  # a leaf: held by its graph's AccumulateGrad node if it requires grad
        return t.requires_grad
    # One walk over the op's inputs (this runs for every tensor autograd saves). An op that hands
    # back a leaf's own memory as a new tensor: Transformer Engine's fused QKV weight, a "no-op cat"
    # of three parameters that sit side by side in one buffer. The leaves keep that memory; a copy
    # would free nothing, and its reload would duplicate it. And autocast saves `weight.to(bf16)`:
    # one input, a leaf that requires grad, same shape, another dtype, which autocast's cache holds.
    inputs, leaf, storage = 0, None, None
    for f, _ in fn.next_functions:
        if f is None:
            continue
        inputs += 1
        if type(f) is not _AccumulateGrad or not _plain(v := f.variable):  # a nested or subclass leaf
            continue  # has no storage to compare
        if storage is None:
            storage = t.untyped_storage().data_ptr()
        if v.untyped_storage().data_ptr() == storage:
            return True
        leaf = leaf if leaf is not None else v
    return inputs == 1 and leaf is not None and leaf.shape == t.shape and leaf.dtype != t.dtype


def keep_reason(t: torch.Tensor, device: torch.device, min_bytes: int) -> str | None:
    """Why ``t`` stays on the device, or ``None`` to offload it.

    It runs for every tensor an offloaded layer saves, on the host's critical path: the common
    cases (a parameter, an activation) are decided with as few calls into torch as the rules allow.
    """
    if t.device != device:
        return "on another device"
    base = t._base
    if _marked(t) or (base is not None and _marked(base)):
        return "marked with mark_not_offload"
    cls = type(t)
    if cls is not torch.Tensor and cls is not _Parameter and not isinstance(t, _Parameter):
        return f"tensor subclass {cls.__name__}"
    if t.is_nested:  # before anything reads its sizes, which a nested tensor does not have
        return "a nested tensor"
    if base is not None and not _plain(base):
        return "a view of a nested tensor or a tensor subclass"
    if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg():  # first: a sparse
        return "not a plain strided tensor"  # tensor has no storage for is_weight_like to compare
    if is_weight_like(t):
        return "a parameter or a leaf that requires grad, or a view or cast of one (held anyway)"
    nbytes = t.untyped_storage().nbytes()
    if nbytes == 0 or nbytes < min_bytes:
        return "smaller than min_offload_bytes"
    return None


def _marked(t: torch.Tensor) -> bool:
    return getattr(t, _KEEP_ATTR, False)


def held_elsewhere(storage_view: torch.Tensor, ours: int) -> bool:
    """Whether anything but the engine's ``ours`` tensors still references ``storage_view``'s storage.

    Uses the storage's reference count (each tensor on it holds one). On a PyTorch without
    that read-out, answers ``False``: the tensor is offloaded, as before the check existed.
    """
    if _use_count is None:
        return False
    storage = storage_view.untyped_storage()  # this Python object holds one reference too
    return _use_count(storage._cdata) > ours + 1


_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def outer_hooks() -> str | None:
    """Whose saved-tensor hooks are active now: ``"checkpoint"`` (``torch.utils.checkpoint`` took over
    the region), ``"other"`` (``save_on_cpu``, someone's own), or ``None``."""
    if _top_hooks is None:  # an old PyTorch cannot tell whose: assume someone's
        return "other"
    top = _top_hooks(False)
    if top is None:
        return None
    return "checkpoint" if getattr(top[0], "__module__", None) == "torch.utils.checkpoint" else "other"


_set_version = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)


def version_witness(t: torch.Tensor) -> torch.Tensor | None:
    """A tensor without memory that shares ``t``'s version counter (``t``: a detached tensor the
    caller gives up). Once a storage is released, it is how an in-place change made through any
    other tensor on that counter (a ``detach()`` someone keeps) is still caught at backward.
    ``None`` on a PyTorch without the means to build one."""
    if _set_version is None:
        return None
    version = t._version
    t.set_()  # drops the storage; as any in-place op, it bumps the shared counter, which is set back
    try:
        _set_version((t,), (version,))
    except TypeError:  # torch < 2.5 takes one tensor
        _set_version(t, version)
    return t


class KeptTensor:
    """A saved tensor that stays on the device, with the version it was saved at.

    While saved-tensor hooks are active autograd no longer checks for in-place changes itself,
    so the engine does. The tensor is held detached: an output that held its own ``grad_fn``
    through this object would form a reference cycle (autograd restores the link on unpack).
    """

    __slots__ = ("tensor", "version", "layer")

    def __init__(self, t: torch.Tensor, layer: int):
        self.tensor = t.detach()
        self.version = t._version
        self.layer = layer

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise in_place_error(self.layer)
        return self.tensor


class ModuleSelection:
    """Offload only what chosen submodules save: a count of how deep the forward is inside them.

    Forward hooks on each module raise the count when its forward starts and lower it when it ends,
    also when it raises (``always_call``), so a tensor saved while the count is above zero was saved
    by one of them (or by something they called). Autograd saves tensors only during forward, so the
    count is all the engine needs to ask.
    """

    def __init__(self, modules: Iterable[torch.nn.Module]):
        self._local = threading.local()  # per thread: a no_grad pass in another thread is not inside
        self.modules = list(modules)
        if not self.modules or not all(isinstance(m, torch.nn.Module) for m in self.modules):
            raise TypeError("offload_modules expects one or more torch.nn.Module objects")
        self._handles = []
        for m in self.modules:
            self._handles.append(m.register_forward_pre_hook(self._entered))
            self._handles.append(m.register_forward_hook(self._left, always_call=True))

    @property
    def depth(self) -> int:
        """How many chosen modules' forwards are open in this thread."""
        return getattr(self._local, "depth", 0)

    @property
    def _open(self) -> dict[int, int]:  # entries counted per module (a hook before ours may raise first)
        if not hasattr(self._local, "open"):
            self._local.open, self._local.depth = {}, 0
        return self._local.open

    def _entered(self, module: torch.nn.Module, args: object) -> None:
        self._open[id(module)] = self._open.get(id(module), 0) + 1
        self._local.depth += 1

    def _left(self, module: torch.nn.Module, args: object, output: object) -> None:
        # ``always_call`` also runs this when a pre-hook before ours raised: only count what was counted
        if self._open.get(id(module), 0) > 0:
            self._open[id(module)] -= 1
            self._local.depth -= 1

    def reset(self) -> None:
        """Forget any forward still open in this thread (a step failed inside a chosen module)."""
        self._local.open, self._local.depth = {}, 0

    @property
    def active(self) -> bool:
        """Whether a chosen module's forward is running now."""
        return self.depth > 0

    def remove(self) -> None:
        """Take the hooks off the modules."""
        for h in self._handles:
            h.remove()
        self._handles = []


#: :func:`keep_reason`-style answer for a tensor saved outside the chosen modules.
OUTSIDE_SELECTION = "saved outside the modules chosen with offload_modules"
