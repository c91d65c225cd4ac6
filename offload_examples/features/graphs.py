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
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

__all__ = ["CapturedStep", "capture_step"]


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
