"""The FSDP scenario's sizes and options, checked as they are made, and the memory a run of them needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from offload_examples.instruments.cli import Need, SizeError
from offload_examples.instruments.sizes import ScenarioConfig, Timing, TransformerSize

__all__ = ["FsdpConfig", "Wrap"]

#: How the scenario wraps its layers: FSDP2's ``fully_shard`` on every layer, or ``DistributedDataParallel``.
Wrap = Literal["fsdp", "ddp"]


@dataclass
class FsdpConfig(TransformerSize, Timing, ScenarioConfig):
    """Sizes of the data-parallel scenario; the defaults are the full GPU size (per rank).

    Attributes
    ----------
    world:
        Processes, one per GPU (NCCL) or on the CPU (gloo); ``None``: every visible GPU, else 2.
    wrap:
        ``"fsdp"``: ``fully_shard`` on every layer and the root; ``"ddp"``: ``DistributedDataParallel``.
    layers:
        ``N``, the transformer layers of the stack; each enters the offload context once per step.
    offload:
        ``k``: the saved activations of the first ``offload`` layers go to host memory.
    batch:
        Sequences per rank and step (each rank draws its own).
    checkpoint:
        Recompute the last ``checkpoint`` layers in backward (``torch.utils.checkpoint``);
        ``None`` (or 0 on the command line): none.
    reshard_after_forward:
        FSDP2's option: free each layer's all-gathered parameters after its forward and gather
        them again for its backward (FSDP only).
    cpu_params:
        FSDP2's ``CPUOffloadPolicy``: sharded parameters, gradients and the optimizer step on the
        host, on top of activation offloading (FSDP on GPUs only).
    plan:
        Let the planner choose keep, offload or recompute for each layer (instead of ``offload``
        and ``checkpoint``): the fastest plan whose predicted peak of saved activations is at most
        this fraction of keeping them all (0 < plan <= 1), see
        :func:`~offload_examples.instruments.fsdp.measure.make_plan`; or a given plan, one letter per
        layer: ``K`` keep, ``O`` offload, ``R`` recompute (``"OORK"``).
    """

    world: int | None = None
    wrap: Wrap = "fsdp"
    layers: int = 12
    offload: int = 4
    batch: int = 16
    checkpoint: int | None = None
    reshard_after_forward: bool = True
    cpu_params: bool = False
    plan: float | str | None = None

    #: The small size, which runs in seconds on a CPU: what it changes here (the shared sizes have their own).
    SMALL = dict(world=2, layers=4, offload=2, batch=2)

    def memory_need(self, device_type: str) -> Need:
        """Per rank: the layers as built whole, then, for each of the two runs (whose steps take turns,
        so both models live at once), their shards of parameters, gradients and AdamW's two moments
        (whole, and DDP's buckets, with ``ddp``); two layers gathered, and a training step's
        activations; with a fraction ``plan`` rank 0 first measures a step of the whole layers. On the
        host the layers as built (float32), or the pinned buffers and both runs' gradients and updated
        parameters (and both runs' optimizer states with ``cpu_params``)."""
        s = self.stack(self.layers, self.batch, device_type)
        world = self.world or 1
        shard = s.param_bytes if self.wrap == "ddp" else s.param_bytes // world
        runs = 2
        weights = (runs * 5 * shard if self.wrap == "ddp"
                   else s.param_bytes + runs * 4 * shard + 2 * s.param_bytes // self.layers)
        device = max(weights + s.saved_bytes(self.layers + 1) + 3 * s.io_bytes,
                     s.step_bytes() if isinstance(self.plan, float) else 0)
        host = s.saved_bytes(self.offload) + 4 * shard + (runs * 4 * shard if self.cpu_params else 0)
        return Need(device, max(s.build_bytes, host), world)

    def check(self) -> None:
        if self.wrap not in ("fsdp", "ddp"):
            raise ValueError(f"wrap must be 'fsdp' or 'ddp', got {self.wrap!r}")
        if self.checkpoint is not None and self.checkpoint > self.layers:
            raise SizeError(f"checkpoint ({self.checkpoint}) must be at most layers ({self.layers})",
                            checkpoint=self.checkpoint, layers=self.layers)
        if self.wrap == "ddp" and not self.reshard_after_forward:
            raise ValueError("--no-reshard-after-forward is an FSDP option: DDP keeps whole parameters (use --wrap fsdp)")
        if self.wrap == "ddp" and self.cpu_params:
            raise ValueError("--cpu-params is FSDP's CPUOffloadPolicy: it needs --wrap fsdp")
        if isinstance(self.plan, str):
            if len(self.plan) != self.layers or set(self.plan) - set("KOR") or self.plan[-1] == "O":
                raise SizeError(f"plan {self.plan!r}: one letter per layer ({self.layers}) of K (keep), O (offload) "
                                "and R (recompute), the last not O", plan=self.plan, layers=self.layers)
        elif self.plan is not None and not 0 < self.plan <= 1:
            raise ValueError(f"plan is a fraction of the saved activations' peak, 0 < plan <= 1; got {self.plan}")
        if self.plan is not None and self.checkpoint is not None:
            raise ValueError("--plan chooses the recomputed layers itself: leave out --checkpoint")
