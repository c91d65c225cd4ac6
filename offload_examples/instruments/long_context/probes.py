"""Each strategy's runs in the long-context scenario: its gradients against no offloading's, the search
for its longest sequence (with the engine's and the planner's settings chosen from the cost model and
corrected by what steps measure), and its speed at one length.

:mod:`~offload_examples.scenarios.long_context` calls these in turn; the search itself is
:func:`~offload_examples.instruments.long_context.search.longest_sequence`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from offload_examples.instruments.long_context import strategies as lc
from offload_examples.instruments.long_context.memory import OutOfMemoryError
from offload_examples.instruments.long_context.search import Probe, SearchResult, longest_sequence
from offload_examples.instruments.measure import compare_tensors, free_memory

__all__ = ["SHORT", "as_dict", "at_checkpoints_longest", "check_grads", "search_strategy"]

#: The most tokens of the gradient check and the cost step (no memory limit; deterministic attention is quadratic).
SHORT = 1024


def check_grads(trainee: lc.Trainee, strategies: Sequence[str], resolution: int, costs: lc.CostModel | None,
                host: int) -> tuple[dict[str, Any], int]:
    """Each strategy's adapter gradients at :data:`SHORT` tokens (or one resolution) against no offloading's,
    and the bytes the engine offloaded in all of them."""
    seq, out, offloaded, reference = min(resolution, SHORT), {}, 0, None
    for name in ["no offload", *(s for s in strategies if s != "no offload")]:
        with lc.strategy_mode(trainee, name):
            setting = lc.choose(name, seq, trainee.layers, costs, None, host, check=True)
            grads, moved = lc.gradients_at(trainee, setting, seq, host)
        reference = reference or grads
        check = compare_tensors(grads, reference)
        out[name] = dict(equal=check.equal, max_abs_diff=check.max_abs_diff, compared=len(grads), offloaded_bytes=moved,
                         plan=setting.note)
        offloaded += moved
    return out, offloaded


def search_strategy(trainee: lc.Trainee, name: str, costs: lc.CostModel | None, limit: int | None, host: int,
                    say: Callable[[str], None], *, resolution: int, max_seq: int, warmup: int = 1, steps: int = 1,
                    only: int | None = None) -> SearchResult:
    """The longest sequence of strategy ``name`` (with ``only``: one probe at ``only`` tokens).

    The engine's ``k`` and the planner's plans come from the cost model, whose peaks may fall short of
    what a step measures (the allocator's rounding and fragmentation, temporaries it does not see).
    Each step that peaks above its prediction, or runs out of memory although predicted to fit, raises
    ``error``, the largest shortfall seen (a ratio), and later settings are chosen under the limit
    divided by ``1 + error``: the search learns how far to trust the model. A length whose setting
    runs out of memory is tried again with the setting the raised error chooses, then with the one of
    the lowest predicted peak, and last with the one that holds least
    (:func:`~offload_examples.instruments.long_context.strategies.least_memory`).
    """
    error = 0.0

    def budget() -> int | None:
        return None if limit is None else int(limit / (1 + error))

    def probe(seq: int) -> Probe:
        nonlocal error
        tried: list[lc.Setting] = []

        def new(setting: lc.Setting) -> bool:  # one that differs in what runs, not only in its prediction
            return all((setting.checkpointed, setting.offloaded, setting.caps) != (t.checkpointed, t.offloaded, t.caps)
                       for t in tried)

        while True:
            setting = lc.choose(name, seq, trainee.layers, costs, budget(), host)
            for fallback in (lambda: lc.choose(name, seq, trainee.layers, costs, 0, host),  # the lowest predicted peak
                             lambda: lc.least_memory(name, trainee.layers, costs, seq, host)):
                if not new(setting):  # the raised error changes nothing
                    setting = fallback()
            if not new(setting):
                raise OutOfMemoryError(f"out of memory with {len(tried)} settings, the last {tried[-1].note}")
            tried.append(setting)
            predicted = setting.predicted_peak_bytes
            try:
                ran = lc.run_at(trainee, setting, seq, limit_bytes=limit, host_budget_bytes=host,
                                warmup=warmup, steps=steps)
            except OutOfMemoryError:
                if name not in ("engine", "planner"):  # one setting at every length: nothing else to try
                    raise
                if predicted and limit and setting.fits:  # it needed more than the limit: plan strictly below it now
                    error = max(error, limit / max(predicted - 1, 1) - 1)
                free_memory(pinned=True)
                continue  # what the model now chooses, or a fallback
            if predicted and ran.peak_bytes:
                error = max(error, ran.peak_bytes / predicted - 1)
            return ran

    predict = None
    if name in ("engine", "planner") and only is None:  # the cost model, not a fit: their setting changes with length
        longest_for: dict[int | None, int] = {}  # per budget: a bisection of plans, redone only when error moves

        def predict(_: list[tuple[int, int]]) -> int:
            if budget() not in longest_for:
                longest_for[budget()] = lc.predicted_longest(name, costs, trainee.layers, budget(), host, resolution,
                                                           max_seq)
            return longest_for[budget()]
    with lc.strategy_mode(trainee, name):
        return longest_sequence(probe, resolution=only or resolution, max_seq=only or max_seq,
                                limit_bytes=limit, predict=predict, progress=say, label=name)


def as_dict(probe: Probe | None) -> dict[str, Any] | None:
    """A probe as the report stores it (``None`` stays ``None``)."""
    return probe and dataclasses.asdict(probe)


def at_checkpoints_longest(trainee: lc.Trainee, costs: lc.CostModel | None, limit: int | None, host: int,
                           results: dict[str, Any], say: Callable[[str], None], *, warmup: int = 1,
                           steps: int = 1) -> tuple[int, dict[str, Any]]:
    """``(checkpointing's longest length, {strategy: its probe there})`` for the strategies that ran at
    least as long: what the longer sequences cost in speed where checkpointing still runs."""
    seq = (results.get("checkpoint") or {}).get("longest") or 0
    longer = [n for n, r in results.items() if n != "checkpoint" and seq and r["longest"] >= seq]
    if not longer:
        return seq, {}
    say(f"at {seq} tokens, the longest checkpointing ran:")
    best = next(p for p in reversed(results["checkpoint"]["probes"]) if p["ok"] and p["seq"] == seq)
    found = {n: search_strategy(trainee, n, costs, limit, host, say, resolution=seq, max_seq=seq, warmup=warmup,
                                steps=steps, only=seq).best for n in longer}
    return seq, {"checkpoint": best, **{n: as_dict(p) for n, p in found.items()}}
