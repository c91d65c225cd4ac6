# Keep, offload or recompute each layer of an unmodified Hugging Face model under a
# memory budget: one call.
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from offload_examples.instruments.plan_model import plan_layers

device = "cuda" if torch.cuda.is_available() else "cpu"
config = LlamaConfig(  # built from its config: nothing downloaded
    hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    vocab_size=256, use_cache=False,
)
model = LlamaForCausalLM(config).to(device).train()
# model.gradient_checkpointing_enable() works as well
ids = torch.randint(0, 256, (2, 128), device=device)


def step():  # one training step without the optimizer: forward, loss, backward
    model(input_ids=ids, labels=ids).loss.backward()


# the budget counts the weights: what is allocated before the step
before = torch.cuda.memory_allocated() if device == "cuda" else 0
handle = plan_layers(
    model,
    LlamaDecoderLayer,  # the layers: by type, class name, a tuple of them, or a test
    step,  # measured through step(), then planned and applied
    budget_bytes=before + 3 * 2**20,
)
print(handle.plan)  # one choice per layer, in the order the model calls them

optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for _ in range(3):  # the training loop is unchanged
    step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
mib = handle.ctx.offloaded_bytes / 2**20
print(f"layers: {', '.join(handle.names)}; offloaded {mib:.2f} MiB per step")
handle.remove()  # the model as it was
