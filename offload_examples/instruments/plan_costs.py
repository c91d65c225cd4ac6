"""What the planner needs, measured on this machine: each layer's costs and the copy link's speed.

:func:`measure_costs` runs training steps through an engine that offloads nothing (a probe: its
hooks count what every layer saves) with timing marks on the compute stream, and returns one
:class:`~offload_examples.features.planner.LayerCost` per layer: forward and backward time (median
over the steps), the bytes its forward keeps for backward, and the bytes of its input (what
recomputation keeps instead). :func:`measure_link` times pinned copies each way and both at once
on a GPU; on a CPU, where the engine's copies are host-to-host memory copies, it times those.

Typical use::

    costs, base = measure_costs(layers, x)
    chosen = plan(costs, measure_link(), budget_bytes=budget, base_bytes=base)
    ctx, sync, run_layers = apply_plan(chosen, layers)
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
from torch import nn

from offload_examples.core.api import get_cpu_offload_context
from offload_examples.features.planner import LayerCost, LinkCost
from offload_examples.instruments.measure import training_step
from offload_examples.instruments.timeline import per_layer_ms, record_layer_timeline

__all__ = ["measure_costs", "measure_link"]


def _zero(layers: Sequence[nn.Module], x: torch.Tensor) -> None:
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    x.grad = None


def measure_costs(layers: Sequence[nn.Module], x: torch.Tensor, steps: int = 3) -> tuple[list[LayerCost], int]:
    """One :class:`~offload_examples.features.planner.LayerCost` per layer, and the base bytes.

    The base bytes are what is allocated on the device before the step (weights, the input): the
    planner adds them to every predicted peak. The steps clear the ``.grad`` of the layers' parameters
    and of ``x`` (also when one fails): call it before accumulating gradients, not in the middle.
    ``steps`` timed steps follow one warm-up step; each
    layer's times are the median over them. On a CPU the times are host times of a CPU run: right
    for planning a CPU run, not a prediction for a GPU.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n = len(layers)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=0, model_layers=n, device=x.device)
    inputs: list[int] = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: inputs.append(args[0].untyped_storage().nbytes()))
             for layer in layers]

    def step() -> torch.Tensor:
        _zero(layers, x)
        inputs.clear()
        return training_step(layers, x, ctx, sync)

    try:
        step()  # warm-up: workspaces, caches, the allocator's blocks
        cuda = x.is_cuda
        if cuda:
            torch.cuda.synchronize(x.device)
        base = torch.cuda.memory_allocated(x.device) if cuda else 0
        runs = [per_layer_ms(record_layer_timeline(step, ctx), n) for _ in range(steps)]
    finally:
        for h in hooks:
            h.remove()
        _zero(layers, x)
    fwd = [statistics.median(r[0][i] for r in runs) for i in range(n)]
    bwd = [statistics.median(r[1][i] for r in runs) for i in range(n)]
    return [LayerCost(f, b, s.candidate_bytes, inp) for f, b, s, inp in zip(fwd, bwd, ctx.stats, inputs)], base


def measure_link(device: torch.device | str | None = None, nbytes: int = 256 * 2**20) -> LinkCost:
    """The copy link's speed in GB/s: pinned copies on a GPU, host memory copies on a CPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        from offload_examples.instruments.bandwidth import link_bandwidth

        bw = link_bandwidth(nbytes)
        return LinkCost(bw["d2h"], bw["h2d"], bw["both"])
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    gb_per_s = nbytes / min(times) / 1e9
    return LinkCost(gb_per_s, gb_per_s, gb_per_s)
