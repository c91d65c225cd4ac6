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
the plain optimizer runs CUDA kernels, which round differently. In the optimizer-offload notebook's
run on an H200 (fp32, Adam, lr 1e-3) the parameters differ by at most 1.9e-9 after one step and
5.3e-3 after 15 steps. The growth is Adam's, not the copies': the first step's rounding differences
change the next gradients slightly, and Adam's normalisation turns a sign change of a near-zero
gradient into a step of size ``lr``.

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

from .optimizer import OptimizerOffload
from .params import SUPPORTED_OPTIMIZERS

__all__ = ["OptimizerOffload", "SUPPORTED_OPTIMIZERS"]
