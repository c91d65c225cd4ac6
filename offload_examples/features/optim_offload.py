"""Optimizer state offloading: part of the parameters is updated on the host, from host memory.

:class:`OptimizerOffload` wraps an elementwise optimizer (Adam, SGD, ...). A chosen fraction of the
parameters keeps its optimizer state (Adam's two moments, SGD's momentum) in host memory and is
updated by the CPU; the other parameters go through the plain optimizer on the device as usual.
The life of one offloaded parameter's data, in the order it happens:

1. **Partitioned.** Walking the parameters in the order given, parameter ``i`` is offloaded when
   the bytes offloaded before it are still below ``fraction`` of all parameter bytes. The
   offloaded parameters are therefore a prefix of the list, and the offloaded share overshoots
   ``fraction`` by less than one parameter (:attr:`OptimizerOffload.offloaded_fraction` says by
   how much). ``fraction=1.0`` offloads every parameter, zero-size ones included.
2. **Mirrored.** At construction the parameter borrows two pinned buffers from a
   :class:`~offload_examples.core.host_pool.HostBufferPool`: a *master* copy, filled once from the
   device, and a gradient buffer. It gets its own optimizer over the master, so it can be updated
   as soon as its own gradient has arrived (for an elementwise optimizer, one optimizer per
   parameter computes exactly what one optimizer over all of them would). The optimizer state it
   creates on the first step lives in ordinary host memory, since it never crosses the bus.
3. **Gradient copied out.** In the backward, once autograd has accumulated the parameter's
   gradient, a post-accumulate-grad hook queues the copy of ``p.grad`` into the gradient buffer
   on the device-to-host stream, after that stream has waited for the compute stream (the
   gradient has only just been written there), and records an event. The copies thus overlap the
   rest of the backward. A gradient the hook did not see (set by hand, or changed in place after
   the backward, e.g. by gradient clipping) is copied at :meth:`~OptimizerOffload.step` instead:
   still correct, but without overlap (:attr:`~OptimizerOffload.late_grad_copies` counts these).
4. **Updated on the host.** :meth:`~OptimizerOffload.step` first queues the device optimizer's
   step, which runs asynchronously on the device. Then, for each offloaded parameter with a
   gradient, in the order its gradient copy was queued (the order the copies finish in), the host
   waits for that copy's event and runs the parameter's CPU optimizer on the master.
5. **Copied back.** The updated master is copied into the device parameter on the host-to-device
   stream, and an event is recorded. While the CPU updates parameter ``i``, the copy of parameter
   ``i - 1`` and the device optimizer's step run on the device.
6. **Used.** At the end of ``step()`` the compute stream waits (on the device; the host does not
   block) for the last host-to-device copy, so the next forward reads updated parameters. The
   master is next written by the CPU only after this copy has finished reading it.

Tolerance
---------
On the CPU device the host optimizers run the same per-tensor arithmetic as the plain optimizer
(torch's default on CPU is the single-tensor path, and ``foreach=True`` or ``fused=True`` work
tensor by tensor too), so parameters and states are **bitwise equal** to the plain optimizer's at
any fraction. ``fraction=0.0`` is bitwise equal on any device: everything then goes through one
plain ``optimizer_class(params, **kwargs)``. On a GPU the offloaded part runs CPU kernels while
the plain optimizer runs CUDA kernels, which round differently. Measured on the H100 (fp32, Adam,
lr 1e-3): after one step the parameters differ by at most 1.9e-9; after 12 steps by at most
3.4e-3 per element and 5.5e-3 in relative L2 norm per tensor. The growth is Adam's, not the
copies': the first step's rounding differences change the next gradients slightly, and Adam's
normalisation turns a sign change of a near-zero gradient into a step of size ``lr``.

Options
-------
``foreach`` and ``fused`` are passed to every optimizer unchanged (torch has fused CPU kernels
for SGD, Adam, AdamW and Adagrad). When the device is a GPU and neither is given, the host
optimizers use ``fused=True`` where the class has a fused CPU kernel: the CPU update is what
limits the step, and the fused kernel is several times faster than the per-tensor loop. ``capturable=True`` is kept for the device optimizer but
dropped for the host optimizers when the device is a GPU: it exists for CUDA graph capture and
torch refuses it for CPU tensors. On the CPU device nothing is dropped, so the wrapper accepts
exactly the keyword arguments the plain optimizer accepts.

Caveats
-------
The gradient copied in step 3 is the one autograd produced. A later change that PyTorch's version
counter sees (clipping, ``mul_``, assigning ``p.grad``) makes :meth:`~OptimizerOffload.step` copy
it again. ``torch.amp.GradScaler`` is supported: the wrapper takes the scale from it and unscales
the host copies itself (after ``scaler.unscale_(optimizer)``, e.g. to clip, every gradient is
copied again at the step). Changes the counter does not see are not noticed: an in-place
``all_reduce`` of ``p.grad`` (or DDP with ``gradient_as_bucket_view=True``) and writes through
``p.grad.data``. Pass ``grad_copy="step"`` in those cases, and to use the wrapper with CUDA graphs
(a replay runs no hooks): every gradient is then copied at the step, without overlap.

The host master, not the device tensor, is what an offloaded parameter is updated from. A change
made to the parameter in place (``with torch.no_grad(): p.copy_(w)``, ``load_state_dict``) bumps
its version counter and is picked up at the next step (a blocking copy). Writing through
``p.data`` or replacing ``p.data`` is invisible to the wrapper and is lost at the next step.

The plain optimizer's face
--------------------------
The wrapper is a ``torch.optim.Optimizer`` whose one param group holds every parameter with the
hyperparameters and flags the plain ``optimizer_class(params, **kwargs)`` would have. A
learning-rate scheduler changes that group; :meth:`~OptimizerOffload.step` copies its
hyperparameters into the optimizers inside (each keeps its own ``fused``/``foreach``/``capturable``). ``state[p]`` is
``p``'s state in whichever optimizer holds it. :meth:`~OptimizerOffload.state_dict` writes the plain
optimizer's format, parameters numbered in the order given, so a checkpoint loads into the plain
optimizer or into a wrapper with another fraction, and the plain optimizer's loads into the wrapper.
"""

from __future__ import annotations

import functools
import math
import numbers
import threading
import warnings
import weakref
from dataclasses import dataclass
from types import TracebackType
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

import torch

from ..core.engine import GraphCaptureError
from ..core.host_pool import HostBuffer, HostBufferPool
from ..core.streams import Streams

__all__ = ["OptimizerOffload", "SUPPORTED_OPTIMIZERS"]

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
        The order decides which parameters are offloaded (a prefix of the list, see the module
        docstring); pass ``reversed(list(model.parameters()))`` to offload the last layers, whose
        gradients arrive first in the backward and so have the most time to reach the host.
    optimizer_class:
        An elementwise optimizer: one of :data:`SUPPORTED_OPTIMIZERS` or a subclass of one.
    fraction:
        Share of the parameter bytes whose state goes to the host, in ``[0, 1]``.
    grad_copy:
        ``"backward"`` (default): copy each offloaded gradient to the host as soon as autograd
        has accumulated it, overlapping the rest of the backward. ``"step"``: copy them all at
        :meth:`step`, for gradients changed after the backward in ways the hooks cannot see
        (see the module docstring's caveats).
    **optimizer_kwargs:
        Passed to every optimizer (see the module docstring for ``capturable``).

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
        """Update every parameter that has a gradient (see the module docstring, steps 4 to 6).

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
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():  # registered as on any optimizer
            pre_hook(self)
        state = {i: dict(self.state[p]) for i, p in enumerate(self.param_groups[0]["params"]) if p in self.state}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        state_dict = {"state": state, "param_groups": [{**group, "params": list(range(len(self._where)))}]}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state_dict = post_hook(self, state_dict) or state_dict
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint written by :meth:`state_dict`, at any fraction, or by the plain optimizer.

        The checkpoint's hyperparameters replace the wrapper's; every optimizer keeps its own
        implementation flags. Raises ``ValueError`` for a checkpoint of another shape (several
        param groups, another number of parameters) before loading anything.
        """
        self._check_open()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        group, state = self._check_checkpoint(state_dict)
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names") and k not in _FLAGS}
        self.param_groups[0].update(hyper)
        if self.gpu_optimizer is not None:
            kept = [i for i, (on_host, _) in enumerate(self._where) if not on_host]
            self.gpu_optimizer.load_state_dict({
                "state": {j: state[i] for j, i in enumerate(kept) if i in state},
                "param_groups": [{**self.gpu_optimizer.param_groups[0], **hyper, "params": list(range(len(kept)))}],
            })
        for i, (on_host, j) in enumerate(self._where):
            if on_host:
                optimizer = self._slots[j].optimizer
                optimizer.load_state_dict({
                    "state": {0: state[i]} if i in state else {},
                    "param_groups": [{**optimizer.param_groups[0], **hyper, "params": [0]}],
                })
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _check_checkpoint(self, state_dict: Any) -> tuple[dict[str, Any], dict[int, Any]]:
        """The single group and the state of a checkpoint, or a ValueError that says what differs."""
        n = len(self._where)
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or len(groups) != 1 or "state" not in state_dict:
            shape = f"{len(groups)} param groups" if isinstance(groups, list) else f"{type(state_dict).__name__}"
            raise ValueError(
                f"expected an optimizer state_dict with one param group over {n} parameters (what "
                f"state_dict() and a plain {self.optimizer_class.__name__}(params) save), got {shape}"
            )
        params = list(groups[0].get("params", []))
        if sorted(params) != list(range(n)) or not set(state_dict["state"]) <= set(params):
            raise ValueError(
                f"the checkpoint's param group holds {len(params)} parameters and state for "
                f"{len(state_dict['state'])}; this optimizer has {n} parameters, numbered 0..{n - 1} "
                "in the order given to the constructor"
            )
        return groups[0], state_dict["state"]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this OptimizerOffload was closed; build a new one to keep training")


class _StateView(Mapping):
    """``OptimizerOffload.state``: each parameter's state in the optimizer that holds it (the
    device optimizer's, or its host optimizer's, whose tensors are on the CPU), read-only."""

    def __init__(self, owner: OptimizerOffload):
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


# ---------------------------------------------------------------------- helpers
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


#: Keys of a param group that choose an implementation rather than the arithmetic.
_FLAGS = ("foreach", "fused", "capturable", "differentiable")


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


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value
