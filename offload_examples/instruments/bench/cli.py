"""``python -m offload_examples bench``: the benchmark's command line."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from typing import Any, Sequence

from offload_examples.instruments.bench.grid import MODELS, BenchConfig, memory_need
from offload_examples.instruments.bench.plots import PLOTS_MISSING, write_outputs
from offload_examples.instruments.bench.runner import run
from offload_examples.instruments.bench.strategies import STRATEGIES, available
from offload_examples.instruments.bench.tables import markdown
from offload_examples.instruments.cli import (
    ArgumentParser, add_device, check_memory, claim_output, default_device, nonnegative_int, output_folder_arg,
    positive_int, size_error_text,
)
from offload_examples.instruments.models import import_transformer_engine

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m offload_examples bench``: run the grid, print :func:`markdown`, write the outputs.

    Runs the tiny grid on a CPU or with ``--tiny``; returns the results that :func:`run` made.
    """
    full, tiny = BenchConfig(), BenchConfig.tiny()
    from offload_examples.instruments import bench  # its docstring's first line describes the command

    parser = ArgumentParser("offload_examples bench", description=bench.__doc__.split("\n")[0])
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
