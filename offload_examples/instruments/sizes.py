"""The sizes every scenario is built from, declared once.

A scenario's config is a dataclass derived from :class:`ScenarioConfig` and from the groups of
fields it uses (:class:`TransformerSize`, :class:`MicroBatches`, :class:`Timing`). It declares only
its own fields, and a shared one again only where its default differs. Each group's ``SMALL`` says
what changes at the size that runs in seconds on a CPU; :meth:`ScenarioConfig.small` merges them
along the class's bases, the scenario's own ``SMALL`` last::

    @dataclass
    class MyConfig(TransformerSize, Timing, ScenarioConfig):
        layers: int = 20
        seq: int = 1024          # a shared field with another default

        SMALL = dict(layers=4, seq=16)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from offload_examples.instruments.cli import Need, Stack, check_sizes, default_device

__all__ = ["MicroBatches", "ScenarioConfig", "Timing", "TransformerSize"]

C = TypeVar("C", bound="ScenarioConfig")


@dataclass
class ScenarioConfig:
    """Base of every scenario's sizes: a dataclass whose field defaults are the full (GPU) size.

    A subclass sets ``SMALL``, the values that differ at the small size, and may override
    :meth:`check` for checks of its own. Every instance is checked as it is made
    (:func:`~offload_examples.instruments.cli.check_sizes`): a value that cannot run raises ``ValueError``.
    """

    seed: int = 0

    #: The small size: the fields whose value differs from the full size's default.
    SMALL: ClassVar[dict[str, Any]] = {}
    #: The field that ``offload`` must stay below (``None``: no such field).
    OFFLOAD_OF: ClassVar[str | None] = "layers"

    def __post_init__(self) -> None:
        check_sizes(self, offload_of=self.OFFLOAD_OF)
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` for values this scenario cannot run (beyond the shared checks)."""

    def device_problem(self, device: torch.device) -> str | None:
        """Why these values cannot run on ``device`` (the command line's one-line error), or ``None``."""
        return None

    def memory_need(self, device_type: str) -> Need:
        """The GPU and host memory a run of these sizes on ``device_type`` (``cuda`` or ``cpu``) needs,
        estimated from the sizes alone (see :func:`~offload_examples.instruments.cli.memory_error`); each scenario
        counts what it holds."""
        raise NotImplementedError(f"{type(self).__name__} does not estimate its memory")

    @classmethod
    def small_values(cls) -> dict[str, Any]:
        """Every ``SMALL`` along the class's bases, merged (a subclass's value wins)."""
        values: dict[str, Any] = {}
        for base in reversed(cls.__mro__):
            values.update(vars(base).get("SMALL", {}))
        return values

    @classmethod
    def small(cls: type[C], **changes: Any) -> C:
        """A size that runs in seconds on a CPU."""
        return cls(**{**cls.small_values(), **changes})

    @classmethod
    def for_device(cls: type[C], device: torch.device, **changes: Any) -> C:
        """The full size on a GPU, the small one elsewhere."""
        return cls(**changes) if device.type == "cuda" else cls.small(**changes)

    @classmethod
    def for_run(cls: type[C], config: C | None, device: torch.device | str | None) -> tuple[C, torch.device]:
        """What ``run(config, device)`` runs: ``device`` (default: cuda when available, else cpu) and
        ``config`` (default: the size for that device).

        Also asks cuBLAS for a fixed workspace: the scenarios compare gradients bit for bit, which
        needs cuBLAS to pick the same reduction order in both runs; it reads this setting when its
        first handle is made, so it only helps if nothing has run a matmul yet.
        """
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        device = torch.device(device or default_device())
        return config or cls.for_device(device), device


@dataclass
class TransformerSize:
    """A stack of transformer layers: width, attention heads, feed-forward width, tokens, dtype."""

    hidden: int = 1024
    heads: int = 8
    ffn: int = 4096
    seq: int = 2048
    dtype: str = "bfloat16"

    SMALL: ClassVar[dict[str, Any]] = dict(hidden=64, heads=4, ffn=256, seq=32, dtype="float32")

    def stack(self, layers: int, sequences: int, device_type: str) -> Stack:
        """``layers`` of the scenarios' transformer layers of these sizes, trained on ``sequences`` sequences
        on ``device_type``."""
        return Stack.transformer(layers, self.hidden, self.heads, self.ffn, sequences, self.seq, self.dtype, device_type)


@dataclass
class MicroBatches:
    """A pipeline's batch: ``microbatches`` micro-batches of ``micro_batch`` sequences each."""

    microbatches: int = 8
    micro_batch: int = 4

    SMALL: ClassVar[dict[str, Any]] = dict(micro_batch=2)


@dataclass
class Timing:
    """How many steps are measured (their median is reported) after ``warmup`` unmeasured ones."""

    steps: int = 5
    warmup: int = 2

    SMALL: ClassVar[dict[str, Any]] = dict(steps=2, warmup=1)
