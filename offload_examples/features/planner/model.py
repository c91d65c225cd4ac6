"""The cost model: the peak memory and step time a plan predicts, and the plan itself.

:func:`simulate_plan` walks :class:`~offload_examples.core.schedule.DefaultSchedule`'s step with each
layer's choice (the package's docstring says what each choice holds and costs); the offloaded layers
are released and reloaded at :class:`SubsetSchedule`'s points.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...core.host_pool import pinned_nbytes
from ...core.schedule import DefaultSchedule
from .costs import (KEEP, OFFLOAD, OFFLOADED, RECOMPUTE, RECOMPUTE_OFFLOAD, RECOMPUTED, Choice, LayerCost, LinkCost,
                    _check, _taken, capped_bytes)

__all__ = ["Plan", "SubsetSchedule", "offload_schedule", "plan_host_bytes", "simulate_plan"]


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
    if choices[-1] in OFFLOADED:
        raise ValueError("the last layer cannot be offloaded: its backward runs first")
    caps = _checked_caps(caps, choices)
    modules = _checked_modules(modules, choices)
    sched = offload_schedule([i for i, c in enumerate(choices) if c in OFFLOADED], n)
    off = [copied_bytes(c, ch, cap) for c, ch, cap in zip(costs, choices, caps)]
    # a recomputed layer holds its kept bytes from its forward on (RECOMPUTE_OFFLOAD: none once its input
    # is copied out), and its module's (or whole) saved bytes again in its backward
    terms = [c.recompute_terms(m) if ch in RECOMPUTED else None for c, ch, m in zip(costs, choices, modules)]
    kept = [{KEEP: c.saved_bytes, OFFLOAD: c.saved_bytes - o}[ch] if t is None else t[0] - o
            for c, ch, o, t in zip(costs, choices, off, terms)]
    points = sched.simulate(off, kept).points
    peak = max(total + (terms[j][1] if phase == "backward" and terms[j] is not None else 0)
               for phase, j, _, total in points)
    fwd, bwd = zip(*(c.phase_ms(ch, m) for c, ch, m in zip(costs, choices, modules)))
    ms = sched.predict_step_ms(fwd, bwd, off, link.d2h_gb_per_s, link.h2d_gb_per_s)
    return base_bytes + peak, ms


def plan_host_bytes(choices: Sequence[Choice | str], costs: Sequence[LayerCost],
                    caps: Sequence[int | None] | None = None) -> int:
    """The pinned host bytes a plan holds: what its offloaded layers copy out (a capped layer's share,
    a RECOMPUTE_OFFLOAD layer's input), each storage rounded up to a power of two as PyTorch pins it
    (a layer whose ``storage_bytes`` are unknown as one buffer, an estimate). All of it is held at once: every copy
    has left by the end of the forward, and the pool keeps its buffers for the next step."""
    choices = tuple(Choice(c) for c in choices)
    caps = _checked_caps(caps, choices)
    return sum(_pinned_copied_bytes(c, ch, cap) for c, ch, cap in zip(costs, choices, caps))


def copied_bytes(cost: LayerCost, choice: Choice, cap: int | None = None) -> int:
    """The bytes the engine copies out of a layer under ``choice``: what it saves (under ``cap``) for
    OFFLOAD, the checkpoint's input for RECOMPUTE_OFFLOAD, nothing otherwise. Exact: what the copies move
    and the device frees (the pinned host memory they take is :func:`_pinned_copied_bytes`)."""
    if choice is OFFLOAD:
        return capped_bytes(cost, cap)
    return cost.input_bytes if choice is RECOMPUTE_OFFLOAD else 0


def _pinned_copied_bytes(cost: LayerCost, choice: Choice, cap: int | None = None) -> int:
    """The pinned host memory of what the engine copies out of a layer under ``choice`` (``copied_bytes``).

    Each offloaded storage is a host buffer of its own, and PyTorch's pinned allocator reserves the next
    power of two of each (:func:`~offload_examples.core.host_pool.pinned_nbytes`): the storages the cap
    takes (as :func:`capped_bytes` walks them) are rounded one by one, and a RECOMPUTE_OFFLOAD layer's input
    as one tensor. A layer whose ``storage_bytes`` are unknown is rounded as one buffer: an estimate, which
    may fall short of what the engine pins (it rounds each storage) or exceed it; give the sizes to count
    exactly, as :func:`~offload_examples.instruments.plan_costs.measure_costs` does.
    """
    # always rounded: on a CPU the engine's pool pins nothing, but a plan is made for the GPU, where it does
    if choice is RECOMPUTE_OFFLOAD:
        return pinned_nbytes(cost.input_bytes)
    if choice is not OFFLOAD:
        return 0
    if cost.storage_bytes is None:
        return pinned_nbytes(capped_bytes(cost, cap))  # a cap without the sizes raises there
    taken = (True,) * len(cost.storage_bytes) if cap is None else _taken(cost, cap)
    return sum(pinned_nbytes(size) for size, t in zip(cost.storage_bytes, taken) if t)


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
                raise ValueError(f"{field}[{i}] is set but layer {i} is {ch.value}: only a layer whose choice is "
                                 f"{only.value} takes one (layers that are not {participle} take None)")
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
    not recomputed); :func:`apply_plan` checkpoints that module inside the layer. ``host_bytes`` is
    the pinned host memory the plan holds (:func:`plan_host_bytes`), within ``host_budget_bytes`` when
    :func:`plan` had one (:func:`apply_plan` then makes it the engine's ``host_memory_limit``).
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
    #: Pinned host bytes the plan holds (:func:`plan_host_bytes`); :func:`plan` fills it in.
    host_bytes: int = 0
    host_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(Choice(c) for c in self.choices))
        object.__setattr__(self, "caps", _checked_caps(self.caps, self.choices))
        object.__setattr__(self, "modules", _checked_modules(self.modules, self.choices))
        parts = tuple(self.parts) or (None,) * len(self.choices)
        if len(parts) != len(self.choices) or any(p is not None and (cap is None or not isinstance(p, str))
                                                  for p, cap in zip(parts, self.caps)):
            raise ValueError("parts must have one entry per layer, and a str only where the layer has a cap")
        object.__setattr__(self, "parts", parts)
        if self.host_budget_bytes is not None:  # apply_plan hands it to the engine as its host limit
            _check("Plan", "host_budget_bytes", self.host_budget_bytes, int)

    @property
    def offload_prefix(self) -> int | None:
        """``k`` when exactly the first ``k`` layers are offloaded (``num_layers`` for the engine), else None."""
        k = sum(c in OFFLOADED for c in self.choices)
        return k if all(c in OFFLOADED for c in self.choices[:k]) else None

    @property
    def offloaded(self) -> tuple[int, ...]:
        """The layers the engine offloads (OFFLOAD and RECOMPUTE_OFFLOAD)."""
        return tuple(i for i, c in enumerate(self.choices) if c in OFFLOADED)

    @property
    def recomputed(self) -> tuple[int, ...]:
        """The layers recomputed, whole or one submodule of them (RECOMPUTE and RECOMPUTE_OFFLOAD)."""
        return tuple(i for i, c in enumerate(self.choices) if c in RECOMPUTED)

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
                "modules": list(self.modules), "host_bytes": self.host_bytes,
                "host_budget_bytes": self.host_budget_bytes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(tuple(data["choices"]), int(data["predicted_peak_bytes"]), float(data["predicted_step_ms"]),
                   bool(data["feasible"]), str(data.get("why", "")), data.get("budget_bytes"),
                   tuple(data.get("caps") or ()), tuple(data.get("parts") or ()), tuple(data.get("modules") or ()),
                   int(data.get("host_bytes", 0)), data.get("host_budget_bytes"))

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
        # capped offloads after whole ones
        order = [RECOMPUTE_OFFLOAD.value, OFFLOAD.value, RECOMPUTE.value, KEEP.value]
        named = sorted(groups, key=lambda d: (order.index(d.split()[0]), d != d.split()[0]))
        return ", ".join(f"{d} " + " ".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in groups[d])
                         for d in named)

    def __str__(self) -> str:
        mib = 2**20
        budget = "" if self.budget_bytes is None else f" (budget {self.budget_bytes / mib:.2f} MiB)"
        host = "" if not self.host_bytes else f", pinned host {self.host_bytes / mib:.2f} MiB" + (
            "" if self.host_budget_bytes is None else f" (host budget {self.host_budget_bytes / mib:.2f} MiB)")
        head = [(f"plan for {len(self.choices)} layers: peak {self.predicted_peak_bytes / mib:.2f} MiB{budget}, "
                 f"step {self.predicted_step_ms:.3f} ms{host}")]
        if not self.feasible:
            head.append(f"infeasible: {self.why}")
        rows = [f"{i:5d}  {self.describe(i)}" + (f": {part}" if part else "") for i, part in enumerate(self.parts)]
        return "\n".join(head + ["layer  choice"] + rows)
