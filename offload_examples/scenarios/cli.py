"""The command line every scenario shares: ``python -m offload_examples <name> [--small] [--json PATH]``.

A scenario module provides a config dataclass (with ``small()`` and ``for_device()``), ``run`` and
``format_report``; :func:`scenario_main` turns the config's int and str fields into options. Every
value is checked before the scenario starts (see :mod:`offload_examples.cli`): a bad one ends the
command with one line on standard error and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Callable, Sequence

from offload_examples.cli import (
    DTYPES, KINDS, ArgumentParser, add_device, add_json, check_kind, default_device, field_int_arg,
)
from offload_examples.models import import_transformer_engine
from offload_examples.report import write_json

__all__ = ["add_config_options", "scenario_main"]

#: What each size field means, for ``--help``.
FIELD_HELP = {
    "layers": "number of layers",
    "offload": "offload the first N layers (1 to layers - 1)",
    "hidden": "model width",
    "heads": "attention heads",
    "ffn": "feed-forward width",
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
    for f in dataclasses.fields(config_cls):
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
        parser.add_argument(f"--{f.name.replace('_', '-')}", **kwargs)
        names.append(f.name)
    return names


def scenario_main(
    name: str,
    doc: str,
    config_cls: type,
    run: Callable[..., dict[str, Any]],
    format_report: Callable[[dict[str, Any]], str],
    argv: Sequence[str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
    failure: str = "gradients differ",
) -> dict[str, Any]:
    """Parse and check ``argv``, run the scenario, print its report, write JSON if asked.

    Exits with ``failure`` (code 1) when the report's ``grads_equal`` is false. ``extra`` may add
    options whose destinations are config fields of other types.
    """
    parser = ArgumentParser(f"offload_examples {name}", description=doc.split("\n")[0])
    add_device(parser)
    parser.add_argument("--small", action="store_true",
                        help="use the small CPU-sized model on any device (the default on a CPU)")
    add_config_options(parser, config_cls)
    if extra is not None:
        extra(parser)
    add_json(parser)
    args = parser.parse_args(argv)
    device = args.device or default_device()
    fields = dataclasses.fields(config_cls)
    changes = {f.name: getattr(args, f.name) for f in fields if getattr(args, f.name, None) is not None}
    try:
        config = config_cls.small(**changes) if args.small else config_cls.for_device(device, **changes)
    except ValueError as e:  # values that are fine alone but not together, e.g. --offload >= --layers
        parser.error(str(e))
    if (why := check_kind(getattr(config, "kind", "torch"), device)) is not None:
        parser.error(why)
    import_transformer_engine()  # when installed: before CUDA starts
    report = run(config, device, progress=lambda s: print(s, flush=True))
    print(format_report(report))
    if args.json:  # pictures' raw data (timelines) stay out of the JSON
        print(f"wrote {write_json(args.json, {k: v for k, v in report.items() if k not in ('timeline', 'events')})}")
    if not report["grads_equal"]:
        sys.exit(failure)
    return report
