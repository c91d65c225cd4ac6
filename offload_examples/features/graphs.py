"""Capture a whole training step in one CUDA graph and replay it with new inputs.

A captured graph replays the GPU work of the step (kernels, the engine's copies, the event
waits between streams) without running any Python, so the host cost of launching kernels and of
the engine's hooks disappears. What the graph cannot do is change: every replay reads the same
input tensor and writes the same output and gradient tensors. :func:`capture_step` sets that
up the way PyTorch's CUDA graph notes recommend:

1. a few warm-up steps on a side stream (cuBLAS workspaces, autograd's device threads, and the
   offload engine's pinned host buffers are all made here, outside the capture);
2. gradients set to ``None``, so the captured backward *allocates* them in the graph's private
   memory pool and every replay overwrites them (instead of accumulating);
3. the capture, on the same side stream (cuBLAS keeps a workspace per stream: the warm-up's is
   reused rather than a new one made inside the graph), in which the step runs exactly once.

Replays then copy each new batch into :attr:`CapturedStep.static_input` first, and point every
parameter's ``.grad`` back at the gradients the graph writes, so ``zero_grad(set_to_none=True)``
between replays does no harm.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ..core.entries import _disabled_for_dynamo

__all__ = ["CapturedStep", "OffloadedLayer", "capture_step", "make_graphed_layers"]


@dataclass
class CapturedStep:
    """A training step captured in a CUDA graph.

    Attributes
    ----------
    graph:
        The captured graph.
    static_input:
        The tensor the graph reads its input from; :meth:`replay` copies new inputs into it.
    static_output:
        The tensor the graph writes the step's output to (overwritten by every replay).
    baseline_bytes:
        CUDA memory allocated just before the capture (weights, inputs, anything alive).
    peak_bytes:
        Peak CUDA memory allocated during the capture. Replays allocate nothing; they run in the
        memory the capture allocated, so this is the step's peak as the graph sees it.
    pool_bytes:
        Memory the caching allocator reserved for the graph's private pool during the capture.
    static_grads:
        ``(parameter, gradient)`` for every parameter the captured backward wrote a gradient to.
    """

    graph: torch.cuda.CUDAGraph
    static_input: torch.Tensor
    static_output: torch.Tensor
    baseline_bytes: int
    peak_bytes: int
    pool_bytes: int
    static_grads: list[tuple[nn.Parameter, torch.Tensor]]

    def replay(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """Copy ``x`` (when given) into the static input and replay the step; returns the output.

        The returned tensor and the parameters' ``.grad`` are the graph's own memory: copy them
        before the next replay if they must be kept. Each ``.grad`` is set back to the tensor the
        graph writes, in case it was cleared or replaced since the last replay.
        """
        if x is not None:
            if x.shape != self.static_input.shape or x.dtype != self.static_input.dtype:
                raise ValueError(
                    f"a captured step replays one shape: got {tuple(x.shape)} {x.dtype}, captured with "
                    f"{tuple(self.static_input.shape)} {self.static_input.dtype}"
                )
            with torch.no_grad():
                self.static_input.copy_(x)
        for p, grad in self.static_grads:
            p.grad = grad
        self.graph.replay()
        return self.static_output


@functools.lru_cache(maxsize=None)
def _warmup_stream(device: int) -> torch.cuda.Stream:
    """One warm-up stream per device: cuBLAS keeps a workspace per stream it has run on, so a
    new stream for every capture would leave another workspace (tens of MiB) behind each time."""
    return torch.cuda.Stream(device)


def _clear_grads(params: list[nn.Parameter], x: torch.Tensor) -> None:
    for p in params:
        p.grad = None
    x.grad = None


def capture_step(
    step: Callable[[torch.Tensor], torch.Tensor],
    example: torch.Tensor,
    params: Iterable[nn.Parameter],
    *,
    warmup: int = 3,
) -> CapturedStep:
    """Warm up ``step`` on a side stream, then capture one call of it in a CUDA graph.

    Parameters
    ----------
    step:
        Runs forward and backward for one input and returns the output, for example
        ``lambda x: training_step(layers, x, ctx, sync)``. It must not branch on tensor
        values or synchronize with the host: the capture records one run of it.
    example:
        An input of the shape and dtype every replay will use (its values are copied).
    params:
        The parameters whose gradients the step produces (cleared before the capture).
    warmup:
        Eager steps before the capture; at least 1, so that the offload engine's host buffers
        exist before the capture needs them.
    """
    if not example.is_cuda:
        raise ValueError("CUDA graphs need a CUDA device: the example input is on " + str(example.device))
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (buffers and workspaces are made eagerly), got {warmup}")
    params = list(params)
    static_input = example.detach().clone().requires_grad_(example.requires_grad)
    # Warm up on a side stream: the capture stream must not inherit half-finished eager work,
    # and some libraries make their workspaces on first use, which a capture cannot contain.
    side = _warmup_stream(example.device.index if example.device.index is not None else torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            _clear_grads(params, static_input)
            step(static_input)
    torch.cuda.current_stream().wait_stream(side)
    _clear_grads(params, static_input)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what torch.cuda.graph does on entry: measure the pool from there
    baseline, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = step(static_input)
    torch.cuda.synchronize()
    grads = [(p, p.grad) for p in params if p.grad is not None]
    return CapturedStep(
        graph, static_input, out, baseline, torch.cuda.max_memory_allocated(),
        torch.cuda.memory_reserved() - reserved, grads,
    )


class OffloadedLayer(nn.Module):
    """``layer`` called inside the offload context ``ctx``, its output through ``sync``: one entry of
    the context, as :func:`make_graphed_layers` captures it."""

    def __init__(self, layer: nn.Module, ctx: Any, sync: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.layer, self.ctx, self.sync = layer, ctx, sync

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.ctx:
            h = self.layer(x)
        return self.sync(h)


def _capture_stream() -> torch.cuda.Stream:
    """The stream ``torch.cuda.graph`` captures on by default (made here if no graph made it yet): a
    warm-up there leaves cuBLAS's workspace for that stream made before any capture needs it."""
    if torch.cuda.graph.default_capture_stream is None:
        torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
    return torch.cuda.graph.default_capture_stream


def make_graphed_layers(layers: Sequence[nn.Module], example: torch.Tensor, ctx: Any,
                        sync: Callable[[torch.Tensor], torch.Tensor], *, backend: str = "torch", warmup: int = 2,
                        copies_out: str = "between", **graph_options: Any
                        ) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """Capture each layer's forward and backward in CUDA graphs of their own, with offloading.

    Large-scale training captures per layer this way (one forward and one backward graph per layer,
    all sharing one memory pool) and runs the rest of the step eagerly. Each layer is wrapped in
    :class:`OffloadedLayer` and the context is told that captures hold single layers
    (``ctx.set_capture_scope("layer")``). A layer's copies back run inside the backward graphs, spread
    over those from its reload's start to its own. Its copies to the host run between the forward
    replays (``copies_out``): the returned layers queue them on the copy stream once the layer's forward
    graph has been replayed, and the graph that releases the layer waits for them. Replays run no engine
    code; the host buffers are the ones the warm-up made, the same in every replay.

    Parameters
    ----------
    layers:
        The model's layers in the order of the forward; each takes and returns one tensor.
    example:
        An input of the first layer, of the shape and dtype of every call (its values are not kept).
    ctx, sync:
        From :func:`~offload_examples.get_cpu_offload_context` with ``model_layers=len(layers)`` and
        ``retain_pinned_cpu_buffers=True`` (the graphs keep the buffers of the warm-up).
    backend:
        ``"torch"`` (:func:`torch.cuda.make_graphed_callables`) or ``"te"`` (Transformer Engine's
        ``make_graphed_callables``, for its layers and FP8 recipes).
    warmup:
        Eager training steps before the capture, in the order of a step (forwards, then backwards),
        on the capture stream: they make the host buffers and the libraries' workspaces, which a
        capture cannot. The parameters' gradients are set to ``None`` afterwards, and the CUDA
        random state is put back as it was before them, so dropout in the graphs draws what an
        eager step would have drawn.
    copies_out:
        ``"between"`` (the default): the copies to the host are left out of the graphs and run as above,
        back to back across the replays and the host's gaps between them; the host waits for a release's
        copies once it has queued the graph that releases them, so the backward is launched after them.
        ``"inside"``: they run inside the forward graphs, spread over those of the layers after it up to
        its release; each graph ends only once its share has ended, so a share longer than the graph's
        compute lengthens it. The returned layers are then the backend's graphed callables themselves.
    graph_options:
        Passed on to the backend's ``make_graphed_callables``. PyTorch's ``num_warmup_iters`` must
        stay 0: its warm-up runs one layer's forward and backward at a time, which is no step to the
        context.

    Returns
    -------
    list
        The graphed layers, to call in order in place of ``layers`` (modules: ``train()``, ``eval()`` and
        ``parameters()`` reach the graphed layer; in another training state than the captured one a layer
        runs eagerly).
    """
    if not example.is_cuda:
        raise ValueError(f"CUDA graphs need a CUDA device: the example input is on {example.device}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (host buffers and workspaces are made eagerly), got {warmup}")
    if backend not in ("torch", "te"):
        raise ValueError(f"backend must be 'torch' or 'te', got {backend!r}")
    if copies_out not in ("inside", "between"):
        raise ValueError(f"copies_out must be 'inside' or 'between', got {copies_out!r}")
    if backend == "torch" and graph_options.get("num_warmup_iters", 0) != 0:
        raise ValueError("num_warmup_iters must be 0 with backend='torch': its warm-up runs one layer's forward and "
                         "backward at a time, which is no training step to the offload context (use warmup=)")
    offloads = hasattr(ctx, "set_capture_scope")  # a disabled context is a null context
    if offloads and ctx.model_layers != len(layers):
        raise ValueError(f"the context expects model_layers={ctx.model_layers} entries a step, but {len(layers)} "
                         "layers are graphed")
    with torch.cuda.device(example.device):
        rng = torch.cuda.get_rng_state()
        if offloads:
            ctx.set_capture_scope("layer")
            if copies_out == "between":
                ctx._copy_between_replays()  # the layers returned below replay them
        try:
            graphed = _warm_up_and_capture(layers, example, ctx, sync, backend, warmup, rng, graph_options)
            if offloads and copies_out == "between":
                return _CopiesBetween(graphed, ctx, example.device).layers()
            return graphed
        finally:
            if offloads:  # eager steps and whole-step captures of this context go on as before
                ctx.set_capture_scope("step")


def _warm_up_and_capture(layers: Sequence[nn.Module], example: torch.Tensor, ctx: Any,
                         sync: Callable[[torch.Tensor], torch.Tensor], backend: str, warmup: int,
                         rng: torch.Tensor, graph_options: dict[str, Any]) -> list[Callable]:
    wrapped = tuple(OffloadedLayer(layer, ctx, sync) for layer in layers)
    params = [p for layer in layers for p in layer.parameters()]
    # torch's make_graphed_callables warms each callable up on its own (a forward and a backward of one
    # layer), which is not a step to the context: the warm-up here runs whole steps, and torch's is skipped.
    stream = _capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            h, inputs = example.detach().clone().requires_grad_(example.requires_grad), []
            for layer in wrapped:
                inputs.append(h.detach().clone().requires_grad_(h.requires_grad))
                h = layer(h)
            h.backward(torch.ones_like(h))
            for p in params:
                p.grad = None
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.cuda.set_rng_state(rng)
    samples = tuple((x,) for x in inputs)
    if backend == "torch":
        graph_options.setdefault("num_warmup_iters", 0)
        graphed = torch.cuda.make_graphed_callables(wrapped, samples, **graph_options)
    else:
        if "transformer_engine.pytorch" not in sys.modules:  # its layers would have imported it, before CUDA
            raise ModuleNotFoundError("backend='te' needs Transformer Engine's layers, and transformer_engine.pytorch "
                                      "imported before CUDA starts: pip install 'offload_examples[te]'")
        import transformer_engine.pytorch as te

        graphed = te.make_graphed_callables(wrapped, samples, **graph_options)
    return list(graphed)


class _CopiesBetween:
    """Per-layer graphs whose copies to the host run between their replays (``copies_out="between"``).

    The capture left each offloaded layer's storages in the graphs' memory pool, where every replay of the
    layer's forward graph writes them, and gave each a pinned host buffer (the engine's
    :meth:`~offload_examples.core.settings.EngineSettings._take_copies_between`). After that graph's replay the copy
    stream waits for the compute stream and copies them out; before the forward graph that releases the
    layer, whose capture may have put other tensors in that memory, the compute stream waits for the copies.
    Every later replay on the compute stream, the backward graphs' reloads from those buffers included,
    comes after that wait; and the next step's replay of the layer's graph, which writes the storages again,
    comes after this step's (a step that stopped before the release leaves its copies to the next step's first
    replay to wait for). Once that graph is queued the host waits for the copies as well, so that the step's
    backward is launched after them, not while they run.
    """

    def __init__(self, graphed: Sequence[nn.Module], ctx: Any, device: torch.device):
        copies, self.waits = ctx._take_copies_between()
        self.stream, self.device = ctx.streams.d2h, device
        self.graphed = list(graphed)
        # the storages as the graphs hold them: views of their memory, which the graphs' pool owns
        self.copies = {layer: [(_bytes_at(address, nbytes, device), host[:nbytes]) for address, nbytes, host in items]
                       for layer, items in copies.items() if items}
        self.ends: dict[int, torch.cuda.Event] = {}  # each layer's copies out, from its replay to its release
        self.releasing: list[torch.cuda.Event] = []  # those the graph replayed last waited for

    def layers(self) -> list[nn.Module]:
        return [_LayerBetween(self, i, layer) for i, layer in enumerate(self.graphed)]

    @_disabled_for_dynamo
    def before(self, i: int) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("layers graphed with copies_out='between' copy between their replays, so they cannot "
                               "be captured in another graph (make them with copies_out='inside')")
        compute = torch.cuda.current_stream(self.device)  # where the graphs replay, whatever device is current
        if i == 0:  # copies still unwaited for (a step that stopped before their release): their storages are
            for end in self.ends.values():  # the ones the replays from here on write
                compute.wait_event(end)
            self.ends.clear()
        # the copies out of the layers this graph releases: its replay may write their memory
        self.releasing = [end for layer in self.waits.get(i, ()) if (end := self.ends.pop(layer, None)) is not None]
        for end in self.releasing:
            compute.wait_event(end)

    @_disabled_for_dynamo
    def after(self, i: int) -> None:
        if i in self.copies:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the graph just replayed wrote them
            with torch.cuda.stream(self.stream), torch.no_grad():
                for device, host in self.copies[i]:
                    host.copy_(device, non_blocking=True)
                self.ends[i] = self.stream.record_event()
        # The host, too, waits for those copies once the graph that releases them is queued (the device has it and
        # the graphs before it to run meanwhile). Launched while they ran, the step's backward slowed them by about
        # a tenth (docs/evidence/h200-bench/copies_beside_a_step.json); launched after, it finds them done.
        for end in self.releasing:
            end.synchronize()
        self.releasing = []


class _LayerBetween(nn.Module):
    """Layer ``i`` of per-layer graphs whose copies run between the replays: the graphed layer (a submodule,
    so ``train()``, ``eval()`` and ``parameters()`` reach it), with the waits before its replay and the copies
    after. In another training state than the captured one the layer runs its eager forward (through the
    offload context, which offloads as in any eager step), no graph replays, and none of these copies or
    waits happen."""

    def __init__(self, copies: _CopiesBetween, i: int, layer: nn.Module):
        super().__init__()
        self.layer, self.i, self.captured_training = layer, i, layer.training
        self.copies = copies  # shared by the layers (not a module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.layer.training != self.captured_training:
            return self.layer(*args, **kwargs)
        self.copies.before(self.i)
        out = self.layer(*args, **kwargs)
        self.copies.after(self.i)
        return out


def _bytes_at(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of device memory at ``address`` that it does not own (a graph pool's)."""
    storage = torch._C._construct_storage_from_data_pointer(address, device, nbytes)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
