"""Stream safety on the GPU: reloads started on another stream must not be freed to that stream's pool.

The reproducer: the backward of an offloaded layer first sleeps on the compute stream, then reads
its reloaded tensor. The Python side of ``backward()`` returns long before the GPU gets there, and
autograd has already dropped the saved tensor. If the reload had been allocated on a side stream,
its block would go back to that stream's pool, and a tensor that the side stream allocates and
fills right away would overwrite it before the compute stream reads it: a silently wrong gradient.
"""

from __future__ import annotations

import pytest
import torch

from offload_examples import get_cpu_offload_context
from offload_examples.instruments.measure import free_memory

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _empty_cache():
    """Each test starts from an empty CUDA cache: a block that earlier tests left cached for the side
    stream could take the junk allocation instead of the block the engine gave back, and a broken
    engine would pass."""
    free_memory()
    yield

N = 1 << 22  # 16 MiB of float32: large enough to be offloaded, one exact block size


class SlowRead(torch.autograd.Function):
    """``y = 2 x``; the backward sleeps on its stream, then returns ``g * x`` (reads the saved x)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        torch.cuda._sleep(100_000_000)  # tens of milliseconds of GPU time before the read
        return g * x


def _overwrite_on(stream: torch.cuda.Stream, cuda) -> torch.Tensor:
    """What another part of the program does next on its own stream: allocate, fill."""
    with torch.cuda.stream(stream):
        return torch.full((N,), -1.0, device=cuda)


def test_gpu_manual_reload_started_inside_another_stream_is_read_safely(cuda):
    side = torch.cuda.Stream()
    inp = torch.rand(N, device=cuda) + 1.0  # every value >= 1: an overwrite by -1 cannot pass
    inp.requires_grad_()
    ctx, sync, synchronizer = get_cpu_offload_context(enabled=True, model_layers=2, manual_synchronization=True)
    for _ in range(3):
        with ctx:
            h = SlowRead.apply(inp * 1.0)  # saves an activation of N floats
        h = sync(h)
        synchronizer.start_offload_layer(0)
        with ctx:
            out = h + 1.0
        out = sync(out)
        synchronizer.release_activation_forward_gpu_memory(0)
        with torch.cuda.stream(side):  # e.g. a pipeline's P2P stream is current here
            synchronizer.start_reload_layer(0)
        out.sum().backward()
        junk = _overwrite_on(side, cuda)
        torch.cuda.synchronize()
        assert torch.equal(inp.grad, inp.detach()), "the backward read memory another stream had overwritten"
        inp.grad = None
        del junk


def test_gpu_default_reload_triggered_on_a_side_stream_is_read_safely(cuda):
    """A multi-stream model: the layer whose backward starts the reload ran on a side stream."""
    side = torch.cuda.Stream()
    inp = (torch.rand(N, device=cuda) + 1.0).requires_grad_()
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=4)
    # layer 0 is offloaded; its reload starts at the backward of layer 0 + max(1, 4 - 2 - 1) = 1
    for _ in range(3):
        with ctx:
            h = SlowRead.apply(inp * 1.0)
        h = sync(h)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # layer 1 runs on a side stream: so does its backward
            with ctx:
                h = h * 1.0
            h = sync(h)
        torch.cuda.current_stream().wait_stream(side)
        for _layer in (2, 3):
            with ctx:
                h = h * 1.0
            h = sync(h)
        out = h
        out.sum().backward()
        junk = _overwrite_on(side, cuda)
        torch.cuda.synchronize()
        assert torch.equal(inp.grad, inp.detach()), "the backward read memory another stream had overwritten"
        inp.grad = None
        del junk


def test_gpu_a_tensor_made_on_one_stream_and_saved_on_another_is_released_safely(cuda):
    """The tensor's block belongs to the compute stream's pool, but the layer that saves it runs on a
    side stream. When the release comes while the copy out is still queued (a busy link), the
    compute stream must not get the block back before the copy has read it."""
    compute, side, d2h = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()
    inp = (torch.rand(N, device=cuda) + 1.0).requires_grad_()
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4, offload_stream=d2h)
    for _ in range(3):
        with torch.cuda.stream(d2h):
            torch.cuda._sleep(200_000_000)  # the offload stream is busy: the copy out waits
        with ctx:
            h = inp * 1.0  # layer 0, on the compute stream
        h = sync(h)
        side.wait_stream(compute)
        with torch.cuda.stream(side):  # layer 1 runs on a side stream and saves h
            with ctx:
                h1 = SlowRead.apply(h)
            h1 = sync(h1)
        compute.wait_stream(side)
        del h
        with ctx:
            h2 = h1 + 1.0
        h2 = sync(h2)
        with ctx:  # entering layer 3 releases layer 1; the compute stream allocates right after
            junk = torch.full((N,), -1.0, device=cuda)
            h3 = h2 * 1.0
        h3 = sync(h3)
        h3.sum().backward()
        torch.cuda.synchronize()
        assert torch.equal(inp.grad, inp.detach()), "the copy out read memory the compute stream had reused"
        inp.grad = None
        del junk


def test_gpu_copy_streams_are_none_of_the_streams_callers_draw(cuda):
    """PyTorch's pooled streams come round again after 32 draws. However many a caller has drawn (the
    compute streams of a pipeline, torch.cuda.graph's capture stream), none of them is one of the
    engine's copy streams: copies on the caller's own stream would wait for its kernels."""
    drawn = {torch.cuda.Stream(cuda) for _ in range(32)}  # every stream of the default-priority pool
    for _ in range(40):  # more contexts than a pool holds streams
        ctx, _ = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=cuda)
        assert not {ctx.streams.d2h, ctx.streams.h2d} & drawn
        assert ctx.streams.d2h != ctx.streams.h2d and ctx.streams.d2h.priority < 0
