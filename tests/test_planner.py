"""The planner against brute force: every plan of small models, under the same simulation.

Two kinds of random instances: general floats (times compared to 1e-9 relative), and "exact" ones
whose times and copy times are small dyadic numbers, so every sum is exact and ties are real ties
(then the tie-break, lower peak, is checked too).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_examples import OffloadEngine
from offload_examples.core.host_pool import pinned_nbytes
from offload_examples.core.schedule import DefaultSchedule
from offload_examples.features import planner
from offload_examples.features.planner import (
    TIME_FIELDS,
    KEEP,
    OFFLOAD,
    OFFLOADED,
    RECOMPUTE,
    RECOMPUTE_OFFLOAD,
    RECOMPUTED,
    Checkpointed,
    Choice,
    LayerCost,
    LinkCost,
    ModuleCost,
    Plan,
    SubsetSchedule,
    pareto,
    plan,
    simulate_plan,
)
from offload_examples.features.planner.search import _DECIMALS, _prefix_front, _prefixes

EXAMPLES = settings(max_examples=30, deadline=None)
MB = 1_000_000


def instance(data, exact: bool, max_layers: int = 6):
    n = data.draw(st.integers(1, max_layers), label="layers")
    if exact:  # copy time = bytes / (GB/s * 1e6) ms: multiples of 1/8 ms
        ms, nbytes = st.integers(0, 8).map(float), st.integers(0, 8).map(lambda x: x * MB)
        bw = st.sampled_from([0.5, 1.0, 2.0, 4.0])
    else:
        ms, nbytes, bw = st.floats(0.0, 10.0), st.integers(0, 10**8), st.floats(0.5, 50.0)
    per_choice = data.draw(st.booleans(), label="times measured per choice")
    optional = st.one_of(st.none(), ms) if per_choice else st.none()
    sizes_known = data.draw(st.booleans(), label="storage sizes known (byte caps possible)")
    module_options = data.draw(st.integers(0, 2 if n <= 4 else 1), label="submodules that may be recomputed")
    costs = []
    for _ in range(n):
        saved = data.draw(nbytes)
        modules = tuple(ModuleCost(f"m{i}", data.draw(nbytes), data.draw(nbytes), data.draw(ms))
                        for i in range(module_options))
        costs.append(LayerCost(data.draw(ms), data.draw(ms), saved, data.draw(nbytes), data.draw(optional),
                               data.draw(optional), data.draw(optional),
                               split(data, saved, MB if exact else 1) if sizes_known else None,
                               recompute_modules=modules))
    link = LinkCost(data.draw(bw), data.draw(bw), data.draw(bw))
    base = data.draw(st.integers(0, 4).map(lambda x: x * MB) if exact else st.integers(0, 10**6), label="base")
    return costs, link, base


def split(data, total: int, unit: int) -> tuple[int, ...]:
    """``total`` bytes as up to four storages of whole ``unit``s (none for 0 bytes)."""
    cuts = data.draw(st.lists(st.integers(1, max(1, total // unit - 1)), max_size=3), label="storage cuts")
    points = sorted({c * unit for c in cuts if 0 < c * unit < total})
    return tuple(b - a for a, b in zip([0, *points], [*points, total])) if total else ()


def every_plan(costs, prefix_only: bool):
    """``(choices, modules)`` of every plan: a recomputed layer whole or any of its submodules."""
    per_layer = [[(KEEP, None), (OFFLOAD, None), (RECOMPUTE, None), (RECOMPUTE_OFFLOAD, None)]
                 + [(RECOMPUTE, m.module) for m in c.recompute_modules] for c in costs]
    for picked in itertools.product(*per_layer):
        ch = tuple(c for c, _ in picked)
        k = sum(c in OFFLOADED for c in ch)
        # prefix_only: the first k layers, all OFFLOAD or all RECOMPUTE_OFFLOAD
        if ch[-1] not in OFFLOADED and (not prefix_only or ch[:k] in ((OFFLOAD,) * k, (RECOMPUTE_OFFLOAD,) * k)):
            yield ch, tuple(m for _, m in picked)


def brute_force(costs, link, base, prefix_only, partial=True):
    """Every plan and its simulation: choices, the submodule of each recomputed layer (or all of it),
    and caps on the last offloaded layer at the sum of each run of its first storages (the plans the
    planner searches; a cap between two sums offloads what the lower one does, and only prefixes are
    tried: a cap that skips a storage to take a later one is not)."""
    out = {}
    for ch, modules in every_plan(costs, prefix_only):
        last = max((i for i, c in enumerate(ch) if c is OFFLOAD), default=None)
        sizes = costs[last].storage_bytes if last is not None and partial else None
        caps = [None] + [sum(sizes[:i]) for i in range(1, len(sizes))] if sizes else [None]
        for cap in caps:
            per_layer = tuple(cap if i == last else None for i in range(len(ch)))
            out[ch, per_layer, modules] = simulate_plan(ch, costs, link, base, per_layer, modules)
    return out


def draw_budget(data, results):
    peaks = sorted({peak for peak, _ in results.values()})
    return data.draw(st.one_of(st.sampled_from(peaks), st.integers(0, peaks[-1] + 1)), label="budget")


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def check_against_brute_force(data, exact: bool, prefix_only: bool, max_layers: int = 6) -> None:
    costs, link, base = instance(data, exact, max_layers)
    results = brute_force(costs, link, base, prefix_only)
    budget = draw_budget(data, results)
    got = plan(costs, link, budget, base, prefix_only=prefix_only)
    fits = {ch: r for ch, r in results.items() if r[0] <= budget}
    assert (got.predicted_peak_bytes, got.predicted_step_ms) == simulate_plan(got.choices, costs, link, base, got.caps,
                                                                             got.modules)
    assert (got.choices, got.caps, got.modules) in results  # OFFLOAD only on a prefix when prefix_only
    if not fits:
        assert not got.feasible and got.predicted_peak_bytes == min(p for p, _ in results.values())
        return
    assert got.feasible and got.predicted_peak_bytes <= budget and got.why == ""
    best = min(ms for _, ms in fits.values())
    if exact:
        assert got.predicted_step_ms == best
        assert got.predicted_peak_bytes == min(p for p, ms in fits.values() if ms == best)  # ties: lower peak
    else:
        assert close(got.predicted_step_ms, best)


@EXAMPLES
@given(st.data())
def test_optimal_against_every_prefix_plan(data):
    check_against_brute_force(data, exact=False, prefix_only=True)


@EXAMPLES
@given(st.data())
def test_optimal_and_ties_to_lower_peak_exact(data):
    check_against_brute_force(data, exact=True, prefix_only=True)


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_any_offload_set_against_brute_force(data):
    check_against_brute_force(data, exact=True, prefix_only=False, max_layers=5)


@EXAMPLES
@given(st.data())
def test_pareto_is_the_brute_force_front(data):
    costs, link, base = instance(data, exact=True)
    results = brute_force(costs, link, base, True)
    front = {(ms, peak) for peak, ms in results.values()
             if not any(m <= ms and p <= peak and (m, p) != (ms, peak) for p, m in results.values())}
    got = pareto(costs, link, base)
    assert {(p.predicted_step_ms, p.predicted_peak_bytes) for p in got} == front
    assert [p.predicted_peak_bytes for p in got] == sorted(p.predicted_peak_bytes for p in got)
    for p in got:  # each point is what plan() gives at that budget
        assert plan(costs, link, p.predicted_peak_bytes, base).predicted_step_ms == p.predicted_step_ms


@EXAMPLES
@given(st.data())
def test_search_states_predict_what_the_simulation_does(data):
    """What the dynamic program believes of every plan it keeps (its time as ``max_g cut[g] + ...``,
    its peak from the bytes held) is exactly what :func:`simulate_plan` says."""
    costs, link, _ = instance(data, exact=True)
    for k in range(len(costs)):
        for variant, last in _prefixes(costs, k, partial=True):  # whole offloads under each cap, recompute+offload
            for alpha, peak, changes, choices, (caps, modules) in _prefix_front(costs, link, k, math.inf, last, variant):
                assert simulate_plan(choices, costs, link, caps=caps, modules=modules) == (peak, alpha)
                assert choices[:k] == (variant,) * k and changes[0] == sum(c is not KEEP for c in choices)
                assert changes[1] == planner.plan_host_bytes(choices, costs, caps)
                assert caps == tuple(last if i == k - 1 else None for i in range(len(costs)))


def test_recompute_hides_behind_a_reload():
    """Layer 0 (8 MB, recomputing it saves nothing) is offloaded and reloaded during the backward of
    layer 1, whose 8 ms copy leaves room to recompute layer 1 (5 ms) for free; layer 2 would cost."""
    costs = [LayerCost(1.0, 1.0, 8 * MB, 8 * MB), LayerCost(5.0, 1.0, 4 * MB, 0), LayerCost(5.0, 1.0, 4 * MB, 0),
             LayerCost(1.0, 1.0, 4 * MB, 0)]
    link = LinkCost(1.0, 1.0, 1.0)
    assert simulate_plan([OFFLOAD, KEEP, RECOMPUTE, KEEP], costs, link) == (12 * MB, 28.0)
    assert simulate_plan([KEEP, RECOMPUTE, RECOMPUTE, KEEP], costs, link) == (12 * MB, 26.0)
    got = plan(costs, link, 12 * MB)
    assert got.choices == (OFFLOAD, RECOMPUTE, KEEP, KEEP)
    assert (got.predicted_peak_bytes, got.predicted_step_ms) == (12 * MB, 23.0)


def test_a_free_recomputation_that_saves_nothing_is_not_chosen():
    """Found by the property below: recomputing a last layer with no forward time and no input ties
    keeping it on time and peak; it held less, which no later layer could use, and won the tie."""
    got = plan([LayerCost(0.0, 0.0, 1, 0)], LinkCost(1.0, 1.0, 1.0), budget_bytes=1)
    assert got.choices == (KEEP,)


@EXAMPLES
@given(st.data())
def test_ample_budget_costs_no_time(data):
    costs, link, base = instance(data, exact=False)
    # no choice makes a layer faster than keeping it (measure_costs never reports one that does)
    costs = [dataclasses.replace(c, offloaded_forward_ms=None if c.offloaded_forward_ms is None else
                                 max(c.forward_ms, c.offloaded_forward_ms),
                                 offloaded_backward_ms=None if c.offloaded_backward_ms is None else
                                 max(c.backward_ms, c.offloaded_backward_ms)) for c in costs]
    keep_peak, keep_ms = simulate_plan([KEEP] * len(costs), costs, link, base)
    got = plan(costs, link, keep_peak + data.draw(st.integers(0, 10**6)), base)
    # nothing is faster than keeping everything (step times compare rounded, as the planner's do)
    assert round(got.predicted_step_ms, _DECIMALS) == round(keep_ms, _DECIMALS)
    assert got.choices == (KEEP,) * len(costs) or got.predicted_peak_bytes < keep_peak  # free saving only


def test_times_measured_per_choice_by_hand():
    """An offloaded layer takes its offloaded times, a recomputed one adds recompute_ms to its backward."""
    link = LinkCost(1e6, 1e6, 1e6)  # copies take no time: only compute counts
    cost = LayerCost(1.0, 2.0, 100, 10, offloaded_forward_ms=1.5, offloaded_backward_ms=2.25, recompute_ms=0.5)
    costs = [cost, LayerCost(1.0, 2.0, 100, 10)]
    assert cost.phase_ms(OFFLOAD) == (1.5, 2.25) and cost.phase_ms(RECOMPUTE) == (1.0, 2.5)
    assert costs[1].phase_ms(OFFLOAD) == (1.0, 2.0) and costs[1].phase_ms(RECOMPUTE) == (1.0, 3.0)
    assert simulate_plan((KEEP, KEEP), costs, link)[1] == pytest.approx(6.0)
    assert simulate_plan((OFFLOAD, KEEP), costs, link)[1] == pytest.approx(6.75)
    assert simulate_plan((RECOMPUTE, RECOMPUTE), costs, link)[1] == pytest.approx(7.5)
    assert cost.scaled(2.0) == LayerCost(2.0, 4.0, 100, 10, 3.0, 4.5, 1.0)
    with pytest.raises(ValueError, match="recompute_ms"):
        LayerCost(1.0, 1.0, 1, 1, recompute_ms=-1.0)


def test_ample_budget_keeps_every_layer():
    costs = [LayerCost(1.0, 2.0, 40 * MB, 4 * MB) for _ in range(5)]
    link = LinkCost(1.0, 1.0, 1.5)  # a 40 MB copy takes 40 ms: offloading cannot hide
    keep_peak, _ = simulate_plan([KEEP] * 5, costs, link, 7)
    for budget in (keep_peak, 10 * keep_peak):
        assert plan(costs, link, budget, base_bytes=7).choices == (KEEP,) * 5


def test_semantics_by_hand():
    costs = [LayerCost(1.0, 2.0, 100, 10) for _ in range(3)]
    link = LinkCost(1.0, 1.0, 1.0)
    assert simulate_plan([KEEP, KEEP, KEEP], costs, link, 5) == (305, 9.0)
    # recompute 0 and 1: 10 + 10 + 100 held at the last forward, and during the backward of layer 1
    # (10 + its input 10 + its saved 100); each recomputation adds its forward to the step
    assert simulate_plan([RECOMPUTE, RECOMPUTE, KEEP], costs, link, 0) == (120, 11.0)
    # offload layer 0: released at the forward of layer 2, reloaded at the backward of layer 1
    peak, ms = simulate_plan([OFFLOAD, KEEP, KEEP], costs, link, 0)
    assert (peak, ms) == (200, 9.0)  # the 1e-4 ms copies hide behind compute
    assert DefaultSchedule(1, 3).actions("forward", 2) == [("release", 0)]


@EXAMPLES
@given(st.data())
def test_a_host_budget_is_never_exceeded_and_costs_only_what_it_must(data):
    """Under a pinned host budget the plan is the fastest of the plans within both budgets (brute force),
    and its host bytes are what its offloaded layers copy out, as the pinned allocator reserves them."""
    costs, link, base = instance(data, exact=True)
    results = brute_force(costs, link, base, True)
    budget = draw_budget(data, results)
    hosts = sorted({planner.plan_host_bytes(ch, costs, caps) for ch, caps, _ in results})
    host = data.draw(st.one_of(st.sampled_from(hosts), st.integers(0, hosts[-1] + 1)), label="host budget")
    got = plan(costs, link, budget, base, host_budget_bytes=host)
    assert got.host_bytes == planner.plan_host_bytes(got.choices, costs, got.caps) <= host or not got.feasible
    assert got.host_budget_bytes == host
    fits = {key: r for key, r in results.items()
            if r[0] <= budget and planner.plan_host_bytes(key[0], costs, key[1]) <= host}
    if not fits:
        assert not got.feasible and got.why
        return
    assert got.feasible and got.predicted_step_ms == min(ms for _, ms in fits.values())
    # what the offloaded layers copy, each storage in a pinned buffer of its own rounded up to a power of two:
    # an OFFLOAD layer's storages (those under its cap; the layer as one buffer where they are unknown), a
    # RECOMPUTE_OFFLOAD layer's input
    assert got.host_bytes == sum(pinned_copies(c, got.choices[i], got.caps[i])
                                 for i, c in enumerate(costs) if got.choices[i] in OFFLOADED)


def pinned_copies(cost: LayerCost, choice: Choice, cap: int | None) -> int:
    """The pinned bytes of what a layer copies out, each storage rounded on its own (the engine's pool)."""
    if choice is RECOMPUTE_OFFLOAD:
        return pinned_nbytes(cost.input_bytes)
    if cost.storage_bytes is None:
        return pinned_nbytes(cost.saved_bytes)
    total, out = 0, 0
    for size in cost.storage_bytes:  # in save order, each while it still fits under the cap
        if cap is None or total + size <= cap:
            total, out = total + size, out + pinned_nbytes(size)
    return out


def test_the_smallest_host_budget_named_counts_slower_plans_that_hold_less():
    """A plan off the time-and-peak front (recompute+offload, slower than offloading whole) may need less
    host memory than every plan on it: the message names the least of all plans that fit."""
    costs, link = [LayerCost(1.0, 1.0, 3 * 10**6, 2 * 10**6)] * 3, LinkCost(100.0, 100.0, 100.0)
    least = pinned_nbytes(2 * 10**6)  # one input in pinned memory: 2 MiB
    assert plan(costs, link, 6 * 10**6, host_budget_bytes=least).feasible
    got = plan(costs, link, 6 * 10**6, host_budget_bytes=least - 1)
    assert not got.feasible and f"need at least {least} bytes of pinned host memory" in got.why
    got = plan(costs, link, 6 * 10**6, prefix_only=False, host_budget_bytes=least - 1)
    assert not got.feasible and f"need at least {least} bytes of pinned host memory" in got.why


def test_a_host_budget_that_no_plan_meets_names_the_smallest_that_would():
    # recomputing saves nothing here (every layer's input is all it saves): only offloading frees memory
    costs = [LayerCost(1.0, 2.0, 100 * MB, 100 * MB) for _ in range(4)]
    link = LinkCost(10.0, 10.0, 12.0)
    layer = 128 * 2**20  # what one layer's 100 MB take pinned
    ample = plan(costs, link, 250 * MB, host_budget_bytes=None)
    assert ample.feasible and ample.host_bytes == 2 * layer and ample.host_budget_bytes is None
    got = plan(costs, link, 250 * MB, host_budget_bytes=150 * MB)
    assert not got.feasible and got.host_bytes <= 150 * MB
    assert got.why == (f"the plans that fit the budget of {250 * MB} bytes need at least {2 * layer} bytes of pinned "
                       f"host memory > host budget {150 * MB} bytes")
    assert plan(costs, link, 250 * MB, host_budget_bytes=2 * layer).feasible
    assert "pinned host 256.00 MiB (host budget 256.00 MiB)" in str(plan(costs, link, 250 * MB,
                                                                        host_budget_bytes=2 * layer))
    assert [p.host_bytes for p in pareto(costs, link, host_budget_bytes=layer)] == [layer, 0]
    with pytest.raises(ValueError, match="host_budget_bytes must be a finite int >= 0"):
        plan(costs, link, 250 * MB, host_budget_bytes=-1)


def test_a_plan_whose_copies_fit_the_host_budget_only_unrounded_is_never_chosen():
    """PyTorch pins the next power of two of every buffer: 2 x 100 MB copied out take 256 MiB pinned. A host
    budget of 200 MB fits the bytes copied but not the memory pinned, so no plan that offloads two layers
    is chosen, and the smallest budget named is the pinned one."""
    costs = [LayerCost(1.0, 2.0, 100 * MB, 100 * MB) for _ in range(4)]  # recomputing frees nothing
    link = LinkCost(10.0, 10.0, 12.0)
    assert planner.copied_bytes(costs[0], OFFLOAD) == 100 * MB
    assert planner.plan_host_bytes((OFFLOAD, OFFLOAD, KEEP, KEEP), costs) == 2 * 128 * 2**20 > 200 * MB
    for prefix_only in (True, False):
        got = plan(costs, link, 250 * MB, prefix_only=prefix_only, host_budget_bytes=200 * MB)
        assert not got.feasible and sum(c in OFFLOADED for c in got.choices) <= 1 and got.host_bytes <= 200 * MB
        assert f"need at least {2 * 128 * 2**20} bytes of pinned host memory > host budget {200 * MB}" in got.why
    assert all(p.host_bytes <= 200 * MB for p in pareto(costs, link, host_budget_bytes=200 * MB))


def test_host_bytes_are_rounded_storage_by_storage():
    """Each offloaded storage is a pinned buffer of its own: three 3 MB storages take three 4 MiB buffers
    (not the 16 MiB of 9 MB in one), a cap takes the rounded size of the storages it takes, a checkpoint's
    input is one tensor, and a layer whose storages are unknown is rounded as one buffer."""
    mb = 1_000_000
    sized = LayerCost(1.0, 1.0, 9 * mb, 3 * mb, storage_bytes=(3 * mb,) * 3)
    unsized = LayerCost(1.0, 1.0, 9 * mb, 3 * mb)
    four = 4 * 2**20

    def host(choice, cost, cap=None):  # one layer's, offloaded first
        return planner.plan_host_bytes((choice, KEEP), [cost, cost], (cap, None))

    assert host(OFFLOAD, sized) == 3 * four and planner.copied_bytes(sized, OFFLOAD) == 9 * mb
    assert host(OFFLOAD, sized, 7 * mb) == 2 * four  # the first two fit the cap
    assert host(RECOMPUTE_OFFLOAD, sized) == four
    assert host(KEEP, sized) == host(RECOMPUTE, sized) == 0
    assert host(OFFLOAD, unsized) == 16 * 2**20
    costs = [sized, unsized, sized]
    assert planner.plan_host_bytes((OFFLOAD, OFFLOAD, KEEP), costs, (None, None, None)) == 3 * four + 16 * 2**20
    assert planner.plan_host_bytes((OFFLOAD, RECOMPUTE_OFFLOAD, KEEP), costs, (6 * mb, None, None)) == 3 * four


def test_the_default_host_budget_is_a_share_of_available_memory_per_local_process(monkeypatch):
    from offload_examples.features.planner import costs as costs_module

    monkeypatch.setattr(costs_module, "available_host_bytes", lambda: 64 * 2**30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert planner.host_budget() == 32 * 2**30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun's processes of one node share its memory
    assert planner.host_budget() == 4 * 2**30
    assert planner.host_budget(share=0.25, processes=2) == 8 * 2**30
    for bad in ({"share": 0}, {"share": 1.5}, {"processes": 0}):
        with pytest.raises(ValueError):
            planner.host_budget(**bad)
    for local in ("abc", "2.0", "0"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE='{local}' is not a number of processes"):
            planner.host_budget()
    for bad in ("auto", 1.5, True, "1000", -1):
        with pytest.raises(ValueError, match="Plan.host_budget_bytes must be a finite int >= 0"):
            Plan((KEEP,), 0, 0.0, host_budget_bytes=bad)
    monkeypatch.undo()
    assert 0 < planner.host_budget() < costs_module.available_host_bytes()
    # plan()'s default: a plan on this machine is within it
    costs = [LayerCost(1.0, 2.0, 100 * MB, 10 * MB) for _ in range(3)]
    assert 0 < plan(costs, LinkCost(10.0, 10.0, 12.0), 10**12).host_budget_bytes <= costs_module.available_host_bytes()


def test_apply_plan_makes_the_host_budget_the_engines_limit():
    chosen = Plan((OFFLOAD, KEEP), 0, 0.0, host_bytes=10, host_budget_bytes=1234)
    ctx, _, _ = planner.apply_plan(chosen, [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], "cpu")
    assert ctx.pool.limit_bytes == 1234
    ctx, _, _ = planner.apply_plan(chosen, [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], "cpu", host_memory_limit=99)
    assert ctx.pool.limit_bytes == 99


def test_infeasible_budgets_say_why():
    costs = [LayerCost(1.0, 2.0, 100 * MB, 10 * MB) for _ in range(4)]
    link = LinkCost(10.0, 10.0, 12.0)
    lowest = min(p.predicted_peak_bytes for p in pareto(costs, link, base_bytes=MB))
    got = plan(costs, link, lowest - 1, base_bytes=MB)
    assert not got.feasible and got.predicted_peak_bytes == lowest
    assert f"needs {lowest} bytes > budget {lowest - 1} bytes" in got.why and "even the plan" in got.why
    assert f"({got.summary()})" in got.why  # the lowest plan in the words every report uses
    assert "infeasible" in str(got)
    got = plan(costs, link, 10, base_bytes=11)
    assert not got.feasible and "base_bytes=11 alone exceed the budget of 10 bytes" in got.why
    all_recompute = [LayerCost(1.0, 1.0, 100, 0)] * 3
    got = plan(all_recompute, link, 50, prefix_only=False)
    assert not got.feasible and got.choices == (RECOMPUTE, RECOMPUTE, KEEP)


@EXAMPLES
@given(st.data())
def test_serialisation_round_trips_and_prints_a_row_per_layer(data):
    costs, link, base = instance(data, exact=False)
    budget = data.draw(st.integers(0, 6 * 10**8))
    got = plan(costs, link, budget, base)
    back = Plan.from_dict(json.loads(json.dumps(got.to_dict())))
    assert back == got and all(isinstance(c, Choice) for c in back.choices)
    rows = re.findall(r"^\s*(\d+)\s+(keep|offload|recompute\+offload|recompute)( up to [0-9.]+ (?:MiB|bytes)| m\d)?$", str(got),
                      flags=re.MULTILINE)
    assert rows == [(str(i), c.value, "" if cap is None and module is None else f" {module}" if module is not None
                     else f" up to {cap / 2**20:.2f} MiB" if cap >= 2**20 else f" up to {cap} bytes")
                    for i, (c, cap, module) in enumerate(zip(got.choices, got.caps, got.modules))]


def test_prefix_and_engine_call():
    got = Plan((OFFLOAD, OFFLOAD, RECOMPUTE, KEEP), 1, 2.0)
    assert got.offload_prefix == 2 and got.recomputed == (2,)
    assert Plan((KEEP, OFFLOAD, KEEP), 1, 2.0).offload_prefix is None


@pytest.mark.parametrize("n", range(1, 9))
def test_subset_schedule_is_default_schedule_on_prefixes(n):
    timeline = DefaultSchedule(0, n).timeline()
    for k in range(n):
        general, default = SubsetSchedule(k, n, tuple(range(k))), DefaultSchedule(k, n)
        assert [general.actions(*p) for p in timeline] == [default.actions(*p) for p in timeline]


@pytest.mark.parametrize("n", range(2, 8))
def test_subset_schedule_windows(n):
    """Every offloaded layer is released once, after its forward and by the last forward (so the two
    directions never copy at once), and reloaded once, at a backward before its own."""
    timeline = DefaultSchedule(0, n).timeline()
    for k in range(n):
        for layers in itertools.combinations(range(n - 1), k):
            sched = SubsetSchedule(k, n, layers)
            seen = [(pos, act) for pos, p in enumerate(timeline) for act in sched.actions(*p)]
            for s in layers:
                (rel,) = [pos for pos, act in seen if act == ("release", s)]
                (rld,) = [pos for pos, act in seen if act == ("reload", s)]
                assert s < rel <= n - 1 < rld < timeline.index(("backward", s))


def test_subset_schedule_reloads_the_layer_needed_first_first():
    sched = SubsetSchedule(2, 7, (4, 5))  # reload_lead 3: both reloads clip to the first backward
    assert sched.actions("backward", 6) == [("reload", 5), ("reload", 4)]
    assert sched.actions("forward", 5) == [("release", 4)] and sched.actions("forward", 6) == [("release", 5)]


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="forward_ms"):
        LayerCost(-1.0, 1.0, 1, 1)
    with pytest.raises(ValueError, match="saved_bytes"):
        LayerCost(1.0, 1.0, 1.5, 1)
    with pytest.raises(ValueError, match="both_gb_per_s"):
        LinkCost(1.0, 1.0, 0.0)
    link, costs = LinkCost(1.0, 1.0, 1.0), [LayerCost(1.0, 1.0, 1, 1)] * 2
    with pytest.raises(ValueError, match="last layer"):
        simulate_plan([KEEP, OFFLOAD], costs, link)
    with pytest.raises(ValueError, match="non-empty"):
        plan([], link, 10)
    with pytest.raises(ValueError, match="4\\^N"):
        plan(costs * 6, link, 10, prefix_only=False)


def test_an_applied_plan_runs_bitwise_and_offloads_exactly_its_layers():
    """apply_plan: offloaded layers (not a prefix) copy out and come back, recomputed layers re-run,
    gradients equal a plain run bit for bit, and the engine's resident bytes follow the schedule."""
    import torch

    from offload_examples.features.planner import Checkpointed, apply_plan
    from offload_examples.instruments.measure import snapshot, training_step
    from offload_examples.instruments.models import build_linear_stack

    n = 6
    choices = (OFFLOAD, RECOMPUTE, OFFLOAD, KEEP, RECOMPUTE_OFFLOAD, KEEP)
    chosen = Plan(choices, predicted_peak_bytes=0, predicted_step_ms=0.0)
    model = build_linear_stack(n, 32)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    reference = snapshot(model, x, training_step(model, x))
    model.zero_grad(set_to_none=True)
    x.grad = None
    ctx, sync, layers = apply_plan(chosen, list(model), device="cpu")
    assert [isinstance(layer, Checkpointed) for layer in layers] == [c in RECOMPUTED for c in choices]
    _check_plan_steps(choices, model, x, reference, (ctx, sync, layers), steps=2)
    with pytest.raises(ValueError, match="6 choices but there are 5 layers"):
        apply_plan(chosen, list(model)[:5], device="cpu")


def test_measured_costs_match_what_each_layer_saves_and_takes_in():
    """measure_costs: saved bytes as the engine counts them, input bytes of each layer's input, times > 0;
    with ``pool_kinds=False`` the last layer, never timed offloaded, has no offloaded time."""
    import torch

    from offload_examples import get_cpu_offload_context
    from offload_examples.instruments.measure import training_step
    from offload_examples.instruments.models import build_linear_stack
    from offload_examples.instruments.plan_costs import measure_costs, measure_link

    model = build_linear_stack(4, 32)
    x = torch.randn(16, 32, requires_grad=True)
    costs, base = measure_costs(list(model), x, steps=2, pool_kinds=False)  # each layer's own times
    assert x.grad is None and all(p.grad is None for p in model.parameters())  # left as found
    probe, sync = get_cpu_offload_context(enabled=True, num_layers=0, model_layers=4, device="cpu")
    training_step(model, x, probe, sync)
    assert [c.saved_bytes for c in costs] == [s.candidate_bytes for s in probe.stats]
    assert [c.storage_bytes for c in costs] == [tuple(s.candidate_sizes) for s in probe.stats]
    assert all(len(c.storage_bytes) > 1 for c in costs)  # each saves several storages: caps can split it
    # every layer maps width 32 to width 32; the first one's input is x, a leaf that requires grad (the caller
    # holds it), which the engine keeps on the device: nothing of it leaves, recomputed and offloaded or not
    assert [c.input_bytes for c in costs] == [0] + [x.numel() * 4] * 3
    assert all(c.forward_ms > 0 and c.backward_ms > 0 for c in costs) and base == 0
    # timed offloaded (one layer of the kind; every layer but the last gets its kind's) and recomputed
    assert all(c.offloaded_forward_ms >= c.forward_ms and c.offloaded_backward_ms >= c.backward_ms
               for c in costs[:-1])
    assert costs[-1].offloaded_forward_ms is None and all(c.recompute_ms >= 0 for c in costs)
    link = measure_link("cpu", nbytes=2**20)
    assert link.d2h_gb_per_s > 0 and link.h2d_gb_per_s == link.d2h_gb_per_s


def _fake_hook_free_step(times, per_round: list[float], runs: list):
    """A stand-in for ``plan_costs._hook_free_step``: ``times(offloaded, recomputed)`` gives a run's
    per-layer times, every run of a round scaled by that round's factor (a run's first call is its
    warm-up). ``runs`` collects ``(offloaded, recomputed)`` of each call, in order."""
    calls: dict = {}

    def fake_step(run_layers, x, offloaded, param_layers):
        key = (tuple(offloaded), tuple(i for i, layer in enumerate(run_layers) if isinstance(layer, Checkpointed)))
        calls[key] = 0

        def step():
            runs.append(key)
            r = max(0, calls[key] - 1)
            calls[key] += 1
            f, b = times(*key)
            return ([t * per_round[r] for t in f], [t * per_round[r] for t in b])

        class Engine:
            class pool:
                release = staticmethod(lambda: None)
        return step, Engine()

    return fake_step


def _spilling_times(kept_f, kept_b, kind_of, off_f, off_b, rec):
    """Per-layer times of a launch-bound step: offloading layer j lengthens the forward of layer
    j + 1 (its host work runs beside j's copies) by ``off_f[kind]`` and j's backward by ``off_b[kind]``;
    recomputing j lengthens its backward by ``rec[kind]``."""
    def times(offloaded, recomputed):
        f, b = list(kept_f), list(kept_b)
        for j in offloaded:
            f[j + 1] += off_f[kind_of[j]]
            b[j] += off_b[kind_of[j]]
        for j in recomputed:
            b[j] += rec[kind_of[j]]
        return f, b
    return times


def test_per_choice_times_are_the_hook_free_runs_taking_turns(monkeypatch):
    """With ``per_choice`` the times are the hook-free runs' (a probe's hooks on every layer lengthen
    every forward of a launch-bound layer), the runs take turns step by step, and what recomputing or
    offloading adds is the median over rounds of the whole step's difference within a round, per
    layer changed: a round that ran slow throughout (the machine drifting) does not move it, and a
    cost that shows in the next layer's forward counts."""
    from offload_examples.instruments import plan_costs

    runs = []
    times = _spilling_times([1.0, 1.0], [2.0, 2.0], [0, 0], off_f=[0.5], off_b=[7.0], rec=[0.75])
    # the second round runs three times slower, every run alike
    monkeypatch.setattr(plan_costs, "_hook_free_step", _fake_hook_free_step(times, [1.0, 3.0, 1.0], runs))
    monkeypatch.setattr(plan_costs, "_busy_ms", lambda spans, n: spans)
    layers = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    probe = [LayerCost(100.0, 200.0, 10, 2), LayerCost(100.0, 200.0, 10, 2)]  # a probe's inflated times
    costs = plan_costs._per_choice(probe, layers, torch.zeros(1, 2), steps=3)
    kept, offloaded, recomputed = ((), ()), ((0,), ()), ((), (0,))  # never the last layer offloaded
    # a warm-up each, then three rounds in the balanced orders taken in turn (no run always follows the same one)
    assert runs == [kept, offloaded, recomputed] * 2 + [offloaded, recomputed, kept] + [recomputed, kept, offloaded]
    assert [(c.forward_ms, c.backward_ms) for c in costs] == [(1.0, 2.0), (1.0, 2.0)]
    assert [c.recompute_ms for c in costs] == [0.75, 0.75]  # every layer of the kind
    # the quartiles over the rounds keep the spread the median leaves out: the slow round's 2.25 ms
    assert [c.recompute_ms_quartiles for c in costs] == [(0.75, 1.5)] * 2
    # kept + what offloading added to the step (the forward's part showed in layer 1)
    assert costs[0].offloaded_forward_ms == 1.5 and costs[1].offloaded_forward_ms is None
    assert costs[0].offloaded_backward_ms == 9.0 and costs[1].offloaded_backward_ms is None
    assert [c.saved_bytes for c in costs] == [10, 10]


def test_each_kind_is_timed_on_a_few_of_its_layers(monkeypatch):
    """For each kind of layer one run offloads its first OFFLOAD_SAMPLE layers (never the model's last)
    and one recomputes a RECOMPUTE_SHARE-th of them: few, so that the copies fit and the backward's
    spare host time is not used up (on Transformer Engine's layers); each layer of a kind gets its own kept
    times plus its kind's additions, and a kind found only in the last layer no offloaded times."""
    from offload_examples.instruments import plan_costs

    narrow, wide = (lambda: torch.nn.Linear(2, 2)), (lambda: torch.nn.Linear(4, 4))
    layers = [narrow(), wide(), narrow(), wide(), narrow(), wide(), narrow(), wide(), torch.nn.Linear(3, 3)]
    kind_of = [0, 1] * 4 + [2]
    times = _spilling_times([1.0, 2.0, 1.25, 2.5, 1.0, 2.0, 1.0, 2.0, 3.0], [1.0] * 9, kind_of,
                            off_f=[0.5, 1.5], off_b=[0.25, 0.75], rec=[0.5, 1.0, 2.0])
    runs = []
    monkeypatch.setattr(plan_costs, "_hook_free_step", _fake_hook_free_step(times, [1.0, 1.0], runs))
    monkeypatch.setattr(plan_costs, "_busy_ms", lambda spans, n: spans)
    probe = [LayerCost(9.0, 9.0, 10 * (1 + k), 2) for k in kind_of]
    costs = plan_costs._per_choice(probe, layers, torch.zeros(1, 2), steps=2)
    assert plan_costs.OFFLOAD_SAMPLE == 2 and plan_costs.RECOMPUTE_SHARE == 4
    assert runs[:6] == [((), ()), ((0, 2), ()), ((), (0,)), ((1, 3), ()), ((), (1,)), ((), (8,))]
    assert [c.offloaded_forward_ms for c in costs] == [1.5, 3.5, 1.75, 4.0, 1.5, 3.5, 1.5, 3.5, None]
    assert [c.offloaded_backward_ms for c in costs] == [1.25, 1.75] * 4 + [None]
    assert [c.recompute_ms for c in costs] == [0.5, 1.0] * 4 + [2.0]


def test_a_faster_choice_is_noise_and_adds_nothing(monkeypatch):
    """A step that ran faster offloaded or recomputed than kept in the same round is noise: nothing
    is added (the planner would otherwise offload or recompute for speed)."""
    from offload_examples.instruments import plan_costs

    times = _spilling_times([1.0] * 3, [1.0] * 3, [0, 0, 0], off_f=[-0.5], off_b=[-0.25], rec=[-0.5])
    monkeypatch.setattr(plan_costs, "_hook_free_step", _fake_hook_free_step(times, [1.0], []))
    monkeypatch.setattr(plan_costs, "_busy_ms", lambda spans, n: spans)
    layers = [torch.nn.Linear(2, 2) for _ in range(3)]
    costs = plan_costs._per_choice([LayerCost(9.0, 9.0, 10, 2)] * 3, layers, torch.zeros(1, 2), steps=1)
    assert [(c.offloaded_forward_ms, c.offloaded_backward_ms, c.recompute_ms) for c in costs] == \
        [(1.0, 1.0, 0.0), (1.0, 1.0, 0.0), (None, None, 0.0)]
    # the spread is not clipped: it shows the noise that the cost of 0 hides
    assert [c.recompute_ms_quartiles for c in costs] == [(-0.5, -0.5)] * 3


def test_busy_ms_takes_the_waits_for_copies_out():
    """A release's wait is a span of its own; the wait for a reload (until the layer's last
    host-to-device copy ends) is taken out of the backward that reads it, never below 0."""
    from offload_examples.instruments.plan_costs import _busy_ms
    from offload_examples.instruments.timeline import Span

    spans = [Span("compute", 0.0, 2.0, "F0", 0), Span("compute", 2.0, 3.0, "wait", 1),
             Span("compute", 3.0, 5.0, "F1", 1), Span("compute", 5.0, 8.0, "B1", 1),
             Span("compute", 8.0, 12.0, "B0", 0),
             Span("device-to-host", 2.0, 4.0, "layer 0", 0, 10),
             Span("host-to-device", 5.0, 7.0, "layer 0", 0, 5), Span("host-to-device", 7.0, 9.5, "layer 0", 0, 5)]
    assert _busy_ms(spans, 2) == ([2.0, 2.0], [2.5, 3.0])  # B0 waited 1.5 ms for its reload
    late = spans[:5] + [Span("host-to-device", 5.0, 13.0, "layer 0", 0, 10)]
    assert _busy_ms(late, 2) == ([2.0, 2.0], [0.0, 3.0])


def times(cost: LayerCost) -> tuple:
    return tuple(getattr(cost, name) for name in TIME_FIELDS)


def test_identical_layers_share_one_measured_cost(monkeypatch):
    """measure_costs pools by kind (the default): identical layers get the same times, the last one an
    offloaded forward time too (its kind's, though it was never timed offloaded); the bytes are each layer's."""
    from offload_examples.instruments.plan_costs import measure_costs

    from offload_examples.instruments import plan_costs

    # host timings on a 2-core CPU can differ by more than the pooling tolerance: widen it here, so
    # that this test checks the grouping; the tolerance itself is checked by hand below
    monkeypatch.setattr(plan_costs, "POOL_TOLERANCE", float("inf"))
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(4)]
    x = torch.randn(16, 32)
    costs, _ = measure_costs(layers, x, steps=2)
    assert len({times(c) for c in costs}) == 1
    assert costs[-1].offloaded_forward_ms is not None and costs[-1].recompute_ms is not None
    assert all(c.saved_bytes == 2 * x.numel() * 4 and c.input_bytes == x.numel() * 4 for c in costs)
    # an input that requires grad is a leaf the engine does not count: the first layer saves less
    # (only Tanh's output), so it is a kind of its own and the other three share one cost
    costs, _ = measure_costs(layers, x.requires_grad_(), steps=2)
    assert costs[0].saved_bytes == x.numel() * 4 and len({times(c) for c in costs[1:]}) == 1


def test_pooling_takes_medians_within_each_kind_only():
    """Kinds: class, parameter and buffer (name, shape, dtype), saved and input bytes. Each time is the
    median over the kind, ``None`` left out (kept where every member has ``None``); bytes stay per layer."""
    from offload_examples.instruments.plan_costs import _pooled_by_kind

    def narrow():
        return torch.nn.Linear(8, 8)

    def wide():
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))  # with buffers

    layers = [narrow(), wide(), narrow(), wide(), narrow(), wide(),
              narrow().double(),  # same shapes, another dtype: its own kind
              narrow()]  # same module, other saved bytes: its own kind
    costs = [
        LayerCost(1.8, 4.5, 100, 32, offloaded_forward_ms=2.4, recompute_ms=0.55),
        LayerCost(18.0, 45.0, 400, 64, offloaded_forward_ms=20.0, offloaded_backward_ms=46.0, recompute_ms=5.5),
        LayerCost(2.2, 5.5, 100, 32, offloaded_forward_ms=2.6, recompute_ms=0.65),
        LayerCost(22.0, 55.0, 400, 64, offloaded_forward_ms=23.0, offloaded_backward_ms=56.0, recompute_ms=6.5),
        LayerCost(2.0, 5.0, 100, 32, offloaded_forward_ms=None, recompute_ms=0.6),
        LayerCost(20.0, 50.0, 400, 64, offloaded_forward_ms=None, offloaded_backward_ms=None, recompute_ms=6.0),
        LayerCost(9.0, 9.0, 100, 32, offloaded_forward_ms=9.5),
        LayerCost(7.0, 7.0, 200, 32, recompute_ms=1.0),
    ]
    pooled = _pooled_by_kind(costs, layers)
    narrow_times = (2.0, 5.0, 2.5, None, 0.6)  # medians of 1.8, 2.2, 2 / 4.5, 5.5, 5 / 2.4, 2.6 / none / ...
    wide_times = (20.0, 50.0, 21.5, 51.0, 6.0)
    assert [times(c) for c in pooled] == [narrow_times, wide_times] * 3 + [times(costs[6]), times(costs[7])]
    assert [(c.saved_bytes, c.input_bytes) for c in pooled] == [(c.saved_bytes, c.input_bytes) for c in costs]
    assert _pooled_by_kind(costs[:1], layers[:1]) == costs[:1]  # a kind of one keeps its own costs


def test_a_layer_far_from_its_kinds_median_keeps_its_own_time():
    """Alike parameters, different work (a sliding-window layer among global ones): a time further
    than POOL_TOLERANCE from the kind's median is not noise, and stays the layer's own."""
    from offload_examples.instruments.plan_costs import POOL_TOLERANCE, _pooled_by_kind

    layers = [torch.nn.Linear(8, 8) for _ in range(5)]
    forward = [1.0, 1.1, 4.0, 0.9, 1.0]  # layer 2 computes four times as much
    costs = [LayerCost(f, 2 * f, 100, 32, recompute_ms=f) for f in forward]
    pooled = _pooled_by_kind(costs, layers)
    assert [c.forward_ms for c in pooled] == [1.0, 1.0, 4.0, 1.0, 1.0]
    assert [c.backward_ms for c in pooled] == [2.0, 2.0, 8.0, 2.0, 2.0]
    assert pooled[2].recompute_ms == 4.0 and POOL_TOLERANCE == 0.25


def test_a_noisy_difference_does_not_make_a_layer_its_own_kind():
    """``recompute_ms`` is a difference of two timed runs: one layer's far off its kind's median, with
    forward and backward alike, is noise. The layer takes the kind's times, all of them (on 12 TE
    layers the search had recomputed exactly the layer whose difference came out 27 % low)."""
    from offload_examples.instruments.plan_costs import _pooled_by_kind

    layers = [torch.nn.Linear(8, 8) for _ in range(5)]
    recompute = [1.4, 1.5, 1.0, 1.4, 2.4]
    costs = [LayerCost(3.3, 3.6, 100, 32, recompute_ms=r) for r in recompute]
    assert [c.recompute_ms for c in _pooled_by_kind(costs, layers)] == [1.4] * 5


def test_a_bare_cuda_device_means_the_current_one(monkeypatch):
    """``torch.device("cuda")`` is not ``cuda:0``: an engine built with it compared every saved tensor
    with a device none of them is on and kept them all: offloading then freed nothing."""
    from offload_examples.core.streams import resolve_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.gpu
def test_apply_plan_on_a_bare_cuda_device_offloads():
    from offload_examples.features.planner import apply_plan

    layers = [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh()).cuda() for _ in range(3)]
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    ctx, sync, run_layers = apply_plan(Plan((OFFLOAD, KEEP, KEEP), 0, 0.0), layers, device="cuda")
    h = x
    for layer in run_layers:
        with ctx:
            h = layer(h)
        h = sync(h)
    h.sum().backward()
    assert ctx.device == torch.device("cuda", torch.cuda.current_device())
    assert ctx.stats[0].offloaded_bytes > 0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from([KEEP, OFFLOAD, RECOMPUTE, RECOMPUTE_OFFLOAD]), min_size=4, max_size=4),
       st.sampled_from([KEEP, RECOMPUTE]), st.booleans())
def test_any_applied_plan_runs_bitwise_with_the_schedules_resident_bytes(first, last, retain):
    """Every plan shape (offloaded layers anywhere but last, recomputed ones between them), on transformer
    layers (views, attention): three steps, each bitwise equal to a plain step, with the engine's resident
    bytes following the plan's schedule and no saved view left after backward."""
    from offload_examples.features.planner import apply_plan
    from offload_examples.instruments.measure import snapshot, training_step
    from offload_examples.instruments.models import build_basic_model

    choices = (*first, last)
    model = build_basic_model(len(choices), 16, 2, 32, kind="torch")
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    reference = snapshot(model, x, training_step(model, x))
    applied = apply_plan(Plan(choices, 0, 0.0), list(model), device="cpu", retain_pinned_cpu_buffers=retain)
    _check_plan_steps(choices, model, x, reference, applied, steps=3)


def _check_plan_steps(choices, model, x, reference, applied, steps):
    """Run ``steps`` steps of an applied plan: each bitwise equal to the plain ``reference``, exactly the
    plan's layers offloaded, resident bytes as the schedule says, no saved view left after backward."""
    from offload_examples.instruments.measure import compare_grads, resident_vs_theory, snapshot, training_step

    ctx, sync, layers = applied
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        x.grad = None
        got = snapshot(model, x, training_step(layers, x, ctx, sync))
        assert compare_grads(reference, got).equal, choices
        # a checkpointed layer in the engine's context hands it what the checkpoint keeps: its input, no more
        # (layer 0's input is x, a leaf that requires grad: held anyway, so kept)
        hidden = x.numel() * x.element_size()
        assert [s.offloaded_bytes == hidden for s, c in zip(ctx.stats, choices) if c is RECOMPUTE_OFFLOAD] == [
            i > 0 for i, c in enumerate(choices) if c is RECOMPUTE_OFFLOAD], [s.offloaded_bytes for s in ctx.stats]
        assert [s.offloaded_bytes > 0 for s in ctx.stats] == [
            c is OFFLOAD or (c is RECOMPUTE_OFFLOAD and i > 0) for i, c in enumerate(choices)]
        assert all(g == w for _, _, g, w in resident_vs_theory(ctx)), choices
        assert ctx.live_views == 0


def test_a_byte_cap_tops_up_the_saving_where_a_whole_layer_would_stall():
    """Three layers; offloading a whole layer stalls the step (its copy outlasts the next forward),
    recomputing costs 1 ms. A budget that needs only a little saving is met by offloading the first
    storage of layer 0 alone: the copy hides behind layer 1's forward and nothing is recomputed."""
    mb = 1_000_000
    layer = LayerCost(2.0, 2.0, 8 * mb, mb, recompute_ms=1.0, storage_bytes=(2 * mb, 6 * mb))
    costs, link = [layer] * 3, LinkCost(1.0, 1.0, 1.0)  # 1 GB/s: 2 ms per 2 MB, 8 ms per layer
    keep_peak, keep_ms = simulate_plan((KEEP,) * 3, costs, link)
    got = plan(costs, link, keep_peak - 2 * mb)
    assert got.choices == (OFFLOAD, KEEP, KEEP) and got.caps == (2 * mb, None, None) and got.capped == {0: 2 * mb}
    assert got.predicted_step_ms == keep_ms and got.predicted_peak_bytes == keep_peak - 2 * mb
    assert planner.capped_bytes(layer, 2 * mb) == 2 * mb and planner.capped_bytes(layer, 5 * mb) == 2 * mb
    assert planner.partial_caps(layer) == (2 * mb,)
    # whole layers only: recompute one, its input offloaded (the same time as keeping it, 1 MB lower)
    whole = plan(costs, link, keep_peak - 2 * mb, partial=False)
    assert whole.choices == (RECOMPUTE_OFFLOAD, KEEP, KEEP) and whole.predicted_step_ms == keep_ms + 1.0
    assert whole.predicted_peak_bytes == keep_peak - 8 * mb and whole.host_bytes == pinned_nbytes(mb)  # 1 MiB pinned
    kept_input = plan(costs, link, keep_peak - 2 * mb, partial=False, host_budget_bytes=0)  # no host memory
    assert kept_input.choices == (RECOMPUTE, KEEP, KEEP) and kept_input.predicted_peak_bytes == keep_peak - 7 * mb
    assert "offload up to 1.91 MiB 0, keep 1-2" == got.summary()
    assert Plan.from_dict(json.loads(json.dumps(got.to_dict()))) == got


def test_caps_are_refused_where_they_cannot_mean_anything():
    mb = 1_000_000
    sized = LayerCost(1.0, 1.0, 3 * mb, mb, storage_bytes=(mb, 2 * mb))
    with pytest.raises(ValueError, match="add up to"):
        LayerCost(1.0, 1.0, 3 * mb, mb, storage_bytes=(mb, mb))
    with pytest.raises(ValueError, match="caps\\[1\\] is set but layer 1 is keep: only a layer whose choice is offload"):
        Plan((OFFLOAD, KEEP), 0, 0.0, caps=(None, mb))
    with pytest.raises(ValueError, match="layer 0 is recompute\\+offload: only a layer whose choice is offload takes"):
        Plan((RECOMPUTE_OFFLOAD, KEEP), 0, 0.0, caps=(mb, None))
    with pytest.raises(ValueError, match="one cap"):
        Plan((OFFLOAD, KEEP), 0, 0.0, caps=(mb,))
    with pytest.raises(ValueError, match="storage_bytes"):  # no sizes: no way to tell what a cap offloads
        simulate_plan((OFFLOAD, KEEP), [LayerCost(1.0, 1.0, 3 * mb, mb)] * 2, LinkCost(1.0, 1.0, 1.0), caps=(mb, None))
    with pytest.raises(ValueError, match="caps\\[0\\] must be an int"):
        simulate_plan((OFFLOAD, KEEP), [sized] * 2, LinkCost(1.0, 1.0, 1.0), caps=(0, None))
    model = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
    from offload_examples.features.planner import apply_plan
    caps = {0: mb}
    ctx, _, _ = apply_plan(Plan((OFFLOAD, KEEP), 0, 0.0, caps=(mb, None)), list(model), device="cpu")
    engine = OffloadEngine(DefaultSchedule(1, 2), device=torch.device("cpu"),
                           max_offload_bytes_per_layer=caps)
    caps[0] = -7  # the engine keeps its own checked copy
    assert ctx.max_offload_bytes_per_layer == {0: mb} and engine.max_offload_bytes_per_layer == {0: mb}
    with pytest.raises(ValueError, match="override"):
        apply_plan(Plan((OFFLOAD, KEEP), 0, 0.0, caps=(mb, None)), list(model), device="cpu",
                   max_offload_bytes_per_layer=5)


@settings(max_examples=10, deadline=None)
@given(st.data())
def test_an_applied_cap_offloads_what_the_model_says(data):
    """A plan with a cap on its last offloaded layer, run on transformer layers: the engine offloads
    exactly ``capped_bytes`` of the measured storage sizes there, the other offloaded layers whole,
    every step bitwise equal to a plain one, resident bytes as the engine's schedule says."""
    from offload_examples.features.planner import apply_plan, capped_bytes, partial_caps
    from offload_examples.instruments.measure import snapshot, training_step
    from offload_examples.instruments.models import build_basic_model
    from offload_examples.instruments.plan_costs import measure_costs

    model = build_basic_model(4, 16, 2, 32, kind="torch")
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    costs, _ = measure_costs(list(model), x, steps=1, per_choice=False)
    k = data.draw(st.integers(1, 3), label="offloaded")
    cap = data.draw(st.sampled_from(partial_caps(costs[k - 1])), label="cap")
    choices = (OFFLOAD,) * k + (KEEP,) * (4 - k)
    chosen = Plan(choices, 0, 0.0, caps=tuple(cap if i == k - 1 else None for i in range(4)))
    reference = snapshot(model, x, training_step(model, x))
    applied = apply_plan(chosen, list(model), device="cpu", retain_pinned_cpu_buffers=True)
    _check_plan_steps(choices, model, x, reference, applied, steps=2)
    ctx = applied[0]
    assert [s.offloaded_bytes for s in ctx.stats[:k]] == [capped_bytes(c, p) for c, p in zip(costs, chosen.caps[:k])]
    assert ctx.stats[k - 1].offloaded_bytes == cap < costs[k - 1].saved_bytes


class _TwoModules(torch.nn.Module):
    """``a``, then ``b`` (a Linear and a Tanh), then a ReLU in the layer's own forward."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(256, 256)
        self.b = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())

    def forward(self, x):
        return torch.relu(self.b(self.a(x)))


def test_measured_costs_name_the_module_that_saved_each_storage():
    """measure_costs records, per storage, the innermost submodule whose forward saved it first ("" for
    the layer's own forward), from a hooked warm-up step whose hooks are gone before the timed steps."""
    from offload_examples.instruments.plan_costs import measure_costs

    torch.manual_seed(0)
    layers = [_TwoModules(), _TwoModules()]
    costs, _ = measure_costs(layers, torch.randn(2048, 256, requires_grad=True), steps=1, per_choice=False)
    # layer 0's input is the caller's (kept); layer 1's is layer 0's output, saved by its ``a``
    assert [c.storage_modules for c in costs] == [("b.0", "b.1", ""), ("a", "b.0", "b.1", "")]
    assert all(len(c.storage_modules) == len(c.storage_bytes) for c in costs)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for layer in layers for m in layer.modules())


def test_a_cap_is_said_in_modules_and_printed_with_the_plan():
    """cap_in_modules names the modules whose storages a cap takes (the engine's rule: each storage
    that still fits), "part of" where it takes some of a module's; plan() puts that in the printed plan
    and its dict; without storage_modules it is unknown (None)."""
    mib = 2**20
    cost = LayerCost(1.0, 1.0, 60 * mib, 4 * mib, storage_bytes=(10 * mib, 20 * mib, 30 * mib),
                     storage_modules=("attn.qkv", "attn.core", ""))
    assert planner.cap_in_modules(cost, 10 * mib) == "attn.qkv"
    assert planner.cap_in_modules(cost, 29 * mib) == "attn.qkv"
    assert planner.cap_in_modules(cost, 30 * mib) == "attn.qkv, attn.core"
    assert planner.cap_in_modules(cost, 40 * mib) == "attn.qkv, attn.core"
    skipping = LayerCost(1.0, 1.0, 45 * mib, 4 * mib, storage_bytes=(10 * mib, 30 * mib, 5 * mib),
                         storage_modules=("attn.qkv", "attn.core", ""))
    assert planner.cap_in_modules(skipping, 20 * mib) == "attn.qkv, (the layer's own forward)"  # 30 MiB skipped
    assert planner.cap_in_modules(dataclasses.replace(cost, storage_modules=None), 10 * mib) is None
    shared = dataclasses.replace(cost, storage_modules=("mlp", "mlp", "norm"))
    assert planner.cap_in_modules(shared, 10 * mib) == "part of mlp"
    with pytest.raises(ValueError, match="one module"):
        dataclasses.replace(cost, storage_modules=("a", "b"))
    chosen = Plan((OFFLOAD, KEEP), 1, 2.0, caps=(30 * mib, None), parts=("attn.qkv, attn.core", None))
    assert "    0  offload up to 30.00 MiB: attn.qkv, attn.core\n    1  keep" in str(chosen)
    assert Plan.from_dict(json.loads(json.dumps(chosen.to_dict()))) == chosen
    for parts in (("attn.qkv", None), (7, None)):
        with pytest.raises(ValueError, match="a str only where the layer has a cap"):
            Plan((OFFLOAD, KEEP), 1, 2.0, caps=(None, None) if parts[0] == "attn.qkv" else (30 * mib, None), parts=parts)
    # the planner fills them in, where a whole layer's copies would stall the step
    slow = dataclasses.replace(cost, forward_ms=5.0, backward_ms=10.0)
    costs = [slow, dataclasses.replace(slow, storage_modules=None), LayerCost(5.0, 10.0, 60 * mib, 4 * mib)]
    capped = [p for p in planner.pareto(costs, LinkCost(5.0, 5.0, 10.0)) if p.capped]
    assert [p.parts for p in capped] == [("attn.qkv, attn.core", None, None), ("attn.qkv", None, None)]


def test_module_names_come_from_an_extra_step_and_only_where_the_steps_agree(monkeypatch):
    """The names come from one more untimed step with hooks: a call nested in another module's forward
    but registered elsewhere is named for itself (the call that started last); a layer with a scripted
    submodule is measured (no hooks on it); a layer whose last step counted other storages than the
    hooked one gets None; compiled layers without ``torch.compiler.set_stance`` get None."""
    from offload_examples.instruments import plan_costs

    class Borrowing(torch.nn.Module):  # calls ``a``, which the layer registers beside it
        def __init__(self, a):
            super().__init__()
            self.lin = torch.nn.Linear(256, 256)
            self.__dict__["a"] = a  # not a submodule of this one

        def forward(self, x):
            return self.a(self.lin(x)) if not hasattr(self, "flip") else self.lin(x)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Tanh()
            self.inner = Borrowing(self.a)

        def forward(self, x):
            return torch.relu(self.inner(x))

    torch.manual_seed(0)
    layers = [Outer(), Outer()]
    x = torch.randn(2048, 256, requires_grad=True)
    costs, _ = plan_costs.measure_costs(layers, x, steps=1, per_choice=False)
    assert costs[1].storage_modules == ("inner.lin", "a", "")
    scripted = [torch.nn.Sequential(torch.jit.script(torch.nn.Linear(256, 256)), torch.nn.Tanh()) for _ in range(2)]
    costs, _ = plan_costs.measure_costs(scripted, x, steps=1, per_choice=False)
    assert costs[1].storage_modules == ("", "1")  # the scripted Linear's saves belong to the layer
    # the timed steps save differently from the hooked one: no names
    real = plan_costs._SavingModules.from_step.__func__

    def then_flip(cls, layers, engine, step):
        sites = real(cls, layers, engine, step)
        layers[1].inner.flip = True
        return sites
    monkeypatch.setattr(plan_costs._SavingModules, "from_step", classmethod(then_flip))
    costs, _ = plan_costs.measure_costs(layers, x, steps=1, per_choice=False)
    assert costs[0].storage_modules is not None and costs[1].storage_modules is None
    monkeypatch.undo()
    del layers[1].inner.flip
    monkeypatch.delattr(torch.compiler, "set_stance")
    compiled = type("OptimizedModule", (torch.nn.Module,), {"forward": lambda self, x: x})
    layers[0].add_module("compiled", compiled())
    costs, _ = plan_costs.measure_costs(layers, x, steps=1, per_choice=False)
    assert all(c.storage_modules is None for c in costs)


# ---------------------------------------------------------------------- recomputing one submodule
def test_recomputing_a_submodule_is_chosen_where_it_frees_enough_for_less():
    """Two layers of 8 MB; recomputing a layer keeps 1 MB and costs 4 ms, recomputing its MLP keeps
    3 MB and costs 1 ms (2 MB held again while its backward runs). A budget that needs 5 MB freed
    recomputes the MLP of layer 0 (1 ms); one that needs 8 MB, both MLPs (2 ms), not a whole layer."""
    mb = 1_000_000
    mlp = ModuleCost("mlp", kept_bytes=3 * mb, module_bytes=2 * mb, recompute_ms=1.0)
    layer = LayerCost(2.0, 2.0, 8 * mb, mb, recompute_ms=4.0, recompute_modules=(mlp,))
    costs, link = [layer] * 2, LinkCost(1.0, 1.0, 1.0)
    keep_peak, keep_ms = simulate_plan((KEEP, KEEP), costs, link)
    got = plan(costs, link, keep_peak - 5 * mb)
    assert (got.choices, got.modules) == ((RECOMPUTE, KEEP), ("mlp", None))
    assert got.predicted_step_ms == keep_ms + 1.0 and got.recomputed_modules == {0: "mlp"}
    assert got.summary() == "recompute mlp 0, keep 1" and got.describe(0) == "recompute mlp"
    both = plan(costs, link, keep_peak - 8 * mb)
    assert (both.choices, both.modules, both.predicted_step_ms) == ((RECOMPUTE,) * 2, ("mlp",) * 2, keep_ms + 2.0)
    whole = plan(costs, link, keep_peak - 8 * mb, prefix_only=False)  # the exhaustive search agrees
    assert (whole.choices, whole.modules) == (both.choices, both.modules)
    # the peak: layer 0's backward holds its 3 MB, the MLP's 2 MB again, and layer 1 is freed by then
    assert simulate_plan((RECOMPUTE, KEEP), costs, link, modules=("mlp", None))[0] == keep_peak - 5 * mb
    assert layer.scaled(2.0).recompute_modules == (ModuleCost("mlp", 3 * mb, 2 * mb, 2.0),)
    assert LayerCost(**json.loads(json.dumps(dataclasses.asdict(layer)))) == layer  # as the bench stores costs
    spread = dataclasses.replace(layer, recompute_ms_quartiles=(3.5, 4.5), recompute_modules=(
        dataclasses.replace(mlp, recompute_ms_quartiles=(-0.25, 1.5)),))
    assert LayerCost(**json.loads(json.dumps(dataclasses.asdict(spread)))) == spread
    doubled = spread.scaled(2.0)
    assert (doubled.recompute_ms_quartiles, doubled.recompute_modules[0].recompute_ms_quartiles) == \
        ((7.0, 9.0), (-0.5, 3.0))


def test_module_recompute_bad_input_says_what_is_wrong():
    link, layer = LinkCost(1.0, 1.0, 1.0), LayerCost(1.0, 1.0, 10, 1, recompute_modules=(ModuleCost("mlp", 5, 5, 1.0),))
    with pytest.raises(ValueError, match="no cost for recomputing the submodule 'attn' \\(measured: mlp\\)"):
        simulate_plan((RECOMPUTE, KEEP), [layer] * 2, link, modules=("attn", None))
    with pytest.raises(ValueError, match="modules\\[1\\] is set but layer 1 is keep: only a layer whose choice is recompute"):
        simulate_plan((RECOMPUTE, KEEP), [layer] * 2, link, modules=(None, "mlp"))
    with pytest.raises(ValueError, match="one module name"):
        Plan((RECOMPUTE, KEEP), 0, 0.0, modules=("mlp",))
    with pytest.raises(ValueError, match="one per module name"):
        LayerCost(1.0, 1.0, 10, 1, recompute_modules=(ModuleCost("mlp", 5, 5, 1.0),) * 2)
    with pytest.raises(ValueError, match="kept_bytes"):
        ModuleCost("mlp", -1, 5, 1.0)
    with pytest.raises(ValueError, match="non-empty str"):
        ModuleCost("", 1, 5, 1.0)
    with pytest.raises(ValueError, match="lower <= upper"):
        LayerCost(1.0, 1.0, 10, 1, recompute_ms_quartiles=(2.0, 1.0))
    with pytest.raises(ValueError, match="recompute_ms_quartiles"):
        ModuleCost("mlp", 1, 5, 1.0, recompute_ms_quartiles=(float("nan"), 1.0))


def _basic(n=3, seed=1):
    from offload_examples.instruments.models import build_basic_model

    model = build_basic_model(n, 32, 4, 64, kind="torch")
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    return model, x


def test_a_checkpointed_submodule_recomputes_bitwise_and_leaves_the_layer_as_it_was():
    """Checkpointed(layer, "transformer.self_attn"): the attention (given one tensor as query, key and
    value, which it tests for identity) is recomputed, the gradients equal a plain step's bit for bit,
    the layer keeps its forward and state_dict keys, also after a failing step."""
    from offload_examples.instruments.measure import compare_grads, snapshot, training_step

    model, x = _basic()
    reference = snapshot(model, x, training_step(model, x))
    model.zero_grad(set_to_none=True)
    x.grad = None
    attn = model[0].transformer.self_attn
    keys = list(model[0].state_dict())
    runs = []
    attn.register_forward_hook(lambda *a: runs.append(1))  # a hook runs once: around the first forward only
    wrapped = [Checkpointed(model[0], "transformer.self_attn"), model[1], model[2]]
    got = snapshot(model, x, training_step(wrapped, x))
    assert compare_grads(reference, got).equal and runs == [1]
    assert "forward" not in attn.__dict__ and list(model[0].state_dict()) == keys
    assert "module='transformer.self_attn'" in repr(wrapped[0])
    with pytest.raises(RuntimeError):
        wrapped[0](torch.randn(2, 16, 31))  # wrong width: fails inside the layer
    assert "forward" not in attn.__dict__
    with pytest.raises(AttributeError, match="no attribute `attn`"):
        Checkpointed(model[0], "transformer.attn")


def test_a_plan_recomputing_a_submodule_applies_and_runs_bitwise():
    """apply_plan with Plan.modules: the named submodule is checkpointed inside its layer, next to an
    offloaded layer and a layer recomputed whole; gradients bitwise, two steps."""
    from offload_examples.features.planner import apply_plan
    from offload_examples.instruments.measure import snapshot, training_step

    model, x = _basic(4)
    reference = snapshot(model, x, training_step(model, x))
    model.zero_grad(set_to_none=True)
    x.grad = None
    choices = (OFFLOAD, RECOMPUTE, RECOMPUTE, KEEP)
    chosen = Plan(choices, 0, 0.0, modules=(None, "transformer.self_attn", None, None))
    ctx, sync, layers = apply_plan(chosen, list(model), device="cpu")
    assert [getattr(layer, "module", "-") for layer in layers] == ["-", "transformer.self_attn", None, "-"]
    _check_plan_steps(choices, model, x, reference, (ctx, sync, layers), steps=2)


def test_measured_submodule_costs_are_what_the_layer_holds_with_it_recomputed():
    """measure_costs finds the attention and the second linear as the basic layer's candidates; the
    linear's recomputation frees nothing (checkpointing keeps its input, all it saves) and is dropped;
    the attention's kept bytes are what the engine counts for the layer with the attention
    checkpointed, its bytes what the attention saves."""
    from offload_examples import get_cpu_offload_context
    from offload_examples.instruments.measure import training_step
    from offload_examples.instruments.plan_costs import _bytes_under, measure_costs, module_candidates

    model, x = _basic(3)
    costs, _ = measure_costs(list(model), x, steps=2)
    assert module_candidates(model[0], costs[0]) == ["transformer.self_attn", "transformer.linear2"]
    assert costs[1].recompute_modules == costs[2].recompute_modules  # one kind (layer 0 takes a leaf: another)
    probe, sync = get_cpu_offload_context(enabled=True, num_layers=0, model_layers=3, device="cpu")
    wrapped = [Checkpointed(layer, "transformer.self_attn") for layer in model]
    training_step(wrapped, x, probe, sync)
    for cost, counted in zip(costs, probe.stats):
        (attn,) = cost.recompute_modules
        assert attn.module == "transformer.self_attn" and attn.recompute_ms >= 0
        assert attn.kept_bytes == counted.candidate_bytes < cost.saved_bytes
        assert attn.module_bytes == _bytes_under(cost)["transformer.self_attn"] > 0
    none, _ = measure_costs(list(model), x, steps=1, recompute_modules=())
    assert all(c.recompute_modules == () for c in none)
    asked, _ = measure_costs(list(model), x, steps=1, recompute_modules=["transformer.norm1", "nowhere"])
    assert [m.module for m in asked[0].recompute_modules] in ([], ["transformer.norm1"])  # frees nothing: dropped


def test_module_candidates_look_into_a_module_that_is_almost_the_layer():
    """A layer = linear (5 %) + block (95 %: attention 40 %, mlp 55 %): the candidates are block.mlp
    and block.attn, largest first; the linear saves too little, the block is nearly the whole layer."""
    from torch import nn

    from offload_examples.instruments.plan_costs import module_candidates

    block = nn.Module()
    block.attn, block.mlp = nn.Linear(2, 2), nn.Linear(2, 2)
    block.forward = lambda x: x  # noqa: E731 (a module with a forward: not a container)
    layer = nn.Module()
    layer.linear, layer.block = nn.Linear(2, 2), block
    cost = LayerCost(1.0, 1.0, 100, 1, storage_bytes=(5, 40, 50, 5),
                     storage_modules=("linear", "block.attn", "block.mlp", "block"))
    assert module_candidates(layer, cost) == ["block.mlp", "block.attn"]
    assert module_candidates(layer, dataclasses.replace(cost, storage_modules=None, storage_bytes=None)) == []
