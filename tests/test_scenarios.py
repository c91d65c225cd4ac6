"""Every scenario runs from the command line, small, on the CPU, and reports correct results."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from offload_examples.instruments.report import CPU_TIMING_NOTE
from offload_examples.scenarios import SCENARIOS


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_cli_runs_small_and_is_correct(name, tmp_path):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "offload_examples", name, "--small", "--device", "cpu", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equal" in proc.stdout  # the table, with its gradient column, was printed
    if name != "pipeline-dist":  # which shows no step times on a CPU
        assert CPU_TIMING_NOTE in proc.stdout  # the step times are not passed off as a measurement
    assert "NumPy" not in proc.stderr  # no "Failed to initialize NumPy" warning
    report = json.loads(out.read_text())
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # written whole: no temporary file left beside it
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
