"""What the planner would have chosen without byte caps (``partial=False``), from the costs the bench stored.

Run from the repository root: ``python docs/runs/2026-11-24-h100-session16/uncapped_plans.py``. Predictions
only (the model's, with the run's own calibrated costs and link); nothing here was measured.
"""
import json
import pathlib

from offload_examples.features.planner import LayerCost, LinkCost, plan

here = pathlib.Path(__file__).parent
results = json.loads((here / "bench_planner" / "bench.json").read_text())
link = LinkCost(**results["planner_link_gb_per_s"])
for model in results["models"]:
    setup = model["planner"]
    costs = [LayerCost(**c) for c in setup["costs"]]
    for run in model["runs"]:
        if run["strategy"] != "planner" or run["status"] != "ok":
            continue
        whole = plan(costs, link, run["budget_bytes"], setup["base_bytes"], partial=False)
        capped = plan(costs, link, run["budget_bytes"], setup["base_bytes"])
        print(f"{model['model']:8s} k={run['k']} budget from {run['budget_from']:10s} | with caps: {capped.summary()}, "
              f"predicted {capped.predicted_step_ms:.1f} ms, {capped.predicted_peak_bytes / 2**30:.2f} GiB | "
              f"whole layers only: {whole.summary()}, predicted {whole.predicted_step_ms:.1f} ms, "
              f"{whole.predicted_peak_bytes / 2**30:.2f} GiB | step "
              f"{capped.predicted_step_ms / whole.predicted_step_ms - 1:+.1%}")
