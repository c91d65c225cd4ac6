"""Run training steps with or without offloading and measure them the same way.

Memory is CUDA's peak *allocated* bytes during the measured steps (what tensors really used, not
what the caching allocator reserved). Time is measured with CUDA events on the compute stream,
or with ``time.perf_counter`` on the CPU.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "GradCheck", "Measurement", "StepReport", "balanced_orders", "balanced_rounds", "compare_grads", "compare_tensors",
    "deterministic_kernels", "free_memory", "host_copy", "local_part", "measure_paired", "measure_round_robin",
    "measure_stage_steps", "measure_steps", "memory_by_phase", "overhead_spread", "paired_overhead", "quartiles",
    "resident_vs_theory", "snapshot", "training_step",
]

Progress = Callable[[str], None]


def training_step(
    layers: Iterable[nn.Module],
    x: torch.Tensor,
    ctx: contextlib.AbstractContextManager | None = None,
    sync: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Forward every layer inside ``ctx`` (passing outputs through ``sync``), then backward.

    Returns the detached output of the last layer.
    """
    ctx = ctx if ctx is not None else contextlib.nullcontext()
    h = x
    for layer in layers:
        with ctx:
            h = layer(h)
        if sync is not None:
            h = sync(h)
    h.float().square().mean().backward()
    return h.detach()


@dataclass
class Measurement:
    """What :func:`measure_steps` saw.

    Attributes
    ----------
    step_ms:
        Wall time of each measured step, in milliseconds.
    peak_bytes:
        Peak CUDA memory allocated during the measured steps (``None`` on the CPU).
    baseline_bytes:
        CUDA memory allocated before the steps (weights and inputs).
    output:
        The last step's output, copied to host memory so that keeping it does not change the
        next measurement's peak.
    grads:
        The last step's gradients (parameters by name, and ``"input"``), copied to host memory
        like :attr:`output`.
    """

    label: str
    step_ms: list[float]
    peak_bytes: int | None
    baseline_bytes: int | None
    output: torch.Tensor
    grads: dict[str, torch.Tensor] = field(repr=False)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def activation_peak_bytes(self) -> int | None:
        """Peak minus baseline: what the steps themselves added on top of weights and inputs."""
        return None if self.peak_bytes is None else self.peak_bytes - self.baseline_bytes


def _zero_grads(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    x.grad = None


def _timed(fn: Callable[[], torch.Tensor], cuda: bool) -> tuple[float, torch.Tensor]:
    """Run ``fn`` once; its time in ms (CUDA events on the current stream, else the host clock)."""
    if not cuda:
        start = time.perf_counter()
        out = fn()
        return (time.perf_counter() - start) * 1e3, out
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    out = fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end), out


class StepReport:
    """Progress of a measurement: a line when the warm-up ends, one with the median at the end,
    and one whenever ``every_s`` seconds have passed without a line (slow steps stay visible).

    Call :meth:`step` after each step with its index, its time and the measured times so far.
    """

    def __init__(self, progress: Progress | None, label: str, warmup: int, steps: int, every_s: float = 5.0):
        self.progress, self.label, self.warmup, self.total = progress, label, warmup, warmup + steps
        self.every_s = every_s
        self.last = time.perf_counter()

    def step(self, i: int, ms: float, times: list[float]) -> None:
        """Report step ``i`` (counting the warm-up), which took ``ms``; ``times`` are the measured steps so far."""
        if self.progress is None:
            return
        if i == self.total - 1:
            line = f"{len(times)} step{'s' * (len(times) != 1)}, median {statistics.median(times):.1f} ms (min {min(times):.1f}, max {max(times):.1f})"
        elif i == self.warmup - 1:
            line = f"warm-up: {self.warmup} step{'s' * (self.warmup != 1)}, the last {ms:.1f} ms"
        elif time.perf_counter() - self.last >= self.every_s:
            line = f"step {i + 1}/{self.total}: {ms:.1f} ms"
        else:
            return
        self.progress(f"  [{self.label}] {line}")
        self.last = time.perf_counter()


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` where it is sharded (a DTensor, as FSDP2's parameters and their
    gradients are); ``t`` itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` in host memory; of this rank's part where ``t`` is sharded."""
    return local_part(t).detach().to("cpu", copy=True)


def snapshot(model: nn.Module, x: torch.Tensor, out: torch.Tensor, label: str = "") -> Measurement:
    """Copy the output and every gradient (parameters and ``x``) to host memory, leaving them in place.

    For steps whose tensors must stay where they are, such as a replayed CUDA graph's. A sharded
    gradient (FSDP2's) is copied as this rank's part (:func:`host_copy`).
    """
    grads = {name: host_copy(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    if x.grad is not None:
        grads["input"] = host_copy(x.grad)
    return Measurement(label, [], None, None, host_copy(out), grads)


def _finish(label: str, model: nn.Module, x: torch.Tensor, times: list[float], peak, baseline, out) -> Measurement:
    m = snapshot(model, x, out, label)
    _zero_grads(model, x)
    return Measurement(label, times, peak, baseline, m.output, m.grads)


def measure_steps(
    model: nn.ModuleList,
    x: torch.Tensor,
    ctx: contextlib.AbstractContextManager | None = None,
    sync: Callable[[torch.Tensor], torch.Tensor] | None = None,
    *,
    steps: int = 3,
    warmup: int = 1,
    label: str = "",
    progress: Progress | None = None,
    step: Callable[[], torch.Tensor] | None = None,
) -> Measurement:
    """Run ``warmup`` then ``steps`` training steps and measure the latter.

    ``step`` replaces :func:`training_step` (a pipeline order, a manual schedule); it runs
    forward and backward and returns the output.

    On CUDA the allocator's cached blocks are given back first (:func:`free_memory`): blocks that
    earlier work left free are handed out larger than asked, so without that the peak would depend
    on what the process ran before.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    cuda = x.is_cuda
    if cuda:
        free_memory()
    run = step if step is not None else (lambda: training_step(model, x, ctx, sync))
    times: list[float] = []
    peak = baseline = None
    report = StepReport(progress, label, warmup, steps)
    for i in range(warmup + steps):
        _zero_grads(model, x)
        out = None  # the last step's output would count in this step's peak
        measured = i >= warmup
        if cuda and i == warmup:
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        ms, out = _timed(run, cuda)
        if measured:
            times.append(ms)
        report.step(i, ms, times)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    return _finish(label, model, x, times, peak, baseline, out)



def measure_stage_steps(cases: Mapping[str, tuple[Callable[[], None], nn.Module]], params: nn.Module, steps: int,
                        device: torch.device) -> dict[str, dict[str, Any]]:
    """One pipeline stage's steps on one rank, each case measured the same way, the cases taking turns.

    ``cases`` maps a name to ``(step, stage)``: ``step`` runs one step of the pipeline's schedule
    through ``stage``, whose ``ctx`` is its offload context and whose ``offloading`` switches it;
    ``params`` holds the stage's parameters, shared by the cases. First each case's step that also
    infers shapes, outside the context; then ``steps + 1`` rounds, one step of each case in each,
    the first round a warm-up and the last recording memory at every phase start; then one more step
    of each case under deterministic kernels. The cases take turns step by step in the
    :func:`balanced_orders` (every rank the same way, as a pipeline's ranks must), so that drift of the
    GPU or the host meets all of them alike.

    Returns
    -------
    dict
        Per case: ``memory_trace``, ``activation_peak_bytes`` and ``step_ms`` (both ``None`` off CUDA),
        ``step_ms_by_round`` (empty off CUDA), the engine's ``theory`` and ``stats`` after the measured
        steps, and the last step's ``grads`` (parameter name -> gradient, on the host).
    """
    cuda = device.type == "cuda"
    out = {name: {"times": [], "peak": None} for name in cases}
    for step, stage in cases.values():
        # The first step also runs one forward to infer shapes: keep it out of the context,
        # which counts model_layers entries per step.
        stage.offloading = False
        step()
        stage.offloading = True
    names, orders = list(cases), balanced_orders(len(cases))
    for i in range(steps + 1):  # the first round is a warm-up
        for name in (names[j] for j in orders[i % len(orders)]):
            step, stage = cases[name]
            ms, peak = _stage_step(step, stage, params, cuda, record_memory=i == steps)
            if i and cuda:
                out[name]["times"].append(ms)
                out[name]["peak"] = max(out[name]["peak"] or 0, peak)
            dist.barrier()
    for name, (step, stage) in cases.items():
        # read the last measured step before the gradient check runs another (with other kernels)
        result = out[name]
        result.update(memory_trace=list(stage.ctx.memory_trace), theory=stage.ctx.theoretical(),
                      stats=list(stage.ctx.stats))
        with deterministic_kernels():  # one more step with bit-reproducible kernels for the comparison
            params.zero_grad(set_to_none=True)
            step()
        result["grads"] = {n: p.grad.to("cpu", copy=True) for n, p in params.named_parameters() if p.grad is not None}
        times = result.pop("times")
        result.update(activation_peak_bytes=result.pop("peak"), step_ms_by_round=times,
                      step_ms=statistics.median(times) if times else None)
    return out


def _stage_step(step: Callable[[], None], stage: nn.Module, params: nn.Module, cuda: bool,
                record_memory: bool) -> tuple[float | None, int | None]:
    """One step of a pipeline stage: its time (CUDA events) and peak bytes above the start, on CUDA."""
    params.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    stage.ctx.record_memory = record_memory  # memory at every phase start
    step()
    stage.ctx.record_memory = False
    if not cuda:
        return None, None
    end.record()
    end.synchronize()
    return start.elapsed_time(end), torch.cuda.max_memory_allocated() - base


def measure_paired(
    model: nn.ModuleList,
    x: torch.Tensor,
    reference: Callable[[], torch.Tensor],
    step: Callable[[], torch.Tensor],
    *,
    steps: int = 10,
    warmup: int = 2,
    label: str = "",
) -> tuple[Measurement, list[float]]:
    """Alternate a reference step and ``step``; measure both, and the memory of ``step`` alone.

    Run-to-run drift of a GPU (clocks, temperature, neighbours) is often as large as the
    overheads being measured. Alternating the two steps exposes both to the same drift, so the
    ratio of each pair (:func:`paired_overhead`) is far steadier than the ratio of two separate runs.
    The pairs take turns at which step goes first (:func:`measure_round_robin` with two runs), so
    that what a step leaves to the next (the host's caches and garbage, the allocator's state) falls
    on both alike. An odd ``steps`` is rounded up to the next even number: with one order more often
    than the other, the median of the pairs' ratios would lean to that order's.

    Returns
    -------
    tuple
        The :class:`Measurement` of ``step`` (its memory measured as :func:`measure_round_robin`
        measures it) and the reference's step times, pair by pair.
    """
    measured = measure_round_robin({"reference": (model, x, reference), "step": (model, x, step)},
                                   steps=steps + steps % 2, warmup=warmup)
    return replace(measured["step"], label=label), measured["reference"].step_ms


#: One run of :func:`measure_round_robin`: its layers, its input, and a callable that runs one training step
#: (forward and backward) and returns the output; the gradients are cleared before it is called.
Run = tuple[nn.Module, torch.Tensor, Callable[[], torch.Tensor]]


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` runs in which each run comes right after every other run equally often (Williams).

    Taking the rows in turn, every run holds every position, and follows every other run, as often as
    any other: what a step leaves to the next (caches, clocks, the allocator's state) then falls on all
    runs alike. ``n`` rows for an even ``n``, ``2 n`` for an odd one. The balance holds within rows:
    where rows run back to back, the step that ends one row and the one that starts the next are a
    pair it does not balance.
    """
    base, low, high = [0], 1, n - 1
    while len(base) < n:  # 0, 1, n-1, 2, n-2, ...
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    rows = [[(b + i) % n for b in base] for i in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def balanced_rounds(runs: int, at_least: int) -> int:
    """The fewest rounds, at least ``at_least`` (and one), that take :func:`balanced_orders` of ``runs`` runs
    in whole cycles: each run then goes first, and follows every other, equally often."""
    cycle = len(balanced_orders(runs))
    return -(-max(at_least, 1) // cycle) * cycle


def measure_round_robin(runs: Mapping[str, Run], *, steps: int = 10, warmup: int = 2) -> dict[str, Measurement]:
    """Take turns step by step between several runs; one :class:`Measurement` per run.

    Each round runs every step once. The measured rounds take their orders from
    :func:`balanced_orders` in turn, so that drift and whatever a step leaves to the next (clocks,
    caches, the host's speed) fall on every run alike once ``steps`` is a multiple of their number
    (``len(runs)`` rounds for an even number of runs, twice that for an odd one). The runs' ``step_ms``
    line up round by round: ``paired_overhead(a.step_ms, b.step_ms)`` compares two runs within rounds, as
    :func:`measure_paired` does for two. ``warmup`` rounds come first.

    The steps' memory is measured from a reset right before each of them, since the other runs' outputs and
    gradients come and go between them: ``activation_peak_bytes`` is the most one step added on top of what
    was allocated before it (its ``peak_bytes`` and ``baseline_bytes`` are that step's). Runs may share a
    model or an input: gradients are cleared before every step, and each run's output and gradients are
    copied right after its last step.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    if not runs:
        raise ValueError("measure_round_robin needs at least one run")
    names = list(runs)
    orders = balanced_orders(len(names))
    cuda = runs[names[0]][1].is_cuda
    times: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, tuple[int, int] | None] = dict.fromkeys(names)  # the step that added most: (peak, baseline)
    out: dict[str, Measurement] = {}
    for r in range(warmup + steps):
        for name in (names[i] for i in orders[(r - warmup) % len(orders)]):
            model, x, step = runs[name]
            _zero_grads(model, x)
            result = None  # the last step's output would count in this step's peak
            if cuda:
                torch.cuda.synchronize()
                baseline = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            ms, result = _timed(step, cuda)
            if r < warmup:
                continue
            times[name].append(ms)
            if cuda:
                peak = torch.cuda.max_memory_allocated()
                if peaks[name] is None or peak - baseline > peaks[name][0] - peaks[name][1]:
                    peaks[name] = (peak, baseline)
            if r == warmup + steps - 1:  # its last step: keep its output and gradients before another run's
                peak, baseline = peaks[name] or (None, None)
                out[name] = _finish(name, model, x, times[name], peak, baseline, result)
    return {name: out[name] for name in names}


def paired_overhead(times: list[float], reference_ms: list[float]) -> float:
    """Median over pairs of ``time / reference - 1``."""
    return statistics.median(t / r for t, r in zip(times, reference_ms)) - 1


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The lower and upper quartile of ``values`` (at least one). The inclusive method stays within the
    extremes, so a spread over a few rounds never reaches beyond what a round measured."""
    if len(values) == 1:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def overhead_spread(times: list[float], reference_ms: list[float]) -> dict[str, Any]:
    """Round by round ``time / reference - 1``: its median and how far the rounds spread.

    Parameters
    ----------
    times, reference_ms:
        Two runs' step times, round by round (as :func:`measure_round_robin` lines them up); pairs
        beyond the shorter list are left out.

    Returns
    -------
    dict
        ``overhead`` (:func:`paired_overhead`), ``overhead_quartiles`` (the first and third quartile
        of the rounds' ratios less one, inclusive: within the extremes, and equal to them for one
        round) and ``overhead_range`` (the lowest and highest round).
    """
    ratios = [t / r - 1 for t, r in zip(times, reference_ms)]
    if not ratios:
        raise ValueError("overhead_spread needs at least one round of both runs")
    return {"overhead": paired_overhead(times, reference_ms), "overhead_quartiles": list(quartiles(ratios)),
            "overhead_range": [min(ratios), max(ratios)]}


def free_memory(*, pinned: bool = False) -> None:
    """Give back what the last run left before the next one is measured: its graph (the garbage
    collector breaks the cycles an exception's frames make) and CUDA's cached blocks; with ``pinned``,
    the pinned host blocks PyTorch's caching host allocator keeps too (they count against a host budget,
    but a run that measures pinning costs would find them gone)."""
    gc.collect()
    if not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()  # blocks still used by queued work are freed only once it has run
    torch.cuda.empty_cache()
    if pinned and (host_empty := getattr(torch._C, "_host_emptyCache", None)) is not None:  # torch >= 2.5
        host_empty()


def requested_bytes() -> int:
    """The bytes CUDA tensors asked the caching allocator for, once the device is idle.

    ``memory_allocated`` counts the blocks handed out instead, and a block may be up to 1 MiB larger
    than asked (a remainder that small is not split off): which blocks are free depends on everything
    the process ran before, so a difference of a few MiB measured that way moves from one run to the
    next. A tensor freed while another stream still used it (``record_stream``, as the engine's copies
    do) leaves the requested count only when the allocator next looks at its pending events, which it
    does on an allocation: so this synchronizes and allocates one byte before reading.
    """
    torch.cuda.synchronize()
    torch.empty(1, dtype=torch.uint8, device="cuda")  # an allocation: the allocator retires finished streams' frees
    return torch.cuda.memory_stats().get("requested_bytes.all.current", 0)


def graph_pools_bytes() -> int:
    """Bytes the caching allocator holds in CUDA graphs' private pools, free or not. A capture's pool
    is the growth of this across it; the growth of ``memory_reserved`` would also count eager work
    around the capture, as much as the blocks left free by earlier work do not absorb it."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0))


@contextlib.contextmanager
def deterministic_kernels() -> Iterator[None]:
    """Run only kernels that give bit-identical results from run to run.

    Flash and cuDNN attention accumulate gradients with atomics, so two identical backward
    passes differ in the last bits with or without offloading. Inside this block attention uses
    the memory-efficient kernel (or math), and PyTorch's deterministic mode makes it, and every
    other op, take its deterministic algorithm or raise. Bitwise comparisons run inside this
    block; timings do not.
    """
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.use_deterministic_algorithms(True)
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


@dataclass
class GradCheck:
    """Result of comparing two runs' outputs and gradients bit for bit."""

    equal: bool
    compared: int
    max_abs_diff: float
    mismatched: list[str]


def compare_grads(a: Measurement, b: Measurement) -> GradCheck:
    """Compare outputs and every gradient of two measurements exactly (``rtol=0, atol=0``)."""
    if a.grads.keys() != b.grads.keys():
        raise ValueError(f"the runs have different gradients: {sorted(a.grads.keys() ^ b.grads.keys())}")
    return compare_tensors({"output": a.output, **a.grads}, {"output": b.output, **b.grads})


def compare_tensors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> GradCheck:
    """Compare two sets of named tensors exactly; a name only one set has counts as a mismatch (and makes
    ``max_abs_diff`` infinite, as does a shape that differs)."""
    mismatched = sorted(a.keys() ^ b.keys())
    worst = float("inf") if mismatched else 0.0
    for name in (k for k in a if k in b):
        x, y = a[name], b[name]
        if not torch.equal(x, y):
            mismatched.append(name)
            worst = max(worst, (x.float() - y.float()).abs().max().item() if x.shape == y.shape else float("inf"))
    return GradCheck(not mismatched, len(a.keys() | b.keys()), worst, mismatched)


def resident_vs_theory(engine) -> list[tuple[str, int, int, int]]:
    """Pair the engine's resident offloadable bytes with the schedule's prediction.

    Returns ``(phase, layer, measured, expected)`` for each phase of the last iteration.
    """
    expected = {(phase, j): offloaded for phase, j, offloaded, _ in engine.theoretical().points}
    return [(phase, j, got, expected.get((phase, j), -1)) for phase, j, got in engine.resident_trace]


def memory_by_phase(model: nn.ModuleList, x: torch.Tensor, ctx, sync) -> list[tuple[str, int, int]]:
    """CUDA memory allocated at the start of every layer's forward and backward, for one step.

    ``ctx`` must be an :class:`~offload_examples.core.engine.OffloadEngine` (use ``num_layers=0`` for a
    run without offloading through the same hooks). A first step warms up; the second is traced.
    """
    ctx.record_memory = True
    try:
        for _ in range(2):
            _zero_grads(model, x)
            training_step(model, x, ctx, sync)
        return list(ctx.memory_trace)
    finally:
        ctx.record_memory = False
        _zero_grads(model, x)
