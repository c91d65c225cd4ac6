"""The command line every scenario shares: ``python -m offload_examples <name> [--small] [--json PATH]``.

A scenario module provides a config dataclass (with ``small()`` and ``for_device()``), ``run`` and
``format_report``; :func:`scenario_main` turns the config's int and str fields into options.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Callable, Sequence

import torch

from offload_examples.models import import_transformer_engine
from offload_examples.report import write_json

__all__ = ["scenario_main"]


def scenario_main(
    name: str,
    doc: str,
    config_cls: type,
    run: Callable[..., dict[str, Any]],
    format_report: Callable[[dict[str, Any]], str],
    argv: Sequence[str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> dict[str, Any]:
    """Parse ``argv``, run the scenario, print its report, write JSON if asked; exit 1 if gradients differ.

    ``extra`` may add options whose destinations are config fields of other types.
    """
    parser = argparse.ArgumentParser(prog=f"python -m offload_examples {name}", description=doc.split("\n")[0])
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--small", action="store_true", help="use the small CPU-sized model on any device")
    fields = dataclasses.fields(config_cls)
    for f in fields:
        if f.type in ("int", "str"):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=int if f.type == "int" else str)
    if extra is not None:
        extra(parser)
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    import_transformer_engine()  # when installed: before CUDA starts
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    changes = {f.name: getattr(args, f.name) for f in fields if getattr(args, f.name, None) is not None}
    config = config_cls.small(**changes) if args.small else config_cls.for_device(device, **changes)
    report = run(config, device, progress=lambda s: print(s, flush=True))
    print(format_report(report))
    if args.json:  # pictures' raw data (timelines) stay out of the JSON
        print(f"wrote {write_json(args.json, {k: v for k, v in report.items() if k not in ('timeline', 'events')})}")
    if not report["grads_equal"]:
        sys.exit("gradients differ")
    return report
