# Offload the saved activations of the first 2 of 6 layers to host memory.
import torch

from offload_examples import get_cpu_offload_context

device = "cuda" if torch.cuda.is_available() else "cpu"
layers = [
    torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, device=device)
    for _ in range(6)
]
x = torch.randn(8, 128, 256, device=device)
params = [p for layer in layers for p in layer.parameters()]
optimizer = torch.optim.SGD(params, lr=1e-3)

ctx, sync = get_cpu_offload_context(
    enabled=True, num_layers=2, model_layers=len(layers)
)
for step in range(3):
    h = x
    for layer in layers:
        with ctx:  # tensors saved for backward in here are offloaded (first 2 layers)
            h = layer(h)
        h = sync(h)  # this layer's backward will start the reloads scheduled for it
    h.square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

print(f"copied {ctx.offloaded_bytes / 2**20:.1f} MiB to host memory per step")
print(f"theoretical peak-memory saving: {ctx.theoretical().saving / 2**20:.1f} MiB")
