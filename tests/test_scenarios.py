"""Every scenario runs from the command line, small, on the CPU, and reports correct results."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import subprocess
import sys

import pytest
import torch

from offload_examples.instruments.models import build_basic_model, build_linear_stack
from offload_examples.instruments.report import CPU_TIMING_NOTE
from offload_examples.scenarios import SCENARIOS


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_cli_runs_small_and_is_correct(name, scenario_cli):
    proc, out = scenario_cli(name)  # python -m offload_examples NAME --small --device cpu --json OUT (conftest.py)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equal" in proc.stdout  # the table, with its gradient column, was printed
    if name != "pipeline-dist":  # which shows no step times on a CPU
        assert CPU_TIMING_NOTE in proc.stdout  # the step times are not passed off as a measurement
    assert "NumPy" not in proc.stderr  # no "Failed to initialize NumPy" warning
    report = json.loads(out.read_text())
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # written whole: no temporary file left beside it
    assert report["grads_equal"] is True
    assert report.get("resident_matches_theory", True) is True
    offloaded = report.get("offloaded_bytes") or sum(
        c["offloaded_bytes"] for c in (report.get("cases") or {}).values()) or sum(
        r["offloaded_bytes"] for r in report.get("ranks", []))
    assert offloaded > 0


def test_basic_report_numbers_are_consistent():
    from offload_examples.scenarios.basic import BasicConfig, format_report, run

    report = run(BasicConfig.small(layers=5, offload=3), "cpu", progress=None)
    per_layer = report["offloaded_bytes_per_layer"]
    assert all(b > 0 for b in per_layer[:3]) and not any(per_layer[3:])
    assert report["theoretical_saving_bytes"] == report["offloaded_bytes"] == sum(per_layer)
    assert report["peak_with_bytes"] is None and report["saving_ratio"] is None  # no CUDA: no fake numbers
    assert "n/a (no CUDA)" in format_report(report)
    assert format_report(report).endswith(CPU_TIMING_NOTE)


def test_unknown_scenario_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "offload_examples", "nope"], capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown scenario 'nope'" in proc.stderr


# ---------------------------------------------------------------------------- the loops to copy
def _weights(layers: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in layers.parameters()]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_scenario_opens_with_its_loop_to_copy(name):
    """A reader opening a scenario meets ``train`` (after the model it trains, where the scenario has
    one of its own) before the scenario's sizes and its measuring."""
    module = importlib.import_module(SCENARIOS[name])
    defined = [node.name for node in ast.parse(inspect.getsource(module)).body
               if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    assert "train" in defined[:2], defined
    assert defined.index("train") < defined.index("run")


def test_the_loops_to_copy_train_on_the_cpu():
    """Each one-process scenario's ``train`` runs as written and moves the weights."""
    from offload_examples.scenarios import basic, optimizer_offload, pipeline, weight_streaming

    layers = build_basic_model(3, 16, 2, 32, kind="torch")
    before = _weights(layers)
    basic.train(layers, [torch.randn(2, 4, 16) for _ in range(2)], offload=2)
    assert all(not torch.equal(a, b) for a, b in zip(before, layers.parameters()))

    layer = build_basic_model(1, 16, 2, 32, kind="torch")[0]
    before = _weights(layer)
    pipeline.train(layer, [torch.randn(8, 2, 4, 16) for _ in range(2)])  # 8 micro-batches a batch
    assert all(not torch.equal(a, b) for a, b in zip(before, layer.parameters()))

    for train, options in ((optimizer_offload.train, {"fraction": 0.5}), (weight_streaming.train, {"device": "cpu"})):
        layers = build_linear_stack(3, 8)
        before = _weights(layers)
        train(layers, [torch.randn(4, 8) for _ in range(2)], **options)
        assert all(not torch.equal(a, b) for a, b in zip(before, layers.parameters())), train.__module__


def _train_on_rank(rank: int, device: torch.device) -> dict:
    """One rank of each multi-process scenario's ``train``, one after the other in the same process group:
    whether every weight of the rank moved, by scenario."""
    return {"fsdp": _fsdp_moved(rank, device), "pipeline-dist": _pipeline_moved(rank, device)}


def _fsdp_moved(rank: int, device: torch.device) -> bool:
    from offload_examples.scenarios import fsdp

    torch.manual_seed(0)
    layers = build_basic_model(2, 16, 2, 32, kind="torch", device=device)
    before = _weights(layers)
    fsdp.train(layers, [torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(rank)) for _ in range(2)],
               offload=1)
    after = [p.full_tensor() for p in layers.parameters()]  # FSDP's parameters are sharded
    return all(not torch.equal(a, b) for a, b in zip(before, after))


def _pipeline_moved(rank: int, device: torch.device) -> bool:
    from offload_examples.scenarios import pipeline_dist

    torch.manual_seed(0)
    cfg = pipeline_dist.DistConfig.small()
    model = build_basic_model(cfg.stages * cfg.layers_per_stage, cfg.hidden, cfg.heads, cfg.ffn, kind="torch")
    layers = torch.nn.ModuleList(model[rank * cfg.layers_per_stage:(rank + 1) * cfg.layers_per_stage])
    before = _weights(layers)
    batches = [torch.randn(cfg.microbatches * cfg.micro_batch, cfg.seq, cfg.hidden) for _ in range(3)]
    pipeline_dist.train(layers, batches, cfg, rank, device)
    return all(not torch.equal(a, b) for a, b in zip(before, layers.parameters()))


def test_the_loops_to_copy_train_on_two_cpu_ranks():
    """The multi-process scenarios' ``train``, each on the same two gloo ranks: every rank's weights move.
    Both loops share the ranks, whose start (a fresh torch each) is most of the time."""
    from offload_examples.instruments.spawn import Launch, run_ranks

    ranks = run_ranks(_train_on_rank, (), 2, Launch("cpu"), timeout_s=300)
    assert ranks == [{"fsdp": True, "pipeline-dist": True}] * 2, ranks


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["train", "train_per_layer"])
def test_the_cuda_graph_loops_train(cuda, loop):
    from offload_examples.scenarios import cuda_graphs

    layers = build_basic_model(3, 64, 4, 256, kind="torch", device=cuda)
    before = _weights(layers)
    getattr(cuda_graphs, loop)(layers, [torch.randn(2, 16, 64, device=cuda) for _ in range(3)], offload=1)
    assert all(not torch.equal(a, b) for a, b in zip(before, layers.parameters()))
