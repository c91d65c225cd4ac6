"""Offloading strategies side by side, on the same model, data and GPU, in one run.

For each model of the grid and each number ``k`` of treated layers (the first ``k`` of ``N``),
every strategy runs the same training step:

- ``no offload``: the baseline;
- ``engine``: this package, default schedule, pinned buffers reused from step to step;
- ``engine (fresh pinned)``: the same, with the pool emptied after every step;
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the ``k`` layers
  (skipped on Transformer Engine's layers, where it crashes);
- ``torchtune``: torchtune's ``OffloadActivations`` around the ``k`` layers, when installed;
- ``transformer_engine``: Transformer Engine's ``get_cpu_offload_context``, when installed;
- ``checkpoint``: recomputation (``torch.utils.checkpoint``) of the ``k`` layers instead;
- ``planner``: :func:`~offload_examples.features.planner.plan`'s choice of keep, offload or recompute
  per layer, under two budgets per ``k``: the predicted peak of offloading the first ``k`` layers and
  that of recomputing them (see ``_planner_budgets``). ``engine`` and ``checkpoint`` at every
  ``k`` are its offload-only and recompute-only curves; :func:`check_planner` compares them.

Each result has the peak memory, the saving against the theoretical saving (what the engine's
schedule predicts for the same ``k`` from the bytes each layer's forward holds, measured by the CUDA
allocator; on a CPU, from the engine's own count), the median step time (CUDA events, after
warm-up) and its ratio to the baseline. For the engine it also has the *copy bound*: the step
time the schedule allows when copies run at the pinned bandwidth measured at the start of the
run (the fastest of three rounds) and compute takes what the baseline's layers took (:meth:`DefaultSchedule.predict_step_ms`),
and the bandwidth its copies achieved. Output: JSON, a Markdown table and plots.

Run it::

    python -m offload_examples bench                     # the full grid on a GPU, tiny on a CPU
    python -m offload_examples bench --models A --ks 2 4 --out results/bench
    python -m offload_examples bench --models A A-torch B --strategies "no offload" engine checkpoint planner
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib.util
import multiprocessing
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from offload_examples import DefaultSchedule, get_cpu_offload_context
from offload_examples.core.streams import resolve_device
from offload_examples.core import te_path
from offload_examples.features.planner import KEEP, OFFLOAD, RECOMPUTE, LayerCost, LinkCost, Plan, apply_plan, plan, simulate_plan
from offload_examples.instruments.cli import (
    ArgumentParser, Need, SizeError, Stack, add_device, check_memory, check_sizes, claim_output, default_device,
    json_text, nonnegative_int, output_folder_arg, positive_int, size_error_text, write_atomic,
)
from offload_examples.instruments.measure import (
    compare_grads, deterministic_kernels, measure_paired, measure_steps, paired_overhead, resident_vs_theory,
)
from offload_examples.instruments.memory_history import MemoryCurve, record_memory_curve
from offload_examples.instruments.models import (
    TE_LAYER, Checkpointed, build_basic_model, has_transformer_engine, import_transformer_engine, layer_kind,
)
from offload_examples.instruments.plan_costs import measure_costs, measure_link
from offload_examples.instruments.report import CPU_TIMING_NOTE, ProgressBar, format_bytes, format_markdown_table
from offload_examples.instruments.timeline import Span, achieved_gb_per_s, per_layer_ms, record_layer_timeline

__all__ = ["MODELS", "PLOTS_MISSING", "STRATEGIES", "BenchConfig", "DeviceLost", "ModelSpec", "check_planner", "main", "run",
           "write_outputs"]

GiB = 2**30

#: The error when the plots extra (matplotlib) is missing.
PLOTS_MISSING = "install offload_examples[plots] (matplotlib) to draw the benchmark's plots, or pass --no-plots"

#: Strategy names, in the order they run.
STRATEGIES = (
    "no offload", "engine", "engine (fresh pinned)", "save_on_cpu", "torchtune", "transformer_engine", "checkpoint",
    "planner",
)

#: Transformer Engine's context around every layer with nothing offloaded (0 layers), run once per model
#: with ``transformer_engine``: what TE's hooks on every layer cost by themselves.
TE_CONTEXT_ONLY = "transformer_engine, nothing offloaded"
#: On Transformer Engine's layers every run takes the path TE's layers take inside an offload context
#: (the engine's or TE's; :mod:`offload_examples.core.te_path`), the no-offload baseline and the
#: recomputation included, so that all of them compute the same thing. This row is the same model
#: outside any offload context, paired with that baseline: what the path itself changes.
TE_DEFAULT_PATH = "no offload, TE's default path"

#: The pure strategies whose budgets the planner runs under (its offload-only and recompute-only curves).
PLANNER_BUDGETS = ("engine", "checkpoint")
#: :func:`check_planner`'s limits: the plan's step may exceed the best pure run's by this much (the median of
#: their alternating steps' ratios; step-to-step noise), and its predicted peak and step may miss the
#: measured ones by this much.
PLANNER_TIME_NOISE = 0.02
PLANNER_PREDICTION_ERROR = 0.05
#: Measured peaks this close (relative) count as the same: a plan equal in bytes to a pure run also has
#: the engine's bookkeeping (1 KiB more than ``checkpoint`` on model A-torch on an H100).
PLANNER_PEAK_NOISE = 0.001
#: The strategies also measured against each other, step by step (model A, k = 2 and 4).
HEAD_TO_HEAD = ("engine", "transformer_engine")
#: The names under which the step-by-step runs are left out after one left the device unusable.
HEAD_TO_HEAD_RUN = "engine against Transformer Engine, pair by pair"
PLAN_PAIRS_RUN = "plans against their rivals, pair by pair"


@dataclass(frozen=True)
class ModelSpec:
    """One model of the grid: ``N`` x (``nn.Linear`` + a pre-norm transformer layer)."""

    hidden: int
    heads: int
    ffn: int
    batch: int
    activation: str = "gelu"
    dropout: float = 0.0
    kind: str = "auto"
    note: str = ""

    def small(self) -> ModelSpec:
        """The same architecture at a size that runs in seconds on a CPU."""
        return dataclasses.replace(self, hidden=64, heads=4, ffn=256, batch=4, kind="torch")


#: The grid's models. ``A`` and ``B`` have the shapes of the measurements in the project's facts
#: file, so figures compare directly; ``A-torch`` is ``A`` with PyTorch's layer where ``A`` gets
#: Transformer Engine's; ``A-wide`` doubles the width (twice the compute per byte saved).
MODELS = {
    "A": ModelSpec(1024, 8, 4096, 16, note="GELU, no dropout (Transformer Engine's layer when installed)"),
    "A-torch": ModelSpec(1024, 8, 4096, 16, kind="torch", note="model A with torch layers: GELU, no dropout"),
    "B": ModelSpec(1024, 8, 4096, 16, activation="relu", dropout=0.1, kind="torch",
                   note="nn.TransformerEncoderLayer defaults: ReLU, dropout 0.1"),
    "A-wide": ModelSpec(2048, 16, 8192, 8, note="model A at twice the width, half the batch"),
}


@dataclass
class BenchConfig:
    """What to run. The defaults are the full grid for an 80 GB GPU.

    ``steps`` pairs of steps are measured per run (after ``warmup`` pairs); the runs the targets
    are checked on (model A, ``k`` = 2 and 4, the engine) measure ``target_steps`` pairs, since
    step-to-step noise on a GPU (a few percent) is larger than the 1% some targets resolve.
    """

    models: tuple[str, ...] = ("A", "A-torch", "B", "A-wide")
    ks: tuple[int, ...] = (1, 2, 3, 4, 6)
    strategies: tuple[str, ...] = STRATEGIES
    layers: int = 20
    seq: int = 2048
    dtype: str = "bfloat16"
    steps: int = 10
    warmup: int = 2
    target_steps: int = 40
    small: bool = False
    seed: int = 0

    @classmethod
    def tiny(cls, **changes: Any) -> BenchConfig:
        """A CPU-sized run: small models, ``k`` in (1, 2), few steps."""
        base = dict(models=("A", "B"), ks=(1, 2), layers=6, seq=32, dtype="float32", steps=2, warmup=1, small=True,
                    target_steps=2)
        return cls(**{**base, **changes})

    def __post_init__(self) -> None:
        check_sizes(self)
        if not (self.models and self.ks and self.strategies):
            raise ValueError("models, ks and strategies each need at least one value")
        if self.layers < 2:
            raise SizeError(f"layers must be at least 2 (k is between 1 and layers - 1), got {self.layers}",
                            layers=self.layers)
        unknown = [m for m in self.models if m not in MODELS] + [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown models or strategies {unknown}; models: {list(MODELS)}, "
                             f"strategies: {list(STRATEGIES)}")
        bad = [k for k in self.ks if not 1 <= k <= self.layers - 1]
        if bad:
            raise SizeError(f"every k must be between 1 and layers - 1 = {self.layers - 1}, got {bad}",
                            ks=self.ks, layers=self.layers)


#: save_on_cpu on Transformer Engine's layers: the illegal access poisons the CUDA context, so every
#: later run of the process fails too.
SAVE_ON_CPU_ON_TE = ("crashes with Transformer Engine layers: CUDA illegal memory access "
                     "(seen with torch 2.11, TE 2.20.2)")


#: Transformer Engine's offload on PyTorch's layers: it raises at the first step and keeps what it held.
TE_ON_TORCH_LAYERS = ("runs on Transformer Engine's layers only: on PyTorch's it raised 'Tensor at index 4 "
                      "must be contiguous for CPU offload' and then kept ~77 GiB allocated (H100, TE 2.20.2)")


def available(strategy: str, device: torch.device, kind: str | None = None) -> str | None:
    """``None`` when ``strategy`` can run here on layers of ``kind`` (see :func:`layer_kind`), else why not."""
    if strategy == "save_on_cpu" and kind == TE_LAYER:
        return SAVE_ON_CPU_ON_TE
    if strategy == "torchtune" and importlib.util.find_spec("torchtune") is None:
        return "torchtune is not installed (pip install 'offload_examples[torchtune]')"
    if strategy in ("transformer_engine", TE_CONTEXT_ONLY, TE_DEFAULT_PATH):
        if not has_transformer_engine():
            return "Transformer Engine is not installed"
        if device.type != "cuda":
            return "Transformer Engine needs CUDA"
        if kind is not None and kind != TE_LAYER:
            return TE_ON_TORCH_LAYERS
    return None


# ---------------------------------------------------------------------- one forward per strategy
Forward = Callable[[torch.Tensor], torch.Tensor]


def _through(layers: Sequence[nn.Module], h: torch.Tensor, ctx: Callable[[int], Any] | None = None,
             sync: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    for i, layer in enumerate(layers):
        with ctx(i) if ctx else contextlib.nullcontext():
            h = layer(h)
        h = sync(h) if sync else h
    return h


def make_forward(strategy: str, model: nn.ModuleList, k: int, device: torch.device,
                 chosen: Plan | None = None) -> tuple[Forward, Any]:
    """The forward pass of ``strategy`` treating the first ``k`` layers, and its engine (or ``None``).

    ``planner`` runs the plan ``chosen`` (``k`` only names the budget it was made for).
    """
    n = len(model)
    if strategy == "planner":
        if chosen is None:
            raise ValueError("the planner strategy needs a plan")
        ctx, sync, run_layers = apply_plan(chosen, list(model), device, retain_pinned_cpu_buffers=True)
        return lambda x: _through(run_layers, x, lambda i: ctx, sync), ctx
    if strategy == "no offload":
        return lambda x: _through(model, x), None
    if strategy == TE_DEFAULT_PATH:
        def outside(x: torch.Tensor) -> torch.Tensor:
            with te_path.offload_path(False):
                return _through(model, x)
        return outside, None
    if strategy in ("engine", "engine (fresh pinned)"):
        ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n, device=device,
                                            retain_pinned_cpu_buffers=strategy == "engine")
        return lambda x: _through(model, x, lambda i: ctx, sync), ctx
    if strategy == "save_on_cpu":
        pin = device.type == "cuda"  # pinning needs an accelerator

        def ctx(i: int) -> Any:
            return torch.autograd.graph.save_on_cpu(pin_memory=pin) if i < k else contextlib.nullcontext()
        return lambda x: _through(model, x, ctx), None
    if strategy == "checkpoint":
        wrapped = [Checkpointed(layer) if i < k else layer for i, layer in enumerate(model)]
        return lambda x: _through(wrapped, x), None
    if strategy == "torchtune":
        from torchtune.training import OffloadActivations

        def forward(x: torch.Tensor) -> torch.Tensor:
            with OffloadActivations(use_pin_memory=device.type == "cuda"):
                h = _through(model[:k], x)
            return _through(model[k:], h)
        return forward, None
    if strategy in ("transformer_engine", TE_CONTEXT_ONLY):
        import transformer_engine.pytorch as te

        ctx, sync = te.get_cpu_offload_context(True, k if strategy == "transformer_engine" else 0, n, True, False)
        return lambda x: _through(model, x, lambda i: ctx, sync), None
    raise ValueError(f"unknown strategy {strategy!r}")


def _step(forward: Forward, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        h = forward(x)
        h.float().square().mean().backward()
        return h.detach()
    return step


# ---------------------------------------------------------------------- the run
def _link(device: torch.device) -> dict[str, float] | None:
    if device.type != "cuda":
        return None
    from offload_examples.instruments.bandwidth import link_bandwidth

    return link_bandwidth()


def _layer_times(spans: Sequence[Span], n: int, total_ms: float) -> tuple[list[float], list[float]]:
    """Per-layer forward and backward ms of a run without offloading, scaled to ``total_ms``."""
    fwd, bwd = per_layer_ms(spans, n)
    traced = sum(fwd) + sum(bwd)
    scale = total_ms / traced if traced > 0 else 1.0
    return [t * scale for t in fwd], [t * scale for t in bwd]


def _spans_json(spans: Sequence[Span]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(s) for s in spans]


def _curve_json(curve: MemoryCurve) -> dict[str, list]:
    return {"ms": [round(t, 4) for t in curve.ms], "allocated": curve.allocated}


def _free(*engines: Any) -> None:
    try:
        for e in engines:
            if e is not None and hasattr(e, "release_buffers"):
                e.release_buffers()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except RuntimeError:  # after a sticky CUDA error every call raises it again: DeviceLost says why
        if not torch.cuda.is_initialized() or device_usable(torch.device("cuda", torch.cuda.current_device())):
            raise


def _first(per_layer: Sequence[int], k: int) -> list[int]:
    """``per_layer`` for the first ``k`` layers, 0 for the others."""
    return [b if i < k else 0 for i, b in enumerate(per_layer)]


def _theoretical_saving(per_layer: Sequence[int], k: int) -> int:
    """The saving the default schedule predicts when the first ``k`` layers' bytes are offloaded."""
    offloaded = _first(per_layer, k)
    kept = [b - o for b, o in zip(per_layer, offloaded)]
    return DefaultSchedule(k, len(per_layer)).simulate(offloaded, kept).saving


def _held_bytes(model: nn.ModuleList, x: torch.Tensor) -> list[int] | None:
    """The bytes each layer's forward keeps for backward, as the CUDA allocator sees them in one forward
    without offloading (``None`` off CUDA): every tensor kept, whoever saved it, not one engine's count.

    After layer ``i`` the allocator holds what the layers so far keep plus layer ``i``'s output, the
    next layer's input: what grew apart from that output is layer ``i``'s. A layer's input thus counts
    once, for the layer whose graph keeps it (the model's input, which the caller keeps anyway, for none).
    """
    if x.device.type != "cuda":
        return None
    held, h = [], x
    before = torch.cuda.memory_allocated(x.device)
    for layer in model:
        h = layer(h)
        after = torch.cuda.memory_allocated(x.device) - h.untyped_storage().nbytes()
        held.append(after - before)
        before = after
    return held


def _bench_model(name: str, config: BenchConfig, device: torch.device, link: dict | None,
                 bar: ProgressBar, detail: bool, plan_link: LinkCost | None = None,
                 left_out: dict[str, str] | None = None) -> dict[str, Any]:
    """One model's grid. ``left_out``: strategies not to run, with why (see :class:`DeviceLost`)."""
    kind = layer_kind(MODELS[name].kind)  # what "auto" builds here
    # On TE's layers every run takes TE's offload path (see TE_DEFAULT_PATH)
    with te_path.offload_path() if kind == TE_LAYER else contextlib.nullcontext():
        return _bench_model_on_path(name, config, device, link, bar, detail, plan_link, kind, dict(left_out or {}))


def _bench_model_on_path(name: str, config: BenchConfig, device: torch.device, link: dict | None,
                         bar: ProgressBar, detail: bool, plan_link: LinkCost | None, kind: str,
                         left_out: dict[str, str]) -> dict[str, Any]:
    spec = MODELS[name].small() if config.small else MODELS[name]
    dtype = getattr(torch, config.dtype)
    n = config.layers
    model = build_basic_model(n, spec.hidden, spec.heads, spec.ffn, device=device, dtype=dtype, kind=spec.kind,
                              seed=config.seed, activation=spec.activation, dropout=spec.dropout)
    gen = torch.Generator(device="cpu").manual_seed(config.seed + 1)
    x = torch.randn(spec.batch, config.seq, spec.hidden, generator=gen, dtype=dtype).to(device).requires_grad_()
    steps = dict(steps=config.steps, warmup=config.warmup)
    out: dict[str, Any] = {"model": name, "layer_kind": kind, "spec": dataclasses.asdict(spec), "runs": [],
                           "left_out": left_out}

    bar.show(f"model {name}: no offload")
    forward, _ = make_forward("no offload", model, 0, device)
    base = measure_steps(model, x, step=_step(forward, x), label="no offload", **steps)
    # the same step through an engine that offloads nothing: per-layer compute time and saved bytes
    probe, sync = get_cpu_offload_context(enabled=True, num_layers=0, model_layers=n, device=device)
    probe_step = _step(lambda h: _through(model, h, lambda i: probe, sync), x)
    probe_step()
    spans = record_layer_timeline(probe_step, probe)
    fwd_ms, bwd_ms = _layer_times(spans, n, base.median_ms)
    per_layer = [s.candidate_bytes for s in probe.stats]  # what the engine copies: the copy bound's bytes
    held = _held_bytes(model, x)  # what the layers hold: the theory's bytes, where the allocator can tell
    out.update(forward_ms=fwd_ms, backward_ms=bwd_ms, saved_bytes_per_layer=per_layer, held_bytes_per_layer=held,
               theory_source="engine candidates" if held is None else "measured allocator")
    out["predicted"] = _predictions(n, fwd_ms, bwd_ms, per_layer, link, base.median_ms)
    if detail:
        out["memory_curves"] = {"no offload": _curve_json(record_memory_curve(_step(forward, x)))}
        out["timelines"] = {"no offload": _spans_json(spans)}
    model.zero_grad(set_to_none=True)
    _free(probe)
    out["runs"].append(_result("no offload", 0, base, base, None))
    bar.advance()
    if kind == TE_LAYER and available(TE_DEFAULT_PATH, device, kind) is None:
        bar.show(f"model {name}: {TE_DEFAULT_PATH}")
        out["runs"].append(_run_strategy(TE_DEFAULT_PATH, model, x, 0, device, kind, steps, base, None, None,
                                         None, False, out, reference=_step(forward, x)))
    setup: PlannerSetup | str | None = None
    if "planner" in config.strategies:
        bar.show(f"model {name}: the planner's costs")
        try:
            setup = left_out.get("planner") or _planner_setup(model, x, base, plan_link, config)
            if not isinstance(setup, str):
                out["planner"] = setup.to_json()
        except Exception as err:  # the planner's runs report it; the other strategies still run
            _raise_if_lost(device, "planner", 0, err)
            setup = f"measuring the planner's costs failed: {_reason(err)}"
    planned: dict[tuple, dict[str, Any]] = {}  # plan -> its run: one measurement per distinct plan
    if "transformer_engine" in config.strategies:
        if available(TE_CONTEXT_ONLY, device, kind) is None:  # else TE's own rows say why
            bar.show(f"model {name}: {TE_CONTEXT_ONLY}")
            out["runs"].append(_run_strategy(TE_CONTEXT_ONLY, model, x, 0, device, kind, steps, base, None, None,
                                             None, False, out, reference=_step(forward, x)))
        bar.advance()

    for k in config.ks:
        theory = _theoretical_saving(per_layer if held is None else held, k)
        bound = functools.partial(_copy_bound, k, fwd_ms, bwd_ms, _first(per_layer, k), link) if link else None
        for strategy in config.strategies:
            if strategy == "no offload":
                continue
            bar.show(f"model {name}, k={k}: {strategy}")
            if strategy == "planner":
                if isinstance(setup, str):
                    status = "skipped" if "planner" in left_out else "failed"
                    out["runs"] += [{"strategy": strategy, "k": k, "status": status, "reason": setup,
                                     "budget_from": source} for source in PLANNER_BUDGETS]
                    for _ in PLANNER_BUDGETS:
                        bar.advance()
                    continue
                for budget_from, budget in _planner_budgets(setup, k):
                    out["runs"].append(_run_planner(setup, budget_from, budget, model, x, k, device, kind, steps, base,
                                                    reference=_step(forward, x), planned=planned))
                    bar.advance()
                continue
            target = name == "A" and k in (2, 4) and strategy in HEAD_TO_HEAD
            run_steps = dict(steps, steps=max(config.steps, config.target_steps)) if target else steps
            out["runs"].append(_run_strategy(strategy, model, x, k, device, kind, run_steps, base, theory, bound, link,
                                             detail and k in (2, 4) and strategy == "engine", out,
                                             reference=_step(forward, x)))
            bar.advance()
        if name == "A" and k in (2, 4) and _both_ran(out["runs"], k):
            bar.show(f"model {name}, k={k}: engine against Transformer Engine, pair by pair")
            steps_h2h = dict(steps, steps=max(config.steps, config.target_steps))
            h2h = ({"k": k, "status": "skipped", "reason": left_out[HEAD_TO_HEAD_RUN]} if HEAD_TO_HEAD_RUN in left_out
                   else _head_to_head(model, x, k, device, steps_h2h))
            out.setdefault("head_to_head", []).append(h2h)
    if "planner" in config.strategies:  # every pure run has run: each plan meets its best rival
        if PLAN_PAIRS_RUN not in left_out:  # else the checks fall back on the separate overheads
            _pair_plans_with_rivals(out["runs"], model, x, device, steps, bar)
        bar.advance()
    del model, x
    _free()
    return out


def _both_ran(runs: list[dict[str, Any]], k: int) -> bool:
    ran = {r["strategy"] for r in runs if r["k"] == k and r["status"] == "ok"}
    return set(HEAD_TO_HEAD) <= ran


def _head_to_head(model: nn.ModuleList, x: torch.Tensor, k: int, device: torch.device,
                  steps: dict) -> dict[str, Any]:
    """The engine's step against Transformer Engine's, both offloading the first ``k`` layers.

    Each strategy's overhead is a median of pairs with no-offload steps, so comparing two of them
    adds the noise of two measurements, and on a launch-bound step that noise (a few %) is larger
    than the difference. Here the two alternate step by step: the median of the pairs' ratios
    answers "which is faster" directly.
    """
    engine = None
    try:
        te_forward, _ = make_forward("transformer_engine", model, k, device)
        engine_forward, engine = make_forward("engine", model, k, device)
        a = _alternating(model, x, te_forward, engine_forward, "engine vs TE", steps)
        return {"k": k, "status": "ok", "pairs": a["pairs"], "engine_vs_te": a["ratio"], "quartiles": a["quartiles"],
                "engine_ms": a["candidate_ms"], "te_ms": a["reference_ms"]}
    except Exception as err:  # reported in the targets; the benchmark goes on
        _raise_if_lost(device, HEAD_TO_HEAD_RUN, k, err)
        return {"k": k, "status": "failed", "reason": _reason(err)}
    finally:
        model.zero_grad(set_to_none=True)
        x.grad = None
        _free(engine)


def _alternating(model: nn.ModuleList, x: torch.Tensor, reference: Forward, candidate: Forward, label: str,
                 steps: dict) -> dict[str, Any]:
    """``candidate``'s steps alternating with ``reference``'s: the median over the pairs of candidate /
    reference - 1 (``ratio``), its quartiles, and each one's median step (ms)."""
    measured, reference_ms = measure_paired(model, x, _step(reference, x), _step(candidate, x), label=label,
                                            **steps)
    pairs = sorted(c / r - 1 for c, r in zip(measured.step_ms, reference_ms))
    return {"ratio": statistics.median(pairs), "quartiles": _quartiles(pairs), "pairs": len(pairs),
            "candidate_ms": measured.median_ms, "reference_ms": statistics.median(reference_ms)}


def _quartiles(ordered: Sequence[float]) -> list[float]:
    """The first and third quartile of values already sorted (as the reports have always taken them)."""
    return [ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]]


def _copy_bound(k: int, fwd_ms: Sequence[float], bwd_ms: Sequence[float], offloaded: Sequence[int], link: dict,
                compute_scale: float) -> float:
    """The copy bound of the first ``k`` layers with every compute time multiplied by ``compute_scale``."""
    return DefaultSchedule(k, len(fwd_ms)).predict_step_ms([t * compute_scale for t in fwd_ms],
                                                          [t * compute_scale for t in bwd_ms], offloaded,
                                                          link["d2h"], link["h2d"])


def _run_strategy(strategy: str, model: nn.ModuleList, x: torch.Tensor, k: int, device: torch.device, kind: str,
                  steps: dict, base, theory: int, bound: Callable[[float], float] | None, link: dict | None, detail: bool,
                  out: dict[str, Any], reference: Callable[[], torch.Tensor], chosen: Plan | None = None) -> dict[str, Any]:
    skipped = out.get("left_out", {}).get(strategy) or available(strategy, device, kind)
    if skipped:
        return {"strategy": strategy, "k": k, "status": "skipped", "reason": skipped}
    engine = None
    try:
        inputs = _host_copies(model, x)  # to tell whether the strategy changed the input or a weight
        # the plan goes positionally only when there is one: wrappers of make_forward take (strategy, *args)
        forward, engine = make_forward(strategy, model, k, device, *([chosen] if chosen is not None else []))
        step = _step(forward, x)
        # steps alternate with no-offload steps: the overhead is the median of the pairs' ratios
        measured, reference_ms = measure_paired(model, x, reference, step, label=strategy, **steps)
        result = _result(strategy, k, measured, base, theory)
        pairs = sorted(t / r - 1 for t, r in zip(measured.step_ms, reference_ms))
        result.update(reference_ms=statistics.median(reference_ms), reference_ms_all=reference_ms,
                      overhead=paired_overhead(measured.step_ms, reference_ms), pairs=len(pairs),
                      overhead_quartiles=_quartiles(pairs))
        if engine is not None:
            result["pinned_allocations"] = engine.pool.allocations
            # the bound's compute times come from the first no-offload run: rescale them (not the
            # copies' times) to the no-offload steps that ran alongside this one
            scaled = bound(result["reference_ms"] / base.median_ms) if bound else None
            result.update(_copy_figures(step, engine, scaled, measured.median_ms, link, detail, out, k))
            # the engine's count of offloaded bytes on the device, phase by phase, against its schedule
            result["resident_matches_theory"] = all(got == want for _, _, got, want in resident_vs_theory(engine))
        # last: its deterministic kernels save other tensors, which the engine's pool would pin for the trace
        result["grads"] = _grads_check(model, x, reference, step, device, kind, inputs)
        return result
    except Exception as err:  # one failing strategy must not end the benchmark; its memory is freed below
        _raise_if_lost(device, strategy, k, err)
        return {"strategy": strategy, "k": k, "status": "failed", "reason": _reason(err)}
    finally:
        model.zero_grad(set_to_none=True)
        x.grad = None
        _free(engine)


class DeviceLost(Exception):
    """A run's failure left the device unusable for the rest of the process.

    CUDA reports an illegal memory access and similar faults to every later call in the process
    (a "sticky" error), so no later run could measure anything. :func:`run` starts the model again in a
    fresh process with ``strategy`` (a strategy, or one of the runs ``HEAD_TO_HEAD_RUN`` and
    ``PLAN_PAIRS_RUN``) left out, and its rows say why (the model's ``left_out``).
    """

    def __init__(self, strategy: str, k: int, reason: str) -> None:
        super().__init__(f"{strategy}{f' at k={k}' if k else ''} left the device unusable: {reason}")
        self.strategy, self.k, self.reason = strategy, k, reason

    def __reduce__(self) -> tuple:  # it travels from a model's process to the parent
        return type(self), (self.strategy, self.k, self.reason)

    def why(self, model: str) -> str:
        """The reason the restarted model's rows give for leaving the strategy out."""
        at = f"at k={self.k} " if self.k else ""
        return f"left out: {at}on model {model} it failed and left the device unusable for the process ({self.reason})"


def _reason(err: BaseException) -> str:
    """An error in one line, for a table row: CUDA's errors go on with lines of advice."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _raise_if_lost(device: torch.device, run: str, k: int, err: Exception) -> None:
    """Raise :class:`DeviceLost` for ``run`` if its failure ``err`` left ``device`` unusable: every
    later run would fail too, so the model starts again in a fresh process without it."""
    if not device_usable(device):
        raise DeviceLost(run, k, _reason(err)) from err


def device_usable(device: torch.device) -> bool:
    """Whether ``device`` still runs work: ``False`` after a sticky CUDA error (always ``True`` off CUDA)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:  # the sticky error comes back from any call
        return False


def _host_copies(model: nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().to("cpu", copy=True) for t in (x, *model.parameters())]


def _grads_check(model: nn.ModuleList, x: torch.Tensor, reference: Callable[[], torch.Tensor],
                 step: Callable[[], torch.Tensor], device: torch.device, kind: str,
                 inputs: list[torch.Tensor]) -> dict[str, Any]:
    """One step of ``step`` against one no-offload step: the output and every gradient, bit for bit.

    Both start from the same random state (dropout draws alike). On PyTorch's layers they run under
    :func:`~offload_examples.instruments.measure.deterministic_kernels` (attention's default kernels
    accumulate with atomics, so two plain steps already differ); Transformer Engine's layers are asked
    for deterministic kernels when TE is imported. ``inputs``: host copies of the input and the weights
    taken before the strategy first ran; if it changed any, both steps ran on the changed values, so the
    row says so (``changed``) and is not equal. ``equal`` is ``None`` where the steps could not be compared
    (a kernel with no deterministic form, say; ``reason`` says why).
    """
    def once(run: Callable[[], torch.Tensor]):
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            return measure_steps(model, x, step=run, steps=1, warmup=0)

    try:
        with contextlib.nullcontext() if kind == TE_LAYER else deterministic_kernels():
            plain, treated = once(reference), once(step)
        changed = sum(not torch.equal(a, b) for a, b in zip(inputs, _host_copies(model, x)))
        if plain.grads.keys() != treated.grads.keys():  # a gradient missing (or extra) is a difference too
            missing = sorted(plain.grads.keys() ^ treated.grads.keys())
            return {"equal": False, "compared": len(plain.grads) + 1, "mismatched": len(missing),
                    "max_abs_diff": float("inf"), "first_mismatched": missing[:3], "changed": changed}
        check = compare_grads(plain, treated)
    except Exception as err:  # the row keeps its timings; a lost device goes up as DeviceLost
        if not device_usable(device):
            raise
        return {"equal": None, "reason": _reason(err)}
    return {"equal": check.equal and not changed, "compared": check.compared, "mismatched": len(check.mismatched),
            "max_abs_diff": check.max_abs_diff, "first_mismatched": check.mismatched[:3], "changed": changed}


def _grads_cell(r: dict[str, Any]) -> str:
    g = r.get("grads")
    if g is None:
        return ""
    if g["equal"] is None:
        return "not compared: " + g["reason"]
    if g.get("changed"):
        return f"changed {g['changed']} of the input and weights"
    return "bitwise equal" if g["equal"] else f"{g['mismatched']} of {g['compared']} differ (max {g['max_abs_diff']:.3g})"


def _copy_figures(step, engine, bound: float | None, median_ms: float, link: dict | None, detail: bool,
                  out: dict[str, Any], k: int) -> dict[str, Any]:
    """Bound, achieved copy bandwidth and stalls of the engine, from one traced step."""
    spans = record_layer_timeline(step, engine)
    fig: dict[str, Any] = {
        "bound_ms": bound,
        "step_over_bound": median_ms / bound if bound else None,
        "stall_ms": sum(s.end - s.start for s in spans if s.name == "wait"),
    }
    for lane, key in (("device-to-host", "d2h"), ("host-to-device", "h2d")):
        achieved = achieved_gb_per_s(spans, lane) if link else None
        fig[f"{key}_gb_per_s"] = achieved
        fig[f"{key}_of_link"] = achieved / link[key] if achieved and link else None
    if detail:
        label = f"engine k={k}"
        out.setdefault("timelines", {})[label] = _spans_json(spans)
        out.setdefault("memory_curves", {})[label] = _curve_json(record_memory_curve(step))
    return fig


def _result(strategy: str, k: int, m, base, theory: int | None) -> dict[str, Any]:
    saving = None if m.peak_bytes is None else base.activation_peak_bytes - m.activation_peak_bytes
    return {
        "strategy": strategy, "k": k, "status": "ok",
        "peak_bytes": m.peak_bytes,
        "saving_bytes": saving,
        "theoretical_saving_bytes": theory,
        "saving_ratio": saving / theory if saving is not None and theory else None,
        "step_ms": m.median_ms,
        "step_ms_all": m.step_ms,
        "overhead": m.median_ms / base.median_ms - 1,
    }


def _predictions(n: int, fwd: list[float], bwd: list[float], per_layer: list[int], link: dict | None,
                 base_ms: float) -> dict[str, Any] | None:
    """The copy bound for every k, and the first k at which the copies no longer fit behind compute."""
    if not link:
        return None
    bounds = {k: _copy_bound(k, fwd, bwd, _first(per_layer, k), link, 1.0) for k in range(1, n)}
    stop = next((k for k, ms in bounds.items() if ms > 1.01 * base_ms), None)
    return {"bound_ms": bounds, "copies_stop_fitting_at_k": stop}


# ---------------------------------------------------------------------- the planner strategy
def _plan_link(device: torch.device, link: dict[str, float] | None) -> LinkCost:
    """The link the planner plans with: the run's pinned bandwidths on a GPU; on a CPU, where the
    engine's copies are host memory copies, those timed once for the whole run."""
    if link:
        return LinkCost(link["d2h"], link["h2d"], link["both"])
    return measure_link(device, nbytes=16 * 2**20)


@dataclass
class PlannerSetup:
    """One model's planner inputs, calibrated on its no-offload run.

    ``measure_costs`` times each layer between marks on the compute stream, and its base bytes are
    what is allocated between steps. The measured step has more: the loss, launches between layers,
    and at its peak whatever the backward has allocated by then (gradients, workspaces). So that
    predicted and measured mean the same thing, two constants are fitted to the no-offload run,
    which the planner then predicts exactly: every layer's times are scaled by one factor so that
    keeping every layer predicts the measured median step, and the base bytes are the measured peak
    minus the saved bytes that plan predicts at its peak. Every other plan's prediction is then a
    prediction. Without a peak to fit (a CPU), the base bytes are ``measure_costs``'s.
    """

    costs: list[LayerCost]
    link: LinkCost
    base_bytes: int
    keep_peak_bytes: int  # predicted peak of keeping every layer (= the no-offload peak on a GPU)
    keep_step_ms: float  # predicted step of keeping every layer (= the no-offload median)
    time_scale: float  # what multiplied the measured layer times
    idle_base_bytes: int  # measure_costs's base: allocated between steps

    def to_json(self) -> dict[str, Any]:
        return {"costs": [dataclasses.asdict(c) for c in self.costs], "base_bytes": self.base_bytes,
                "keep_peak_bytes": self.keep_peak_bytes, "keep_step_ms": self.keep_step_ms,
                "time_scale": self.time_scale, "idle_base_bytes": self.idle_base_bytes}


def _planner_setup(model: nn.ModuleList, x: torch.Tensor, base, link: LinkCost, config: BenchConfig) -> PlannerSetup:
    """Measure ``model``'s costs once and calibrate them on the no-offload measurement ``base``."""
    costs, idle = measure_costs(list(model), x, steps=max(1, min(40, 2 * config.steps)))
    keep = (KEEP,) * len(costs)
    saved_peak, raw_ms = simulate_plan(keep, costs, link)
    scale = base.median_ms / raw_ms if raw_ms > 0 else 1.0
    costs = [c.scaled(scale) for c in costs]
    base_bytes = idle if base.peak_bytes is None else max(0, base.peak_bytes - saved_peak)
    peak, ms = simulate_plan(keep, costs, link, base_bytes)
    return PlannerSetup(costs, link, base_bytes, peak, ms, scale, idle)


def _pure_plan(setup: PlannerSetup, choice, k: int) -> tuple:
    """The choices of a pure strategy: ``choice`` for the first ``k`` layers, KEEP for the others."""
    return (choice,) * k + (KEEP,) * (len(setup.costs) - k)


def _planner_budgets(setup: PlannerSetup, k: int) -> list[tuple[str, int]]:
    """The planner's budgets at ``k``, one per strategy of :data:`PLANNER_BUDGETS`: the peak the model
    predicts for offloading (``engine``) or recomputing (``checkpoint``) the first ``k`` layers.

    Predicted rather than measured peaks: the planner compares plans under its own model, so the
    pure plan itself always fits its budget and the planner can only do as well or better there.
    """
    choice = {"engine": OFFLOAD, "checkpoint": RECOMPUTE}
    return [(s, simulate_plan(_pure_plan(setup, choice[s], k), setup.costs, setup.link, setup.base_bytes)[0])
            for s in PLANNER_BUDGETS]


def _run_planner(setup: PlannerSetup, budget_from: str, budget: int, model: nn.ModuleList, x: torch.Tensor, k: int,
                 device: torch.device, kind: str, steps: dict, base, reference: Callable[[], torch.Tensor],
                 planned: dict[tuple, dict[str, Any]]) -> dict[str, Any]:
    """Plan under ``budget``, run the plan paired with no-offload steps, and compare with its prediction.

    A plan already run for this model (another budget chose it too) is not measured again: its run is
    reported under this budget as well, with ``same_run_as``.
    """
    chosen = plan(setup.costs, setup.link, budget, setup.base_bytes)
    figures = {
        "budget_from": budget_from, "budget_bytes": budget, "plan": chosen.summary(),
        "choices": [c.value for c in chosen.choices], "caps": list(chosen.caps), "parts": list(chosen.parts),
        "modules": list(chosen.modules),
        "feasible": chosen.feasible,
        "predicted_peak_bytes": chosen.predicted_peak_bytes, "predicted_step_ms": chosen.predicted_step_ms,
        # as a ratio to keeping every layer: the measured overhead's counterpart
        "predicted_overhead": chosen.predicted_step_ms / setup.keep_step_ms - 1,
    }
    key = (chosen.choices, chosen.caps, chosen.modules)
    if key in planned:
        first = planned[key]
        return {**first, **figures, "k": k, "same_run_as": {"budget_from": first["budget_from"], "k": first["k"]}}
    theory = setup.keep_peak_bytes - chosen.predicted_peak_bytes
    result = _run_strategy("planner", model, x, k, device, kind, steps, base, theory, None, None, False, {},
                           reference=reference, chosen=chosen)
    result.update(figures)
    if result["status"] == "ok":
        result.update(_prediction_errors(result))
        planned[key] = result
    return result


def _prediction_errors(r: dict[str, Any]) -> dict[str, float | None]:
    """``peak_error`` and ``step_error``: measured over predicted, minus 1.

    The step is compared as a ratio to the no-offload steps: the measured paired overhead against
    the predicted overhead, so drift between the calibrating run and this one does not count as error.
    """
    peak = None if r["peak_bytes"] is None else r["peak_bytes"] / r["predicted_peak_bytes"] - 1
    return {"peak_error": peak, "step_error": (1 + r["overhead"]) / (1 + r["predicted_overhead"]) - 1,
            # the prediction at the steps it ran beside, for plotting next to the measured step
            "predicted_step_ms_paired": r["reference_ms"] * (1 + r["predicted_overhead"])}


def _best_rival(run: dict[str, Any], runs: list[dict[str, Any]]) -> tuple[dict | None, dict | None]:
    """``(best, source)``: the fastest pure run that fits a planner run's budget (see :func:`check_planner`),
    and the pure run its budget came from (``None`` when that run did not succeed)."""
    pure = [r for r in runs if r["strategy"] in PLANNER_BUDGETS and r["status"] == "ok"]
    source = next((r for r in pure if r["strategy"] == run["budget_from"] and r["k"] == run["k"]), None)
    peak = run["peak_bytes"]
    if peak is None or source is None or source["peak_bytes"] is None:
        rivals = [source] if source else []  # no measured peaks: the run the budget came from
    else:
        low, high = peak * (1 - PLANNER_PEAK_NOISE), source["peak_bytes"] * (1 + PLANNER_PEAK_NOISE)
        rivals = [r for r in pure if r["peak_bytes"] is not None and low <= r["peak_bytes"] <= high]
        rivals = rivals or [source]  # the planner's peak is above its budget's run: a miss, shown against that run
    return min(rivals, key=lambda r: r["overhead"], default=None), source


def _pair_plans_with_rivals(runs: list[dict[str, Any]], model: nn.ModuleList, x: torch.Tensor,
                            device: torch.device, steps: dict, bar: ProgressBar) -> None:
    """Run each plan step by step against its best rival; the result goes into the run's ``vs_best``.

    Each run's overhead is a median of pairs with no-offload steps, so comparing a plan's overhead with a
    rival's adds the noise of two measurements made minutes apart; on launch-bound layers (model A with
    Transformer Engine's) that spread is several per cent, more than the 2 % the check allows. Alternating
    the plan's steps with the rival's answers "is the plan as fast" directly, as :func:`_head_to_head`
    does for the engine and Transformer Engine. One measurement per distinct plan and rival.
    """
    measured: dict[tuple, dict[str, Any]] = {}
    for run in runs:
        if run["strategy"] != "planner" or run["status"] != "ok":
            continue
        best, _ = _best_rival(run, runs)
        if best is None:
            continue
        key = (tuple(run["choices"]), tuple(run["caps"]), tuple(run.get("modules") or ()), best["strategy"], best["k"])
        if key not in measured:
            bar.show(f"plan of {run['budget_from']} k={run['k']} against {best['strategy']} k={best['k']}, "
                     "pair by pair")
            measured[key] = _plan_against(run, best, model, x, device, steps)
        run["vs_best"] = measured[key]


def _plan_against(run: dict[str, Any], best: dict[str, Any], model: nn.ModuleList, x: torch.Tensor,
                  device: torch.device, steps: dict) -> dict[str, Any]:
    """The planner ``run``'s plan, its steps alternating with those of the pure run ``best``: the median of
    plan / best - 1 (``status`` "failed" and the ``reason`` when it could not run)."""
    engines = []
    try:
        chosen = Plan(tuple(run["choices"]), run["predicted_peak_bytes"], run["predicted_step_ms"],
                      caps=tuple(run["caps"]), modules=tuple(run.get("modules") or ()))
        plan_forward, engine = make_forward("planner", model, run["k"], device, chosen)
        engines.append(engine)
        best_forward, engine = make_forward(best["strategy"], model, best["k"], device)
        engines.append(engine)
        a = _alternating(model, x, best_forward, plan_forward, f"plan vs {best['strategy']}", steps)
        return {"strategy": best["strategy"], "k": best["k"], "status": "ok", "ratio": a["ratio"],
                "quartiles": a["quartiles"], "pairs": a["pairs"], "plan_ms": a["candidate_ms"],
                "best_ms": a["reference_ms"]}
    except Exception as err:  # the check falls back on the separate overheads, and its table says why
        _raise_if_lost(device, PLAN_PAIRS_RUN, run["k"], err)
        return {"strategy": best["strategy"], "k": best["k"], "status": "failed",
                "reason": _reason(err)}
    finally:
        model.zero_grad(set_to_none=True)
        x.grad = None
        _free(*engines)


def _planner_check(run: dict[str, Any], runs: list[dict[str, Any]], timed: bool) -> dict[str, Any]:
    """One planner run against the pure runs at its budget (see :func:`check_planner`); ``timed``: whether
    step times mean anything here (not on a CPU, whose copies are memory copies)."""
    best, source = _best_rival(run, runs)
    peak = run["peak_bytes"]
    vs = run.get("vs_best")
    failed = vs["reason"] if vs is not None and vs["status"] != "ok" else None
    if vs is not None and (best is None or failed or (vs["strategy"], vs["k"]) != (best["strategy"], best["k"])):
        vs = None
    check = {
        "k": run["k"], "budget_from": run["budget_from"], "budget_bytes": run["budget_bytes"], "plan": run["plan"],
        "peak_bytes": peak, "overhead": run["overhead"],
        "best": None if best is None else {key: best[key] for key in ("strategy", "k", "peak_bytes", "overhead")},
        "within_budget_run": None if peak is None or source is None or source["peak_bytes"] is None
        else peak <= source["peak_bytes"] * (1 + PLANNER_PEAK_NOISE),
        # plan / best - 1 from their alternating steps (None where they did not run so)
        "vs_best": None if vs is None else vs["ratio"],
        "vs_best_quartiles": None if vs is None else vs["quartiles"],
        "vs_best_failed": failed,  # why the alternating steps did not run (then the separate overheads decide)
        "time_met": None if best is None or not timed
        else (vs["ratio"] if vs is not None else run["overhead"] - best["overhead"]) <= PLANNER_TIME_NOISE,
        "peak_error": run["peak_error"], "step_error": run["step_error"],
    }
    for key in ("peak_error", "step_error"):
        known = run[key] is not None and (timed or key == "peak_error")
        check[f"{key}_met"] = abs(run[key]) <= PLANNER_PREDICTION_ERROR if known else None
    parts = [check[key] for key in ("within_budget_run", "time_met", "peak_error_met", "step_error_met")]
    check["met"] = None if None in parts else all(parts)
    return check


def check_planner(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The planner against pure offloading and pure recomputation, and its predictions against measurement.

    For each model and planner run (a budget), the *rivals* are the ``engine`` and ``checkpoint`` runs
    of that model whose measured peak is at least the planner's and at most that of the run the budget
    came from (the pure runs that fit the same budget and use no less memory), peaks compared within
    ``PLANNER_PEAK_NOISE``. The planner passes when

    - its measured peak is at most that of the run its budget came from,
    - its step is at most the best rival's plus ``PLANNER_TIME_NOISE``: the median of plan / rival - 1
      over their alternating steps (``vs_best``, measured after all runs of the model); where those did not
      run, its paired overhead against the rival's, and
    - ``|peak_error|`` and ``|step_error|`` are at most ``PLANNER_PREDICTION_ERROR``.

    On a CPU there are no measured peaks and its step times say nothing about a GPU: the rival is the
    run the budget came from, the values are reported, and every verdict (``met`` too) is ``None``.
    Runs that failed are reported with ``met`` False.
    """
    timed = results.get("device_type") == "cuda"
    checks = []
    for model in results["models"]:
        for run in model["runs"]:
            if run["strategy"] != "planner":
                continue
            if run["status"] != "ok":
                checks.append({"model": model["model"], "k": run["k"], "budget_from": run.get("budget_from"),
                               "met": False, "reason": f"{run['status']}: {run['reason']}"})
                continue
            checks.append({"model": model["model"], **_planner_check(run, model["runs"], timed)})
    return checks


def _model_units(config: BenchConfig) -> int:
    """Progress units of one model: its no-offload run, TE's context alone, each strategy (each planner
    budget) per k, and the plans against their rivals at the end."""
    per_k = sum({"no offload": 0, "planner": len(PLANNER_BUDGETS)}.get(s, 1) for s in config.strategies)
    planner = "planner" in config.strategies  # the plans against their rivals, after every k
    return 1 + ("transformer_engine" in config.strategies) + planner + len(config.ks) * per_k


def _measured_model(name: str, config: BenchConfig, device: torch.device, link: dict | None, bar: ProgressBar,
                    detail: bool, plan_link: LinkCost | None, left_out: dict[str, str]) -> dict[str, Any]:
    """:func:`_bench_model`, and the device memory it left allocated (``left_allocated_bytes``); or, where a
    strategy left the device unusable, ``{"device_lost": DeviceLost}`` (the process must end)."""
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    try:
        out = _bench_model(name, config, device, link, bar, detail, plan_link, left_out)  # frees its model
    except DeviceLost as lost:
        return {"device_lost": lost}
    out["left_allocated_bytes"] = torch.cuda.memory_allocated(device) - before if cuda else None
    return out


def _model_in_child(args: tuple, elapsed_s: float, done: int, total: int, path: str) -> None:
    """A spawned process's work: one model's grid, pickled to ``path``; its bar goes on from the parent's."""
    import_transformer_engine()  # when installed: before CUDA starts in this process
    bar = ProgressBar(total)
    bar.done, bar.began = done, time.perf_counter() - elapsed_s
    out = _measured_model(args[0], args[1], args[2], args[3], bar, *args[4:])
    with open(path, "wb") as f:
        pickle.dump(out, f)
    if "device_lost" in out:  # freeing tensors on a lost device can abort the process: skip the destructors
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _model_in_process(args: tuple, bar: ProgressBar) -> dict[str, Any]:
    """One model's grid in a fresh process: what a library leaves allocated after a model (a handler
    that keeps tensors, a cache) cannot fall on the next model's peak or run it out of memory, and a
    strategy that leaves the device unusable takes only that process with it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.pkl")
        child = multiprocessing.get_context("spawn").Process(
            target=_model_in_child, args=(args, time.perf_counter() - bar.began, bar.done, bar.total, path))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"model {args[0]}: its process exited with code {child.exitcode} (its output is above)")
        with open(path, "rb") as f:
            return pickle.load(f)


def _model(args: tuple, bar: ProgressBar, units: int, isolate: bool) -> dict[str, Any]:
    """One model's grid, started again without each strategy that left the device unusable."""
    name = args[0]
    left_out: dict[str, str] = {}
    start = bar.done
    while True:
        out = (_model_in_process((*args, left_out), bar) if isolate
               else _measured_model(*args[:4], bar, *args[4:], left_out))
        lost = out.get("device_lost")
        if lost is None:
            break
        if not isolate and args[2].type == "cuda":  # this process's device is gone: nothing else can run in it
            raise RuntimeError(f"model {name}: {lost}; run with isolate=True to go on without {lost.strategy}")
        if lost.strategy in left_out:  # left out, yet the device was lost again: not that run's doing
            raise RuntimeError(f"model {name}: {lost}")
        left_out[lost.strategy] = lost.why(name)
        bar.done = start  # the model's units count again
        bar.show(f"model {name}: starting again without {lost.strategy} (it left the device unusable)")
    bar.done = start + units
    return out


def run(config: BenchConfig | None = None, device: torch.device | str | None = None,
        stream=None, isolate: bool | None = None,
        partial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the benchmark and return everything it measured (see :func:`write_outputs`).

    ``partial`` is called with the results so far after each model (to write them as they come).

    ``isolate`` runs each model in a fresh process (default: on CUDA). A first full-size run on the
    H100 had a previous model's 78 GiB still allocated when the next was built; and a strategy that
    leaves the device unusable (:class:`DeviceLost`) ends only its model's process, which starts again
    without it.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Garbage left by earlier work (a model in a reference cycle) would sit in the first run's peak
    # and could be collected during a later one: the planner's costs, calibrated on that first
    # run, then predicted peaks about 10 % too high (seen inside the GPU test suite).
    _free()
    device = resolve_device(device)
    config = config or (BenchConfig() if device.type == "cuda" else BenchConfig.tiny())
    units = _model_units(config)
    bar = ProgressBar(len(config.models) * units, stream)
    bar.show("measuring the host<->device link")
    link = _link(device)
    plan_link = _plan_link(device, link) if "planner" in config.strategies else None
    results = {
        "device_type": device.type,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "config": dataclasses.asdict(config),
        "link_gb_per_s": link,
        "planner_link_gb_per_s": None if plan_link is None else dataclasses.asdict(plan_link),
        "skipped": {s: why for s in config.strategies if (why := available(s, device))},
        "models": [],
    }
    if isolate is None:
        isolate = device.type == "cuda"
    for i, name in enumerate(config.models):
        results["models"].append(_model((name, config, device, link, i == 0, plan_link), bar, units, isolate))
        if partial is not None:
            partial(results)
    bar.close()
    results["targets"] = check_targets(results)
    results["planner_checks"] = check_planner(results)
    return results


# ---------------------------------------------------------------------- targets, table, plots
def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for model A at k=2 (copies fit) and k=4 (they do not), met or missed."""
    model = next((m for m in results["models"] if m["model"] == "A"), None)
    if model is None or not results.get("link_gb_per_s"):
        return []
    engine = {r["k"]: r for r in model["runs"] if r["strategy"] == "engine" and r["status"] == "ok"}
    checks = []
    if 2 in engine:
        r = engine[2]
        q1, q3 = r.get("overhead_quartiles", (None, None))
        spread = f"median of {r['pairs']} pairs; quartiles {q1:+.2%} .. {q3:+.2%}" if q1 is not None else ""
        default = _ok_run(model["runs"], TE_DEFAULT_PATH)
        if default is not None:  # the baseline ran on TE's offload path: say what the default path takes
            spread += f"; TE's default path without offloading: {default['overhead']:+.1%}"
        checks += [("model A, k=2: saving >= 99% of theoretical", r["saving_ratio"], 0.99, ">=", ""),
                   ("model A, k=2: overhead <= 1%", r["overhead"], 0.01, "<=", spread)]
    te = {r["k"]: r for r in model["runs"] if r["strategy"] == "transformer_engine" and r["status"] == "ok"}
    alone = _ok_run(model["runs"], TE_CONTEXT_ONLY)
    pairs = {h["k"]: h for h in model.get("head_to_head", ())}
    for k in sorted(set(engine) & set(te) & {2, 4}):
        apart = f"separate runs: engine {engine[k]['overhead']:+.1%}, TE {te[k]['overhead']:+.1%}"
        apart += f"; TE's context alone: {alone['overhead']:+.1%}" if alone else ""
        checks.append((f"model A, k={k}: saving >= Transformer Engine's (GiB)", engine[k]["saving_bytes"] / GiB,
                       te[k]["saving_bytes"] / GiB, ">=", ""))
        h = pairs.get(k)
        if h is None:  # no step-by-step run: the two separate overheads
            checks.append((f"model A, k={k}: overhead <= Transformer Engine's", engine[k]["overhead"],
                           te[k]["overhead"], "<=", apart))
        elif h["status"] != "ok":
            checks.append((f"model A, k={k}: step <= Transformer Engine's (alternating pairs)", None, 0.0, "<=",
                           h["reason"]))
        else:
            q1, q3 = h["quartiles"]
            checks.append((f"model A, k={k}: step <= Transformer Engine's (alternating pairs)", h["engine_vs_te"],
                           0.0, "<=", f"engine / TE - 1, median of {h['pairs']} pairs; quartiles {q1:+.2%} .. "
                                      f"{q3:+.2%}; {apart}"))
    if 4 in engine:
        r = engine[4]
        bound = f"{r['step_ms']:.1f} ms measured, {r['bound_ms']:.1f} ms bound" if r.get("bound_ms") else ""
        checks += [("model A, k=4: step time within 5% of the copy bound", r["step_over_bound"], 1.05, "<=", bound),
                   ("model A, k=4: device-to-host bandwidth >= 90% of measured", r["d2h_of_link"], 0.90, ">=", ""),
                   ("model A, k=4: host-to-device bandwidth >= 90% of measured", r["h2d_of_link"], 0.90, ">=", "")]
    return [{"target": t, "value": v, "limit": lim, "detail": detail,
             "met": v is not None and (v >= lim if op == ">=" else v <= lim)} for t, v, lim, op, detail in checks]


def _head_to_head_note(runs: Sequence[dict[str, Any]]) -> list[str]:
    """One sentence on the engine's and Transformer Engine's steps measured alternately."""
    said = []
    for h in runs:
        if h["status"] != "ok":
            said.append(f"k = {h['k']}: failed ({h['reason']})")
            continue
        q1, q3 = h["quartiles"]
        said.append(f"k = {h['k']}: engine {h['engine_ms']:.1f} ms, TE {h['te_ms']:.1f} ms; engine / TE "
                    f"{h['engine_vs_te']:+.1%} (median of {h['pairs']} pairs, quartiles {q1:+.1%} .. {q3:+.1%})")
    if not said:
        return []
    return ["The engine and Transformer Engine's offload, alternating step by step (the most direct "
            "comparison of the two): " + "; ".join(said) + "."]


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


def _pct(x: float | None, signed: bool = False) -> str:
    return "n/a" if x is None else (f"{x:+.1%}" if signed else f"{x:.1%}")


def markdown(results: dict[str, Any]) -> str:
    """The results as Markdown: the link, one table per model, the targets."""
    link = results["link_gb_per_s"]
    parts = [f"Device: {results['device']}, torch {results['torch']}."]
    if results.get("device_type") == "cpu":
        parts.append(CPU_TIMING_NOTE)
    if link:
        parts.append(f"Pinned copy bandwidth measured in this run: host-to-device {link['h2d']:.1f} GB/s, "
                     f"device-to-host {link['d2h']:.1f} GB/s, both at once {link['both']:.1f} GB/s in total.")
    header = ["k", "strategy", "peak GiB", "saving GiB", "saving / theory", "step ms", "overhead",
              "copy bound ms", "step / bound", "d2h GB/s (of link)", "h2d GB/s (of link)", "output and gradients"]
    for m in results["models"]:
        spec = m["spec"]
        rows = []
        for r in m["runs"]:
            strategy = r["strategy"] + (f" ({r['budget_from']}'s budget)" if r.get("budget_from") else "")
            if r["status"] != "ok":
                rows.append([r["k"] or "-", strategy, r["status"] + ": " + r["reason"]] + [""] * 9)
                continue
            bw = {key: "" if r.get(f"{key}_gb_per_s") is None else
                  f"{r[f'{key}_gb_per_s']:.1f} ({r[f'{key}_of_link']:.0%})" for key in ("d2h", "h2d")}
            rows.append([r["k"] or "-", strategy, _gib(r["peak_bytes"]), _gib(r["saving_bytes"]),
                         _pct(r["saving_ratio"]), f"{r['step_ms']:.1f}", _pct(r["overhead"], True),
                         "" if r.get("bound_ms") is None else f"{r['bound_ms']:.1f}",
                         "" if r.get("step_over_bound") is None else f"{r['step_over_bound']:.3f}",
                         bw["d2h"], bw["h2d"], _grads_cell(r)])
        pred = m.get("predicted") or {}
        stop = pred.get("copies_stop_fitting_at_k")
        kind = m.get("layer_kind", "transformer layer")
        saved = f"the engine's candidates {format_bytes(max(m['saved_bytes_per_layer']))}"
        if m.get("held_bytes_per_layer"):
            saved = f"{format_bytes(max(m['held_bytes_per_layer']))} held (measured by the allocator), {saved}"
        parts.append(f"### Model {m['model']}: {kind}\n\n{results['config']['layers']} layers of Linear + {kind}, "
                     f"hidden {spec['hidden']}, ffn {spec['ffn']}, {spec['heads']} heads, batch {spec['batch']}, "
                     f"sequence {results['config']['seq']}, {results['config']['dtype']}; {spec['note']}. "
                     f"Saved for backward per layer: {saved}."
                     + (f" The copies stop fitting behind compute at k = {stop} (copy bound > 1.01 x baseline)."
                        if stop else ""))
        parts.append(format_markdown_table(rows, header))
        parts += _te_path_note(m["runs"])
        parts += _head_to_head_note(m.get("head_to_head", ()))
    if results.get("targets"):
        rows = [[t["target"], "n/a" if t["value"] is None else f"{t['value']:.3f}", f"{t['limit']:.3g}",
                 "met" if t["met"] else "**missed**", t["detail"]] for t in results["targets"]]
        parts.append("### Targets\n\n" + format_markdown_table(rows, ["target", "value", "limit", "result", "detail"]))
    if results.get("planner_checks"):
        parts.append(_planner_markdown(results["planner_checks"]))
    if results["skipped"]:
        parts.append("Skipped: " + "; ".join(f"{s} ({why})" for s, why in results["skipped"].items()) + ".")
    return "\n\n".join(parts) + "\n"


def _te_path_note(runs: list[dict[str, Any]]) -> list[str]:
    """Sentences on Transformer Engine's paths, when the model's layers are TE's."""
    default = _ok_run(runs, TE_DEFAULT_PATH)
    alone = _ok_run(runs, TE_CONTEXT_ONLY)
    said = []
    if default is not None:
        said.append(f"On Transformer Engine's layers every run here takes the path TE's layers take inside an "
                    f"offload context, the engine's or TE's (TE's attention slices q, k and v off the fused "
                    f"projection instead of passing the packed buffer), \"no offload\" and \"checkpoint\" "
                    f"included, so that all runs compute the same thing. Outside any offload context (TE's "
                    f"default path) a step took {default['overhead']:+.1%} against \"no offload\" (median of "
                    f"{default['pairs']} pairs).")
    if alone is not None:
        said.append(f"TE's context with nothing offloaded (its hooks on every layer): {alone['overhead']:+.1%}.")
    return [" ".join(said)] if said else []


def _ok_run(runs: Sequence[dict[str, Any]], strategy: str) -> dict[str, Any] | None:
    return next((r for r in runs if r["strategy"] == strategy and r["status"] == "ok"), None)


def _planner_markdown(checks: list[dict[str, Any]]) -> str:
    """The planner's checks as a Markdown section: one row per model and budget, misses in bold."""
    def verdict(met: bool | None) -> str:
        return "n/a" if met is None else ("met" if met else "**missed**")

    rows = []
    for c in checks:
        if "reason" in c:
            rows.append([c["model"], f"{c['budget_from']} k={c['k']}", c["reason"]] + [""] * 8 + [verdict(c["met"])])
            continue
        best = c["best"]
        vs, q = c.get("vs_best"), c.get("vs_best_quartiles")
        rows.append([c["model"], f"{c['budget_from']} k={c['k']}", c["plan"], _gib(c["peak_bytes"]),
                     _pct(c["overhead"], True),
                     "none" if best is None else f"{best['strategy']} k={best['k']}: {_gib(best['peak_bytes'])} GiB, "
                                                 f"{best['overhead']:+.1%}",
                     (f"failed: {c['vs_best_failed']}" if c.get("vs_best_failed") else "n/a") if vs is None
                     else f"{vs:+.1%} ({q[0]:+.1%} .. {q[1]:+.1%})",
                     verdict(c["time_met"]), _pct(c["peak_error"], True), _pct(c["step_error"], True),
                     verdict(c["within_budget_run"]), verdict(c["met"])])
    header = ["model", "budget of", "plan", "peak GiB", "overhead", "best pure run at >= its peak, within budget",
              "plan / best - 1, alternating (quartiles)", f"step <= best + {PLANNER_TIME_NOISE:.0%}", "peak error",
              "step error", "peak <= budget's run", "result"]
    return (f"### Planner\n\nPer budget (the predicted peak of offloading, or recomputing, the first k layers): "
            f"the plan, its measured peak and paired overhead, the fastest engine or checkpoint run whose measured "
            f"peak is between the planner's and that of the run the budget came from, the plan's steps against "
            f"that run's, alternating step by step (what the time check reads), and the prediction errors "
            f"(measured / predicted - 1, limit {PLANNER_PREDICTION_ERROR:.0%}). The planner's costs are calibrated "
            f"on the no-offload run (see `PlannerSetup`).\n\n" + format_markdown_table(rows, header))


def write_outputs(results: dict[str, Any], out: str | Path, plots: bool = True) -> list[Path]:
    """Write ``bench.json``, ``bench.md`` and (with ``plots``) the plots into ``out``; returns the paths.

    The plots need matplotlib (the ``plots`` extra); without it an ``ImportError`` says so.
    """
    if plots and importlib.util.find_spec("matplotlib") is None:
        raise ImportError(PLOTS_MISSING)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [write_atomic(out / "bench.json", json_text(results)),
             write_atomic(out / "bench.md", markdown(results))]
    if plots:
        paths += _write_plots(results, out)
    return paths


def _write_plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from offload_examples.instruments.plots import (
        plot_bench_memory_time, plot_bench_overhead, plot_bench_pareto, plot_memory_curves, plot_timeline,
    )

    paths = []
    figures: dict[str, Any] = {"memory_vs_time.png": plot_bench_memory_time(results),
                               "overhead_vs_k.png": plot_bench_overhead(results)}
    if any(r["strategy"] == "planner" for m in results["models"] for r in m["runs"]):
        figures["planner_pareto.png"] = plot_bench_pareto(results)
    first = results["models"][0]
    for label, spans in first.get("timelines", {}).items():
        if label != "no offload":
            ax = plot_timeline([Span(**s) for s in spans], title=f"model {first['model']}, one step, {label}")
            figures[f"timeline_{label.replace(' ', '_').replace('=', '')}.png"] = ax.figure
    curves = {label: MemoryCurve(c["ms"], c["allocated"]) for label, c in first.get("memory_curves", {}).items()}
    if any(c.ms for c in curves.values()):
        figures["memory_over_step.png"] = plot_memory_curves(
            curves, title=f"model {first['model']}: memory over one step").figure
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m offload_examples bench``: run the grid, print :func:`markdown`, write the outputs.

    Runs the tiny grid on a CPU or with ``--tiny``; returns the results that :func:`run` made.
    """
    full, tiny = BenchConfig(), BenchConfig.tiny()
    parser = ArgumentParser("offload_examples bench", description=__doc__.split("\n")[0])
    add_device(parser)
    parser.add_argument("--tiny", action="store_true", help="the CPU-sized grid on any device (the default on a CPU)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS),
                        help=f"models of the grid (default: {' '.join(full.models)}; {' '.join(tiny.models)} tiny)")
    parser.add_argument("--ks", nargs="+", type=positive_int, metavar="K",
                        help=f"numbers of treated layers, each 1 to layers - 1 (default: {' '.join(map(str, full.ks))}; "
                             f"{' '.join(map(str, tiny.ks))} tiny)")
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), metavar="STRATEGY",
                        help=f"strategies to run, of: {', '.join(map(repr, STRATEGIES))} (default: all)")
    parser.add_argument("--layers", type=positive_int, metavar="N",
                        help=f"layers per model (default: {full.layers}; {tiny.layers} tiny)")
    parser.add_argument("--steps", type=positive_int, metavar="N",
                        help=f"measured steps per run, whose median is reported (default: {full.steps}; {tiny.steps} tiny)")
    parser.add_argument("--warmup", type=nonnegative_int, metavar="N",
                        help=f"unmeasured steps per run (default: {full.warmup}; {tiny.warmup} tiny)")
    parser.add_argument("--out", type=output_folder_arg, default="results/bench", metavar="FOLDER",
                        help="folder for bench.json, bench.md and the plots, created if missing")
    parser.add_argument("--no-plots", action="store_true",
                        help="write bench.json and bench.md only (no matplotlib needed)")
    args = parser.parse_args(argv)
    if not args.no_plots and importlib.util.find_spec("matplotlib") is None:
        parser.error(PLOTS_MISSING)
    device = args.device or default_device()
    changes = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items()
               if k in {f.name for f in dataclasses.fields(BenchConfig)} and v is not None}
    tiny = args.tiny or device.type != "cuda"
    try:
        config = BenchConfig.tiny(**changes) if tiny else BenchConfig(**changes)
    except ValueError as e:  # values that are fine alone but not together, e.g. a k >= --layers
        parser.error(size_error_text(e, changes))
    if args.ks is not None and set(config.strategies) <= {"no offload"}:
        parser.error("--ks: 'no offload' treats no layers; add a strategy that does (or leave out --ks)")
    if args.strategies is not None and (why := [f"{s}: {r}" for s in args.strategies if (r := available(s, device))]):
        parser.error(f"--strategies {'; '.join(why)}")
    import_transformer_engine()  # before CUDA starts, when installed
    check_memory(parser, memory_need(config, device.type), [device],
                 hint=f"{'' if tiny else 'use --tiny or '}lower --layers, or choose smaller --models")
    with claim_output(parser, "--out", args.out / "bench.json") as out:
        results = run(config, device, partial=lambda r: out.write_json({**r, "partial": True}))
        print(markdown(results))
        paths = write_outputs(results, args.out, plots=not args.no_plots)
    for path in paths:
        print(f"wrote {path}")
    if any(r["status"] == "failed" for m in results["models"] for r in m["runs"]):
        print("some strategies failed; see the table", file=sys.stderr)
    for m in results["models"]:
        if m.get("left_out"):
            print(f"model {m['model']}: left out after they left the device unusable: {', '.join(m['left_out'])}",
                  file=sys.stderr)
    return results


def memory_need(config: BenchConfig, device_type: str) -> Need:
    """What the grid needs: its largest model's no-offload step (the models run one after another); on the
    host that model as built (float32), or the pinned buffers of the largest ``k`` and four steps' gradients."""
    specs = [MODELS[m].small() if config.small else MODELS[m] for m in config.models]
    stacks = [Stack.transformer(config.layers, spec.hidden, spec.heads, spec.ffn, spec.batch, config.seq, config.dtype,
                                device_type) for spec in specs]
    host = max(max(s.build_bytes, s.saved_bytes(max(config.ks)) + s.copies_bytes(4)) for s in stacks)
    return Need(max(s.step_bytes() for s in stacks), host)
