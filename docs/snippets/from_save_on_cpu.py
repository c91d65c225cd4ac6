# The same training step with torch's save_on_cpu and with this package's engine.
import torch

from offload_examples import get_cpu_offload_context

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
layers = torch.nn.ModuleList(torch.nn.Linear(512, 512, device=device) for _ in range(8))
x = torch.randn(64, 512, device=device, requires_grad=True)

# Before: one context around the whole forward; every saved tensor goes to the host.
with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
    h = x
    for layer in layers:
        h = torch.relu(layer(h))
h.sum().backward()
before = [p.grad.clone() for p in layers.parameters()]
layers.zero_grad()

# After: one context entered per layer, a sync after each; only the first 4 layers go
# to the host.
ctx, sync = get_cpu_offload_context(
    enabled=True, num_layers=4, model_layers=len(layers)
)
h = x
for layer in layers:
    with ctx:
        h = torch.relu(layer(h))
    h = sync(h)
h.sum().backward()

assert all(torch.equal(a, p.grad) for a, p in zip(before, layers.parameters()))
offloaded = [s.offloaded_bytes for s in ctx.stats]
print("same gradients; offloaded", offloaded, "bytes per layer")
