# Measure each layer, choose keep/offload/recompute per layer under a memory budget,
# run the plan.
import torch

from offload_examples.features.planner import apply_plan, plan
from offload_examples.instruments.plan_costs import measure_costs, measure_link

device = "cuda" if torch.cuda.is_available() else "cpu"
layers = [
    torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, device=device)
    for _ in range(8)
]
x = torch.randn(4, 64, 256, device=device, requires_grad=True)

# per layer: forward and backward ms, saved bytes, input bytes (steps: 20 by default)
costs, base = measure_costs(layers, x, steps=5)
link = measure_link(device)  # copy speed each way (pinned on a GPU)
everything = sum(c.saved_bytes for c in costs)
# a budget of half of the activations
chosen = plan(costs, link, budget_bytes=base + everything // 2, base_bytes=base)
print(chosen)

ctx, sync, run_layers = apply_plan(chosen, layers, device=device)
params = [p for layer in layers for p in layer.parameters()]
optimizer = torch.optim.SGD(params, lr=1e-3)
for step in range(2):
    h = x
    for layer in run_layers:
        with ctx:
            h = layer(h)
        h = sync(h)
    h.square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"offloaded {ctx.offloaded_bytes / 2**20:.1f} MiB per step; "
      f"theory's saving {ctx.theoretical().saving / 2**20:.1f} MiB")
