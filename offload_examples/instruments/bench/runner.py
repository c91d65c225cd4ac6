"""A run of the whole grid: the link measured once, then model after model, then the verdicts."""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any, Callable

import torch

from offload_examples.core.streams import resolve_device
from offload_examples.instruments.bench.faults import _free
from offload_examples.instruments.bench.grid import BenchConfig
from offload_examples.instruments.bench.isolation import _model
from offload_examples.instruments.bench.planner_bench import PLANNER_BUDGETS, _plan_link, check_planner
from offload_examples.instruments.bench.strategies import available
from offload_examples.instruments.bench.tables import check_targets
from offload_examples.instruments.report import ProgressBar

__all__ = ["run"]


def _link(device: torch.device) -> dict[str, float] | None:
    if device.type != "cuda":
        return None
    from offload_examples.instruments.bandwidth import link_bandwidth

    return link_bandwidth()


def _model_units(config: BenchConfig) -> int:
    """Progress units of one model: its no-offload run, TE's context alone, each strategy (each planner
    budget) per k, and the plans against their rivals at the end."""
    per_k = sum({"no offload": 0, "planner": len(PLANNER_BUDGETS)}.get(s, 1) for s in config.strategies)
    planner = "planner" in config.strategies  # the plans against their rivals, after every k
    return 1 + ("transformer_engine" in config.strategies) + planner + len(config.ks) * per_k


def run(config: BenchConfig | None = None, device: torch.device | str | None = None,
        stream=None, isolate: bool | None = None,
        partial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the benchmark and return everything it measured (see :func:`write_outputs`).

    ``partial`` is called with the results so far after each model (to write them as they come).

    ``isolate`` runs each model in a fresh process (default: on CUDA): what a strategy leaks (a library
    that keeps its memory after a failure) does not stay allocated when the next model is built; and a
    strategy that leaves the device unusable (:class:`DeviceLost`) ends only its model's process, which starts again
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
