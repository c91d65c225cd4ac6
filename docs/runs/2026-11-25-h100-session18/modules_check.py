# Run on the H100 at e7a7931 with TE installed: what measure_costs records per storage, and caps said in modules.
# python docs/runs/2026-11-25-h100-session18/modules_check.py  (needs CUDA and Transformer Engine)
import transformer_engine.pytorch  # noqa: F401  (before CUDA starts)
import torch
from offload_examples.instruments.models import build_basic_model
from offload_examples.instruments.plan_costs import measure_costs, measure_link
from offload_examples.features.planner import plan, cap_in_modules, partial_caps, pareto
for kind in ("te", "torch"):
    layers = build_basic_model(4, 1024, 8, 4096, device="cuda", dtype=torch.bfloat16, kind=kind)
    x = torch.randn(16, 2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    costs, base = measure_costs(list(layers), x, steps=4)
    c = costs[1]
    print(kind, len(c.storage_bytes), c.storage_modules)
    print("  caps:", [cap_in_modules(c, cap) for cap in partial_caps(c)][:8])
    link = measure_link()
    print("  link", link)
    for p in pareto(costs, link, base):
        if p.capped:
            print(p)
            break
    del layers, x
    torch.cuda.empty_cache()
