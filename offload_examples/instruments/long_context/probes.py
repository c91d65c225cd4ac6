"""Each strategy's runs in the long-context scenario: its gradients against no offloading's, the search
for its longest sequence (with the engine's and the planner's settings chosen from the cost model and
corrected by what steps measure), and the strategies' speeds at one length, their steps taking turns.

:mod:`~offload_examples.scenarios.long_context` calls these in turn; the search itself is
:func:`~offload_examples.instruments.long_context.search.longest_sequence`.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from offload_examples.instruments.long_context import strategies as lc
from offload_examples.instruments.long_context.memory import OutOfMemoryError
from offload_examples.instruments.long_context.search import Probe, SearchResult, first_probe, longest_sequence
from offload_examples.instruments.measure import (balanced_orders, balanced_rounds, compare_tensors, free_memory,
                                                  overhead_spread)
from offload_examples.instruments.report import format_bytes, format_table

__all__ = ["REFERENCE", "SAME_SEARCH", "SHORT", "as_dict", "at_checkpoints_longest", "check_grads", "format_turns",
           "resumable", "search_all", "search_entry", "search_strategy", "speeds_in_turns", "take_turns"]

#: The strategy the others' steps are compared with at one length, where it ran there: checkpointing,
#: which every long-context recipe starts from.
REFERENCE = "checkpoint"

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
                    only: int | None = None, on_probe: Callable[[SearchResult], None] | None = None,
                    known: Sequence[Probe] = ()) -> SearchResult:
    """The longest sequence of strategy ``name`` (with ``only``: one probe at ``only`` tokens); ``on_probe``
    gets the search so far after each probe; ``known``: the probes of a search cut short, to go on from
    (:func:`~offload_examples.instruments.long_context.search.longest_sequence`).

    The engine's ``k`` and the planner's plans come from the cost model, which also predicts the longest
    length of checkpointing with offloaded inputs (the planner's plan that holds least). Its peaks may fall
    short of what a step measures (the allocator's rounding and fragmentation, temporaries it does not see).
    Each step that peaks above its prediction, or runs out of memory although predicted to fit, raises
    ``shortfall``, the most bytes the model fell short by, and later settings are chosen under the limit
    less ``shortfall``: the search learns how far to trust the model. Bytes, not a ratio: what the model
    misses at the short first steps (workspaces, the allocator's blocks) does not grow with the length,
    and a ratio learned there would cut the budget near the limit by many times as much. A length whose
    setting runs out of memory is tried again with the setting the raised shortfall chooses, then with the one of
    the lowest predicted peak, and last with the one that holds least
    (:func:`~offload_examples.instruments.long_context.strategies.least_memory`).
    """
    # what the model fell short by in the probes already run (a resumed search) holds for the ones to come: a
    # step that peaked above its prediction, and a setting that ran out of memory although predicted to fit
    shortfall = max([p.peak_bytes - p.predicted_peak_bytes for p in known
                     if p.ok and p.peak_bytes and p.predicted_peak_bytes]
                    + [limit - p.missed_peak_bytes + 1 for p in known if p.missed_peak_bytes and limit] + [0])
    ran_with: dict[int, lc.Setting] = {}  # per length, the setting that ran there last

    def budget() -> int | None:
        return None if limit is None else max(limit - shortfall, 0)

    def probe(seq: int) -> Probe:
        nonlocal shortfall
        tried: list[lc.Setting] = []
        missed: list[int] = []  # the predicted peaks of the settings that fit the model but ran out of memory

        def new(setting: lc.Setting) -> bool:  # one that differs in what runs, not only in its prediction
            return all((setting.checkpointed, setting.offloaded, setting.caps) != (t.checkpointed, t.offloaded, t.caps)
                       for t in tried)

        while True:
            setting = lc.choose(name, seq, trainee.layers, costs, budget(), host)
            for fallback in (lambda: lc.choose(name, seq, trainee.layers, costs, 0, host),  # the lowest predicted peak
                             lambda: lc.least_memory(name, trainee.layers, costs, seq, host)):
                if not new(setting):  # the raised shortfall changes nothing
                    setting = fallback()
            if not new(setting):
                last = tried[-1]
                peak = last.predicted_peak_bytes
                predicted = f", predicted peak {format_bytes(peak)}" if peak else ""
                raise _missed(OutOfMemoryError(f"out of memory with {len(tried)} settings, the last {last.note}"
                                               f"{predicted}"), missed)
            tried.append(setting)
            predicted = setting.predicted_peak_bytes
            try:
                ran = lc.run_at(trainee, setting, seq, limit_bytes=limit, host_budget_bytes=host,
                                warmup=warmup, steps=steps)
            except OutOfMemoryError as err:
                if predicted and limit and setting.fits:  # it needed more than the limit: plan strictly below it now
                    shortfall = max(shortfall, limit - predicted + 1)
                    missed.append(predicted)
                if name not in ("engine", "planner"):  # one setting at every length: nothing else to try
                    raise _missed(err, missed)
                free_memory(pinned=True)
                continue  # what the model now chooses, or a fallback
            if predicted and ran.peak_bytes:
                shortfall = max(shortfall, ran.peak_bytes - predicted)
            ran_with[seq] = setting
            ran.missed_peak_bytes = min(missed, default=None)
            return ran

    predict = None
    # the cost model, not a fit: their setting changes with the length (checkpointing with offloaded inputs: where
    # the host budget is full, the inputs that do not fit stay on the device, and its peak bends there)
    if name in ("engine", "planner", "checkpoint + offload") and costs is not None and only is None:
        longest_for: dict[int | None, int] = {}  # per budget: a bisection of plans, redone only when shortfall moves

        def predict(_: list[tuple[int, int]]) -> int:
            if budget() not in longest_for:
                longest_for[budget()] = lc.predicted_longest(name, costs, trainee.layers, budget(), host, resolution,
                                                           max_seq)
            return longest_for[budget()]
    with lc.strategy_mode(trainee, name):
        found = longest_sequence(probe, resolution=only or resolution, max_seq=only or max_seq,
                                 limit_bytes=limit, predict=predict, progress=say, label=name,
                                 first=only or first_probe(resolution, max_seq), on_probe=on_probe, known=known)
    found.setting = ran_with.get(found.longest)
    return found


def _missed(err: OutOfMemoryError, missed: list[int]) -> OutOfMemoryError:
    """``err``, carrying the lowest peak the cost model predicted for a setting that fit its budget yet ran out
    of memory (``None``: none did). The search keeps it on the failed probe, so that a search resumed from
    its report plans under the limit less the same shortfall as the whole search does."""
    err.missed_peak_bytes = min(missed, default=None)
    return err


def search_entry(found: SearchResult, done: bool = True) -> dict[str, Any]:
    """A strategy's search as the report keeps it: the longest length, its step, every probe; ``done``
    False for a search still under way (the report written after each probe keeps what it found)."""
    best = found.best
    return {"longest": found.longest, "capped": found.capped, "predicted": found.predicted, "done": done,
            "peak_bytes": best and best.peak_bytes, "host_bytes": best and best.host_bytes,
            "tokens_per_s": best and best.tokens_per_s, "setting": best.note if best else "",
            "probes": [dataclasses.asdict(p) for p in found.probes]}


#: What a resumed search must share with the report it goes on from: what its steps' memory depends on.
SAME_SEARCH = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "dtype", "batch", "lora_rank", "loss_chunk",
               "resolution", "memory_limit", "host_budget", "seed", "warmup", "steps")


def resumable(path: str, header: Mapping[str, Any]) -> tuple[dict[str, Any], int | None]:
    """``(the strategies' entries, its pinned host budget)`` of the long-context report at ``path`` (written
    with ``--json`` or ``--progress-json``), for a run whose report starts with ``header``
    (:func:`~offload_examples.instruments.report.report_header`; ``config`` at least); each entry's probes
    as :class:`Probe` under ``known``, for :func:`search_all`.

    The report must come from the same search: the sizes of :data:`SAME_SEARCH`, the device where
    ``header`` names it, strategies the run searches too, and probes as a search writes them (lengths
    that are multiples of the resolution up to the run's ``max_seq``, every one that ran shorter than
    every one that did not). Raises ``ValueError`` naming what differs or is malformed.
    """
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"cannot read the report to resume, {path}: {e}") from None
    if not isinstance(report, dict) or report.get("scenario") != "long-context" \
            or not isinstance(report.get("strategies"), dict) or not isinstance(report.get("config"), dict):
        raise ValueError(f"{path} is not a long-context report (one written by --json or --progress-json)")
    config = header["config"]
    for key in SAME_SEARCH:
        if report["config"].get(key) != config.get(key):
            raise ValueError(f"the report's search ran with {key} {report['config'].get(key)!r}, this one with "
                             f"{config.get(key)!r}: only the same search can be resumed")
    for key in ("device_type", "device"):
        if key in header and report.get(key) != header[key]:
            raise ValueError(f"the report's search ran on {report.get(key)!r}, this one on {header[key]!r}")
    if other := [name for name in report["strategies"] if name not in config["strategies"]]:
        raise ValueError(f"the report also searched {other}: name every strategy it searched (--strategies)")
    host = report.get("host_budget_bytes")
    if host is not None and (not _is_int(host) or host < 1):
        raise ValueError(f"the report's host_budget_bytes is not a positive number of bytes: {host!r}")
    entries = {name: _entry(name, entry, config) for name, entry in report["strategies"].items()}
    return entries, host


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63


_PROBE_TYPES = {"seq": _is_int, "ok": lambda v: isinstance(v, bool), "note": lambda v: isinstance(v, str),
                "why": lambda v: isinstance(v, str),
                **{k: lambda v: v is None or _is_int(v)
                   for k in ("peak_bytes", "host_bytes", "predicted_peak_bytes", "missed_peak_bytes")},
                "tokens_per_s": lambda v: v is None or isinstance(v, (int, float)) and not isinstance(v, bool)}


def _entry(name: str, entry: Any, config: Mapping[str, Any]) -> dict[str, Any]:
    """A strategy's entry of a stored report, checked as :func:`resumable` says, its probes under ``known``."""
    def bad(why: str) -> ValueError:
        return ValueError(f"the report's search of {name!r} is not what a search writes: {why}")

    if not isinstance(entry, dict) or not isinstance(entry.get("probes"), list):
        raise bad("no list of probes")
    done, longest, capped, predicted = (entry.get(k) for k in ("done", "longest", "capped", "predicted"))
    if not isinstance(done, (bool, type(None))) or not _is_int(longest) or not isinstance(capped, bool) \
            or not (predicted is None or _is_int(predicted)):
        raise bad("done, longest, capped or predicted missing or of the wrong type")
    known, resolution = [], config["resolution"]
    for p in entry["probes"]:
        if not isinstance(p, dict) or "seq" not in p or "ok" not in p \
                or not all(check(p[k]) for k, check in _PROBE_TYPES.items() if k in p) \
                or p["ok"] and (p.get("peak_bytes") is None or p.get("tokens_per_s") is None):
            raise bad(f"a probe with fields missing or of the wrong type: {p!r}")
        if p["seq"] % resolution or not resolution <= p["seq"] <= config["max_seq"]:
            raise bad(f"a probe at {p['seq']} tokens, not a multiple of {resolution} up to max_seq {config['max_seq']}")
        known.append(Probe(**{k: p[k] for k in _PROBE_TYPES if k in p}))
    ran, failed = [p.seq for p in known if p.ok], [p.seq for p in known if not p.ok]
    if ran and failed and max(ran) >= min(failed):
        raise bad(f"{max(ran)} tokens ran, but {min(failed)} did not")
    if longest != max(ran, default=0):
        raise bad(f"its longest, {longest}, is not the longest length its probes ran")
    if done is not False and (failed if capped else min(failed, default=None) != longest + resolution):
        raise bad("a finished search ends where a length ran and the next one did not, or at max_seq")
    found = SearchResult(longest, resolution, known, predicted, capped)  # the entry as a search would write it
    return {**search_entry(found, done is not False), "known": known}


def search_all(trainee: lc.Trainee, names: Sequence[str], costs: lc.CostModel | None, limit: int | None, host: int,
               say: Callable[[str], None], results: dict[str, Any], save: Callable[[], None],
               resumed: Mapping[str, Any] | None = None, **sizes: int) -> None:
    """Each strategy's search (:func:`search_strategy` at ``sizes``: resolution, max_seq, warmup, steps), its
    entry (:func:`search_entry`) in ``results`` after each probe, ``save`` called then. With ``resumed``
    (:func:`resumable`), every entry of the report is in ``results`` from the start; a search the report
    finished is kept as it is (unless it stopped at a shorter ``max_seq``), and the others go on from
    their probes, keeping their first prediction."""
    resumed = resumed or {}
    results.update({name: _stored(resumed[name]) for name in names if name in resumed})
    top = sizes["max_seq"] - sizes["max_seq"] % sizes["resolution"]
    for name in names:
        old = resumed.get(name, {})
        if old.get("done") and not (old["capped"] and old["longest"] < top):  # finished, up to this max_seq
            say(f"  [{name}] its search in the report is finished: {old['longest']} tokens")
            save()
            continue

        def entry(found: SearchResult, done: bool = True, first: int | None = old.get("predicted")) -> dict:
            return {**search_entry(found, done), **({"predicted": first} if first else {})}

        def so_far(found: SearchResult, name: str = name, entry: Callable = entry) -> None:  # a search cut short
            results[name] = entry(found, done=False)  # keeps what it found
            save()

        results[name] = entry(search_strategy(trainee, name, costs, limit, host, say, on_probe=so_far,
                                              known=old.get("known", ()), **sizes))
        save()
    ordered = {name: results[name] for name in names if name in results}  # this run's order, not the report's
    results.clear()
    results.update(ordered)


def _stored(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A stored entry as the report keeps it (its probes as stored, not as :class:`Probe`)."""
    return {k: v for k, v in entry.items() if k != "known"}


def as_dict(probe: Probe | None) -> dict[str, Any] | None:
    """A probe as the report stores it (``None`` stays ``None``)."""
    return probe and dataclasses.asdict(probe)


def _turns_entry(seq: int, probes: list[Probe], note: str, failed: str | None) -> dict[str, Any]:
    """One strategy's steps of :func:`take_turns`, as the report keeps them."""
    speeds = [p.tokens_per_s for p in probes]
    return {"seq": seq, "ok": bool(probes), "rounds": len(probes),
            "peak_bytes": max((p.peak_bytes for p in probes), default=None),
            "host_bytes": max((p.host_bytes for p in probes), default=None),
            "tokens_per_s": statistics.median(speeds) if speeds else None,
            "tokens_per_s_range": [min(speeds), max(speeds)] if speeds else None,
            "tokens_per_s_rounds": speeds, "note": "; ".join(filter(None, [note, failed]))}


def take_turns(trainee: lc.Trainee, settings: Mapping[str, lc.Setting], seq: int, *, limit_bytes: int | None,
               host_budget_bytes: int, rounds: int) -> dict[str, dict[str, Any]]:
    """The strategies' steps at ``seq`` tokens taking turns: ``rounds`` rounds of one step of each, in the
    orders of :func:`~offload_examples.instruments.measure.balanced_orders` taken in turn.

    Each step sets its strategy up (:func:`~offload_examples.instruments.long_context.strategies.strategy_mode`
    and :func:`~offload_examples.instruments.long_context.strategies.run_at` with ``settings[name]``, no
    warm-up) outside its timing. A strategy whose step runs out of memory leaves the turns, keeping its
    rounds so far, and its note says so; the others go on.

    Returns
    -------
    dict
        Per strategy: ``rounds`` (its steps), ``tokens_per_s`` (their median), ``tokens_per_s_range``
        (slowest and fastest), ``tokens_per_s_rounds`` (round by round), ``peak_bytes`` and ``host_bytes``
        (the most of any step), ``seq``, ``ok`` (a step ran) and ``note`` (what ran).
    """
    names = list(settings)
    orders = balanced_orders(len(names))
    probes: dict[str, list[Probe]] = {name: [] for name in names}
    failed: dict[str, str] = {}
    for r in range(rounds):
        for name in (names[i] for i in orders[r % len(orders)] if names[i] not in failed):
            try:
                with lc.strategy_mode(trainee, name):
                    probes[name].append(lc.run_at(trainee, settings[name], seq, limit_bytes=limit_bytes,
                                                  host_budget_bytes=host_budget_bytes, warmup=0, steps=1))
            except OutOfMemoryError:
                failed[name] = f"out of memory in round {r + 1} of the turns"
                free_memory(pinned=True)
    return {name: _turns_entry(seq, probes[name], settings[name].note, failed.get(name)) for name in names}


def _against(entries: dict[str, dict[str, Any]], reference: str) -> None:
    """Add to each entry but the reference its step time against the reference's, round by round
    (:func:`~offload_examples.instruments.measure.overhead_spread` of the time per token)."""
    ref = [1 / v for v in entries[reference]["tokens_per_s_rounds"]]
    for name, entry in entries.items():
        mine = [1 / v for v in entry["tokens_per_s_rounds"]]
        if name != reference and mine and ref:
            entry.update(against=reference, **overhead_spread(mine, ref))


def speeds_in_turns(trainee: lc.Trainee, names: Sequence[str], seq: int, costs: lc.CostModel | None,
                    limit: int | None, host: int, say: Callable[[str], None], *, warmup: int = 1,
                    steps: int = 1) -> dict[str, dict[str, Any]]:
    """The strategies ``names`` at ``seq`` tokens, compared step by step.

    First one probe of each (:func:`search_strategy` at ``seq`` alone, ``warmup`` and ``steps`` steps):
    it finds the setting that runs there (the engine's and the planner's may need a second try) and
    warms the strategy up at that length. Then the strategies that ran take turns
    (:func:`take_turns`) for
    :func:`~offload_examples.instruments.measure.balanced_rounds` rounds, and each one's step is compared with
    :data:`REFERENCE`'s of the same round (``against``, ``overhead``, ``overhead_quartiles`` and
    ``overhead_range``), where that one ran. A strategy whose probe did not run gets its probe.
    """
    free_memory(pinned=True)  # the searches' pinned blocks, cached for other lengths; the probes below share theirs
    found = {name: search_strategy(trainee, name, costs, limit, host, say, resolution=seq, max_seq=seq,
                                   warmup=warmup, steps=steps, only=seq) for name in names}
    settings = {name: f.setting for name, f in found.items() if f.setting is not None}
    entries: dict[str, dict[str, Any]] = {}
    if settings:
        rounds = balanced_rounds(len(settings), steps)
        say(f"  taking turns at {seq} tokens: {rounds} rounds of one step of each of {', '.join(settings)}")
        entries = take_turns(trainee, settings, seq, limit_bytes=limit, host_budget_bytes=host, rounds=rounds)
    if REFERENCE in entries and entries[REFERENCE]["ok"]:
        _against(entries, REFERENCE)
    return {name: entries.get(name) or as_dict(f.best or (f.probes[-1] if f.probes else None))
            for name, f in found.items()}


def at_checkpoints_longest(trainee: lc.Trainee, costs: lc.CostModel | None, limit: int | None, host: int,
                           results: dict[str, Any], say: Callable[[str], None], *, warmup: int = 1,
                           steps: int = 1) -> tuple[int, dict[str, Any]]:
    """``(checkpointing's longest length, {strategy: its steps there})`` for checkpointing and the
    strategies that ran at least as long, their steps taking turns (:func:`speeds_in_turns`): what the
    longer sequences cost in speed where checkpointing still runs."""
    seq = (results.get("checkpoint") or {}).get("longest") or 0
    longer = [n for n, r in results.items() if n != "checkpoint" and seq and r["longest"] >= seq]
    if not longer:
        return seq, {}
    say(f"at {seq} tokens, the longest checkpointing ran:")
    return seq, speeds_in_turns(trainee, ["checkpoint", *longer], seq, costs, limit, host, say, warmup=warmup,
                                steps=steps)


def where_they_meet(trainee: lc.Trainee, costs: lc.CostModel | None, limit: int | None, host: int,
                    report: dict[str, Any], say: Callable[[str], None], save: Callable[[], None], *,
                    warmup: int = 1, steps: int = 1) -> None:
    """Fill ``report``'s speeds where the searched strategies (its ``strategies``) meet: every one at the
    longest length all of them ran (``common_seq``, ``at_common``), then checkpointing and those that ran
    at least as long at checkpointing's longest (``checkpoint_seq``, ``at_checkpoint``); ``save`` after each."""
    results = report["strategies"]
    common = report["common_seq"] = min((r["longest"] for r in results.values() if r["longest"]), default=0)
    ran = [name for name, r in results.items() if common and r["longest"]]
    say(f"every strategy at {common} tokens, the longest all of them ran:")
    report["at_common"] = speeds_in_turns(trainee, ran, common, costs, limit, host, say, warmup=warmup,
                                          steps=steps) if ran else {}
    save()
    report["checkpoint_seq"], report["at_checkpoint"] = at_checkpoints_longest(
        trainee, costs, limit, host, results, say, warmup=warmup, steps=steps)
    save()


def _turn_row(name: str, t: dict[str, Any]) -> tuple[str, ...]:
    """One strategy's steps taken in turns: tokens/s (median, slowest and fastest), and its step against
    the reference's with the quartiles and extremes over the rounds."""
    speeds = (name, f"{t['tokens_per_s']:,.0f}", "{:,.0f}–{:,.0f}".format(*t["tokens_per_s_range"]))
    if "overhead" not in t:
        return (*speeds, "(reference)" if name == REFERENCE else "-", "", "")
    return (*speeds, f"{t['overhead']:+.1%}", "{:+.1%} .. {:+.1%}".format(*t["overhead_quartiles"]),
            "{:+.1%} .. {:+.1%}".format(*t["overhead_range"]))


def format_turns(turns: dict[str, Any], seq: int, where: str) -> list[str]:
    """The lines of a report that give the strategies' steps at ``seq`` tokens taking turns
    (:func:`speeds_in_turns`), a row each: tokens/s (median, slowest and fastest) and the step against
    :data:`REFERENCE`'s with its quartiles and extremes; ``where`` says what the length is. None where
    no strategy took turns (a report whose speeds there are single steps)."""
    rows = [_turn_row(name, t) for name, t in turns.items() if t and t.get("rounds")]
    if not rows:
        return []
    rounds = max(t["rounds"] for t in turns.values() if t and t.get("rounds"))
    return ["", f"at {seq:,} tokens, {where}: {rounds} rounds taking turns, one step of each strategy a round",
            format_table(rows, header=("strategy", "tokens/s", "slowest–fastest", f"step vs {REFERENCE}",
                                       "quartiles", "min–max")),
            f"step vs {REFERENCE}: the median over the rounds of a step's time over {REFERENCE}'s "
            "step in the same round, less one; quartiles, min–max: of that ratio over the rounds"]
