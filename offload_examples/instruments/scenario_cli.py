"""Every scenario's command line, ``python -m offload_examples <name> [--small] [--json PATH]``.

A scenario module provides a config dataclass derived from
:class:`~offload_examples.instruments.sizes.ScenarioConfig` (its fields are the full size; ``SMALL``
lists what differs at the small size), ``run`` and ``format_report``;
:func:`scenario_main` turns the config's int and str fields into options. Every value is checked
before the scenario starts (see :mod:`offload_examples.instruments.cli`): a bad one ends the command
with one line on standard error and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from offload_examples.instruments.cli import (
    DTYPES, KINDS, ArgumentParser, add_device, add_json, check_kind, check_memory, claim_output, default_device,
    field_int_arg, size_error_text,
)
from offload_examples.instruments.models import import_transformer_engine
from offload_examples.instruments.sizes import ScenarioConfig

__all__ = ["DEVICE", "STAGES", "Placement", "add_config_options", "make_config", "scenario_main", "size_hint"]

C = TypeVar("C", bound=ScenarioConfig)


#: What each size field means, for ``--help``.
FIELD_HELP = {
    "layers": "number of layers",
    "offload": "offload the first N layers (1 to layers - 1)",
    "hidden": "model width",
    "heads": "attention heads",
    "kv_heads": "key-value heads (grouped-query attention)",
    "ffn": "feed-forward width",
    "vocab": "vocabulary size",
    "lora_rank": "rank of the LoRA adapters",
    "loss_chunk": "tokens per chunk of the loss (the logits of one chunk at a time)",
    "resolution": "the search's step: each longest sequence is found to within this many tokens",
    "max_seq": "the longest sequence tried",
    "seq": "sequence length",
    "batch": "batch size",
    "micro_batch": "micro-batch size",
    "microbatches": "number of micro-batches",
    "width": "layer width (Linear width -> 4 width -> width)",
    "dtype": "dtype of weights and activations",
    "steps": "measured steps, whose median is reported",
    "warmup": "unmeasured steps before them",
    "replays": "timed replays of the captured graph",
    "checks": "inputs whose output and gradients are compared",
    "kind": "transformer layer: torch's, Transformer Engine's (te), or auto (te when installed and on a GPU)",
    "seed": "random seed of weights and inputs",
}


def _default_text(full: Any, small: Any) -> str:
    show = (lambda v: ",".join(f"{x:g}" for x in v)) if isinstance(full, list) else str
    if full == small:
        return f"(default: {show(full)})"
    return f"(default: {show(full)}; {show(small)} on a CPU or with --small)"


def add_config_options(parser: argparse.ArgumentParser, config_cls: type) -> list[str]:
    """An option for each int and str field of ``config_cls``, checked as it is parsed; returns their names.

    The options default to ``None`` (the size's own default); ``--help`` shows the full size's
    default and, where it differs, the small one.
    """
    full, small = config_cls(), config_cls.small()
    names = []
    # a scenario's own fields first, then the shared ones in FIELD_HELP's order
    order = list(FIELD_HELP)
    for f in sorted(dataclasses.fields(config_cls), key=lambda f: order.index(f.name) if f.name in order else -1):
        if f.type not in ("int", "str"):
            continue
        text = f"{FIELD_HELP.get(f.name, f.name.replace('_', ' '))} "
        text += _default_text(getattr(full, f.name), getattr(small, f.name)).replace("%", "%%")
        kwargs: dict[str, Any] = {"help": text}
        if f.type == "int":
            kwargs.update(type=field_int_arg(f.name), metavar="N")
        elif f.name == "dtype":
            kwargs.update(choices=DTYPES)
        elif f.name == "kind":
            kwargs.update(choices=KINDS)
        elif "choices" in f.metadata:
            kwargs.update(choices=f.metadata["choices"])
        parser.add_argument(f"--{f.name.replace('_', '-')}", **kwargs)
        names.append(f.name)
    return names


def _device_options(parser: argparse.ArgumentParser) -> None:
    add_device(parser)
    parser.add_argument("--small", action="store_true",
                        help="use the small CPU-sized model on any device (the default on a CPU)")


#: The size fields that memory grows with, in the order a hint names them.
MEMORY_FIELDS = ("batch", "micro_batch", "microbatches", "seq", "hidden", "ffn", "width", "layers", "layers_per_stage",
                 "checks")


def make_config(parser: ArgumentParser, config_cls: type[C], changes: dict[str, Any], small: bool) -> C:
    """``config_cls`` at the small size (``small``) or the full one, with ``changes`` (the values typed).

    A size that cannot run ends the command in one line that says which of the values it names were
    not typed but defaults (:func:`~offload_examples.instruments.cli.size_error_text`).
    """
    try:
        return config_cls.small(**changes) if small else config_cls(**changes)
    except ValueError as e:  # values that are fine alone but not together, e.g. --offload >= --layers
        parser.error(size_error_text(e, changes))


def size_hint(args: argparse.Namespace, small: bool) -> str:
    """What to change when a scenario's sizes do not fit: ``--small`` (unless ``small`` already) and the
    command's options that memory grows with."""
    options = [f"--{f.replace('_', '-')}" for f in MEMORY_FIELDS if hasattr(args, f)]
    parts = ([] if small else ["use --small"]) + ([f"lower {_either(options)}"] if options else [])
    return " or ".join(parts) or "nothing here is smaller (use a machine with more memory)"


def _either(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _choose_device(parser: ArgumentParser, args: argparse.Namespace, config_cls: type[C],
                   changes: dict[str, Any]) -> tuple[C, torch.device]:
    device = args.device or default_device()
    small = args.small or device.type != "cuda"
    config = make_config(parser, config_cls, changes, small)
    if (why := check_kind(getattr(config, "kind", "torch"), device)) is not None:
        parser.error(why)
    import_transformer_engine()  # when installed: before CUDA starts (which naming the device does)
    if (why := config.device_problem(device)) is not None:
        parser.error(why)
    check_memory(parser, config.memory_need(device.type), [device], hint=size_hint(args, small))
    return config, device


@dataclass(frozen=True)
class Placement:
    """Where a scenario runs, as options: ``add_options(parser)`` adds them; ``choose(parser, args,
    config_cls, changes)`` checks them and returns the config and where to run, the second argument
    of the scenario's ``run``. ``progress``: whether ``run`` takes a ``progress`` callback."""

    add_options: Callable[[argparse.ArgumentParser], None]
    choose: Callable[..., tuple[Any, Any]]
    progress: bool = True


#: One process on one device: ``--device`` and ``--small`` (every scenario but pipeline-dist).
DEVICE = Placement(_device_options, _choose_device)


def _stage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="nccl: one GPU per stage; gloo: the CPU; auto: nccl where 2 GPUs are visible, else gloo")
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        help="cpu means --backend gloo, cuda means --backend nccl (default: from --backend)")
    parser.add_argument("--small", action="store_true",
                        help="the small CPU-sized model (the default with gloo)")


def _choose_backend(parser, args: argparse.Namespace, config_cls: type[C], changes) -> tuple[C, str]:
    """The config and the backend: one process per stage, each on a GPU (nccl) or on the CPU (gloo)."""
    backend = {"cpu": "gloo", "cuda": "nccl"}.get(args.device, args.backend)
    if args.device is not None and args.backend not in ("auto", backend):
        parser.error(f"--device {args.device} means --backend {backend}, but --backend {args.backend} was given")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    small = args.small or backend == "gloo"
    config = make_config(parser, config_cls, changes, small)
    if backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < config.stages):
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        asked = "--device cuda" if args.device else "--backend nccl"
        parser.error(f"{asked} needs one GPU per stage ({config.stages}); {visible} visible")
    if not dist.is_available():
        parser.error("this torch is built without torch.distributed")
    if importlib.util.find_spec("numpy") is None:
        parser.error("torch.distributed.pipelining needs numpy: pip install numpy")
    gpus = [torch.device("cuda", r) for r in range(config.stages)] if backend == "nccl" else []
    need = config.memory_need("cuda" if backend == "nccl" else "cpu")
    check_memory(parser, need, gpus, here=False, hint=size_hint(args, small))
    return config, backend


#: One process per pipeline stage (``config.stages``), each on a GPU or on the CPU: ``--backend``, ``--device``
#: and ``--small`` (pipeline-dist).
STAGES = Placement(_stage_options, _choose_backend, progress=False)


def scenario_main(
    name: str,
    doc: str,
    config_cls: type[ScenarioConfig],
    run: Callable[..., dict[str, Any]],
    format_report: Callable[[dict[str, Any]], str],
    argv: Sequence[str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
    failure: str = "gradients differ",
    sizes: bool = True,
    placement: Placement = DEVICE,
) -> dict[str, Any]:
    """Parse and check ``argv``, run the scenario, print its report, write JSON if asked.

    Exits with ``failure`` (code 1) when the report's ``grads_equal`` is false. ``sizes``: an option
    for each int and str field of the config; ``extra`` may add options whose destinations are config
    fields of other types; ``placement`` says where the scenario runs (:data:`DEVICE` by default).
    """
    parser = ArgumentParser(f"offload_examples {name}", description=doc.split("\n")[0])
    placement.add_options(parser)
    if sizes:
        add_config_options(parser, config_cls)
    if extra is not None:
        extra(parser)
    add_json(parser)
    args = parser.parse_args(argv)
    fields = dataclasses.fields(config_cls)
    changes = {f.name: getattr(args, f.name) for f in fields if getattr(args, f.name, None) is not None}
    config, where = placement.choose(parser, args, config_cls, changes)
    with claim_output(parser, "--json", args.json) or contextlib.nullcontext() as out:
        if placement.progress:
            report = run(config, where, progress=lambda s: print(s, flush=True))
        else:
            report = run(config, where)
        if out is not None:  # first, so that a failure printing the report cannot lose it
            # pictures' raw data (timelines) stay out of the JSON
            out.write_json({k: v for k, v in report.items() if k not in ("timeline", "events")})
        print(format_report(report))
    if out is not None:
        print(f"wrote {out.path}")
    if not report["grads_equal"]:
        sys.exit(failure)
    return report
