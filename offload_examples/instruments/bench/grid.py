"""The grid: its models, and what a run measures of them.

A run measures every model of :data:`MODELS` it is given, and on each every strategy at every ``k``
of :class:`BenchConfig`; :func:`memory_need` is what that takes of the device and the host.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from offload_examples.instruments.cli import Need, SizeError, Stack, check_sizes
from offload_examples.instruments.bench.strategies import STRATEGIES

__all__ = ["MODELS", "BenchConfig", "ModelSpec", "memory_need"]


@dataclass(frozen=True)
class ModelSpec:
    """One model of the grid: ``N`` x (``nn.Linear`` + a pre-norm transformer layer)."""

    hidden: int
    heads: int
    ffn: int
    batch: int
    activation: str = "gelu"
    dropout: float = 0.0
    kind: str = "auto"
    note: str = ""

    def small(self) -> ModelSpec:
        """The same architecture at a size that runs in seconds on a CPU."""
        return dataclasses.replace(self, hidden=64, heads=4, ffn=256, batch=4, kind="torch")


#: The grid's models. ``A`` and ``B`` have the shapes of the measurements in the project's facts
#: file, so figures compare directly; ``A-torch`` is ``A`` with PyTorch's layer where ``A`` gets
#: Transformer Engine's; ``A-wide`` doubles the width (twice the compute per byte saved).
MODELS = {
    "A": ModelSpec(1024, 8, 4096, 16, note="GELU, no dropout (Transformer Engine's layer when installed)"),
    "A-torch": ModelSpec(1024, 8, 4096, 16, kind="torch", note="model A with torch layers: GELU, no dropout"),
    "B": ModelSpec(1024, 8, 4096, 16, activation="relu", dropout=0.1, kind="torch",
                   note="nn.TransformerEncoderLayer defaults: ReLU, dropout 0.1"),
    "A-wide": ModelSpec(2048, 16, 8192, 8, note="model A at twice the width, half the batch"),
}


@dataclass
class BenchConfig:
    """What to run. The defaults are the full grid for an 80 GB GPU.

    ``steps`` pairs of steps are measured per run (after ``warmup`` pairs); the runs the targets
    are checked on (model A, ``k`` = 2 and 4, the engine) measure ``target_steps`` pairs, since
    step-to-step noise on a GPU (a few percent) is larger than the 1% some targets resolve. ``graphed``: also
    time the engine inside CUDA graphs at ``k`` = 2 and 4 (the graphed column), on a GPU.
    """

    models: tuple[str, ...] = ("A", "A-torch", "B", "A-wide")
    ks: tuple[int, ...] = (1, 2, 3, 4, 6)
    strategies: tuple[str, ...] = STRATEGIES
    layers: int = 20
    seq: int = 2048
    dtype: str = "bfloat16"
    steps: int = 10
    warmup: int = 2
    target_steps: int = 40
    small: bool = False
    seed: int = 0
    graphed: bool = True

    @classmethod
    def tiny(cls, **changes: Any) -> BenchConfig:
        """A CPU-sized run: small models, ``k`` in (1, 2), few steps."""
        base = dict(models=("A", "B"), ks=(1, 2), layers=6, seq=32, dtype="float32", steps=2, warmup=1, small=True,
                    target_steps=2)
        return cls(**{**base, **changes})

    def __post_init__(self) -> None:
        check_sizes(self)
        if not (self.models and self.ks and self.strategies):
            raise ValueError("models, ks and strategies each need at least one value")
        if self.layers < 2:
            raise SizeError(f"layers must be at least 2 (k is between 1 and layers - 1), got {self.layers}",
                            layers=self.layers)
        unknown = [m for m in self.models if m not in MODELS] + [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown models or strategies {unknown}; models: {list(MODELS)}, "
                             f"strategies: {list(STRATEGIES)}")
        bad = [k for k in self.ks if not 1 <= k <= self.layers - 1]
        if bad:
            raise SizeError(f"every k must be between 1 and layers - 1 = {self.layers - 1}, got {bad}",
                            ks=self.ks, layers=self.layers)


def memory_need(config: BenchConfig, device_type: str) -> Need:
    """What the grid needs: its largest model's no-offload step (the models run one after another); on the
    host that model as built (float32), or the pinned buffers of the largest ``k`` and four steps' gradients."""
    specs = [MODELS[m].small() if config.small else MODELS[m] for m in config.models]
    stacks = [Stack.transformer(config.layers, spec.hidden, spec.heads, spec.ffn, spec.batch, config.seq, config.dtype,
                                device_type) for spec in specs]
    host = max(max(s.build_bytes, s.saved_bytes(max(config.ks)) + s.copies_bytes(4)) for s in stacks)
    return Need(max(s.step_bytes() for s in stacks), host)
