"""Session 11 (#17): what the planner's model predicts for the pure strategies (offload or recompute the
first k layers) with each bench run's own measured costs, against what those runs measured (paired
overheads). Runs on a CPU from the stored bench.json files: python pure_predictions.py"""
import json
from pathlib import Path
from offload_examples.features.planner import KEEP, OFFLOAD, RECOMPUTE, LayerCost, LinkCost, simulate_plan

here = Path(__file__).parent
for run in ("bench_planner_c8e7d6f", "bench_planner"):
    d = json.loads((here / run / "bench.json").read_text())
    link = LinkCost(**d["planner_link_gb_per_s"])
    for m in d["models"]:
        p = m["planner"]
        costs = [LayerCost(**c) for c in p["costs"]]
        n = len(costs)
        keep = simulate_plan([KEEP] * n, costs, link, p["base_bytes"])[1]
        cells = []
        for k in (2, 4, 8):
            for strategy, choice in (("engine", OFFLOAD), ("checkpoint", RECOMPUTE)):
                predicted = simulate_plan([choice] * k + [KEEP] * (n - k), costs, link, p["base_bytes"])[1] / keep - 1
                measured = next(r for r in m["runs"] if r["strategy"] == strategy and r["k"] == k)["overhead"]
                cells.append(f"{strategy} k={k} {predicted:+.1%} / {measured:+.1%}")
        print(f"{run:22s} {m['model']:8s} predicted / measured: " + "; ".join(cells))
