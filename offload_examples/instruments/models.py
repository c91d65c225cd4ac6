"""Small models the scenarios and tests offload: plain PyTorch, with Transformer Engine when present."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Literal

import torch
from torch import nn

from offload_examples.features.planner import Checkpointed  # noqa: F401  (the scenarios' recomputation wrapper)

__all__ = [
    "BasicLayer", "Checkpointed", "TE_LAYER", "TORCH_LAYER", "build_basic_model", "build_linear_stack",
    "enable_activation_checkpointing",
    "has_transformer_engine", "import_transformer_engine", "layer_kind",
]

LayerKind = Literal["auto", "torch", "te"]

#: The names :func:`layer_kind` gives the two transformer layers.
TE_LAYER, TORCH_LAYER = "te.TransformerLayer", "nn.TransformerEncoderLayer"


def has_transformer_engine() -> bool:
    """Whether ``transformer_engine.pytorch`` can be imported (without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def _deterministic_te() -> None:
    """The scenarios, notebooks and tests compare gradients bit for bit: ask TE for its deterministic
    kernels (as Megatron-LM's deterministic mode does) before its first attention call. TE reads the
    variable when it picks an attention backend; set it yourself to choose otherwise."""
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")


def import_transformer_engine() -> bool:
    """Import ``transformer_engine.pytorch`` if it is installed, and say whether it is imported.

    Call it before anything starts CUDA: Transformer Engine loads its own CUDA libraries when
    imported, and once CUDA has started a system cuDNN may already be loaded in their place.
    Raises :class:`RuntimeError` if CUDA has started and Transformer Engine is not imported yet.
    """
    if "transformer_engine.pytorch" in sys.modules:
        return True
    if not has_transformer_engine():
        return False
    _deterministic_te()
    if torch.cuda.is_initialized():
        raise RuntimeError("import transformer_engine.pytorch before CUDA starts: CUDA is already initialised, so a "
                           "system cuDNN may be loaded in place of Transformer Engine's; call "
                           "offload_examples.instruments.models.import_transformer_engine() before any CUDA work")
    import transformer_engine.pytorch  # noqa: F401

    return True


def layer_kind(kind: LayerKind = "auto") -> str:
    """The transformer layer ``kind`` builds: :data:`TE_LAYER` or :data:`TORCH_LAYER`.

    ``"auto"`` is Transformer Engine's layer when TE is installed and CUDA is available.
    """
    if kind == "auto":
        kind = "te" if has_transformer_engine() and torch.cuda.is_available() else "torch"
    if kind not in ("te", "torch"):
        raise ValueError(f"layer kind must be 'auto', 'torch' or 'te', got {kind!r}")
    return TE_LAYER if kind == "te" else TORCH_LAYER


def _transformer_layer(
    hidden: int, heads: int, ffn: int, kind: LayerKind, activation: str = "gelu", dropout: float = 0.0
) -> nn.Module:
    if layer_kind(kind) == TE_LAYER:
        if not has_transformer_engine():
            raise ImportError("--kind te needs Transformer Engine: pip install 'offload_examples[te]'")
        _deterministic_te()  # a notebook may build the model without import_transformer_engine()
        import transformer_engine.pytorch as te

        return te.TransformerLayer(
            hidden, ffn, heads, hidden_dropout=dropout, attention_dropout=dropout, attn_input_format="bshd",
            activation=activation,
        )
    return nn.TransformerEncoderLayer(
        hidden, heads, ffn, dropout=dropout, batch_first=True, norm_first=True, activation=activation
    )


class BasicLayer(nn.Module):
    """The basic scenario's layer: an ``nn.Linear`` followed by a transformer layer.

    Parameters
    ----------
    hidden, heads, ffn:
        Model width, attention heads and feed-forward width.
    kind:
        ``"torch"`` for ``nn.TransformerEncoderLayer`` (pre-norm, no dropout), ``"te"`` for
        Transformer Engine's ``TransformerLayer``, ``"auto"`` for TE when it is installed and a
        GPU is present.
    activation, dropout:
        The feed-forward activation (``"gelu"`` or ``"relu"``) and the dropout probability.
    """

    def __init__(
        self, hidden: int, heads: int, ffn: int, kind: LayerKind = "auto", activation: str = "gelu",
        dropout: float = 0.0,
    ):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.transformer = _transformer_layer(hidden, heads, ffn, kind, activation, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer(self.linear(x))


def build_basic_model(
    num_layers: int,
    hidden: int,
    heads: int,
    ffn: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    kind: LayerKind = "auto",
    seed: int = 0,
    activation: str = "gelu",
    dropout: float = 0.0,
) -> nn.ModuleList:
    """``num_layers`` :class:`BasicLayer` s with weights drawn from ``seed``."""
    for name, value in (("num_layers", num_layers), ("hidden", hidden), ("heads", heads), ("ffn", ffn)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
    if activation not in ("gelu", "relu"):
        raise ValueError(f"activation must be 'gelu' or 'relu', got {activation!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    torch.manual_seed(seed)
    layers = nn.ModuleList(BasicLayer(hidden, heads, ffn, kind, activation, dropout) for _ in range(num_layers))
    return layers.to(device=device, dtype=dtype)


def build_linear_stack(
    num_layers: int, width: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> nn.ModuleList:
    """``num_layers`` blocks of ``Linear -> GELU -> Linear``: the smallest model worth offloading."""
    torch.manual_seed(seed)
    layers = nn.ModuleList(
        nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(num_layers)
    )
    return layers.to(device=device, dtype=dtype)




def enable_activation_checkpointing(model: nn.Module, reentrant: bool = False) -> None:
    """Turn on a transformers model's own activation checkpointing (each layer's call checkpointed).

    ``activation_checkpointing_enable`` where transformers has it, ``gradient_checkpointing_enable``
    (its older name) otherwise.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
