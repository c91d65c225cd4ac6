"""The search: the fastest plan under a budget (:func:`plan`), and every plan no other beats (:func:`pareto`)."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

from ...core.schedule import DefaultSchedule
from .costs import (
    KEEP, OFFLOAD, OFFLOADED, RECOMPUTE, RECOMPUTE_OFFLOAD, Choice, LayerCost, LinkCost, _check, cap_in_modules,
    host_budget, partial_caps,
)
from .model import Plan, _pinned_copied_bytes, copied_bytes, plan_host_bytes, simulate_plan

__all__ = ["EXHAUSTIVE_MAX_LAYERS", "pareto", "plan"]


#: ``prefix_only=False`` tries all ``4^N`` plans; beyond this many layers it refuses.
EXHAUSTIVE_MAX_LAYERS = 8


#: Step times are compared rounded to this many decimals of a ms, so rounding noise makes no tie.
_DECIMALS = 9


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
                  last_cap: int | None = None, variant: Choice = OFFLOAD) -> list[tuple]:
    """``(step_ms, peak_saved_bytes, (changes, host bytes, k), choices, (caps, modules))`` of the non-dominated plans
    with the first ``k`` layers offloaded, all as ``variant`` (OFFLOAD, layer ``k - 1`` under the byte cap
    ``last_cap`` if given; or RECOMPUTE_OFFLOAD), the others kept or recomputed (whole or one submodule:
    :func:`_options`), and at most ``cap`` bytes resident."""
    n = len(costs)
    sched = DefaultSchedule(k, n)
    caps = tuple(last_cap if i == k - 1 else None for i in range(n))
    off = [copied_bytes(c, variant, caps[i]) if i < k else 0 for i, c in enumerate(costs)]
    # what a cap keeps; a RECOMPUTE_OFFLOAD layer keeps nothing, and holds what it saves again in its backward
    left = [c.saved_bytes - o if i < k and variant is OFFLOAD else 0 for i, (c, o) in enumerate(zip(costs, off))]
    again = [c.saved_bytes if i < k and variant is RECOMPUTE_OFFLOAD else 0 for i, c in enumerate(costs)]
    points = sched.simulate(off, left).points
    # no other layer is held at the phases of layers 0 .. k-1
    fixed = max((total + (again[j] if phase == "backward" else 0) for phase, j, _, total in points if j < k), default=0)
    resident = {(phase, j): total for phase, j, _, total in points}  # layers 0 .. k-1's bytes on the device
    if fixed > cap:
        return []
    fwd, bwd = zip(*(c.phase_ms(variant if i < k else KEEP) for i, c in enumerate(costs)))

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
    host = _prefix_host_bytes(costs, k, last_cap, variant)  # ties: fewer changes, less pinned memory, as in _front
    return [(alpha, peak, (k + nrec, host, k), (variant,) * k + tuple(c for c, _ in ch), (caps, (None,) * k + tuple(m for _, m in ch)))
            for alpha, peak, _, nrec, ch in states]


def _prefixes(costs: Sequence[LayerCost], k: int, partial: bool) -> list[tuple[Choice, int | None]]:
    """``(variant, cap on layer k - 1)`` of the offloaded prefixes of ``k`` layers the search tries: all
    OFFLOAD under each of :func:`_caps_to_try`, and (``k > 0``) all RECOMPUTE_OFFLOAD."""
    whole = [(OFFLOAD, cap) for cap in _caps_to_try(costs, k - 1 if k else None, partial)]
    return whole + ([(RECOMPUTE_OFFLOAD, None)] if k else [])


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
    per_layer = [[(OFFLOAD, None), (RECOMPUTE_OFFLOAD, None)] + [(c, m) for c, m, *_ in _options(cost)]
                 for cost in costs]
    for picked in itertools.product(*per_layer):
        ch, modules = tuple(c for c, _ in picked), tuple(m for _, m in picked)
        if ch[-1] not in OFFLOADED:
            for caps in _last_caps(costs, ch, partial):
                yield ch, caps, modules


def _front(costs: Sequence[LayerCost], link: LinkCost, base_bytes: int, cap: float,
           prefix_only: bool, partial: bool, host_cap: float = math.inf) -> list[tuple]:
    """Non-dominated ``(rounded step_ms, peak_bytes, changes, step_ms, (choices, caps, modules))`` with peak <=
    ``cap`` and pinned host bytes <= ``host_cap``."""
    n = len(costs)
    if prefix_only:
        # the host bytes depend only on k and the last layer's cap: a prefix over the host budget is not searched
        found = [f for k in range(n) for variant, last in _prefixes(costs, k, partial)
                 if _prefix_host_bytes(costs, k, last, variant) <= host_cap
                 for f in _prefix_front(costs, link, k, cap - base_bytes, last, variant)]
        found = [(f[3], *f[4]) for f in _nondominated(found, 2)]  # then re-simulated: the numbers reported
    elif n > EXHAUSTIVE_MAX_LAYERS:
        raise ValueError(f"prefix_only=False tries all 4^N plans: N={n} > {EXHAUSTIVE_MAX_LAYERS} layers is "
                         "too many (and the engine offloads only the first k layers)")
    elif math.prod(4 + len(c.recompute_modules) for c in costs) > 4 ** EXHAUSTIVE_MAX_LAYERS:
        raise ValueError(f"prefix_only=False tries every plan: with the submodules that may be recomputed there are "
                         f"more than 4^{EXHAUSTIVE_MAX_LAYERS} of them")
    else:
        found = _every_plan(costs, partial)
    out = []
    for ch, caps, modules in found:
        host = plan_host_bytes(ch, costs, caps)
        if host > host_cap:  # before the simulation, which costs far more
            continue
        peak, ms = simulate_plan(ch, costs, link, base_bytes, caps, modules)
        if peak <= cap:
            # ties: fewer changes, less host memory, fewer layers offloaded (RECOMPUTE before RECOMPUTE_OFFLOAD)
            changes = (sum(c is not KEEP for c in ch), host, sum(c in OFFLOADED for c in ch))
            out.append((round(ms, _DECIMALS), peak, changes, ms, (ch, caps, modules)))
    return _nondominated(out, 2)


def _prefix_host_bytes(costs: Sequence[LayerCost], k: int, last_cap: int | None, variant: Choice = OFFLOAD) -> int:
    """The pinned host bytes of offloading the first ``k`` layers as ``variant``, the last under ``last_cap``
    (rounded storage by storage, as :func:`plan_host_bytes` counts them)."""
    return sum(_pinned_copied_bytes(c, variant, last_cap if i == k - 1 else None) for i, c in enumerate(costs[:k]))


def _host_cap(host_budget_bytes: int | str | None) -> tuple[float, int | None]:
    """``(the cap the search applies, the budget a plan reports)`` for :func:`plan`'s ``host_budget_bytes``."""
    if host_budget_bytes == "auto":
        host_budget_bytes = host_budget()
    if host_budget_bytes is None:
        return math.inf, None
    _check("plan", "host_budget_bytes", host_budget_bytes, int)
    return host_budget_bytes, host_budget_bytes


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
         prefix_only: bool = True, partial: bool = True, host_budget_bytes: int | str | None = "auto") -> Plan:
    """The fastest predicted plan whose predicted peak is <= ``budget_bytes`` and whose pinned host
    memory (:func:`plan_host_bytes`) is <= ``host_budget_bytes``.

    ``host_budget_bytes``: ``"auto"`` (the default) is :func:`host_budget`, half of the host memory
    available now, shared among the node's processes; ``None`` sets no limit. A plan over it is never
    chosen; when the GPU budget can be met only with more host memory, the plan is infeasible and
    ``why`` names the smallest host budget that would do.

    Step times are compared rounded to ``10**-_DECIMALS`` ms. Ties go to the lower peak, then to fewer
    layers changed from KEEP (a RECOMPUTE that buys neither time nor peak is undone), then to less
    pinned host memory, so a budget no plan beats on time and peak gives every layer KEEP. No plan fitting gives
    ``feasible=False``, the lowest-peak plan, and ``why``.

    Algorithm (``prefix_only=True``, the sets the engine runs): for each ``k`` in ``0 .. N-1`` the
    first ``k`` layers are offloaded, all as OFFLOAD or all as RECOMPUTE_OFFLOAD (a prefix that mixes
    the two is not tried), and a dynamic program walks layers ``k .. N-1`` in forward order choosing
    KEEP or RECOMPUTE. Two facts make the walk exact:

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

    ``prefix_only=False`` allows any set of offloaded layers, each OFFLOAD or RECOMPUTE_OFFLOAD
    (:class:`SubsetSchedule`, which :func:`apply_plan` runs) and tries every plan: exact, for up to
    :data:`EXHAUSTIVE_MAX_LAYERS` layers.

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
    host_cap, host_budget_bytes = _host_cap(host_budget_bytes)
    front = _front(costs, link, base_bytes, budget_bytes, prefix_only, partial, host_cap)
    if front:
        rounded, peak, _, ms, (ch, caps, modules) = front[0]
        ch, modules = _undo_free_recomputations(ch, caps, modules, costs, link, base_bytes, rounded, peak)
        peak, ms = simulate_plan(ch, costs, link, base_bytes, caps, modules)
        return Plan(ch, peak, ms, True, "", budget_bytes, caps, _parts(costs, caps), modules,
                    plan_host_bytes(ch, costs, caps), host_budget_bytes)
    _, peak, _, ms, (ch, caps, modules) = min(_front(costs, link, base_bytes, math.inf, prefix_only, partial, host_cap),
                                              key=lambda p: p[1::-1])
    why = _why_infeasible(costs, link, base_bytes, budget_bytes, prefix_only, partial, host_cap,
                          Plan(ch, peak, ms, caps=caps, modules=modules))
    return Plan(ch, peak, ms, False, why, budget_bytes, caps, _parts(costs, caps), modules,
                plan_host_bytes(ch, costs, caps), host_budget_bytes)


def _why_infeasible(costs: Sequence[LayerCost], link: LinkCost, base_bytes: int, budget_bytes: int,
                    prefix_only: bool, partial: bool, host_cap: float, lowest: Plan) -> str:
    """One line on why no plan fits: the base alone, the host budget (naming the smallest that would
    do), or the GPU budget (naming the lowest peak any plan reaches)."""
    if base_bytes > budget_bytes:
        return f"base_bytes={base_bytes} alone exceed the budget of {budget_bytes} bytes"
    if host_cap != math.inf:
        need = _least_host_bytes(costs, link, base_bytes, budget_bytes, prefix_only, partial)
        if need is not None:
            return (f"the plans that fit the budget of {budget_bytes} bytes need at least {need} bytes of pinned "
                    f"host memory > host budget {int(host_cap)} bytes")
    return (f"even the plan with the lowest peak ({lowest.summary()}) needs {lowest.predicted_peak_bytes} bytes "
            f"> budget {budget_bytes} bytes ({base_bytes} of them base_bytes)"
            + ("; OFFLOAD limited to a prefix" if prefix_only else ""))


def _least_host_bytes(costs: Sequence[LayerCost], link: LinkCost, base_bytes: int, budget_bytes: int,
                      prefix_only: bool, partial: bool) -> int | None:
    """The least pinned host memory of any plan whose predicted peak fits ``budget_bytes`` (``None``: none
    fits). Not the front's: a slower plan that holds less host memory is off the time-and-peak front."""
    if prefix_only:  # a prefix's host bytes are fixed by (k, variant, cap): is any plan with it under the budget?
        hosts = [_prefix_host_bytes(costs, k, last, variant) for k in range(len(costs))
                 for variant, last in _prefixes(costs, k, partial)
                 if _prefix_front(costs, link, k, budget_bytes - base_bytes, last, variant)]
    else:
        hosts = [plan_host_bytes(ch, costs, caps) for ch, caps, modules in _every_plan(costs, partial)
                 if simulate_plan(ch, costs, link, base_bytes, caps, modules)[0] <= budget_bytes]
    return min(hosts, default=None)


def _parts(costs: Sequence[LayerCost], caps: tuple[int | None, ...]) -> tuple[str | None, ...]:
    return tuple(None if cap is None else cap_in_modules(c, cap) for c, cap in zip(costs, caps))


def pareto(costs: Sequence[LayerCost], link: LinkCost, base_bytes: int = 0, prefix_only: bool = True,
           partial: bool = True, host_budget_bytes: int | str | None = None) -> list[Plan]:
    """Every plan that no other beats on both predicted peak and step time, by increasing peak.

    Same search as :func:`plan` without a GPU budget; for each budget, :func:`plan` with the same
    ``host_budget_bytes`` returns one of these. ``host_budget_bytes`` (``None``: no limit, the
    default; ``"auto"``: :func:`host_budget`) leaves out the plans that hold more pinned host memory.
    """
    costs = _validate(costs, link, base_bytes)
    host_cap, host_budget_bytes = _host_cap(host_budget_bytes)
    front = _front(costs, link, base_bytes, math.inf, prefix_only, partial, host_cap)
    return [Plan(ch, peak, ms, caps=caps, parts=_parts(costs, caps), modules=modules,
                 host_bytes=plan_host_bytes(ch, costs, caps), host_budget_bytes=host_budget_bytes)
            for _, peak, _, ms, (ch, caps, modules) in sorted(front, key=lambda p: p[1::-1])]
