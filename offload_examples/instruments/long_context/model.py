"""A Llama-architecture model fine-tuned as long contexts are: frozen base, LoRA adapters, a chunked loss.

:func:`build_lora_llama` builds the model from its config with transformers (random weights, nothing
downloaded) and puts peft's LoRA adapters on the attention and MLP projections; only the adapters
train. :func:`chunked_cross_entropy` is the loss: the LM head's logits for a sequence of 100K tokens
and a vocabulary of 128K would alone take 50 GB in float32, so the hidden states go through the head
a chunk of tokens at a time, each chunk checkpointed so that its logits are freed at once and made
again in the backward. :func:`lora_step` is one training step with both.

transformers and peft are the ``hf`` extra (``pip install 'offload_examples[hf]'``); they are imported
only when a model is built.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["LLAMA_8B", "LORA_TARGETS", "build_lora_llama", "chunked_cross_entropy", "decoder_layers", "hf_missing",
           "llama_parameters", "lora_step"]

#: Llama 3 8B's shape: what the scenario builds on a GPU (``layers``, ``hidden``, ``heads``, ``kv_heads``,
#: ``ffn``, ``vocab``).
LLAMA_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
#: The projections that get LoRA adapters: every linear layer of attention and of the MLP.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def hf_missing() -> str | None:
    """Why the model cannot be built here (transformers or peft missing), or ``None`` when it can."""
    missing = [name for name in ("transformers", "peft") if importlib.util.find_spec(name) is None]
    if missing:
        return f"the long-context model needs {' and '.join(missing)}: pip install 'offload_examples[hf]'"
    return None


@contextlib.contextmanager
def _torchao_hint():
    """peft refuses to work beside a torchao older than it supports (when it imports, or when it puts
    adapters on a model), and the ``torchtune`` extra pins such a torchao: say so instead of peft's bare
    version complaint."""
    try:
        yield
    except ImportError as err:
        if "torchao" not in str(err):
            raise
        raise ImportError(f"peft does not work beside the installed torchao ({err}). The torchtune extra pins an older "
                          "torchao (torchtune 0.6 imports with torchao 0.14): run the long-context scenario in an "
                          "environment without torchtune, or upgrade torchao") from err


def llama_parameters(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> int:
    """How many parameters the base model of these sizes has (embeddings and LM head untied)."""
    kv = hidden // heads * kv_heads
    per_layer = 2 * hidden * (hidden + kv) + 3 * hidden * ffn + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def build_lora_llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, *,
                     dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", rank: int = 16,
                     max_seq: int = 131072, seed: int = 0) -> nn.Module:
    """A ``LlamaForCausalLM`` of these sizes with random weights, its base frozen, LoRA adapters of rank
    ``rank`` on :data:`LORA_TARGETS` in the model's dtype; attention through PyTorch's SDPA.

    The adapters' ``B`` matrices start random, not zero as in peft's default: with ``B = 0`` every
    ``A`` gets a zero gradient in the first step, and the gradient checks would compare zeros.

    Returns
    -------
    nn.Module
        peft's model; :func:`lora_step` trains it.
    """
    if (why := hf_missing()) is not None:
        raise ModuleNotFoundError(why)
    import transformers

    with _torchao_hint():
        from peft import LoraConfig, get_peft_model

    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads}), and heads by kv_heads ({kv_heads})")
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=max(max_seq, 8192),
        rope_theta=500000.0, tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
                      init_lora_weights=False)
    with warnings.catch_warnings():  # peft asks for the attribute under its old name; transformers 5 warns
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        # adapters in the model's dtype: peft's float32 adapters would save a float32 copy of every projection's
        # input for the backward, about as much again as the layer saves in bfloat16
        with _torchao_hint():
            return get_peft_model(model, lora, autocast_adapter_dtype=False).train()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers, in order."""
    return model.get_base_model().model.layers


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk: int) -> torch.Tensor:
    """Mean next-token cross-entropy of the logits ``hidden @ weight.T``, never holding them whole.

    Parameters
    ----------
    hidden:
        ``(batch, seq, hidden)``: the model's last hidden states (after its final norm).
    weight:
        ``(vocab, hidden)``: the LM head's weight.
    labels:
        ``(batch, seq)`` token ids; position ``t`` predicts ``labels[:, t + 1]``.
    chunk:
        Tokens per chunk: each chunk's logits (``chunk * vocab`` elements, in float32 for the softmax)
        are made, reduced to a loss and freed; the checkpoint keeps only the chunk's hidden states and
        makes its logits again in the backward.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    y = labels[:, 1:].reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, y.numel(), chunk):
        part = slice(start, start + chunk)
        total = total + checkpoint(_chunk_loss, h[part], weight, y[part], use_reentrant=False)
    return total / max(y.numel(), 1)


def lora_step(model: nn.Module, ids: torch.Tensor, loss_chunk: int,
              optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """One training step: forward through the decoder, the chunked loss, backward, and the optimizer's
    step when one is given (then the gradients are cleared). Returns the loss, detached."""
    inner: Any = model.get_base_model()  # the LlamaForCausalLM, adapters in place
    hidden = inner.model(input_ids=ids, use_cache=False).last_hidden_state
    loss = chunked_cross_entropy(hidden, inner.lm_head.weight, ids, loss_chunk)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()
