# Keep, offload or recompute each layer of an unmodified Hugging Face model under a memory budget: one call.
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from offload_examples.instruments.plan_model import plan_layers

device = "cuda" if torch.cuda.is_available() else "cpu"
config = LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                     vocab_size=256, use_cache=False)  # built from its config: nothing downloaded
model = LlamaForCausalLM(config).to(device).train()
# model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}) works as well
ids = torch.randint(0, 256, (2, 128), device=device)


def step():  # one training step as the loop runs it, without the optimizer: forward, loss, backward
    model(input_ids=ids, labels=ids).loss.backward()


before = torch.cuda.memory_allocated() if device == "cuda" else 0  # weights: the budget counts them
handle = plan_layers(model, LlamaDecoderLayer,  # the layers by type, class name, tuple of them, or a test
                     step, budget_bytes=before + 3 * 2**20)  # measures through step(), plans, applies
print(handle.plan)  # one choice per layer, in the order the model calls them

optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for _ in range(3):  # the training loop is unchanged
    step()
    optimizer.step()
    optimizer.zero_grad()
print(f"layers: {', '.join(handle.names)}; offloaded {handle.ctx.offloaded_bytes / 2**20:.2f} MiB per step")
handle.remove()  # the model as it was
