"""The wrapper: the offloaded parameters' slots, the gradient copies, the host updates and the copies back.

Steps 2 to 6 of an offloaded parameter's life (:mod:`~offload_examples.features.optim_offload`)
happen here; which parameters are offloaded is :mod:`~offload_examples.features.optim_offload.params`'s
choice, and what the wrapper shows as a plain optimizer (its state, its checkpoints) is
:mod:`~offload_examples.features.optim_offload.state`'s.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, Iterable

import torch

from ...core.engine import GraphCaptureError
from ...core.host_pool import HostBuffer, HostBufferPool
from ...core.streams import Streams
from .params import (
    _check_fraction, _check_optimizer_class, _collect_params, _has_fused_cpu, _nbytes, _partition, _typed_view,
)
from .state import _FLAGS, _StateView, _load_state_dict, _state_dict, _state_tensors

__all__ = ["OptimizerOffload"]


@dataclass(eq=False)
class _HostSlot:
    """One offloaded parameter: its device tensor, its host mirror, and the events that order them."""

    index: int  # position in ``host_params``
    param: torch.nn.Parameter  # the device parameter the model uses
    master: torch.nn.Parameter  # view of ``master_buf``; the host optimizer updates it
    grad: torch.Tensor  # view of ``grad_buf``; the gradient copied from the device
    master_buf: HostBuffer
    grad_buf: HostBuffer
    optimizer: torch.optim.Optimizer
    hook: Any = None  # handle of the post-accumulate-grad hook
    #: Event of the last gradient copy to the host, the gradient it read and that gradient's version.
    copied: torch.cuda.Event | None = None
    copied_from: weakref.ref | None = None
    copied_version: int = -1
    #: Event of the last copy of the master to the device (it reads the master).
    written: torch.cuda.Event | None = None
    #: The parameter's version counter after the wrapper last wrote it.
    version: int = 0


class OptimizerOffload(torch.optim.Optimizer):
    """Keep the optimizer state of a fraction of the parameters in host memory.

    A ``torch.optim.Optimizer`` with one param group over all the parameters, as the plain
    ``optimizer_class(params, **optimizer_kwargs)`` would have: learning-rate schedulers, step
    hooks and checkpoints work as with the plain optimizer. Its hyperparameters are the truth:
    :meth:`step` copies them into the optimizers inside before updating.

    Parameters
    ----------
    params:
        The parameters, as one flat iterable of tensors (``model.parameters()``). All on one
        device, leaves that require grad, no duplicates. Param-group dicts are not supported.
        The order decides which parameters are offloaded (a prefix of the list, see the package
        docstring); pass ``reversed(list(model.parameters()))`` to offload the last layers, whose
        gradients arrive first in the backward and so have the most time to reach the host.
    optimizer_class:
        An elementwise optimizer: one of
        :data:`~offload_examples.features.optim_offload.params.SUPPORTED_OPTIMIZERS` or a subclass of one.
    fraction:
        Share of the parameter bytes whose state goes to the host, in ``[0, 1]``.
    grad_copy:
        ``"backward"`` (default): copy each offloaded gradient to the host as soon as autograd
        has accumulated it, overlapping the rest of the backward. ``"step"``: copy them all at
        :meth:`step`, for gradients changed after the backward in ways the hooks cannot see
        (see the package docstring's caveats).
    **optimizer_kwargs:
        Passed to every optimizer (see the package docstring for ``capturable``).

    Attributes
    ----------
    gpu_optimizer:
        The plain optimizer over the parameters kept on the device; ``None`` when there are none.
    host_params:
        The device parameters whose state lives on the host, in order.
    fraction:
        The fraction asked for.
    offloaded_fraction:
        Bytes of the offloaded parameters over all parameter bytes (0.0 when there are no bytes).
    late_grad_copies:
        Gradients copied at :meth:`step` rather than during the backward (no overlap).
    pool:
        The pool the pinned host buffers come from; all are borrowed at construction.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.Adam,
        fraction: float = 0.5,
        *,
        grad_copy: str = "backward",
        **optimizer_kwargs: Any,
    ):
        _check_optimizer_class(optimizer_class)
        self.fraction = _check_fraction(fraction)
        if grad_copy not in ("backward", "step"):
            raise ValueError(f'grad_copy must be "backward" or "step", got {grad_copy!r}')
        self.grad_copy = grad_copy
        all_params = _collect_params(params)
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = dict(optimizer_kwargs)
        self.device = all_params[0].device
        self.streams = Streams(self.device)
        self.pool = HostBufferPool(pin_memory=self.device.type == "cuda", retain=True)
        self.late_grad_copies = 0
        self._closed = False
        self._lock = threading.Lock()  # hooks run on autograd's threads
        self._arrived: dict[int, None] = {}  # slot indices in the order their copies were queued (ordered set)
        self._layouts: dict[torch.dtype, tuple[int, int]] = {}  # see theoretical_device_saving

        sizes = [_nbytes(p) for p in all_params]
        offload = _partition(sizes, self.fraction)
        total = sum(sizes)
        self.offloaded_fraction = sum(n for n, o in zip(sizes, offload) if o) / total if total else 0.0
        kept = [p for p, o in zip(all_params, offload) if not o]
        self.host_params: list[torch.nn.Parameter] = [p for p, o in zip(all_params, offload) if o]
        # Where parameter i of the caller's list lives: (on the host?, index in its own list).
        self._index_of = {id(p): i for i, p in enumerate(all_params)}
        self._where: list[tuple[bool, int]] = []
        counts = [0, 0]  # kept, offloaded so far
        for o in offload:
            self._where.append((o, counts[o]))
            counts[o] += 1

        self.gpu_optimizer = optimizer_class(kept, **optimizer_kwargs) if kept else None
        # The wrapper's own group is what the plain optimizer_class(params, **optimizer_kwargs)
        # would hold, implementation flags included; checkpoints and schedulers see only it.
        plain = self.gpu_optimizer or optimizer_class([torch.zeros(0, device=self.device, requires_grad=True)],
                                                      **optimizer_kwargs)
        super().__init__(all_params, {k: v for k, v in plain.param_groups[0].items() if k != "params"})
        self.state = _StateView(self)  # the inner optimizers' states, keyed by the caller's parameters
        host_kwargs = dict(optimizer_kwargs)
        if self.device.type != "cpu":
            host_kwargs.pop("capturable", None)
            if "fused" not in host_kwargs and "foreach" not in host_kwargs and _has_fused_cpu(optimizer_class):
                # The host part's rounding differs from the device's anyway; the fused CPU kernel
                # is several times faster than the per-tensor loop, and the CPU is the bottleneck.
                host_kwargs["fused"] = True
        self._slots = [self._make_slot(i, p, host_kwargs) for i, p in enumerate(self.host_params)]
        if grad_copy == "step":
            return
        if self._slots and torch.distributed.is_available() and torch.distributed.is_initialized():
            warnings.warn(
                "OptimizerOffload copies gradients to the host as autograd finishes them; a reduction that "
                "changes them in place afterwards without bumping their version (DDP with "
                "gradient_as_bucket_view=True, a manual all_reduce of p.grad) would not be seen. Pass "
                'grad_copy="step" unless the reduction happens before the hooks or assigns p.grad.',
                stacklevel=2,
            )
        # Hooks last: a constructor that raised above leaves no hook behind on the caller's parameters.
        for slot in self._slots:
            hook = functools.partial(_grad_ready, weakref.ref(self), slot.index)
            slot.hook = slot.param.register_post_accumulate_grad_hook(hook)

    @property
    def host_optimizers(self) -> list[torch.optim.Optimizer]:
        """One optimizer per offloaded parameter, over its host master copy, in the order of :attr:`host_params`."""
        return [slot.optimizer for slot in self._slots]

    #: ``torch.amp.GradScaler.step`` hands this optimizer the scale and the inf check instead of
    #: unscaling the gradients in place, which would change them behind the copies made in the backward.
    _step_supports_amp_scaling = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Called once by the constructor; the wrapper holds exactly one group."""
        if self.param_groups:
            raise NotImplementedError(
                "OptimizerOffload holds one param group over the parameters given to it; build one wrapper "
                "over all parameters (param-group dicts are not supported)"
            )
        super().add_param_group(param_group)

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        return ([self.gpu_optimizer] if self.gpu_optimizer is not None else []) + self.host_optimizers

    def _sync_hyperparameters(self) -> None:
        """Copy the wrapper's hyperparameters (set by a scheduler, say) into every inner group,
        leaving each inner optimizer its own implementation flags."""
        hyper = {k: v for k, v in self.param_groups[0].items() if k != "params" and k not in _FLAGS}
        for optimizer in self._inner_optimizers():
            for group in optimizer.param_groups:
                group.update(hyper)

    # ------------------------------------------------------------------ setup
    def _make_slot(self, index: int, p: torch.nn.Parameter, kwargs: dict[str, Any]) -> _HostSlot:
        """Borrow the two pinned buffers of ``p``, fill its master and build its host optimizer."""
        nbytes = _nbytes(p)
        # One buffer per tensor: the pool's uint8 buffers start aligned for any dtype.
        master_buf = self.pool.acquire(nbytes)
        grad_buf = self.pool.acquire(nbytes)
        master = _typed_view(master_buf, p)
        with torch.no_grad():
            master.copy_(p)  # blocking, once: the master starts equal to the parameter
        master = torch.nn.Parameter(master)  # shares the buffer; a leaf the optimizer accepts
        return _HostSlot(
            index=index,
            param=p,
            master=master,
            grad=_typed_view(grad_buf, p),
            master_buf=master_buf,
            grad_buf=grad_buf,
            optimizer=self.optimizer_class([master], **kwargs),
            version=p._version,
        )

    # ------------------------------------------------------------------ the training step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient (see the package docstring, steps 4 to 6).

        ``closure``, as for torch's optimizers, re-evaluates the model and returns the loss; it
        runs first and its loss is returned.
        """
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        inv_scale, recopy = self._from_grad_scaler()
        if inv_scale is False:  # GradScaler found inf or nan: skip the step, as it does for any optimizer
            with self._lock:
                self._arrived.clear()
            return loss
        s = self.streams
        compute = s.current()
        # Everything queued so far: the backward and whatever the caller did to the gradients.
        backward_done = Streams.now(compute)
        if self.gpu_optimizer is not None:
            if inv_scale is not None:
                on_device = inv_scale.to(self.device)
                with torch.no_grad():
                    for p in self.gpu_optimizer.param_groups[0]["params"]:
                        if p.grad is not None:
                            p.grad.mul_(on_device)  # what GradScaler.unscale_ computes
            self.gpu_optimizer.step()  # queued first, so the device works while the CPU updates
        # The copies into the parameters must not overwrite them while a backward kernel queued
        # before this point may still read them. The device optimizer's step, queued since, never
        # touches these parameters, so waiting for the event (not the whole compute stream) lets
        # the copies overlap with it.
        last = None
        for slot in self._update_order():
            self._update(slot, backward_done, inv_scale, recopy)
            last = slot.written
        # The next forward reads the parameters on the compute stream. The host-to-device stream
        # runs the copies in order, so its last event covers them all. A device-side wait only.
        Streams.fence(compute, last)
        with self._lock:
            self._arrived.clear()
        return loss

    def _update_order(self) -> list[_HostSlot]:
        """Slots with a gradient: first as their copies were queued (and will finish), then the rest."""
        with self._lock:
            arrived = list(self._arrived)
        order = [self._slots[i] for i in arrived]
        seen = set(arrived)
        order += [slot for slot in self._slots if slot.index not in seen]
        return [slot for slot in order if slot.param.grad is not None]  # skipped, like torch.optim

    def _from_grad_scaler(self) -> tuple[torch.Tensor | None | bool, bool]:
        """Read what ``GradScaler.step`` left on the optimizer (``grad_scale``, ``found_inf``).

        Returns the inverse scale to apply to the gradients (None: nothing to unscale; False: skip
        the step) and whether the gradients were unscaled in place after the backward's copies.
        """
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return None, False
        if found_inf.item():  # a host read, as GradScaler's own step makes
            return False, False
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is None:  # scaler.unscale_(optimizer) ran: the device gradients changed in place
            return None, True
        return grad_scale.double().reciprocal().float().cpu(), False

    def _update(self, slot: _HostSlot, backward_done: torch.cuda.Event | None,
                inv_scale: torch.Tensor | None = None, recopy: bool = False) -> None:
        """Steps 4 and 5 for one parameter: wait for its gradient, update the master, copy it back."""
        p, s = slot.param, self.streams
        grad = p.grad
        if recopy or not (slot.copied_from is not None and slot.copied_from() is grad
                          and slot.copied_version == grad._version):
            self.late_grad_copies += 1  # set by hand, or changed in place (clipping) after the hook's copy
            self._copy_grad(slot, after=backward_done)
        # The previous step's copy of the master to the device may still be reading it, and the
        # CPU is about to overwrite it. (Usually long finished: the forward and backward waited.)
        if slot.written is not None:
            slot.written.synchronize()
        if p._version != slot.version:
            # Changed in place since the wrapper last wrote it (load_state_dict, ...): the device
            # holds the newer values. A blocking copy, queued after that change on this stream.
            with torch.no_grad():
                slot.master.copy_(p)
        # The CPU reads the gradient buffer next; only the host can wait for a copy it reads.
        if slot.copied is not None:
            slot.copied.synchronize()
        if inv_scale is not None:
            slot.grad.mul_(inv_scale)  # the host copy is still scaled; the device gradient stays so too
        slot.master.grad = slot.grad
        try:
            slot.optimizer.step()
        finally:
            slot.master.grad = None  # a later step without a gradient must skip the parameter
        slot.written = s.copy(p.detach(), slot.master, on=s.h2d, after=backward_done, lane="host-to-device")
        slot.version = p._version  # the copy above bumped it; later changes are the caller's

    def _copy_grad(self, slot: _HostSlot, after: torch.cuda.Event | None = None) -> None:
        """Queue the copy of ``slot.param.grad`` into the host gradient buffer (step 3).

        ``after`` is the event the copy must follow; by default all the work queued so far on the
        current stream, which is where autograd has just accumulated the gradient.
        """
        grad = slot.param.grad
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"host_params[{slot.index}] has a {grad.layout} gradient; "
                "OptimizerOffload supports dense gradients only"
            )
        s = self.streams
        # No wait for the CPU's last read of the buffer: the CPU step that read it was synchronous.
        # If the gradient is freed (zero_grad) before the copy has read it, the allocator must not
        # hand its memory to the compute stream until the copy is done: src_owned_elsewhere.
        slot.copied = s.copy(slot.grad, grad, on=s.d2h, after=s.current() if after is None else after,
                             lane="device-to-host", src_owned_elsewhere=True)
        slot.copied_from = weakref.ref(grad)
        slot.copied_version = grad._version
        with self._lock:
            self._arrived.pop(slot.index, None)  # accumulated again: it now finishes last
            self._arrived[slot.index] = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of all parameters, like :meth:`torch.optim.Optimizer.zero_grad`."""
        self._check_open()
        if self.gpu_optimizer is not None:
            self.gpu_optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.host_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()  # bumps its version: a copy made before no longer counts
        with self._lock:
            self._arrived.clear()

    # ------------------------------------------------------------------ read-outs
    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state by where it lives, from the optimizers' state dicts.

        ``"device"`` counts the device optimizer's state tensors that lie on the parameters'
        device; ``"host"`` counts the host optimizers' state and, on a GPU, the device optimizer's
        tensors that torch keeps on the CPU anyway (Adam's step counters unless ``capturable`` or
        ``fused``). On the CPU device ``"device"`` is all of the device optimizer's state.
        """
        device = host = 0
        if self.gpu_optimizer is not None:
            for t in _state_tensors(self.gpu_optimizer):
                if t.device == self.device:
                    device += _nbytes(t)
                else:
                    host += _nbytes(t)
        for slot in self._slots:
            host += sum(_nbytes(t) for t in _state_tensors(slot.optimizer))
        return {"device": device, "host": host}

    def theoretical_device_saving(self) -> int:
        """State bytes the offloaded parameters would hold on the device with the plain optimizer.

        The plain optimizer's layout is measured, not assumed: it takes one step on a two-element
        probe parameter per dtype, on the parameters' device and with the same keyword arguments;
        a state tensor shaped like the probe costs its element size per parameter element, any
        other tensor on the device (a step counter with ``capturable=True``) a fixed size per
        parameter, and tensors torch keeps on the CPU nothing. For Adam on a GPU this is two
        moments times the parameter bytes; on the CPU device it equals
        ``state_bytes()["host"]`` (the step counters count too, the CPU being the device).
        """
        total = 0
        for p in self.host_params:
            if p.dtype not in self._layouts:
                self._layouts[p.dtype] = self._probe_layout(p.dtype)
            per_element, fixed = self._layouts[p.dtype]
            total += per_element * p.numel() + fixed
        return total

    def _probe_layout(self, dtype: torch.dtype) -> tuple[int, int]:
        probe = torch.zeros(2, dtype=dtype, device=self.device, requires_grad=True)
        probe.grad = torch.ones_like(probe)
        optimizer = self.optimizer_class([probe], **self.optimizer_kwargs)
        optimizer.step()
        per_element = fixed = 0
        for t in _state_tensors(optimizer):
            if t.device != self.device:
                continue
            if t.shape == probe.shape:
                per_element += t.element_size()
            else:
                fixed += _nbytes(t)
        return per_element, fixed

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Wait for pending copies, remove the hooks and give every pinned buffer back.

        The device parameters keep their last update; the wrapper cannot step again.
        """
        if self._closed:
            return
        for slot in self._slots:
            # Buffers may be freed only once no copy reads or writes them any more.
            for event in (slot.copied, slot.written):
                if event is not None:
                    event.synchronize()
            slot.hook.remove()
            self.pool.give_back(slot.master_buf, None)
            self.pool.give_back(slot.grad_buf, None)
        self._slots = []
        self.pool.release()
        self._closed = True

    def __enter__(self) -> OptimizerOffload:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """The state as the plain ``optimizer_class(params)`` would save it.

        One param group (the wrapper's) over the parameters numbered ``0..n-1`` in the order
        given to the constructor, and each parameter's state from the optimizer that holds it.
        As with torch's optimizers, the tensors are the live state, not copies; host states are
        CPU tensors.
        """
        self._check_open()
        return _state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint written by :meth:`state_dict`, at any fraction, or by the plain optimizer.

        The checkpoint's hyperparameters replace the wrapper's; every optimizer keeps its own
        implementation flags. Raises ``ValueError`` for a checkpoint of another shape (several
        param groups, another number of parameters) before loading anything.
        """
        self._check_open()
        _load_state_dict(self, state_dict)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this OptimizerOffload was closed; build a new one to keep training")


def _grad_ready(ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook. Holds the wrapper weakly so the parameters don't keep it alive."""
    self = ref()
    if self is None or self._closed:
        return
    if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise GraphCaptureError(
            "OptimizerOffload copies gradients in backward hooks, which a CUDA graph replay does not run, "
            'and the host could read a copy the replay has not finished. Build it with grad_copy="step" '
            "to use it with a captured backward: the gradients are then copied at step()"
        )
    self._copy_grad(self._slots[index])
