"""The FSDP scenario's command line: where its ranks run (``--device``, ``--small``, ``--world``), its own
options, and the checks that end a command that cannot run in one line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from offload_examples.instruments.cli import add_device, check_memory, default_device, nonnegative_int, positive_int
from offload_examples.instruments.fsdp.config import FsdpConfig
from offload_examples.instruments.scenario_cli import Placement, make_config, size_hint
from offload_examples.instruments.spawn import Launch, default_world, under_torchrun

__all__ = ["PLACEMENT", "add_options", "on_rank_zero"]


def _plan_arg(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text.upper()


def _placement_options(parser: argparse.ArgumentParser) -> None:
    add_device(parser)
    parser.add_argument("--small", action="store_true", help="use the small CPU-sized model on any device "
                        "(the default on a CPU)")
    parser.add_argument("--world", type=positive_int, metavar="N",
                        help="ranks, one process each (default: every visible GPU; 2 on a CPU; WORLD_SIZE under torchrun)")


def add_options(parser: argparse.ArgumentParser) -> None:
    """The scenario's own options: ``--wrap``, ``--checkpoint``, ``--reshard-after-forward``, ``--plan``, ``--cpu-params``."""
    parser.add_argument("--wrap", choices=["fsdp", "ddp"],
                        help="fsdp: fully_shard on every layer and the root; ddp: DistributedDataParallel (default: fsdp)")
    parser.add_argument("--checkpoint", type=lambda text: nonnegative_int(text) or None, metavar="N",
                        help="recompute the last N layers in backward, torch.utils.checkpoint (default: 0, none)")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                        help="FSDP frees each layer's gathered parameters after its forward (default: on)")
    parser.add_argument("--plan", type=_plan_arg, metavar="FRACTION|LETTERS",
                        help="let the planner keep, offload or recompute each layer so that the saved activations' "
                             "predicted peak is at most FRACTION of keeping them all, or give the plan, one letter "
                             "per layer of K, O, R (e.g. OORK); instead of --offload/--checkpoint (default: none)")
    parser.add_argument("--cpu-params", action="store_true", default=None,
                        help="FSDP's CPUOffloadPolicy as well: sharded parameters and the optimizer on the host "
                             "(needs CUDA and --wrap fsdp)")


def _choose(parser, args: argparse.Namespace, config_cls: type[FsdpConfig], changes: dict[str, Any]
            ) -> tuple[FsdpConfig, Launch]:
    """The config and where the ranks run; every refusal is one line (``parser.error``)."""
    device = args.device or default_device()
    if device.index is not None:
        parser.error(f"--device {device}: the ranks use GPUs 0 to world - 1; give --device cuda")
    torchrun = under_torchrun()
    if torchrun and args.world not in (None, int(os.environ["WORLD_SIZE"])):
        parser.error(f"--world {args.world} but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} ranks")
    if args.plan is not None and args.offload is not None:
        parser.error("--plan chooses which layers to offload itself: leave out --offload (or --plan)")
    if args.wrap == "ddp" and args.reshard_after_forward:
        parser.error("--reshard-after-forward is an FSDP option: DDP keeps whole parameters (use --wrap fsdp)")
    small = args.small or device.type != "cuda"
    config = make_config(parser, config_cls, {"world": default_world(device.type), **changes}, small)
    if device.type == "cuda" and not torchrun and config.world > torch.cuda.device_count():
        parser.error(f"--world {config.world} needs one GPU per rank; {torch.cuda.device_count()} visible")
    if device.type == "cpu" and config.world > (most := max(4, os.cpu_count() or 1)):
        parser.error(f"--world {config.world} on the CPU: at most {most} ranks here (the cores, or 4)")
    if config.cpu_params and device.type != "cuda":
        parser.error("--cpu-params needs CUDA: FSDP's CPUOffloadPolicy moves parameters out of GPU memory, "
                     "which a CPU run does not have")
    if not dist.is_available():
        parser.error("this torch is built without torch.distributed")
    if config.wrap == "fsdp":
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: F401
        except ImportError:
            parser.error(f"--wrap fsdp needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); this is "
                         f"{torch.__version__} (use --wrap ddp)")
    need = config.memory_need(device.type)
    if torchrun:  # this process is one rank on its own GPU; the host is shared by this node's ranks
        local = int(os.environ["LOCAL_RANK"])
        gpus = [torch.device("cuda", local)] if device.type == "cuda" else []
        need = need.per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", config.world)))
    else:
        gpus = [torch.device("cuda", r) for r in range(config.world)] if device.type == "cuda" else []
    check_memory(parser, need, gpus, here=torchrun, hint=size_hint(args, small))
    return config, Launch(device.type, torchrun)


#: Where the FSDP scenario's ranks run, as options: ``--device``, ``--small`` and ``--world``.
PLACEMENT = Placement(_placement_options, _choose)


def on_rank_zero(run: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """``run`` for the command line: under torchrun every rank runs it, and only rank 0 goes on to print the
    report and write the JSON."""

    def run_and_end_other_ranks(config: FsdpConfig, launch: Launch, progress=print) -> dict[str, Any]:
        other_rank = launch.torchrun and int(os.environ["RANK"]) != 0
        report = run(config, launch, progress=None if other_rank else progress)
        if other_rank:
            sys.exit(0)
        return report

    return run_and_end_other_ranks
