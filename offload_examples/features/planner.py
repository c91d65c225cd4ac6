"""A memory budget in, the fastest plan out: keep, offload or recompute each layer.

The step modelled is :class:`~offload_examples.core.schedule.DefaultSchedule`'s: the forwards of layers
``0 .. N-1``, then their backwards in reverse. Per layer:

- ``KEEP``: its ``saved_bytes`` stay on the device from its forward to the end of its backward.
- ``RECOMPUTE``: only its ``input_bytes`` stay; its backward first re-runs the forward
  (``LayerCost.recompute_extra_ms`` more) and holds ``saved_bytes`` on top of the input while it runs.
- ``RECOMPUTE`` of one submodule (``Plan.modules``): the layer keeps what it saves outside that module
  and the module's input (:attr:`ModuleCost.kept_bytes`, measured with the module checkpointed); its
  backward re-runs the module's forward (:attr:`ModuleCost.recompute_ms` more) and holds what the module
  saves (:attr:`ModuleCost.module_bytes`) on top while it runs. The options come from
  ``LayerCost.recompute_modules`` (:func:`~offload_examples.instruments.plan_costs.measure_costs`
  measures them); :func:`apply_plan` wraps the module in checkpointing inside the unchanged layer.
- ``OFFLOAD``: its ``saved_bytes`` are copied out from the end of its forward and released, and
  reloaded, at :class:`SubsetSchedule`'s points (for the first ``k`` layers these are exactly
  ``DefaultSchedule(k, N)``'s; :func:`apply_plan` runs any set on the engine). A release waits for its copy
  out, a backward for its whole reload (the engine's backward starts on the tensors that come back
  first, so where reloads are the bound this errs long); copies run one at a time per direction
  (:meth:`DefaultSchedule.predict_step_ms`). Its forward and backward take
  ``LayerCost.offloaded_forward_ms`` and ``offloaded_backward_ms`` where they were measured. The last
  layer is never offloaded.
- ``OFFLOAD`` with a byte cap (``Plan.caps``), for the last offloaded layer only: the engine copies the
  storages it saves first, each while it fits under the cap (``max_offload_bytes_per_layer``), and the
  rest stay on the device as when kept. The sizes come from ``LayerCost.storage_bytes``; a cap tops up
  what the other layers free by just the bytes a budget still needs, with copies that may fit behind
  compute where a whole layer's would not. Where ``LayerCost.storage_modules`` is known, the plan
  also says which submodules saved what the cap takes (``Plan.parts``, :func:`cap_in_modules`).

Peak memory is ``base_bytes`` plus the most saved bytes resident at any phase
(:meth:`DefaultSchedule.simulate`, plus a recomputed layer's ``saved_bytes`` during its backward);
the step time is ``predict_step_ms`` with each layer's times under its choice
(:meth:`LayerCost.phase_ms`). :func:`simulate_plan` is that model; :func:`plan` and :func:`pareto` search it.

``LinkCost.both_gb_per_s`` never binds here: every release waits for its copy out and comes before
the last forward, every reload starts at a backward, so the two directions are never busy at once.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

from ..core.engine import OffloadEngine
from ..core.schedule import DefaultSchedule
from ..core.streams import resolve_device
from ..core.te_path import recompute_on_same_path

__all__ = [
    "KEEP", "OFFLOAD", "RECOMPUTE", "Checkpointed", "Choice", "LayerCost", "LinkCost", "ModuleCost", "Plan",
    "SubsetSchedule",
    "apply_plan", "cap_in_modules", "capped_bytes", "offload_schedule", "pareto", "partial_caps", "plan", "simulate_plan",
]

#: ``prefix_only=False`` tries all ``3^N`` plans; beyond this many layers it refuses.
EXHAUSTIVE_MAX_LAYERS = 10
#: Step times are compared rounded to this many decimals of a ms, so rounding noise makes no tie.
_DECIMALS = 9


class Choice(str, Enum):
    """What a plan does with one layer's saved activations: keep them, offload them or recompute them."""

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"

    def __str__(self) -> str:
        return self.value


#: The three choices under shorter names.
KEEP, OFFLOAD, RECOMPUTE = Choice.KEEP, Choice.OFFLOAD, Choice.RECOMPUTE


def _check(cls: str, name: str, value: Any, kind: type) -> None:
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and value >= 0):
        raise ValueError(f"{cls}.{name} must be a finite {kind.__name__} >= 0, got {value!r}")


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

    def __post_init__(self) -> None:
        if not isinstance(self.module, str) or not self.module:
            raise ValueError(f"ModuleCost.module must name a submodule (a non-empty str), got {self.module!r}")
        for name, kind in (("kept_bytes", int), ("module_bytes", int), ("recompute_ms", float)):
            _check("ModuleCost", name, getattr(self, name), kind)


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

    def scaled(self, factor: float) -> LayerCost:
        """The same costs with every time multiplied by ``factor`` (the bytes unchanged)."""
        modules = tuple(dataclasses.replace(m, recompute_ms=m.recompute_ms * factor) for m in self.recompute_modules)
        return dataclasses.replace(self, recompute_modules=modules,
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
        if choice is RECOMPUTE:
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


@dataclass(frozen=True)
class SubsetSchedule(DefaultSchedule):
    """:class:`DefaultSchedule`'s windows for any set of offloaded layers.

    With ``s_0 < ... < s_{k-1}`` offloaded (never layer ``N - 1``, so ``s_j < N - k + j``), ``s_j``
    is released when the forward of ``N - k + j`` starts and reloaded when the backward of
    ``min(N - 1, s_j + reload_lead)`` starts (the one needed first first;
    :meth:`~offload_examples.DefaultSchedule.reload_trigger`). For ``s_j = j`` these are
    DefaultSchedule's points.
    """

    layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        n, s = self.model_layers, self.layers
        if len(s) != self.num_layers or list(s) != sorted(set(s)) or any(not 0 <= i <= n - 2 for i in s):
            raise ValueError(f"layers must be {self.num_layers} distinct sorted indices in [0, {n - 2}], got {s!r}")

    def is_offloaded(self, layer: int) -> bool:
        return layer in self.layers

    @property
    def offloaded_layers(self) -> tuple[int, ...]:
        return self.layers


def offload_schedule(offloaded: Sequence[int], n: int) -> DefaultSchedule:
    """The engine's schedule offloading the layers ``offloaded`` of ``n``: :class:`DefaultSchedule`
    when they are the first ``k``, else :class:`SubsetSchedule`."""
    offloaded = list(offloaded)
    k = len(offloaded)
    return DefaultSchedule(k, n) if offloaded == list(range(k)) else SubsetSchedule(k, n, tuple(offloaded))


def simulate_plan(choices: Sequence[Choice | str], costs: Sequence[LayerCost], link: LinkCost,
                  base_bytes: int = 0, caps: Sequence[int | None] | None = None,
                  modules: Sequence[str | None] | None = None) -> tuple[int, float]:
    """``(peak_bytes, step_ms)`` that the model predicts for one choice per layer.

    ``caps``: per layer, the byte cap of an offloaded layer (``None``: all of it), as in ``Plan.caps``.
    ``modules``: per layer, the submodule a recomputed layer recomputes (``None``: the whole layer),
    as in ``Plan.modules``; it must be one of that layer's ``LayerCost.recompute_modules``.
    """
    choices = tuple(Choice(c) for c in choices)
    n = len(costs)
    if len(choices) != n or n == 0:
        raise ValueError(f"need one choice per layer ({n} layers, at least 1), got {len(choices)}")
    if choices[-1] is OFFLOAD:
        raise ValueError("the last layer cannot be offloaded: its backward runs first")
    caps = _checked_caps(caps, choices)
    modules = _checked_modules(modules, choices)
    sched = offload_schedule([i for i, c in enumerate(choices) if c is OFFLOAD], n)
    off = [capped_bytes(c, cap) if ch is OFFLOAD else 0 for c, ch, cap in zip(costs, choices, caps)]
    # a recomputed layer holds its kept bytes from its forward on, and its module's (or whole) saved bytes again in its backward
    terms = [c.recompute_terms(m) if ch is RECOMPUTE else None for c, ch, m in zip(costs, choices, modules)]
    kept = [{KEEP: c.saved_bytes, OFFLOAD: c.saved_bytes - o}[ch] if t is None else t[0]
            for c, ch, o, t in zip(costs, choices, off, terms)]
    points = sched.simulate(off, kept).points
    peak = max(total + (terms[j][1] if phase == "backward" and terms[j] is not None else 0)
               for phase, j, _, total in points)
    fwd, bwd = zip(*(c.phase_ms(ch, m) for c, ch, m in zip(costs, choices, modules)))
    ms = sched.predict_step_ms(fwd, bwd, off, link.d2h_gb_per_s, link.h2d_gb_per_s)
    return base_bytes + peak, ms


def _per_layer(values: Sequence[Any] | None, choices: tuple[Choice, ...], field: str, entry: str, must_be: str,
               ok: Any, only: Choice, participle: str) -> tuple[Any, ...]:
    """``values`` as one entry per layer (all ``None`` when not given): each ``None`` or, on a layer whose
    choice is ``only``, a value that ``ok`` accepts (``must_be`` says which)."""
    if values is None or len(values) == 0:
        return (None,) * len(choices)
    values = tuple(values)
    if len(values) != len(choices):
        raise ValueError(f"need one {entry} (or None) per layer ({len(choices)} layers), got {len(values)}")
    for i, (value, ch) in enumerate(zip(values, choices)):
        if value is not None:
            if not ok(value):
                raise ValueError(f"{field}[{i}] must be {must_be} or None, got {value!r}")
            if ch is not only:
                raise ValueError(f"{field}[{i}] is set but layer {i} is not {participle} ({ch.value})")
    return values


def _checked_modules(modules: Sequence[str | None] | None, choices: tuple[Choice, ...]) -> tuple[str | None, ...]:
    """``modules`` as one entry per layer (all ``None`` when not given); a name only on a recomputed layer."""
    return _per_layer(modules, choices, "modules", "module name", "a submodule's name (a non-empty str)",
                      lambda name: isinstance(name, str) and bool(name), RECOMPUTE, "recomputed")


def _checked_caps(caps: Sequence[int | None] | None, choices: tuple[Choice, ...]) -> tuple[int | None, ...]:
    """``caps`` as one entry per layer (all ``None`` when not given); a cap only on an offloaded layer."""
    return _per_layer(caps, choices, "caps", "cap", "an int >= 1",
                      lambda cap: isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1, OFFLOAD, "offloaded")


@dataclass(frozen=True)
class Plan:
    """One choice per layer and what the model predicts for it.

    When ``feasible`` is False no plan fits ``budget_bytes``: the choices are then those of the plan
    with the lowest peak, and ``why`` says by how much it misses. ``caps`` holds, per layer, the byte
    cap of an offloaded layer that offloads only part of what it saves (``None``: all of it, and for
    every layer not offloaded); :func:`apply_plan` hands them to the engine. ``modules`` holds, per
    layer, the submodule a recomputed layer recomputes (``None``: the whole layer, and for every layer
    not recomputed); :func:`apply_plan` checkpoints that module inside the layer.
    """

    choices: tuple[Choice, ...]
    predicted_peak_bytes: int
    predicted_step_ms: float
    feasible: bool = True
    why: str = ""
    budget_bytes: int | None = None
    caps: tuple[int | None, ...] = ()
    #: Per layer, what its cap offloads in module names (:func:`cap_in_modules`), or ``None`` (no cap,
    #: or the modules unknown). :func:`plan` fills it in; printing the plan shows it.
    parts: tuple[str | None, ...] = ()
    modules: tuple[str | None, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(Choice(c) for c in self.choices))
        object.__setattr__(self, "caps", _checked_caps(self.caps, self.choices))
        object.__setattr__(self, "modules", _checked_modules(self.modules, self.choices))
        parts = tuple(self.parts) or (None,) * len(self.choices)
        if len(parts) != len(self.choices) or any(p is not None and (cap is None or not isinstance(p, str))
                                                  for p, cap in zip(parts, self.caps)):
            raise ValueError("parts must have one entry per layer, and a str only where the layer has a cap")
        object.__setattr__(self, "parts", parts)

    @property
    def offload_prefix(self) -> int | None:
        """``k`` when exactly the first ``k`` layers are offloaded (``num_layers`` for the engine), else None."""
        k = self.choices.count(OFFLOAD)
        return k if all(c is OFFLOAD for c in self.choices[:k]) else None

    @property
    def recomputed(self) -> tuple[int, ...]:
        """The layers recomputed, whole or one submodule of them."""
        return tuple(i for i, c in enumerate(self.choices) if c is RECOMPUTE)

    @property
    def recomputed_modules(self) -> dict[int, str]:
        """``{layer: submodule}`` of the layers that recompute one submodule, not the whole layer."""
        return {i: name for i, name in enumerate(self.modules) if name is not None}

    @property
    def capped(self) -> dict[int, int]:
        """``{layer: cap}`` of the layers that offload only part of what they save."""
        return {i: cap for i, cap in enumerate(self.caps) if cap is not None}

    def to_dict(self) -> dict[str, Any]:
        return {"choices": [c.value for c in self.choices], "predicted_peak_bytes": self.predicted_peak_bytes,
                "predicted_step_ms": self.predicted_step_ms, "feasible": self.feasible, "why": self.why,
                "budget_bytes": self.budget_bytes, "caps": list(self.caps), "parts": list(self.parts),
                "modules": list(self.modules)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(tuple(data["choices"]), int(data["predicted_peak_bytes"]), float(data["predicted_step_ms"]),
                   bool(data["feasible"]), str(data.get("why", "")), data.get("budget_bytes"),
                   tuple(data.get("caps") or ()), tuple(data.get("parts") or ()), tuple(data.get("modules") or ()))

    def describe(self, layer: int) -> str:
        """``layer``'s choice in words: ``offload``, ``offload up to 96.00 MiB``, ``recompute mlp``, ``keep``..."""
        cap, module = self.caps[layer], self.modules[layer]
        if module is not None:
            return f"{self.choices[layer].value} {module}"
        if cap is None:
            return self.choices[layer].value
        return f"{self.choices[layer].value} up to " + (f"{cap / 2**20:.2f} MiB" if cap >= 2**20 else f"{cap} bytes")

    def summary(self) -> str:
        """``offload 0-1, offload up to 96.00 MiB 2, recompute 3-5, recompute mlp 6, keep 7-11``: each
        choice with its layers, as ranges."""
        groups: dict[str, list[list[int]]] = {}
        for i in range(len(self.choices)):
            runs = groups.setdefault(self.describe(i), [])
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        order = [OFFLOAD.value, RECOMPUTE.value, KEEP.value]  # capped offloads right after the whole ones
        named = sorted(groups, key=lambda d: (order.index(d.split()[0]), d != d.split()[0]))
        return ", ".join(f"{d} " + " ".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in groups[d])
                         for d in named)

    def __str__(self) -> str:
        mib = 2**20
        budget = "" if self.budget_bytes is None else f" (budget {self.budget_bytes / mib:.2f} MiB)"
        head = [(f"plan for {len(self.choices)} layers: peak {self.predicted_peak_bytes / mib:.2f} MiB{budget}, "
                 f"step {self.predicted_step_ms:.3f} ms")]
        if not self.feasible:
            head.append(f"infeasible: {self.why}")
        rows = [f"{i:5d}  {self.describe(i)}" + (f": {part}" if part else "") for i, part in enumerate(self.parts)]
        return "\n".join(head + ["layer  choice"] + rows)


def _nondominated(items: list[tuple], dims: int) -> list[tuple]:
    """Items that no other item beats or equals in all of its first ``dims`` (2 or 3) entries, all
    minimised; sorting on the other entries (but the last) breaks ties: the first of equals stays.

    Sorted by the first entry, an item is dominated when one kept before it has entries 2 and 3 no
    greater: a staircase of those pairs (the second increasing, the third decreasing) answers that.
    """
    kept: list[tuple] = []
    seconds: list[float] = []
    thirds: list[float] = []
    for it in sorted(items, key=lambda s: s[:-1]):
        a, b = it[1], (it[2] if dims == 3 else 0)
        i = bisect.bisect_right(seconds, a)
        if i and thirds[i - 1] <= b:
            continue
        lo = i - 1 if i and seconds[i - 1] == a else i
        hi = i
        while hi < len(thirds) and thirds[hi] >= b:
            hi += 1
        seconds[lo:hi], thirds[lo:hi] = [a], [b]
        kept.append(it)
    return kept


def _options(cost: LayerCost) -> list[tuple[Choice, str | None, int, int, float]]:
    """What a layer after the offloaded ones may do: ``(choice, module, bytes held from its forward to its
    backward, bytes held again on top during its backward, ms added to its backward)``, keeping first."""
    return [(KEEP, None, cost.saved_bytes, 0, 0.0),
            *((RECOMPUTE, m, *cost.recompute_terms(m)) for m in (None, *(o.module for o in cost.recompute_modules)))]


def _prefix_front(costs: Sequence[LayerCost], link: LinkCost, k: int, cap: float,
                  last_cap: int | None = None) -> list[tuple]:
    """``(step_ms, peak_saved_bytes, changes, choices, (caps, modules))`` of the non-dominated plans with the
    first ``k`` layers offloaded (layer ``k - 1`` under the byte cap ``last_cap``, if given), the others
    kept or recomputed (whole or one submodule: :func:`_options`), and at most ``cap`` bytes resident."""
    n = len(costs)
    sched = DefaultSchedule(k, n)
    caps = tuple(last_cap if i == k - 1 else None for i in range(n))
    off = [capped_bytes(c, caps[i]) if i < k else 0 for i, c in enumerate(costs)]
    left = [c.saved_bytes - o if i < k else 0 for i, (c, o) in enumerate(zip(costs, off))]  # what a cap keeps
    points = sched.simulate(off, left).points
    fixed = max((total for _, j, _, total in points if j < k), default=0)  # no other layer is held there
    resident = {(phase, j): total for phase, j, _, total in points}  # layers 0 .. k-1's bytes on the device
    if fixed > cap:
        return []
    fwd, bwd = zip(*(c.phase_ms(OFFLOAD if i < k else KEEP) for i, c in enumerate(costs)))

    def step_ms(lengthen: int | None = None, by: float = 0.0) -> float:
        b = [x + (by if i == lengthen else 0.0) for i, x in enumerate(bwd)]
        return sched.predict_step_ms(fwd, b, off, link.d2h_gb_per_s, link.h2d_gb_per_s)

    # step time = max over g of cut[g] + (recompute ms of layers > g): see plan(). cut[g] is read off
    # by lengthening the backward of layer g + 1 by more than the whole step.
    bump = step_ms() + 1.0
    cut = {g: round(step_ms(g + 1, bump) - bump, _DECIMALS) for g in range(k - 1, n - 1)}
    cut[n - 1] = round(step_ms(), _DECIMALS)
    # (alpha, peak so far, bytes held by layers k..j, recomputes, options taken: (choice, module) per layer)
    states = [(cut[k - 1], fixed, 0, 0, ())]
    for j in range(k, n):
        new = []
        for choice, module, keeps, again, extra_ms in _options(costs[j]):
            rec = choice is RECOMPUTE
            for alpha, peak, held, nrec, ch in states:
                h = held + keeps
                p = max(peak, resident[("forward", j)] + h, resident[("backward", j)] + h + again)
                if p <= cap:
                    a = round(max(alpha + extra_ms, cut[j]), _DECIMALS)
                    new.append((a, p, h, nrec + rec, ch + ((choice, module),)))
        if j < n - 1:
            states = _nondominated(new, 3)
        else:  # what the layers hold matters no more after the last one: equals go to fewer changes
            states = [(a, p, h, r, ch) for a, p, r, h, ch in _nondominated([(a, p, r, h, ch) for a, p, h, r, ch in new], 3)]
    return [(alpha, peak, k + nrec, (OFFLOAD,) * k + tuple(c for c, _ in ch), (caps, (None,) * k + tuple(m for _, m in ch)))
            for alpha, peak, _, nrec, ch in states]


def _caps_to_try(costs: Sequence[LayerCost], last: int | None, partial: bool) -> tuple[int | None, ...]:
    """The caps to try on the last offloaded layer ``last`` (``None`` when nothing is offloaded): none,
    and with ``partial`` each of :func:`partial_caps` (that layer's copies have the least compute to
    hide behind)."""
    return (None, *(partial_caps(costs[last]) if partial and last is not None else ()))


def _last_caps(costs: Sequence[LayerCost], choices: tuple[Choice, ...], partial: bool) -> list[tuple[int | None, ...]]:
    """:func:`_caps_to_try` of ``choices``' last offloaded layer, each as one entry per layer."""
    last = max((i for i, c in enumerate(choices) if c is OFFLOAD), default=None)
    return [tuple(cap if i == last else None for i in range(len(choices)))
            for cap in _caps_to_try(costs, last, partial)]


def _every_plan(costs: Sequence[LayerCost], partial: bool):
    """``(choices, caps, modules)`` of every plan: any set of offloaded layers, every recompute option."""
    per_layer = [[(OFFLOAD, None)] + [(c, m) for c, m, *_ in _options(cost)] for cost in costs]
    for picked in itertools.product(*per_layer):
        ch, modules = tuple(c for c, _ in picked), tuple(m for _, m in picked)
        if ch[-1] is not OFFLOAD:
            for caps in _last_caps(costs, ch, partial):
                yield ch, caps, modules


def _front(costs: Sequence[LayerCost], link: LinkCost, base_bytes: int, cap: float,
           prefix_only: bool, partial: bool) -> list[tuple]:
    """Non-dominated ``(rounded step_ms, peak_bytes, changes, step_ms, (choices, caps, modules))`` with peak <= ``cap``."""
    n = len(costs)
    if prefix_only:
        found = [f for k in range(n) for last in _caps_to_try(costs, k - 1 if k else None, partial)
                 for f in _prefix_front(costs, link, k, cap - base_bytes, last)]
        found = [(f[3], *f[4]) for f in _nondominated(found, 2)]  # then re-simulated: the numbers reported
    elif n > EXHAUSTIVE_MAX_LAYERS:
        raise ValueError(f"prefix_only=False tries all 3^N plans: N={n} > {EXHAUSTIVE_MAX_LAYERS} layers is "
                         "too many (and the engine offloads only the first k layers)")
    elif math.prod(3 + len(c.recompute_modules) for c in costs) > 3 ** EXHAUSTIVE_MAX_LAYERS:
        raise ValueError(f"prefix_only=False tries every plan: with the submodules that may be recomputed there are "
                         f"more than 3^{EXHAUSTIVE_MAX_LAYERS} of them")
    else:
        found = _every_plan(costs, partial)
    out = []
    for ch, caps, modules in found:
        peak, ms = simulate_plan(ch, costs, link, base_bytes, caps, modules)
        if peak <= cap:
            out.append((round(ms, _DECIMALS), peak, sum(c is not KEEP for c in ch), ms, (ch, caps, modules)))
    return _nondominated(out, 2)


def _validate(costs: Sequence[LayerCost], link: LinkCost, base_bytes: int) -> list[LayerCost]:
    costs = list(costs)
    if not costs or not all(isinstance(c, LayerCost) for c in costs):
        raise ValueError("costs must be a non-empty sequence of LayerCost")
    if not isinstance(link, LinkCost):
        raise TypeError(f"link must be a LinkCost, got {type(link).__name__}")
    _check("plan", "base_bytes", base_bytes, int)
    return costs


def _undo_free_recomputations(choices: tuple[Choice, ...], caps: tuple[int | None, ...], modules: tuple[str | None, ...],
                              costs: Sequence[LayerCost], link: LinkCost, base_bytes: int, rounded_ms: float,
                              peak: int) -> tuple[tuple[Choice, ...], tuple[str | None, ...]]:
    """``(choices, modules)`` with every RECOMPUTE (whole or of a submodule) turned back into KEEP where
    that costs neither time nor peak.

    The search drops a state when another holds fewer bytes at equal time and peak; a recomputation
    that frees bytes no later layer needs can so win a tie with KEEP. Undoing it here makes the
    documented tie-break (fewer changes) hold for every plan.
    """
    out, names = list(choices), list(modules)
    for i, c in enumerate(out):
        if c is RECOMPUTE:
            trial, trial_names = out[:i] + [KEEP] + out[i + 1:], names[:i] + [None] + names[i + 1:]
            p, ms = simulate_plan(trial, costs, link, base_bytes, caps, trial_names)
            if p <= peak and round(ms, _DECIMALS) <= rounded_ms:
                out, names = trial, trial_names
    return tuple(out), tuple(names)


def plan(costs: Sequence[LayerCost], link: LinkCost, budget_bytes: int, base_bytes: int = 0,
         prefix_only: bool = True, partial: bool = True) -> Plan:
    """The fastest predicted plan whose predicted peak is <= ``budget_bytes``.

    Step times are compared rounded to ``10**-_DECIMALS`` ms. Ties go to the lower peak, then to fewer
    layers changed from KEEP (a RECOMPUTE that buys neither time nor peak is undone), so a budget no
    plan beats on time and peak gives every layer KEEP. No plan fitting gives
    ``feasible=False``, the lowest-peak plan, and ``why``.

    Algorithm (``prefix_only=True``, the sets the engine runs): for each ``k`` in ``0 .. N-1`` the
    first ``k`` layers are offloaded and a dynamic program walks layers ``k .. N-1`` in forward
    order choosing KEEP or RECOMPUTE. Two facts make the walk exact:

    - Memory. At every phase the resident bytes are those of the offloaded layers (fixed by ``k``:
      ``DefaultSchedule.simulate``) plus ``held``, what layers ``k .. j`` hold (+ a recomputed
      layer's ``saved_bytes`` during its backward), so the peak so far and ``held`` decide what the
      remaining layers can do, and less of either is never worse.
    - Time. ``predict_step_ms`` is a longest path over the phases. The backwards of layers
      ``N-1 .. k`` run first and wait for nothing, so every path through them covers a suffix
      ``N-1 .. g+1``: the step is ``max_g cut[g] + sum(recompute_extra_ms of recomputed layers > g)``
      for ``g`` in ``k-1 .. N-1``, with ``cut[g]`` the same maximum with nothing recomputed (read
      off ``predict_step_ms``). Walking up, ``alpha = max_{g<j} cut[g] + sum(recomputed in g+1..j-1)``
      is all the past contributes, and a lower alpha is never worse.

    A state ``(alpha, peak, held)`` beaten or equalled in all three by another is dropped, so the
    result is optimal under :func:`simulate_plan` (the tests check it against all plans by brute
    force). Cost: ``O(N^2)`` calls of ``predict_step_ms`` plus about ``O(N F log F)`` per ``k``, ``F``
    the number of states kept. No polynomial bounds ``F`` (the choice contains 0/1 knapsack, so
    no exact search is polynomial); measured for :func:`pareto` on a CPU: ``F = N + 1`` for
    identical layers (N = 96: 2.4 s), 176 for 48 layers of two kinds, 3,600 for 64 layers of random
    costs (9 s).

    ``prefix_only=False`` allows any set of offloaded layers (:class:`SubsetSchedule`, which
    :func:`apply_plan` runs) and tries every plan: exact, for up to :data:`EXHAUSTIVE_MAX_LAYERS` layers.

    With ``partial`` (the default) the last offloaded layer may also offload only its first
    storages (a byte cap from :func:`partial_caps`; layers whose ``storage_bytes`` are unknown are
    offloaded whole): the search above runs once more for each such cap, and stays exact over
    plans whose one capped layer's cap is such a sum (a cap that makes the engine skip a large
    early storage for a later small one is not tried). Ties go to the plan without a cap. The time
    grows with the caps tried: 48 layers of 30 storages each took 9 s against 0.4 s with
    ``partial=False`` (the timings above are without caps).
    """
    costs = _validate(costs, link, base_bytes)
    _check("plan", "budget_bytes", budget_bytes, int)
    front = _front(costs, link, base_bytes, budget_bytes, prefix_only, partial)
    if front:
        rounded, peak, _, ms, (ch, caps, modules) = front[0]
        ch, modules = _undo_free_recomputations(ch, caps, modules, costs, link, base_bytes, rounded, peak)
        peak, ms = simulate_plan(ch, costs, link, base_bytes, caps, modules)
        return Plan(ch, peak, ms, True, "", budget_bytes, caps, _parts(costs, caps), modules)
    _, peak, _, ms, (ch, caps, modules) = min(_front(costs, link, base_bytes, math.inf, prefix_only, partial),
                                              key=lambda p: p[1::-1])
    if base_bytes > budget_bytes:
        why = f"base_bytes={base_bytes} alone exceed the budget of {budget_bytes} bytes"
    else:
        lowest = Plan(ch, peak, ms, caps=caps, modules=modules).summary()
        why = (f"even the plan with the lowest peak ({lowest}) needs {peak} bytes > budget {budget_bytes} "
               f"bytes ({base_bytes} of them base_bytes)" + ("; OFFLOAD limited to a prefix" if prefix_only else ""))
    return Plan(ch, peak, ms, False, why, budget_bytes, caps, _parts(costs, caps), modules)


def _parts(costs: Sequence[LayerCost], caps: tuple[int | None, ...]) -> tuple[str | None, ...]:
    return tuple(None if cap is None else cap_in_modules(c, cap) for c, cap in zip(costs, caps))


def pareto(costs: Sequence[LayerCost], link: LinkCost, base_bytes: int = 0, prefix_only: bool = True,
           partial: bool = True) -> list[Plan]:
    """Every plan that no other beats on both predicted peak and step time, by increasing peak.

    Same search as :func:`plan` without a budget; for each budget, :func:`plan` returns one of these.
    """
    costs = _validate(costs, link, base_bytes)
    front = _front(costs, link, base_bytes, math.inf, prefix_only, partial)
    return [Plan(ch, peak, ms, caps=caps, parts=_parts(costs, caps), modules=modules)
            for _, peak, _, ms, (ch, caps, modules) in sorted(front, key=lambda p: p[1::-1])]


def _checkpointed(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` under non-reentrant checkpointing, one tensor passed once.

    The recomputation gets each tensor checkpoint kept as a new object: a module that tests its
    arguments for identity would then compute something else than the first time
    (``nn.MultiheadAttention`` projects ``query is key is value`` in one matmul, else in three), and
    checkpointing refuses what it recomputes. So a tensor given in several places goes in once.
    """
    from torch.utils.checkpoint import checkpoint

    unique = list({id(a): a for a in args if isinstance(a, torch.Tensor)}.values())
    where = {id(t): j for j, t in enumerate(unique)}
    spec = [(where[id(a)], None) if isinstance(a, torch.Tensor) else (None, a) for a in args]

    def run(*tensors: torch.Tensor, **kw: Any) -> Any:
        return function(*(a if j is None else tensors[j] for j, a in spec), **kw)

    return checkpoint(run, *unique, use_reentrant=False, context_fn=recompute_on_same_path, **kwargs)


class Checkpointed(nn.Module):
    """Wrap a layer, or one submodule of it, in activation recomputation (``torch.utils.checkpoint``,
    non-reentrant).

    Without ``module`` only the layer's input is kept for backward and its forward runs again during
    backward. With ``module`` (a name for ``layer.get_submodule``) the layer runs as it is, except that
    that submodule's forward is checkpointed: the layer keeps what it saves outside the module, the
    module keeps only its inputs, and its forward runs again when the backward reaches it. The layer
    is not changed: the submodule's ``forward`` is replaced only while the layer's forward runs, so its
    parameters, hooks and ``state_dict`` keys stay as they are. Either recomputation takes the path
    Transformer Engine's layers took the first time
    (:func:`~offload_examples.core.te_path.recompute_on_same_path`).
    """

    def __init__(self, layer: nn.Module, module: str | None = None):
        super().__init__()
        self.layer = layer
        self.module = module
        if module is not None:
            if not isinstance(module, str) or not module:
                raise ValueError(f"module must name a submodule of the layer (a non-empty str), got {module!r}")
            layer.get_submodule(module)  # an unknown name fails here, not in the first step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.module is None:
            return _checkpointed(self.layer, *args, **kwargs)
        sub = self.layer.get_submodule(self.module)
        own = sub.__dict__.get("forward")  # a forward someone set on the instance: put back afterwards
        original = sub.forward
        # the recomputation calls `original` again, not `sub`: its hooks ran once, around the first call
        sub.forward = functools.partial(_checkpointed, original)
        try:
            return self.layer(*args, **kwargs)
        finally:
            if own is None:
                del sub.forward
            else:
                sub.forward = own

    def extra_repr(self) -> str:
        return "" if self.module is None else f"module={self.module!r}"


def apply_plan(chosen: Plan, layers: Sequence[nn.Module], device: torch.device | str | None = None,
               **engine_options: Any) -> tuple[OffloadEngine, Any, list[nn.Module]]:
    """A plan made runnable: ``(ctx, sync, layers)`` for the usual loop.

    The returned layers are ``layers`` with every recomputed one wrapped in :class:`Checkpointed` (the
    whole layer, or the submodule ``chosen.modules`` names); ``ctx`` offloads exactly the plan's
    offloaded layers, at :class:`SubsetSchedule`'s points (the engine's default schedule when they
    are the first ``k``)::

        ctx, sync, run_layers = apply_plan(chosen, model.layers)
        for layer in run_layers:
            with ctx:
                h = layer(h)
            h = sync(h)

    ``engine_options`` go to :class:`~offload_examples.OffloadEngine` (``retain_pinned_cpu_buffers``,
    ``min_offload_bytes``...); the plan's ``caps`` become its
    ``max_offload_bytes_per_layer``. Raises ``ValueError`` when the plan and the layers differ in
    length, or when both the plan and ``engine_options`` cap bytes.
    """
    if len(chosen.choices) != len(layers):
        raise ValueError(f"the plan has {len(chosen.choices)} choices but there are {len(layers)} layers")
    if chosen.capped:
        if engine_options.get("max_offload_bytes_per_layer") is not None:
            raise ValueError("the plan caps the bytes of some layers: max_offload_bytes_per_layer would override it")
        engine_options["max_offload_bytes_per_layer"] = chosen.capped
    offloaded = [i for i, c in enumerate(chosen.choices) if c is OFFLOAD]
    # a plan that offloads nothing must not hook every layer in every step, as a probe does
    engine_options.setdefault("count_every_layer", False)
    engine = OffloadEngine(offload_schedule(offloaded, len(layers)), device=resolve_device(device), **engine_options)
    run = [Checkpointed(layer, module) if c is RECOMPUTE else layer
           for layer, c, module in zip(layers, chosen.choices, chosen.modules)]
    return engine, engine.sync, run
