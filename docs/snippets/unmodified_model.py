# Offload two layers of a model that runs its own layers (nn.TransformerEncoder),
# without editing it.
import torch

from offload_examples import offload_layers

device = "cuda" if torch.cuda.is_available() else "cpu"
layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, device=device)
model = torch.nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)
x = torch.randn(8, 128, 256, device=device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

handle = offload_layers(
    model,
    torch.nn.TransformerEncoderLayer,  # the layers: by type, class name or test
    num_layers=2,
    modules=["self_attn", "linear1"],  # only what these submodules save (optional)
    max_offload_bytes_per_layer=2**30,  # at most 1 GiB per layer (optional)
)
for step in range(3):
    model(x).square().mean().backward()  # the training code is unchanged
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

print(f"layers found: {', '.join(handle.names)}")
print(f"copied {handle.ctx.offloaded_bytes / 2**20:.1f} MiB to host memory per step")
handle.remove()  # the model as it was
