"""The longest sequence whose training step completes: predicted from memory, then confirmed by steps.

:func:`longest_sequence` probes lengths that are multiples of a resolution. Each probe runs a training
step (``run(seq)``, which returns a :class:`Probe`); one that runs out of memory raises
``torch.OutOfMemoryError``, which the search catches and goes on. Before every probe (of a search over
several lengths), and after a failed one, it frees what steps left
(:func:`~offload_examples.instruments.measure.free_memory`), the pinned host blocks PyTorch caches
included. The first two probes (a length and twice it, :func:`first_probe`) measure how the step's peak
memory grows with the length; a line through the successful probes' peaks (a parabola once three are
known, for attention kernels whose memory grows with the square of the length) predicts the longest
length under the limit, and the next probes confirm it: the predicted length, then its neighbours, until
a length that runs sits one resolution below one that does not (or at ``max_seq``). A prediction that
misses twice in a row (a caller's model, once) gives way to bisection between the longest length that ran
and the shortest that did not, and two successes in a row to steps that double: the search always ends,
after three or four probes where memory grows as measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from offload_examples.instruments.long_context.memory import OutOfMemoryError
from offload_examples.instruments.measure import free_memory
from offload_examples.instruments.report import format_bytes

__all__ = ["Probe", "SearchResult", "first_probe", "longest_multiple", "longest_sequence", "predict_longest"]


@dataclass
class Probe:
    """One training step at one length: whether it completed, and what it took.

    ``peak_bytes``: the step's peak device memory; ``host_bytes``: the pinned host memory the offload
    engine held at once, as the pinned allocator reserves it (each buffer rounded up to a power of two);
    ``tokens_per_s``: tokens trained per second (median step time); ``note``: why it failed, or what the
    strategy ran (the plan, the number of offloaded layers); ``predicted_peak_bytes``: the peak the cost
    model predicted for what ran, where a model predicts it (the engine, the planner, checkpointing with
    offloaded inputs); ``why``: why the search tried this length (``first``, ``predicted``, ``bisect``, ...),
    so that a resumed search knows what its last probe was; ``missed_peak_bytes``: the lowest peak the cost
    model predicted for a setting that fit its budget at this length yet ran out of memory (the error's
    ``missed_peak_bytes`` for a length that failed), so that a resumed search learns what the model missed.
    """

    seq: int
    ok: bool
    peak_bytes: int | None = None
    host_bytes: int | None = None
    tokens_per_s: float | None = None
    note: str = ""
    predicted_peak_bytes: int | None = None
    why: str = ""
    missed_peak_bytes: int | None = None


@dataclass
class SearchResult:
    """The longest length that ran (0: not even ``resolution``), every probe in the order run, the first
    prediction, and whether the search stopped at ``max_seq`` (the longest length it may try) rather
    than at a failure. ``setting``: what ran at the longest length, where the caller's ``run`` tells
    (the long-context strategies' :class:`~offload_examples.instruments.long_context.strategies.Setting`)."""

    longest: int
    resolution: int
    probes: list[Probe] = field(default_factory=list)
    predicted: int | None = None
    capped: bool = False
    setting: object | None = None

    @property
    def best(self) -> Probe | None:
        """The probe at ``longest`` (its last run), or ``None``."""
        return next((p for p in reversed(self.probes) if p.ok and p.seq == self.longest), None)


def predict_longest(points: list[tuple[int, int]], limit_bytes: int | None, resolution: int, max_seq: int) -> int:
    """The longest multiple of ``resolution`` (at most ``max_seq``) whose peak, fitted to ``points``
    (``(seq, peak_bytes)`` of steps that ran), stays within ``limit_bytes``; ``max_seq`` without a limit
    or with fewer than two lengths measured."""
    seqs = sorted({s for s, _ in points})
    if limit_bytes is None or len(seqs) < 2:
        return max_seq
    peak = {s: max(b for t, b in points if t == s) for s in seqs}
    xs = torch.tensor(seqs, dtype=torch.float64)
    ys = torch.tensor([peak[s] for s in seqs], dtype=torch.float64)
    degree = 2 if len(seqs) >= 3 else 1
    coeffs = torch.linalg.lstsq(torch.stack([xs ** d for d in range(degree + 1)], 1), ys[:, None]).solution[:, 0]
    if degree == 2 and coeffs[2] < 0:  # memory does not grow slower than linearly: fit a line instead
        degree, coeffs = 1, torch.linalg.lstsq(torch.stack([xs ** 0, xs], 1), ys[:, None]).solution[:, 0]
    return longest_multiple(lambda seq: sum(float(c) * float(seq) ** d for d, c in enumerate(coeffs)) <= limit_bytes,
                            resolution, max_seq)


def first_probe(resolution: int, max_seq: int) -> int:
    """The search's first length: a sixty-fourth of ``max_seq``, a multiple of ``resolution``, at least one.

    The first two probes give the slope that predicts the limit. At lengths of a few thousand tokens the
    step's peak is set by memory that does not grow with the length (a chunk of logits, the kernels'
    workspaces), so a slope measured there falls short of the one near the limit, and the prediction
    overshoots by tens of percent: each miss then costs a step at the longest lengths, which take minutes.
    A sixty-fourth of the longest length tried is long enough for the length's own memory to set the
    peak where ``max_seq`` is far beyond the short lengths, and its step takes a few seconds where one
    near ``max_seq`` takes minutes (attention's work grows with the square of the length).
    """
    return max(resolution, max_seq // 64 // resolution * resolution)


def longest_multiple(fits: Callable[[int], bool], resolution: int, max_seq: int) -> int:
    """The longest multiple of ``resolution``, at most ``max_seq``, for which ``fits`` holds (0 if none), by
    bisection: ``fits`` must hold for every length below one where it holds, as a peak that grows does."""
    lo, hi = 0, max_seq // resolution  # in resolutions
    while lo < hi:
        n = (lo + hi + 1) // 2
        if fits(n * resolution):
            lo = n
        else:
            hi = n - 1
    return lo * resolution


def longest_sequence(run: Callable[[int], Probe], *, resolution: int, max_seq: int, limit_bytes: int | None,
                     predict: Callable[[list[tuple[int, int]]], int] | None = None,
                     progress: Callable[[str], None] | None = None, label: str = "",
                     first: int | None = None, on_probe: Callable[[SearchResult], None] | None = None,
                     known: Sequence[Probe] = ()) -> SearchResult:
    """Search the longest length, a multiple of ``resolution`` up to ``max_seq``, at which ``run`` completes.

    ``run(seq)`` runs the training step at ``seq`` tokens and returns its :class:`Probe`; running out of
    memory is ``torch.OutOfMemoryError`` (a failed probe). The result's longest length ran and the next
    multiple of ``resolution`` did not (or the longest is ``max_seq``): it is within ``resolution`` of
    the true boundary, provided the steps' memory grows with the length. ``predict`` replaces the fit
    (:func:`predict_longest`) for a strategy that changes what it does with the length, whose peaks lie
    on no one curve: given the ``(seq, peak_bytes)`` measured so far, it returns the longest length it
    expects to run. Such a model's miss is followed by bisection at once, not by the length just below
    it: a model measured at short lengths that overshoots once overshoots its neighbour too (a fitted
    line, which goes through peaks measured near the limit, is tried once more just below). ``progress``
    gets one line per probe. ``first``: the first probe's length, a multiple of ``resolution`` (default:
    one resolution; :func:`first_probe` picks one for long searches), the second
    twice it; where ``first`` does not run, one resolution is tried next. ``on_probe`` gets the result so
    far after each probe (its ``longest`` the longest length that ran yet), so that a caller can keep a
    search that is cut short. ``known``: probes a search of the same steps already ran (a search cut short,
    resumed): they count as if run first (a known model's miss last is followed by bisection), and the
    search goes on from them without running them again.
    """
    if resolution < 1 or max_seq < 1:
        raise ValueError(f"resolution and max_seq must be positive, got {resolution} and {max_seq}")
    if max_seq < resolution:
        raise ValueError(f"max_seq ({max_seq}) must be at least one resolution ({resolution})")
    first = resolution if first is None else first
    if not isinstance(first, int) or isinstance(first, bool) or first < resolution or first % resolution \
            or first > max_seq:
        raise ValueError(f"first ({first!r}) must be a whole multiple of resolution ({resolution}), at least one, "
                         f"and at most max_seq ({max_seq})")
    max_seq -= max_seq % resolution
    if bad := [p.seq for p in known if p.seq % resolution or not resolution <= p.seq <= max_seq]:
        raise ValueError(f"known probes at {bad} tokens: each must be a multiple of resolution ({resolution}) up to "
                         f"max_seq ({max_seq})")
    say = progress or (lambda _: None)
    result = SearchResult(0, resolution)
    lo, hi = 0, max_seq + resolution  # the longest that ran, the shortest that did not (or past max_seq)
    streak = 0  # successes in a row (> 0) or failures in a row (< 0)
    missed = False  # the last probe was a predicted length that did not run

    def record(p: Probe, why: str) -> None:
        nonlocal lo, hi, streak, missed
        result.probes.append(p)
        missed = not p.ok and why in ("predicted", "below")
        if p.ok:
            lo, streak = max(lo, p.seq), max(streak, 0) + 1
        else:
            hi, streak = min(hi, p.seq), min(streak, 0) - 1
        result.longest = lo

    for p in known:  # as if run here: a model's miss last is followed by bisection, as it would have been
        record(p, p.why or "known")
    if known:
        say(f"  [{label}] resumed from {len(known)} probes: {lo} tokens ran, "
            + (f"{hi} did not" if hi <= max_seq else "none failed"))

    def probe(seq: int, why: str) -> None:
        # before every probe of a search over lengths (each at a length of its own): PyTorch's pinned allocator
        # caches the blocks a step gave back, by power-of-two size, and a block reserved for one length's tensors
        # rarely fits the next length's, so without this the cached blocks of each length tried stack up in host
        # memory that the host budget does not count. A search at one length (strategies warmed up there, to
        # take turns) keeps what the others left at that length
        if max_seq > resolution:
            free_memory(pinned=True)
        try:
            p = run(seq)
        except OutOfMemoryError as e:
            p = Probe(seq, False, note=f"out of memory: {str(e).splitlines()[0][:120]}",
                      missed_peak_bytes=getattr(e, "missed_peak_bytes", None))
            free_memory(pinned=True)  # what the failed step held, its pinned copies included
        p.why = why
        record(p, why)
        say(f"  [{label}] {why:>10} {seq:>8} tokens: " + (_ok_text(p) if p.ok else p.note))
        if on_probe is not None:
            on_probe(result)

    if not lo and first < hi:
        probe(first, "first")
    if not lo and resolution < min(first, hi):  # too long to start with: the shortest length then
        probe(resolution, "shortest")
    if lo and len({p.seq for p in result.probes if p.ok}) < 2 and 2 * lo < hi and 2 * lo <= max_seq:
        probe(2 * lo, "slope")
    up = resolution  # the step above the longest that ran, when the fit predicts nothing longer
    for p in known:  # a resumed search gallops on as it would have
        up = 2 * up if p.why in ("confirm", "gallop") and p.ok else resolution
    while lo and hi - lo > resolution:
        points = [(p.seq, p.peak_bytes) for p in result.probes if p.ok and p.peak_bytes is not None]
        fitted = predict is not None or len({s for s, _ in points}) >= 2  # one length says nothing of the slope
        if fitted:
            guess = predict(points) if predict else predict_longest(points, limit_bytes, resolution, max_seq)
            guess -= guess % resolution
            if result.predicted is None:
                result.predicted = guess
        # nothing to predict from, or the fit overshot twice, or the caller's model once (at the longest lengths a
        # step that runs out of memory costs minutes, and the model's miss says little of the length below): bisect
        if not fitted or streak <= -2 or (predict is not None and missed):
            guess, why = (lo + hi) // 2 // resolution * resolution, "bisect"
        elif guess <= lo:  # the fit says nothing longer runs: confirm one step above, doubling while it runs
            guess, why = lo + up, "confirm" if up == resolution else "gallop"
        else:
            why = "predicted" if guess < hi else "below"
        guess = min(max(guess, lo + resolution), hi - resolution)
        probe(guess, why)
        up = 2 * up if why in ("confirm", "gallop") and result.probes[-1].ok else resolution
    result.longest = lo
    result.capped = lo == max_seq
    return result


def _ok_text(p: Probe) -> str:
    parts = [f"ran, peak {format_bytes(p.peak_bytes)}" if p.peak_bytes is not None else "ran"]
    if p.predicted_peak_bytes:  # how far the cost model was off, length by length
        parts[0] += f" (predicted {format_bytes(p.predicted_peak_bytes)})"
    if p.host_bytes:
        parts.append(f"pinned host {format_bytes(p.host_bytes)}")
    if p.tokens_per_s is not None:
        parts.append(f"{p.tokens_per_s:,.0f} tokens/s")
    return ", ".join(parts) + (f" ({p.note})" if p.note else "")
