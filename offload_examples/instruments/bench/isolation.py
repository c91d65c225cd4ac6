"""Each model in a fresh process, started again without a strategy that left the device unusable.

What a library leaves allocated after a model (a handler that keeps tensors, a cache) cannot fall on
the next model's peak or run it out of memory, and a strategy that leaves the device unusable
(:class:`~offload_examples.instruments.bench.faults.DeviceLost`) ends only its model's process.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import tempfile
import time
from typing import Any

import torch

from offload_examples.features.planner import LinkCost
from offload_examples.instruments.bench import model_grid
from offload_examples.instruments.bench.faults import DeviceLost
from offload_examples.instruments.bench.grid import BenchConfig
from offload_examples.instruments.models import import_transformer_engine
from offload_examples.instruments.report import ProgressBar

__all__: list[str] = []


def _measured_model(name: str, config: BenchConfig, device: torch.device, link: dict | None, bar: ProgressBar,
                    detail: bool, plan_link: LinkCost | None, left_out: dict[str, str]) -> dict[str, Any]:
    """:func:`_bench_model`, and the device memory it left allocated (``left_allocated_bytes``); or, where a
    strategy left the device unusable, ``{"device_lost": DeviceLost}`` (the process must end)."""
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    try:
        out = model_grid._bench_model(name, config, device, link, bar, detail, plan_link, left_out)  # frees its model
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
