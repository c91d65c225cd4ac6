"""Session 17's planner costs re-planned with the link its engine runs reached (CPU only, no GPU).

Session 17's bench measured the link once at its start (host-to-device 48.0, device-to-host 52.3,
both 68.2 GB/s) and the engine's copies in the same run then moved 53.8-54.8 GB/s. This plans each
of that run's budgets again from its stored costs with both links and prints the plans and the
predicted overheads of pure offloading next to the measured ones.

    python docs/runs/2026-11-25-h100-session18/resim_session17_link.py
"""
import json

from offload_examples.features.planner import LayerCost, LinkCost, plan, simulate_plan

RUN = "docs/runs/2026-11-25-h100-session17/bench_planner/bench.json"
LINKS = {"measured at the start": LinkCost(52.28, 47.97, 68.23), "reached by the copies": LinkCost(54.8, 53.8, 68.23)}

data = json.load(open(RUN))
for model in data["models"]:
    setup = model["planner"]
    costs = [LayerCost(**{k: tuple(v) if k == "storage_bytes" and v else v for k, v in c.items()}) for c in setup["costs"]]
    keep_ms = setup["keep_step_ms"]
    for name, link in LINKS.items():
        print(f"{model['model']}, link {name}:")
        for r in model["runs"]:
            if r["strategy"] == "planner" and r["status"] == "ok":
                p = plan(costs, link, r["budget_bytes"], setup["base_bytes"])
                print(f"  {r['budget_from']} k={r['k']}: {p.summary()} (predicted {p.predicted_step_ms / keep_ms - 1:+.1%})")
        for r in model["runs"]:
            if r["strategy"] == "engine" and r["status"] == "ok":
                _, ms = simulate_plan(["offload"] * r["k"] + ["keep"] * (len(costs) - r["k"]), costs, link, setup["base_bytes"])
                print(f"  offloading the first {r['k']}: predicted {ms / keep_ms - 1:+.1%}, measured {r['overhead']:+.1%}")
