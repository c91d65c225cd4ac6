"""Scenario 8, long context: the longest sequence one GPU can fine-tune, and at what speed.

A Llama-architecture model at the 8B shape (a tiny one of the same architecture on a CPU), random
weights built by transformers from its config, is fine-tuned as long contexts are: base weights
frozen, LoRA adapters on every attention and MLP projection, AdamW on the adapters, attention through
SDPA, and a loss that sends the hidden states through the LM head a chunk at a time. For each strategy
(:mod:`~offload_examples.instruments.long_context.strategies`: no offloading, transformers'
checkpointing, checkpointing with the checkpoints' inputs in pinned host memory, the engine's
k-of-N offloading at its best ``k``, the planner) the search
(:mod:`~offload_examples.instruments.long_context.search`) finds the longest sequence whose step
completes, to within ``--resolution`` tokens: predicted from the peak memory of short steps, then
confirmed by steps around the prediction; a step that runs out of memory is caught and freed. Where
the strategies meet (the longest length all of them ran, checkpointing's longest) their steps take
turns, each set against checkpointing's of the same round
(:func:`~offload_examples.instruments.long_context.probes.speeds_in_turns`). On a CPU the device
memory is counted as CUDA's allocator would, and ``--memory-limit`` makes a step over it run out
(:mod:`~offload_examples.instruments.long_context.memory`).

Run it (the 8B shape on a GPU, with the whole GPU; or under a memory limit)::

    python -m offload_examples long-context
    python -m offload_examples long-context --memory-limit 80GiB --plot long.png

The loop to copy is :func:`train`, at the top of the module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from offload_examples.features.apply import offload_layers
from offload_examples.features.planner import host_budget
from offload_examples.instruments.cli import Need, bytes_arg, dtype_bytes, json_file_arg, json_path_arg
from offload_examples.instruments.long_context import model as lc_model
from offload_examples.instruments.long_context import probes
from offload_examples.instruments.long_context import strategies as lc
from offload_examples.instruments.long_context.memory import (device_memory_limit, expandable_segments,
                                                           single_thread_on_cpu)
from offload_examples.instruments.models import enable_activation_checkpointing
from offload_examples.instruments.plan_costs import measure_link
from offload_examples.instruments.report import (cpu_timing_note, format_bytes, format_table, report_header,
                                                 write_json)
from offload_examples.instruments.scenario_cli import scenario_main
from offload_examples.instruments.sizes import ScenarioConfig, Timing

__all__ = ["LongContextConfig", "format_report", "main", "run", "train"]


def train(model: nn.Module, batches: Iterable[torch.Tensor], loss_chunk: int = 1024, lr: float = 1e-4) -> None:
    """The loop to copy: LoRA fine-tuning on long sequences, every layer checkpointed by transformers and
    the checkpoints' inputs (but the last layer's, and the first's: a leaf the engine keeps) in pinned host memory."""
    enable_activation_checkpointing(model)  # each layer keeps only its input, and recomputes in the backward
    layers = lc_model.decoder_layers(model)
    handle = offload_layers(model, type(layers[0]), num_layers=len(layers) - 1)  # those inputs go to the host
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    try:
        for ids in batches:
            lc_model.lora_step(model, ids, loss_chunk, optimizer)  # the loss never holds the whole logits
    finally:
        handle.remove()


@dataclass
class LongContextConfig(Timing, ScenarioConfig):
    """Sizes of the long-context scenario: Llama 3 8B's shape by default, LoRA of rank ``lora_rank``."""

    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336
    vocab: int = 128256
    dtype: str = "bfloat16"
    batch: int = 1
    lora_rank: int = 16
    loss_chunk: int = 1024
    resolution: int = 4096
    max_seq: int = 131072
    steps: int = 1  # timed steps of each probe; at the lengths compared, the least number of rounds in turns
    memory_limit: int | None = None  # device bytes; None: the whole GPU (no limit on a CPU)
    host_budget: int | None = None  # pinned host bytes; None: host_budget(), half of what is available
    strategies: list[str] = field(default_factory=lambda: list(lc.STRATEGIES))
    plot: str | None = None  # where to write the plot (PNG), if anywhere
    progress_json: str | None = None  # where to write the report so far after each probe, if anywhere
    speeds: bool = True  # also time the strategies where they meet (the longest length all ran, checkpointing's)
    resume: str | None = None  # a report of the same search (--json, --progress-json) whose searches to go on from

    SMALL = dict(layers=8, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, dtype="float32", lora_rank=4,
                 loss_chunk=64, resolution=32, max_seq=2048, memory_limit=4 * 2**20, warmup=0, steps=1)
    OFFLOAD_OF = None

    def check(self) -> None:
        if (why := lc_model.hf_missing()) is not None:  # the command line's one-line error, as for a bad size
            raise ValueError(why)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if self.max_seq < self.resolution:
            raise ValueError(f"max_seq ({self.max_seq}) must be at least one resolution ({self.resolution})")
        if unknown := [s for s in self.strategies if s not in lc.STRATEGIES]:
            raise ValueError(f"unknown strategy {unknown[0]!r}; choose from: {', '.join(lc.STRATEGIES)}")
        if not self.strategies or len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"strategies must name one or more strategies, each once, got {self.strategies}")
        self.plot, self.progress_json, self.resume = (None if path is None else str(path)
                                                      for path in (self.plot, self.progress_json, self.resume))
        for name in ("memory_limit", "host_budget"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive number of bytes, got {getattr(self, name)}")
        weights = self.weights() * dtype_bytes(self.dtype)
        if self.memory_limit is not None and self.memory_limit <= weights:
            raise ValueError(f"memory_limit ({self.memory_limit} bytes) is too small: the weights alone take {weights}")

    def device_problem(self, device: torch.device) -> str | None:
        """A report to resume that another search wrote (other sizes or strategies, another device, malformed)."""
        try:
            probes.resumable(self.resume, report_header("long-context", device, self)) if self.resume else None
        except ValueError as e:  # refused before anything runs (run() raises it)
            return str(e)
        return None

    def weights(self) -> int:
        """The base model's parameters."""
        return lc_model.llama_parameters(self.layers, self.hidden, self.heads, self.kv_heads, self.ffn, self.vocab)

    def memory_need(self, device_type: str) -> Need:
        """The weights and a checkpointed first probe (inputs, one layer's ``16 hidden + 6 ffn`` elements a token,
        a chunk of logits); on the host, the gradient checks' copies of the adapters and the inputs."""
        element, tokens = dtype_bytes(self.dtype), self.batch * self.resolution
        inputs = tokens * self.layers * self.hidden * element
        step = inputs + tokens * (16 * self.hidden + 6 * self.ffn) * element + 3 * self.loss_chunk * self.vocab * 4
        adapters = self.layers * self.lora_rank * (8 * self.hidden + 3 * self.ffn + 4 * self.hidden) * 4
        return Need(self.weights() * element + step, (len(lc.STRATEGIES) + 2) * adapters + inputs)


def _build(config: LongContextConfig, device: torch.device) -> lc.Trainee:
    model = lc_model.build_lora_llama(config.layers, config.hidden, config.heads, config.kv_heads, config.ffn,
                                      config.vocab, dtype=getattr(torch, config.dtype), device=device,
                                      rank=config.lora_rank, max_seq=config.max_seq, seed=config.seed)
    model.get_base_model().enable_input_require_grads()  # as checkpointing does: the same graph for every strategy
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return lc.Trainee(model, optimizer, device, config.batch, config.vocab, config.loss_chunk, config.seed)


def run(config: LongContextConfig | None = None, device: torch.device | str | None = None,
        progress: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Run the scenario and return its report (see :func:`format_report`)."""
    config, device = LongContextConfig.for_run(config, device)
    with single_thread_on_cpu(device):
        return _run(config, device, progress or (lambda _: None))


def _run(config: LongContextConfig, device: torch.device, say: Callable[[str], None]) -> dict[str, Any]:
    say(f"long-context scenario on {device}: {config.layers} layers of width {config.hidden}, LoRA rank "
        f"{config.lora_rank}, lengths up to {config.max_seq} in steps of {config.resolution}")
    header = report_header("long-context", device, config)
    resumed, stored_host = probes.resumable(config.resume, header) if config.resume else ({}, None)
    trainee = _build(config, device)
    host = config.host_budget if config.host_budget is not None else stored_host or host_budget()
    costs = None  # what the engine's k and the planner's plans are chosen from
    if {"engine", "planner", "checkpoint + offload"} & set(config.strategies):
        link = measure_link(device, 2**20 * (256 if device.type == "cuda" else 4))
        costs = lc.measure_cost_model(trainee, min(config.resolution, probes.SHORT), link, config.max_seq)
    grads, offloaded = probes.check_grads(trainee, config.strategies, config.resolution, costs, host)
    say("gradients bitwise equal to no offloading's: " + ", ".join(f"{n} {g['equal']}" for n, g in grads.items()))
    results: dict[str, Any] = {}
    report = {**header, "memory_limit_bytes": None, "host_budget_bytes": host,
              "strategies": results, "common_seq": 0, "grads": grads, "at_common": {}, "checkpoint_seq": 0,
              "at_checkpoint": {}, "grads_equal": all(g["equal"] for g in grads.values()), "offloaded_bytes": offloaded}
    with device_memory_limit(device, config.memory_limit) as limit, expandable_segments(device):
        report["memory_limit_bytes"] = limit
        probes.search_all(trainee, config.strategies, costs, limit, host, say, results,
                          lambda: _save_progress(config, report), resumed, resolution=config.resolution,
                          max_seq=config.max_seq, warmup=config.warmup, steps=config.steps)
        if config.speeds:
            probes.where_they_meet(trainee, costs, limit, host, report, say, lambda: _save_progress(config, report),
                                   warmup=config.warmup, steps=config.steps)
    if config.plot:
        from offload_examples.instruments.plots import plot_longest_sequence

        figure = plot_longest_sequence(report).figure
        figure.savefig(config.plot, dpi=120)
        figure.clear()
    return report


def _save_progress(config: LongContextConfig, report: dict[str, Any]) -> None:
    if config.progress_json:  # whole or not at all: a run stopped while writing leaves the last report
        write_json(config.progress_json, report)


def format_report(report: dict[str, Any]) -> str:
    """One row per strategy: the longest sequence, its memory and speed, and the speed (median) at the
    length every strategy ran and at checkpointing's longest; then the steps taken in turns there."""
    c, common, ckpt = report["config"], report["common_seq"], report.get("checkpoint_seq") or 0
    rows = []

    def speed(probe: dict[str, Any] | None) -> str:
        return f"{probe['tokens_per_s']:,.0f}" if probe and probe.get("tokens_per_s") else "-"

    for name, r in report["strategies"].items():
        rows.append((name, f"{r['longest']:,}" + (" (the cap)" if r["capped"] else ""), format_bytes(r["peak_bytes"]),
                     format_bytes(r["host_bytes"]) if r["host_bytes"] else "-",
                     f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-",
                     *([speed(report["at_common"].get(name))] if report["at_common"] else []),
                     *([speed(report["at_checkpoint"].get(name))] if report.get("at_checkpoint") else []),
                     "bitwise equal" if report["grads"][name]["equal"] else "DIFFER", r["setting"]))
    header = ("strategy", "longest sequence", "peak device memory", "pinned host", "tokens/s",
              *([f"tokens/s at {common:,}"] if report["at_common"] else []),
              *([f"tokens/s at {ckpt:,}"] if report.get("at_checkpoint") else []),
              "gradients", "what ran at the longest")
    limit = format_bytes(report["memory_limit_bytes"]) if report["memory_limit_bytes"] else "none"
    return "\n".join([
        f"{report['device']} (torch {report['torch']}): Llama shape {c['layers']} x {c['hidden']} (ffn {c['ffn']}, "
        f"{c['heads']}/{c['kv_heads']} heads, vocab {c['vocab']}), {c['dtype']}, LoRA rank {c['lora_rank']}, batch "
        f"{c['batch']}; device memory limit {limit}, pinned host budget {format_bytes(report['host_budget_bytes'])}",
        format_table(rows, header=header),
        f"longest sequences to within {c['resolution']:,} tokens, up to {c['max_seq']:,}; gradients of every strategy "
        f"against no offloading at {min(c['resolution'], probes.SHORT):,} tokens, bitwise equal: "
        f"{report['grads_equal']}",
        *probes.format_turns(report["at_common"], common, "the longest all of them ran"),
        *probes.format_turns(report.get("at_checkpoint") or {}, ckpt, "the longest checkpointing ran"),
        *cpu_timing_note(report),
    ])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m offload_examples long-context``: run it from the command line (see :func:`.scenario_main`)."""
    def options(parser):
        parser.add_argument("--strategies", nargs="+", choices=list(lc.STRATEGIES), metavar="STRATEGY",
                            help=f"strategies to run, of: {', '.join(map(repr, lc.STRATEGIES))} (default: all)")
        parser.add_argument("--memory-limit", type=bytes_arg, metavar="BYTES",
                            help="device memory a step may use, e.g. 40GiB (default: the whole GPU; 4 MiB on a CPU)")
        parser.add_argument("--host-budget", type=bytes_arg, metavar="BYTES",
                            help="pinned host memory the offloading may hold (default: half of what is available)")
        parser.add_argument("--plot", type=json_path_arg, metavar="PATH",
                            help="also draw tokens/s against sequence length into PATH (PNG; default: no plot)")
        parser.add_argument("--progress-json", type=json_path_arg, metavar="PATH",
                            help="write the report so far into PATH after each step of the search, so that a "
                                 "search cut short keeps what it found (default: nowhere)")
        parser.add_argument("--resume", type=json_file_arg, metavar="PATH",
                            help="go on from the searches of a report of the same search (--json or --progress-json "
                                 "wrote it): finished ones are kept, others resume from their steps (default: none)")
        parser.add_argument("--no-speeds", dest="speeds", action="store_const", const=False,
                            help="only search each strategy's longest sequence "
                                 "(default: also time them where they meet)")

    return scenario_main("long-context", __doc__, LongContextConfig, run, format_report, argv, extra=options)
