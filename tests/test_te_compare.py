"""What notebook 02's comparison with Transformer Engine reports, from made-up step times on the CPU
(the runs themselves need CUDA and TE: tests/test_te_gpu.py)."""

import pytest
import torch

from offload_examples.instruments.measure import Measurement
from offload_examples.instruments.te_compare import summarize

BASE = [10.0, 12.0, 11.0, 10.0, 14.0]


def run(times, peak, grad=1.0):
    """A measured run: its steps, its peak over a baseline of 100 bytes, one gradient."""
    return Measurement("", list(times), 100 + peak, 100, torch.zeros(2), {"w": torch.full((2,), grad)})


def runs(engine_grad=1.0):
    return {
        "no offload": run(BASE, 1000),
        "no offload, again": run([t * 1.01 for t in BASE], 1000),
        "no offload, TE's default path": run([t * 0.9 for t in BASE], 1000),
        "this engine": run([t * r for t, r in zip(BASE, (1.1, 1.2, 1.3, 1.4, 1.5))], 600, engine_grad),
        "Transformer Engine": run([t * 1.1 for t in BASE], 700),
    }


def test_te_compare_reports_each_runs_spread_and_its_overheads_round_by_round():
    out = summarize(runs(), "bf16", 2)
    assert (out["recipe"], out["k"], out["deterministic"]) == ("bf16", 2, True)
    assert out["no offload"]["overhead"] == 0 and out["no offload"]["overhead_range"] == [0, 0]
    assert out["no offload"]["step_ms"] == 11.0 and out["no offload"]["step_ms_range"] == [10.0, 14.0]
    engine = out["this engine"]
    assert engine["saving_bytes"] == 400 and engine["activation_peak_bytes"] == 600
    assert engine["overhead"] == pytest.approx(0.3)
    assert engine["overhead_range"] == pytest.approx([0.1, 0.5])
    assert engine["overhead_quartiles"] == pytest.approx([0.2, 0.4])
    assert engine["bitwise_equal"] and out["Transformer Engine"]["saving_bytes"] == 300
    assert out["no offload, again"]["overhead"] == pytest.approx(0.01)
    # the two offloads against each other, round by round: engine / TE - 1
    head = out["this engine vs Transformer Engine"]
    assert head["overhead"] == pytest.approx(1.3 / 1.1 - 1)
    assert head["overhead_range"] == pytest.approx([0.0, 1.5 / 1.1 - 1])


def test_te_compare_spread_of_one_round_and_a_changed_bit():
    one = {name: run(m.step_ms[:1], m.activation_peak_bytes) for name, m in runs().items()}
    assert summarize(one, "bf16", 2)["this engine"]["overhead_quartiles"] == pytest.approx([0.1, 0.1])
    assert not summarize(runs(engine_grad=2.0), "DelayedScaling", 2)["this engine"]["bitwise_equal"]
