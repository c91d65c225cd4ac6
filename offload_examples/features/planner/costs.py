"""What a layer costs the planner: its times and saved bytes, its submodules, the copy link.

:func:`~offload_examples.instruments.plan_costs.measure_costs` measures these; the cost model
(:mod:`~offload_examples.features.planner.model`) and the search
(:mod:`~offload_examples.features.planner.search`) read them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "KEEP", "OFFLOAD", "OFFLOADED", "RECOMPUTE", "RECOMPUTED", "RECOMPUTE_OFFLOAD", "TIME_FIELDS", "Choice",
    "LayerCost", "LinkCost", "ModuleCost", "cap_in_modules",
    "available_host_bytes", "capped_bytes", "host_budget", "partial_caps",
]


class Choice(str, Enum):
    """What a plan does with one layer's saved activations: keep them, offload them, recompute them, or
    recompute them from an input that waits in host memory (``RECOMPUTE_OFFLOAD``: the layer is
    checkpointed and the engine offloads what the checkpoint keeps)."""

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"
    RECOMPUTE_OFFLOAD = "recompute+offload"

    def __str__(self) -> str:
        return self.value


#: The choices under shorter names.
KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_OFFLOAD = Choice.KEEP, Choice.OFFLOAD, Choice.RECOMPUTE, Choice.RECOMPUTE_OFFLOAD
#: The choices whose layer the engine offloads (its saved tensors, or the checkpoint's input).
OFFLOADED = (OFFLOAD, RECOMPUTE_OFFLOAD)
#: The choices whose layer runs its forward again in the backward.
RECOMPUTED = (RECOMPUTE, RECOMPUTE_OFFLOAD)


def _check(cls: str, name: str, value: Any, kind: type) -> None:
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and value >= 0):
        raise ValueError(f"{cls}.{name} must be a finite {kind.__name__} >= 0, got {value!r}")


def _check_quartiles(cost: Any, cls: str) -> None:
    """``cost.recompute_ms_quartiles``: ``None`` or two finite times, the lower first (a list read back
    from JSON becomes a tuple). Either may be below 0: they are differences of two runs' steps."""
    quartiles = cost.recompute_ms_quartiles
    if quartiles is None:
        return
    quartiles = tuple(quartiles)
    if len(quartiles) != 2 or not all(isinstance(q, (int, float)) and not isinstance(q, bool) and math.isfinite(q)
                                      for q in quartiles) or quartiles[0] > quartiles[1]:
        raise ValueError(f"{cls}.recompute_ms_quartiles must be None or (lower, upper), two finite times with "
                         f"lower <= upper, got {cost.recompute_ms_quartiles!r}")
    object.__setattr__(cost, "recompute_ms_quartiles", quartiles)


def _scaled(quartiles: tuple[float, float] | None, factor: float) -> tuple[float, float] | None:
    return None if quartiles is None else (quartiles[0] * factor, quartiles[1] * factor)


#: :class:`LayerCost`'s times, in milliseconds (the other fields are bytes).
TIME_FIELDS = ("forward_ms", "backward_ms", "offloaded_forward_ms", "offloaded_backward_ms", "recompute_ms")


@dataclass(frozen=True)
class ModuleCost:
    """Recomputing one submodule of a layer instead of the whole layer: what the layer then holds, and
    what it costs.

    Only the module's saved tensors are dropped and made again in the backward; what the rest of the
    layer saves stays on the device, and so does the module's input (checkpointing keeps it). A
    module whose input is large against what it saves (a linear layer) frees little; one that saves
    many intermediates from a small input (an MLP with its activation) frees much.
    """

    #: Its name inside the layer: ``layer.get_submodule(module)``.
    module: str
    #: What the layer's forward holds for its backward with the module recomputed.
    kept_bytes: int
    #: What the module's forward saves: held again, on top, while the layer's backward runs.
    module_bytes: int
    #: What recomputing it adds to the step (ms), counted in the layer's backward.
    recompute_ms: float
    # the spread behind recompute_ms, as LayerCost.recompute_ms_quartiles
    recompute_ms_quartiles: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.module, str) or not self.module:
            raise ValueError(f"ModuleCost.module must name a submodule (a non-empty str), got {self.module!r}")
        for name, kind in (("kept_bytes", int), ("module_bytes", int), ("recompute_ms", float)):
            _check("ModuleCost", name, getattr(self, name), kind)
        _check_quartiles(self, "ModuleCost")


@dataclass(frozen=True)
class LayerCost:
    """One layer's measured costs: compute time (ms) and what its forward holds for backward (bytes).

    The three optional times are measured where a choice changes more than the model's copies and
    recomputation account for: on a launch-bound step the engine's work per saved tensor, or the
    checkpoint's, is host time the GPU waits for. ``None`` means "as when kept" (and, for
    ``recompute_ms``, "the forward once more").
    """

    forward_ms: float
    backward_ms: float
    saved_bytes: int  # held from the forward to the backward when kept
    input_bytes: int  # held instead when recomputed (the layer's input)
    offloaded_forward_ms: float | None = None  # the forward's time when the layer is offloaded
    offloaded_backward_ms: float | None = None  # the backward's time when it is offloaded (its waits not counted)
    recompute_ms: float | None = None  # what recomputing the layer adds to its forward and backward together
    #: The bytes of each storage the engine would offload, in the order the forward first saves them
    #: (they add up to ``saved_bytes``): what a byte cap offloads (:func:`capped_bytes`). ``None``: the
    #: layer is offloaded whole or not at all.
    storage_bytes: tuple[int, ...] | None = None
    #: For each storage in ``storage_bytes``, the submodule (its name inside the layer) whose forward
    #: saved it first, the innermost one; ``""`` for the layer's own forward. What a byte cap offloads,
    #: said in modules (:func:`cap_in_modules`). ``None``: unknown.
    storage_modules: tuple[str, ...] | None = None
    #: Submodules that may be recomputed alone, each with what that keeps and costs (one per name).
    recompute_modules: tuple[ModuleCost, ...] = ()
    # the spread behind recompute_ms: the lower and upper quartiles (ms) over the rounds of what recomputing
    # added per layer, not clipped at 0 (a lower quartile below 0: noise as large as the cost); None: not measured
    recompute_ms_quartiles: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for name, kind in (("forward_ms", float), ("backward_ms", float), ("saved_bytes", int), ("input_bytes", int),
                           ("offloaded_forward_ms", float), ("offloaded_backward_ms", float), ("recompute_ms", float)):
            if getattr(self, name) is not None or kind is int or name in ("forward_ms", "backward_ms"):
                _check("LayerCost", name, getattr(self, name), kind)
        if self.storage_bytes is not None:  # a list read back from JSON becomes a tuple
            sizes = tuple(self.storage_bytes)
            object.__setattr__(self, "storage_bytes", sizes)
            for size in sizes:
                _check("LayerCost", "storage_bytes[i]", size, int)
            if sum(sizes) != self.saved_bytes:
                raise ValueError(f"LayerCost.storage_bytes add up to {sum(sizes)}, not saved_bytes={self.saved_bytes}")
        if self.storage_modules is not None:
            names = tuple(self.storage_modules)
            object.__setattr__(self, "storage_modules", names)
            if self.storage_bytes is None or len(names) != len(self.storage_bytes) \
                    or not all(isinstance(name, str) for name in names):
                raise ValueError("LayerCost.storage_modules must name one module (a str) per entry of storage_bytes")
        # dicts read back from JSON (dataclasses.asdict) become ModuleCost
        options = tuple(ModuleCost(**m) if isinstance(m, Mapping) else m for m in self.recompute_modules)
        object.__setattr__(self, "recompute_modules", options)
        if not all(isinstance(m, ModuleCost) for m in options) or len({m.module for m in options}) != len(options):
            raise ValueError("LayerCost.recompute_modules must be ModuleCost entries, one per module name")
        _check_quartiles(self, "LayerCost")

    def scaled(self, factor: float) -> LayerCost:
        """The same costs with every time multiplied by ``factor`` (the bytes unchanged)."""
        modules = tuple(dataclasses.replace(m, recompute_ms=m.recompute_ms * factor,
                                            recompute_ms_quartiles=_scaled(m.recompute_ms_quartiles, factor))
                        for m in self.recompute_modules)
        return dataclasses.replace(self, recompute_modules=modules,
                                   recompute_ms_quartiles=_scaled(self.recompute_ms_quartiles, factor),
                                   **{name: getattr(self, name) * factor for name in TIME_FIELDS
                                      if getattr(self, name) is not None})

    def module_cost(self, module: str) -> ModuleCost:
        """The entry of ``recompute_modules`` named ``module``; ``ValueError`` when there is none."""
        for m in self.recompute_modules:
            if m.module == module:
                return m
        known = ", ".join(m.module for m in self.recompute_modules) or "none"
        raise ValueError(f"no cost for recomputing the submodule {module!r} (measured: {known})")

    def recompute_terms(self, module: str | None = None) -> tuple[int, int, float]:
        """Recomputing the layer (``module=None``) or one submodule: ``(bytes held from the forward to
        the backward, bytes held again on top while the backward runs, ms added to the backward)``."""
        if module is None:
            return self.input_bytes, self.saved_bytes, self.recompute_extra_ms
        m = self.module_cost(module)
        return m.kept_bytes, m.module_bytes, m.recompute_ms

    @property
    def recompute_extra_ms(self) -> float:
        """What recomputing adds to the step, counted in the layer's backward."""
        return self.forward_ms if self.recompute_ms is None else self.recompute_ms

    def phase_ms(self, choice: Choice, module: str | None = None) -> tuple[float, float]:
        """``(forward ms, backward ms)`` of the layer under ``choice`` (``module``: the submodule a
        RECOMPUTE recomputes, ``None`` for the whole layer)."""
        if choice is OFFLOAD:
            return (self.forward_ms if self.offloaded_forward_ms is None else self.offloaded_forward_ms,
                    self.backward_ms if self.offloaded_backward_ms is None else self.offloaded_backward_ms)
        if choice in RECOMPUTED:  # RECOMPUTE_OFFLOAD's copies are the input's: the schedule times them
            return self.forward_ms, self.backward_ms + self.recompute_terms(module)[2]
        return self.forward_ms, self.backward_ms


def _taken(cost: LayerCost, cap: int) -> list[bool]:
    """Which of the layer's storages the engine offloads under ``cap``: in save order, each one that
    still fits (``max_offload_bytes_per_layer``)."""
    if cost.storage_bytes is None:
        raise ValueError("a byte cap needs the layer's LayerCost.storage_bytes (measure_costs records them)")
    total, taken = 0, []
    for size in cost.storage_bytes:
        taken.append(total + size <= cap)
        total += size if taken[-1] else 0
    return taken


def capped_bytes(cost: LayerCost, cap: int | None) -> int:
    """The bytes the engine offloads of a layer under a byte cap: its storages in save order, each
    while it still fits (``max_offload_bytes_per_layer``); ``saved_bytes`` without a cap."""
    if cap is None:
        return cost.saved_bytes
    return sum(size for size, t in zip(cost.storage_bytes, _taken(cost, cap)) if t)


def cap_in_modules(cost: LayerCost, cap: int) -> str | None:
    """What a byte cap offloads of a layer, in the names of the submodules that saved it.

    Each module whose storages the cap takes, in the order the forward first saves into them:
    ``"linear, transformer.self_attn, part of transformer.linear1"`` (``"(the layer's own forward)"``
    for what the layer saves outside its submodules; ``""`` when the cap takes nothing). ``None`` when
    ``cost.storage_modules`` is unknown.
    """
    if cost.storage_modules is None:
        return None
    counts: dict[str, list[int]] = {}  # module -> [storages taken, storages]
    for name, t in zip(cost.storage_modules, _taken(cost, cap)):
        counts.setdefault(name, [0, 0])
        counts[name][0] += t
        counts[name][1] += 1
    words = [("" if taken == total else "part of ") + (name or "(the layer's own forward)")
             for name, (taken, total) in counts.items() if taken]
    return ", ".join(words)


def partial_caps(cost: LayerCost) -> tuple[int, ...]:
    """The caps that offload part of a layer, each a different part: the sums of its first storages
    (the first one, the first two, ...), short of all of them. Under such a cap the engine takes
    exactly those storages: the next one does not fit, nor does any later one. Empty when the
    layer's storage sizes are unknown."""
    if cost.storage_bytes is None:
        return ()
    sums = itertools.accumulate(cost.storage_bytes)
    return tuple(sorted({c for c in sums if 0 < c < cost.saved_bytes}))


@dataclass(frozen=True)
class LinkCost:
    """Pinned copy bandwidth in GB/s (1e6 bytes per ms): each way, and in total with both at once."""

    d2h_gb_per_s: float
    h2d_gb_per_s: float
    both_gb_per_s: float

    def __post_init__(self) -> None:
        for name in ("d2h_gb_per_s", "h2d_gb_per_s", "both_gb_per_s"):
            _check("LinkCost", name, getattr(self, name), float)
            if getattr(self, name) == 0:
                raise ValueError(f"LinkCost.{name} must be > 0")


def host_budget(share: float = 0.5, processes: int | None = None) -> int:
    """A safe pinned host-memory budget for one process: ``share`` of the memory available now,
    divided among the ``processes`` of this node that offload (default: ``LOCAL_WORLD_SIZE``, which
    ``torchrun`` sets, else 1).

    Pinned pages cannot be swapped out, so a budget that takes all free memory starves the data
    loaders, the checkpoint writer and the OS, and the node fails in ways far from the cause; half of
    what is available leaves them room (:func:`available_host_bytes`). The processes of one node share
    its memory, so each gets its part.
    """
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share!r}")
    if processes is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "") or "1"
        if not local.isdigit() or int(local) < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE={local!r} is not a number of processes (an int >= 1): "
                             "host_budget divides the host's memory among them")
        processes = int(local)
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise ValueError(f"processes must be an int >= 1, got {processes!r}")
    return int(share * available_host_bytes()) // processes


def available_host_bytes() -> int:
    """What the host can allocate without swapping: Linux's ``MemAvailable`` (free plus reclaimable
    cache), or the free pages where ``/proc/meminfo`` is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

