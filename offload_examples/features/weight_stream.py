"""Weight streaming: train a stack of layers whose weights live in pinned host memory.

The life of one layer's weights during a training step, in the order it happens:

1. **At rest.** All parameters of layer ``l`` share one flat pinned host buffer (from the same
   :class:`~offload_examples.core.host_pool.HostBufferPool` the activation engine uses); each
   parameter's ``.data`` is a view of it, so an optimizer on the host updates them in place.
2. **Loaded.** GPU memory for the layer is allocated on the compute stream, and the
   host-to-device stream, after waiting for the compute stream (the memory may be what the
   previous layer used until just now), copies the flat buffer into it. An event marks the end.
3. **Forward.** Before layer ``l`` runs, the compute stream waits for its load event and the
   load of layer ``l + 1`` is queued, so it overlaps with layer ``l``'s compute. The parameters
   point at the GPU copy while the layer runs without recording a graph: only the layer's input
   is kept for backward (activation recomputation). Then they point back at the host and the
   GPU copy is dropped; the compute stream allocated and last used it, so it can be reused at once.
4. **Backward.** Layer ``l`` is loaded again (prefetched while layer ``l + 1`` ran backward), the
   load of layer ``l - 1`` is queued, and the layer's forward runs again from its saved input,
   this time recording a graph, which ``torch.autograd.grad`` differentiates: the input's
   gradient goes on to layer ``l - 1`` and the parameters' gradients stay on the GPU.
5. **Written back.** The device-to-host stream, after waiting for the compute stream, copies the
   gradients into a second flat pinned buffer, whose views become the parameters' ``.grad``.
   When the layer's parameters already had gradients (accumulation over micro-batches), that
   buffer was first loaded to the device on the host-to-device stream, during the layer's
   recomputation, and the new gradients were added to it there, as autograd would add them.
   The GPU gradients are dropped one layer later, after the compute stream has waited for that
   copy's event (on the device), so the write-back of layer ``l + 1`` overlaps with layer ``l``.
6. **Done.** When autograd's backward ends (a callback the first layer backward queued), the
   last gradients are dropped and the host waits for the last write-back, so the gradients are
   complete when ``backward()`` returns and a host optimizer can step; a layer loaded ahead but
   never reached (a first layer with nothing to differentiate) is dropped too.

At most two layers' weights and two layers' gradients are on the GPU at any time, plus the
earlier gradients of the layer in backward when they accumulate. Without a GPU the same code
runs with CPU tensors; the copies are then synchronous.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import nn

from ..core.host_pool import HostBuffer, HostBufferPool
from ..core.streams import Streams, resolve_device

__all__ = ["StreamedLayers"]

_ALIGN = 64  # bytes: every view starts aligned for any dtype


class _Layout:
    """Where each parameter of one layer sits in its flat buffer: ``(param, offset, nbytes)``."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.slots: list[tuple[nn.Parameter, int, int]] = []
        offset = 0
        for p in params:
            n = p.numel() * p.element_size()
            self.slots.append((p, offset, n))
            offset += -(-n // _ALIGN) * _ALIGN
        self.nbytes = offset

    def views(self, flat: torch.Tensor) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        for p, offset, n in self.slots:
            yield p, flat[offset:offset + n].view(p.dtype).view(p.shape)


class StreamedLayers(nn.Module):
    """Run ``layers`` in order with their weights streamed from pinned host memory.

    Gradients accumulate as autograd's do: without ``zero_grad`` between backwards, each
    parameter's ``.grad`` (a view of pinned host memory) holds the sum. Clearing them with
    ``zero_grad(set_to_none=True)`` saves loading the old ones. Random layers (dropout) recompute
    with the random state of their first run.

    Parameters
    ----------
    layers:
        Any modules applied one after the other (``x = layer(x)``); each may hold any number
        of parameters. Their parameters move to pinned host memory; their buffers move to
        ``device`` and stay there.
    device:
        Where the layers compute.
    """

    def __init__(self, layers: Sequence[nn.Module], device: torch.device | str):
        super().__init__()
        if len(layers) == 0:
            raise ValueError("StreamedLayers needs at least one layer")
        self.layers = nn.ModuleList(layers)
        self.device = resolve_device(device)
        self.streams = Streams(self.device)
        self.pool = HostBufferPool(pin_memory=self.device.type == "cuda")
        self._layouts = [_Layout(list(layer.parameters())) for layer in self.layers]
        seen: set[int] = set()
        for i, layout in enumerate(self._layouts):
            for p in layout.params:
                if id(p) in seen:
                    raise ValueError(f"layer {i} shares a parameter with an earlier layer; streamed layers "
                                     "must own their parameters (each is loaded and written back once)")
                seen.add(id(p))
        self._host = [self._to_host(layout) for layout in self._layouts]
        self._grads = [self.pool.acquire(layout.nbytes) for layout in self._layouts]
        for layer in self.layers:
            for b in layer.buffers():
                b.data = b.data.to(self.device)
        #: GPU copies by layer: ``(flat weights, load event)``; gradients waiting to be dropped.
        self._loaded: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._writing: dict[int, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}
        #: Bytes of weights and gradients on the device now.
        self.device_bytes = 0
        #: The most bytes of weights and gradients on the device at once (since :meth:`reset_peak`).
        self.peak_device_bytes = 0
        #: ``(action, layer)`` in the order queued: ``load``, ``drop`` (weights), ``write``, ``free``
        #: (gradients), ``load grads`` (earlier gradients to add to). Cleared at every forward.
        self.events: list[tuple[str, int]] = []
        self._keep_last = True
        self._backward_queued = False

    # ------------------------------------------------------------------ read-outs
    @property
    def weight_bytes(self) -> list[int]:
        """Bytes of each layer's parameters (as laid out in its flat buffer)."""
        return [layout.nbytes for layout in self._layouts]

    def resident_bound(self, accumulating: bool = False) -> int:
        """The most weight and gradient bytes streaming may hold: two layers' weights and gradients,
        and, when gradients accumulate, the earlier gradients of one more layer."""
        top = sorted(self.weight_bytes, reverse=True)[:2]
        return 2 * sum(top) + (top[0] if accumulating else 0)

    def reset_peak(self) -> None:
        """Start a new :attr:`peak_device_bytes` from the bytes on the device now."""
        self.peak_device_bytes = self.device_bytes

    # ------------------------------------------------------------------ steps 1, 2 and 5
    def _to_host(self, layout: _Layout) -> HostBuffer:
        """Step 1: copy the parameters into one pinned buffer and point them at it."""
        buf = self.pool.acquire(layout.nbytes)
        with torch.no_grad():
            for p, view in layout.views(buf.data):
                view.copy_(p.data)
                p.data = view
        return buf

    def _count(self, nbytes: int) -> None:
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def _load(self, i: int) -> None:
        """Step 2: queue the host-to-device copy of layer ``i`` (no-op if loaded or out of range)."""
        if not 0 <= i < len(self.layers) or i in self._loaded:
            return
        s = self.streams
        flat = torch.empty(self._layouts[i].nbytes, dtype=torch.uint8, device=self.device)  # on compute
        self._count(flat.numel())
        # after the compute stream's queued work: the new block may be memory it used until now
        loaded = s.copy(flat, self._host[i].data, on=s.h2d, after=s.current(), lane="host-to-device", layer=i)
        self._loaded[i] = (flat, loaded)
        self.events.append(("load", i))

    def _use(self, i: int) -> None:
        """Point layer ``i``'s parameters at its GPU copy, once the compute stream has waited for it."""
        self._load(i)  # a layer run out of order is loaded on demand
        flat, loaded = self._loaded[i]
        Streams.use(flat, loaded, self.streams.current())
        for p, view in self._layouts[i].views(flat):
            p.data = view

    def _unuse(self, i: int, drop: bool = True) -> None:
        """Point the parameters back at the host and drop the GPU copy (used on the compute stream only)."""
        for p, view in self._layouts[i].views(self._host[i].data):
            p.data = view
        if drop:
            flat, _ = self._loaded.pop(i)
            self.device_bytes -= flat.numel()
            self.events.append(("drop", i))

    def _load_earlier_grads(self, i: int) -> tuple[torch.Tensor, torch.cuda.Event | None, set[int]] | None:
        """Queue the host-to-device copy of the gradients layer ``i``'s parameters already have.

        Returns the device copy, its event and the ids of those parameters, or None when no
        parameter has a gradient. A gradient that is not the view the last write-back made
        (set by hand) is first copied into that view, on the host.
        """
        layout = self._layouts[i]
        had = [p for p in layout.params if p.grad is not None]
        if not had:
            return None
        host = dict(layout.views(self._grads[i].data))
        with torch.no_grad():
            for p in had:
                if p.grad.data_ptr() != host[p].data_ptr() or p.grad.stride() != host[p].stride():
                    host[p].copy_(p.grad)
                    p.grad = host[p]
        s = self.streams
        flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)  # on compute
        self._count(flat.numel())
        loaded = s.copy(flat, self._grads[i].data, on=s.h2d, after=s.current(), lane="host-to-device", layer=i)
        self.events.append(("load grads", i))
        return flat, loaded, {id(p) for p in had}

    def _add_earlier_grads(self, i: int, grads: list[torch.Tensor | None], earlier) -> None:
        """Add the loaded earlier gradients into the new ones, on the compute stream, then drop them."""
        flat, loaded, had = earlier
        Streams.use(flat, loaded, self.streams.current())
        with torch.no_grad():
            for (p, old), g in zip(self._layouts[i].views(flat), grads):
                if g is not None and id(p) in had:
                    g.add_(old)  # a parameter without a new gradient keeps its .grad untouched
        self.device_bytes -= flat.numel()  # read on the compute stream only, after the copy's event

    def _write_back(self, i: int, grads: list[torch.Tensor | None]) -> None:
        """Step 5: queue the device-to-host copy of layer ``i``'s gradients into its host buffer."""
        s = self.streams
        host = dict(self._layouts[i].views(self._grads[i].data))
        kept, written = [], None
        for p, g in zip(self._layouts[i].params, grads):
            if g is None:  # the parameter did not take part: like autograd, leave .grad unset
                continue
            # the first copy waits for the compute stream, which just computed the gradients
            written = s.copy(host[p], g, on=s.d2h, after=s.current() if not kept else None,
                             lane="device-to-host", layer=i)
            kept.append(g)
        self._writing[i] = (kept, written)
        self.events.append(("write", i))
        for p, g in zip(self._layouts[i].params, grads):
            if g is not None:
                p.grad = host[p]

    def _drop_written(self, keep: int | None = None) -> None:
        """Drop GPU gradients whose write-back was queued, except layer ``keep``'s.

        The compute stream allocated them and will reuse the memory, so it first waits (on the
        device) for the copy that reads them.
        """
        for i in [j for j in self._writing if j != keep]:
            grads, written = self._writing.pop(i)
            Streams.fence(self.streams.current(), written)
            self.device_bytes -= sum(g.numel() * g.element_size() for g in grads)
            self.events.append(("free", i))

    def _drop_loaded(self) -> None:
        """Drop every loaded layer, after the compute stream has waited for its load to finish."""
        for i in list(self._loaded):
            Streams.fence(self.streams.current(), self._loaded[i][1])
            self._unuse(i)

    def _release_all(self) -> None:
        """Give back everything on the device: loaded weights and gradients being written back."""
        self._drop_loaded()
        self._drop_written()
        self._backward_queued = False  # an aborted backward never ran its callback

    def _end_backward(self) -> None:
        """Step 6, queued with autograd to run once the whole backward has finished."""
        self._backward_queued = False
        self._drop_written()
        self._drop_loaded()  # prefetched for a layer whose backward never ran
        if self.streams.is_cuda:
            self.streams.d2h.synchronize()

    # ------------------------------------------------------------------ the model
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._release_all()  # left by a forward without backward, or by an exception
        self.events = []
        # The last layer stays loaded for the backward that comes next, if one comes.
        self._keep_last = torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for layout in self._layouts for p in layout.params))
        for i, layout in enumerate(self._layouts):
            # The parameters go in too (unused) so that the output requires grad even when x does not.
            x = _StreamedLayer.apply(x, self, i, *layout.params)
        return x

    def _forward_layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self._use(i)
        self._load(i + 1)  # prefetch: overlaps with this layer's compute
        try:
            return self.layers[i](x)
        finally:
            self._unuse(i, drop=i < len(self.layers) - 1 or not self._keep_last)

    def _backward_layer(self, i: int, x: torch.Tensor, grad_out: torch.Tensor, saved) -> torch.Tensor | None:
        if not self._backward_queued:  # step 6 runs when autograd's whole backward is done
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._backward_queued = True
        params = [p for p in self._layouts[i].params if p.requires_grad]  # frozen ones get no gradient
        self._use(i)
        self._load(i - 1)  # prefetch the next layer backward reaches
        self._drop_written(keep=i + 1)  # layer i + 1's write-back keeps running during this layer
        earlier = self._load_earlier_grads(i)  # overlaps with the recomputation below
        try:
            with torch.enable_grad(), _replayed(saved, self.device):
                x = x.detach().requires_grad_(x.requires_grad)
                y = self.layers[i](x)
                inputs = [x] + params if x.requires_grad else params
                grads = torch.autograd.grad(y, inputs, grad_out, allow_unused=True)
            grad_x, grad_params = (grads[0], list(grads[1:])) if x.requires_grad else (None, list(grads))
            # Counted before the weights go: the gradients were made while they were loaded.
            self._count(sum(g.numel() * g.element_size() for g in grad_params if g is not None))
        except BaseException:
            if earlier is not None:  # its copy may still be writing: the compute stream waits before freeing
                Streams.fence(self.streams.current(), earlier[1])
                self.device_bytes -= earlier[0].numel()
            raise
        finally:
            self._unuse(i)
        by_param = {id(p): g for p, g in zip(params, grad_params)}
        grad_params = [by_param.get(id(p)) for p in self._layouts[i].params]
        if earlier is not None:
            self._add_earlier_grads(i, grad_params, earlier)
        self._write_back(i, grad_params)
        return grad_x


def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _forward_state(device: torch.device):
    """What the recomputation must repeat: the random state and the autocast setting of the forward."""
    autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
    return _rng_state(device), autocast


@contextlib.contextmanager
def _replayed(saved, device: torch.device) -> Iterator[None]:
    """Run the recomputation with the random state and autocast its first run had, then restore
    the present random state."""
    state, (enabled, dtype) = saved
    # fork_rng restores the present CPU state (and this GPU's) however the block ends
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        _set_rng_state(state, device)
        with torch.autocast(device.type, dtype=dtype, enabled=enabled):
            yield


class _StreamedLayer(torch.autograd.Function):
    """One layer: forward without a graph, backward by recomputation (steps 3 and 4)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, owner: StreamedLayers, i: int, *params: nn.Parameter) -> torch.Tensor:
        ctx.owner, ctx.i = owner, i
        ctx.saved_state = _forward_state(owner.device)
        ctx.save_for_backward(x)
        return owner._forward_layer(i, x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        grad_x = ctx.owner._backward_layer(ctx.i, x, grad_out, ctx.saved_state)
        # The parameters' gradients were written to their .grad on the host already.
        return (grad_x, None, None) + (None,) * len(ctx.owner._layouts[ctx.i].params)
