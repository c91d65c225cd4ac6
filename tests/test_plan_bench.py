"""The bench's ``planner`` strategy: plans under the budgets of pure offloading and pure recomputation,
run paired like every strategy, compared with their predictions and with the pure runs."""

from __future__ import annotations

import io
import json

import pytest
import torch

from offload_examples import DefaultSchedule
from offload_examples.features.planner import KEEP, OFFLOAD, RECOMPUTE, Plan
from offload_examples.instruments import bench
from offload_examples.instruments.bench import planner_bench, strategies, tables
from offload_examples.instruments.measure import compare_grads, measure_steps
from offload_examples.instruments.models import build_basic_model

PURE_AND_PLANNER = ("no offload", "engine", "checkpoint", "planner")


@pytest.fixture(scope="module")
def tiny_results(tiny_bench):
    """The tiny benchmark of conftest.py: the planner on models A and B at k = 1 and 2 among every strategy,
    its rivals the engine and checkpoint rows (the other strategies' rows are not read)."""
    config, results, _, _ = tiny_bench
    assert set(PURE_AND_PLANNER) <= set(config.strategies)
    return config, results


def test_planner_runs_one_plan_per_budget(tiny_results):
    config, results = tiny_results
    assert results["planner_link_gb_per_s"]["d2h_gb_per_s"] > 0  # timed once for the run
    for model in results["models"]:
        setup = model["planner"]
        n = config.layers
        assert len(setup["costs"]) == n and setup["time_scale"] > 0
        runs = [r for r in model["runs"] if r["strategy"] == "planner"]
        assert [(r["k"], r["budget_from"]) for r in runs] == [(k, s) for k in config.ks for s in bench.PLANNER_BUDGETS]
        for r in runs:
            assert r["status"] == "ok", r
            assert len(r["choices"]) == n and r["choices"][-1] != "offload"
            assert r["feasible"] and r["predicted_peak_bytes"] <= r["budget_bytes"]
            assert r["resident_matches_theory"], "the engine ran the plan's offloads at its schedule's points"
            assert len(r["step_ms_all"]) == config.steps and r["step_error"] is not None
            assert r["peak_error"] is None  # no allocator to measure on a CPU
            assert r["theoretical_saving_bytes"] == setup["keep_peak_bytes"] - r["predicted_peak_bytes"]


def test_planner_budgets_are_the_pure_plans_predicted_peaks(tiny_results):
    """On a CPU the saved bytes are the engine's own count: the engine's budget is the base bytes plus the
    peak its default schedule simulates for those bytes, exactly."""
    config, results = tiny_results
    n = config.layers
    for model in results["models"]:
        setup = model["planner"]
        saved = [c["saved_bytes"] for c in setup["costs"]]
        assert saved == model["saved_bytes_per_layer"]  # measure_costs and the bench's probe agree
        inputs = [c["input_bytes"] for c in setup["costs"]]
        for r in model["runs"]:
            if r["strategy"] != "planner":
                continue
            k = r["k"]
            if r["budget_from"] == "engine":
                off = [b if i < k else 0 for i, b in enumerate(saved)]
                kept = [b - o for b, o in zip(saved, off)]
                want = DefaultSchedule(k, n).simulate(off, kept).peak_with
            else:  # recomputed layers hold their input, and their saved bytes while their backward runs
                held = [inputs[i] if i < k else saved[i] for i in range(n)]
                want = max(sum(held), max(sum(held[:i]) + saved[i] for i in range(k)))
            assert r["budget_bytes"] == setup["base_bytes"] + want


def test_planner_checks_report_every_run(tiny_results):
    _, results = tiny_results
    checks = results["planner_checks"]
    planner_runs = [r for m in results["models"] for r in m["runs"] if r["strategy"] == "planner"]
    assert len(checks) == len(planner_runs)
    for c in checks:
        assert c["best"] is not None and c["best"]["strategy"] == c["budget_from"] and c["best"]["k"] == c["k"]
        # a CPU's peaks are not measured and its times say nothing: values reported, no verdict
        assert c["met"] is None and c["time_met"] is None and c["step_error"] is not None
        # each plan also ran step by step against that rival
        assert isinstance(c["vs_best"], float) and c["vs_best_quartiles"][0] <= c["vs_best"] <= c["vs_best_quartiles"][1]
    for run in planner_runs:
        vs = run["vs_best"]
        assert vs["status"] == "ok" and vs["pairs"] == results["config"]["steps"], vs
        assert (vs["strategy"], vs["k"]) == (run["budget_from"], run["k"])


def test_planner_outputs(tiny_bench):
    _, results, out, paths = tiny_bench  # paths: what bench.write_outputs(results, out) returned
    assert (out / "planner_pareto.png") in paths
    assert (out / "planner_pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    assert "### Planner" in md and "| planner (engine's budget) |" in md
    data = json.loads((out / "bench.json").read_text())
    assert len(data["planner_checks"]) == len(results["planner_checks"])


def test_check_planner_by_hand():
    """Rivals: pure runs at no less than the planner's peak and no more than its budget's run; misses shown."""
    def run(strategy, k, peak, overhead, **more):
        return {"strategy": strategy, "k": k, "status": "ok", "peak_bytes": peak, "overhead": overhead, **more}

    planner = run("planner", 2, 100, 0.03, budget_from="engine", budget_bytes=120, plan="offload 0-1",
                  peak_error=0.01, step_error=-0.02)
    runs = [run("no offload", 0, 200, 0.0), run("engine", 1, 150, 0.0), run("engine", 2, 120, 0.05),
            run("checkpoint", 2, 110, 0.02), run("checkpoint", 4, 90, 0.0), planner]
    results = {"device_type": "cuda", "models": [{"model": "A", "runs": runs}]}
    (check,) = bench.check_planner(results)
    # engine k=1 uses more than the budget's run, checkpoint k=4 less than the planner: not rivals
    assert check["best"] == {"strategy": "checkpoint", "k": 2, "peak_bytes": 110, "overhead": 0.02}
    assert check["time_met"] and check["within_budget_run"] and check["met"]
    planner["overhead"] = 0.05  # more than the best rival's + 2 %
    assert bench.check_planner(results)[0]["met"] is False
    # the plan's steps alternating with that rival's decide instead, when they ran
    planner["vs_best"] = {"strategy": "checkpoint", "k": 2, "status": "ok", "ratio": 0.015, "quartiles": [0.0, 0.03]}
    (check,) = bench.check_planner(results)
    assert check["met"] and check["vs_best"] == 0.015 and check["vs_best_quartiles"] == [0.0, 0.03]
    planner["vs_best"]["ratio"] = 0.025
    assert bench.check_planner(results)[0]["time_met"] is False
    planner["vs_best"]["k"] = 4  # measured against another run than the best: not read
    (check,) = bench.check_planner(results)
    assert check["vs_best"] is None and check["time_met"] is False
    planner["vs_best"] = {"strategy": "checkpoint", "k": 2, "status": "failed", "reason": "RuntimeError: x"}
    (check,) = bench.check_planner(results)
    assert check["vs_best"] is None and check["vs_best_failed"] == "RuntimeError: x"
    assert "failed: RuntimeError: x" in tables._planner_markdown([check])  # not a bare n/a
    del planner["vs_best"]
    planner.update(overhead=0.0, peak_error=0.06)
    assert bench.check_planner(results)[0]["peak_error_met"] is False
    planner.update(peak_error=0.0, peak_bytes=121)  # above its budget's run (beyond the noise): no rival, a miss
    (check,) = bench.check_planner(results)
    assert check["within_budget_run"] is False and check["met"] is False
    runs[-1] = {"strategy": "planner", "k": 2, "status": "failed", "reason": "RuntimeError: x", "budget_from": "engine"}
    (check,) = bench.check_planner(results)
    assert check["met"] is False and "failed" in check["reason"]
    assert "**missed**" in tables._planner_markdown([check])


def test_a_plan_through_make_forward_changes_no_gradient():
    """The planner's forward (offload, recompute and keep mixed) gives the plain run's gradients bit for bit."""
    model = build_basic_model(4, 32, 4, 64, kind="torch")
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    chosen = Plan((OFFLOAD, RECOMPUTE, KEEP, KEEP), predicted_peak_bytes=0, predicted_step_ms=0.0)
    plain, _ = bench.make_forward("no offload", model, 0, torch.device("cpu"))
    planned, engine = bench.make_forward("planner", model, 0, torch.device("cpu"), chosen)
    reference = measure_steps(model, x, step=strategies._step(plain, x), steps=1, warmup=0)
    got = measure_steps(model, x, step=strategies._step(planned, x), steps=1, warmup=1)
    assert compare_grads(reference, got).equal
    assert [s.offloaded_bytes > 0 for s in engine.stats] == [True, False, False, False]
    with pytest.raises(ValueError, match="needs a plan"):
        bench.make_forward("planner", model, 0, torch.device("cpu"))


def test_cli_runs_the_planner(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.cli, "import_transformer_engine", lambda: False)
    results = bench.main(["--tiny", "--models", "B", "--ks", "1", "--strategies", "no offload", "engine", "checkpoint",
                          "planner", "--out", str(tmp_path), "--no-plots"])
    assert {r["strategy"] for r in results["models"][0]["runs"]} == set(PURE_AND_PLANNER)
    assert "### Planner" in (tmp_path / "bench.md").read_text()


def test_model_a_with_torch_layers_is_in_the_default_grid():
    assert {"A", "A-torch", "B"} <= set(bench.BenchConfig().models)
    spec = bench.MODELS["A-torch"]
    assert spec.kind == "torch" and (spec.hidden, spec.heads, spec.ffn, spec.batch) == (1024, 8, 4096, 16)
    assert bench.STRATEGIES[-2:] == ("checkpoint", "planner")


@pytest.mark.gpu
def test_planner_plans_fit_their_budgets_on_the_gpu(tmp_path):
    """Model A with torch layers, 8 layers, at the budgets of offloading or recomputing 2 and 4 layers:
    every plan runs, its measured peak is no more than its budget's pure run (within the bench's
    ``PLANNER_PEAK_NOISE``), and its predicted peak is within ``PLANNER_PREDICTION_ERROR`` of the measured one.

    Nothing here is timed: whether the planner is as fast as the best pure run, and how well it predicts
    its step, are the benchmark's checks (``python -m offload_examples bench --models A-torch --strategies
    "no offload" engine checkpoint planner``, its "Planner" table): a unit test asserts nothing that
    step-to-step noise decides.
    """
    # three steps a run: only peaks are asserted, and a peak is the same in every step; no graphed column
    config = bench.BenchConfig(models=("A-torch",), ks=(2, 4), layers=8, steps=3, warmup=1,
                               strategies=PURE_AND_PLANNER, graphed=False)
    results = bench.run(config, "cuda", stream=io.StringIO())
    bench.write_outputs(results, tmp_path, plots=False)  # the bench's short GPU run draws every plot
    checks = results["planner_checks"]
    assert len(checks) == 4
    for c in checks:
        assert "reason" not in c, c  # a failed or skipped run's check carries only its reason
        assert c["peak_bytes"] is not None and c["within_budget_run"], c
        assert c["peak_error"] is not None and abs(c["peak_error"]) <= bench.PLANNER_PREDICTION_ERROR, c
        # the plan fits its budget: its measured peak is within the prediction error of the budget
        assert c["peak_bytes"] <= c["budget_bytes"] * (1 + bench.PLANNER_PREDICTION_ERROR), c
        assert c["vs_best"] is not None, c  # the plan also ran step by step against its best rival


def test_costs_that_cannot_be_measured_fail_only_the_planner(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no marks")

    monkeypatch.setattr(planner_bench, "measure_costs", broken)
    config = bench.BenchConfig.tiny(models=("B",), ks=(1,), strategies=PURE_AND_PLANNER)
    results = bench.run(config, "cpu", stream=io.StringIO())
    runs = results["models"][0]["runs"]
    assert {r["strategy"]: r["status"] for r in runs if r["strategy"] != "planner"} == {
        "no offload": "ok", "engine": "ok", "checkpoint": "ok"}
    failed = [r for r in runs if r["strategy"] == "planner"]
    assert len(failed) == 2 and all("RuntimeError: no marks" in r["reason"] for r in failed)
    assert [c["met"] for c in results["planner_checks"]] == [False, False]
    assert "**missed**" in bench.markdown(results)


def test_equal_peaks_within_the_noise_count_as_equal():
    """A plan with a pure run's bytes also holds the engine's bookkeeping: a KiB more is the same peak."""
    base = 8 * 2**30
    planner = {"strategy": "planner", "k": 2, "status": "ok", "peak_bytes": base + 1024, "overhead": 0.07,
               "budget_from": "checkpoint", "budget_bytes": base, "plan": "offload 0, recompute 3",
               "peak_error": 0.01, "step_error": 0.02}
    source = {"strategy": "checkpoint", "k": 2, "status": "ok", "peak_bytes": base, "overhead": 0.08}
    (check,) = bench.check_planner({"device_type": "cuda", "models": [{"model": "A", "runs": [source, planner]}]})
    assert check["within_budget_run"] and check["best"]["strategy"] == "checkpoint" and check["met"]
