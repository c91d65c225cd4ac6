"""Ranks: started here, one fresh process each, or by torchrun; each joins the process group, runs its
part, and its result comes back to the caller.

The multi-process scenarios (``fsdp``, ``pipeline-dist``) hand :func:`run_ranks` the function one rank
runs; it returns every rank's result, whoever started the ranks.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["Launch", "default_world", "free_port", "join_group", "rank_results", "run_ranks", "spawn_ranks",
           "under_torchrun"]


@dataclass(frozen=True)
class Launch:
    """Where the ranks run: ``device_type`` ``"cuda"`` (NCCL, one GPU per rank) or ``"cpu"`` (gloo);
    ``torchrun``: this process is one rank started by torchrun, else the ranks are spawned here."""

    device_type: str = "cpu"
    torchrun: bool = False

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"


def under_torchrun() -> bool:
    """Whether this process is one rank that torchrun (or another launcher setting its variables) started."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def default_world(device_type: str) -> int:
    """Ranks when none is asked for: ``WORLD_SIZE`` under torchrun, every visible GPU, or 2 on the CPU."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return max(1, torch.cuda.device_count()) if device_type == "cuda" else 2


def free_port() -> int:
    """A TCP port on this host that nothing listens on now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int, timeout_s: float = 900.0) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes and wait for all of them, at most ``timeout_s``.

    A rank that raises ends the others and raises here (as ``torch.multiprocessing.spawn`` does). A rank
    that hangs (a collective whose peer died, a rendezvous that never completes) is killed with the
    others when the time is up, and :class:`TimeoutError` says so: no process outlives the call.
    """
    context = torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    # when one rank fails, give the others a second to stop, not torch's default half minute
    grace = {"grace_period": 1.0} if "grace_period" in inspect.signature(context.join).parameters else {}
    try:
        while not context.join(timeout=1.0, **grace):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{nprocs} rank(s) did not finish within {timeout_s:.0f} s; they were stopped")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join()


def rank_results(folder: str, world: int) -> list[dict[str, Any]]:
    """The ``rank{r}.json`` each spawned rank wrote into ``folder``; a rank that wrote none is an error
    (a rank interrupted with Ctrl-C exits with code 0 and no result)."""
    results = []
    for r in range(world):
        path = os.path.join(folder, f"rank{r}.json")
        if not os.path.exists(path):
            raise RuntimeError(f"rank {r} ended without writing its result (was it interrupted?)")
        with open(path) as f:
            results.append(json.load(f))
    return results


def join_group(backend: str, rank: int, world: int, device: torch.device, collective_timeout_s: float = 300.0,
               share_cores: bool = True) -> None:
    """Join the process group as ``rank`` of ``world`` on ``device``, collectives timing out after
    ``collective_timeout_s``; with ``share_cores``, CPU ranks split the cores between them (unless
    ``OMP_NUM_THREADS`` says otherwise)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif share_cores and "OMP_NUM_THREADS" not in os.environ:  # as torchrun's default of 1 thread does
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=collective_timeout_s),
                            **({"device_id": device} if device.type == "cuda" else {}))


def _spawned_rank(rank: int, work: Callable[..., dict[str, Any]], args: tuple, world: int, launch: Launch,
                  out_dir: str, port: int, group: dict[str, Any]) -> None:
    """One spawned rank: join the group, run ``work(rank, device, *args)``, write the result for the parent to read."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if launch.device_type == "cuda" else torch.device("cpu")
    join_group(launch.backend, rank, world, device, **group)
    try:
        result = work(rank, device, *args)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_ranks(work: Callable[..., dict[str, Any]], args: tuple, world: int, launch: Launch, timeout_s: float = 900.0,
              **group: Any) -> list[dict[str, Any]]:
    """``work(rank, device, *args)`` on every rank, and each rank's result (a dict of plain JSON types).

    Under torchrun this process is one of the ranks: it runs its part and the results are gathered
    over the group. Otherwise ``world`` ranks are spawned here (:func:`spawn_ranks`, at most
    ``timeout_s``) and write their results for this process to read. ``group`` goes to
    :func:`join_group` (``collective_timeout_s``, ``share_cores``).
    """
    if launch.torchrun:
        rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local) if launch.device_type == "cuda" else torch.device("cpu")
        join_group(launch.backend, rank, world, device, **group)
        try:
            ranks: list[Any] = [None] * world
            dist.all_gather_object(ranks, work(rank, device, *args))
        finally:
            dist.destroy_process_group()
    else:
        with tempfile.TemporaryDirectory() as out_dir:
            spawn_ranks(_spawned_rank, (work, args, world, launch, out_dir, free_port(), group), world, timeout_s)
            ranks = rank_results(out_dir, world)
    return [json.loads(json.dumps(r)) for r in ranks]  # the same plain types however they were gathered
