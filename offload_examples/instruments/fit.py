"""Whether a run fits: the GPU and host memory its sizes need, estimated before anything is allocated.

Every command estimates what its sizes need (:class:`Need`, built from :class:`Stack`) and asks
:func:`memory_error` whether that fits here: on a GPU, the free memory ``torch.cuda.mem_get_info``
reports; on the host, ``MemAvailable`` from ``/proc/meminfo``. A run that cannot fit stops with one
line naming both, instead of a traceback minutes later or a host that swaps.

The estimates count what the scenarios hold at their peak: parameters and their gradients (and
optimizer state), the bytes each layer saves for backward (measured on PyTorch's layers: ``9 h + 2
ffn`` elements per token for a transformer layer, ``9 w`` for ``Linear(w, 4w), GELU, Linear(4w, w)``),
inputs, pinned host buffers and the host copies the gradient checks keep. They are upper bounds
within a few tens of percent; :data:`MARGIN_PERCENT` and :data:`RESERVE_BYTES` leave room for what they do
not count (allocator rounding, workspaces, the CUDA context).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["MARGIN_PERCENT", "RESERVE_BYTES", "SKIP_ENV", "Need", "Stack", "dtype_bytes", "gpu_free_bytes",
           "host_available_bytes", "memory_error"]

GiB = 2**30
#: The estimate plus this percentage of it must fit in what is available.
MARGIN_PERCENT = 10
#: Bytes kept free on top: per process on the host, per GPU on a device.
RESERVE_BYTES = GiB // 2
#: Set to 1 to run even where the estimate says the sizes do not fit.
SKIP_ENV = "OFFLOAD_EXAMPLES_SKIP_MEMORY_CHECK"


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as in ``--dtype`` (``float32``, ``bfloat16``, ``float16``)."""
    return getattr(torch, dtype).itemsize


@dataclass(frozen=True)
class Stack:
    """``layers`` equal layers trained on ``tokens`` tokens of width ``width``.

    Attributes
    ----------
    params:
        Parameters of one layer.
    saved:
        Elements one layer saves for backward, per token.
    element:
        Bytes per element (the model's dtype).
    """

    layers: int
    params: int
    saved: int
    tokens: int
    width: int
    element: int

    @classmethod
    def transformer(cls, layers: int, hidden: int, heads: int, ffn: int, sequences: int, seq: int, dtype: str,
                    device_type: str) -> Stack:
        """``nn.Linear(hidden, hidden)`` and a pre-norm transformer layer per layer (the scenarios' model),
        on ``sequences`` sequences of ``seq`` tokens.

        On a CPU the gradient checks' deterministic kernels run attention's math kernel, which also saves
        the attention weights (``heads * seq`` elements per token) and two more tensors of the width.
        """
        params = 5 * hidden * hidden + 2 * hidden * ffn + 10 * hidden + ffn
        saved = 9 * hidden + 2 * ffn + 2 * heads + 4 + (0 if device_type == "cuda" else 2 * hidden + heads * seq)
        return cls(layers, params, saved, sequences * seq, hidden, dtype_bytes(dtype))

    @classmethod
    def linear(cls, layers: int, width: int, tokens: int, dtype: str) -> Stack:
        """``Linear(width, 4 width), GELU, Linear(4 width, width)`` per layer."""
        return cls(layers, 8 * width * width + 5 * width, 9 * width, tokens, width, dtype_bytes(dtype))

    @property
    def param_bytes(self) -> int:
        """Every layer's parameters."""
        return self.layers * self.params * self.element

    @property
    def build_bytes(self) -> int:
        """The parameters in float32 on the host, where the models are built before they move."""
        return self.layers * self.params * 4

    @property
    def io_bytes(self) -> int:
        """One tensor of the tokens' width: an input, its gradient, an output."""
        return self.tokens * self.width * self.element

    def saved_bytes(self, layers: int | None = None) -> int:
        """What ``layers`` layers (default: all) save for backward."""
        return (self.layers if layers is None else layers) * self.saved * self.tokens * self.element

    def step_bytes(self, states: int = 0) -> int:
        """A training step's peak without offloading: parameters, gradients and ``states`` optimizer
        tensors per parameter, every layer's saved activations and one layer's worth of backward
        temporaries, and the input, its gradient and the output."""
        return (2 + states) * self.param_bytes + self.saved_bytes(self.layers + 1) + 3 * self.io_bytes

    def copies_bytes(self, count: int) -> int:
        """``count`` host copies of the gradients (parameters', input's) and the output, as the checks keep."""
        return count * (self.param_bytes + 2 * self.io_bytes)


@dataclass(frozen=True)
class Need:
    """What a run needs: ``device`` bytes on each GPU it uses (one per rank), ``host`` bytes of host
    memory per rank; on a CPU run both are host memory. ``ranks``: processes, one per GPU."""

    device: int
    host: int
    ranks: int = 1

    def __add__(self, other: Need) -> Need:
        return Need(self.device + other.device, self.host + other.host, max(self.ranks, other.ranks))

    def per_rank(self, ranks: int) -> Need:
        """The same per process, on ``ranks`` processes."""
        return dataclasses.replace(self, ranks=ranks)


def host_available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``: what can be allocated without swapping (``None`` off Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gpu_free_bytes(device: torch.device, here: bool = True) -> int:
    """Free memory of ``device``: ``torch.cuda.mem_get_info`` when this process runs there (``here``),
    else its total less :data:`RESERVE_BYTES` for the other process's CUDA context (asking for the free
    memory would start a context here too, which would hold memory on that GPU while the ranks run)."""
    if here:
        return torch.cuda.mem_get_info(device)[0]
    return torch.cuda.get_device_properties(device).total_memory - RESERVE_BYTES


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n < 2**80 else "over 10^15 GiB"  # sizes typed as huge integers stay exact


def _with_margin(n: int) -> int:
    return n + n * MARGIN_PERCENT // 100 + RESERVE_BYTES


def memory_error(need: Need, devices: Sequence[torch.device] = (), here: bool = True) -> str | None:
    """Why ``need`` does not fit, in one line, or ``None`` when it does.

    ``devices``: the GPUs the ranks use (none for a CPU run, whose device bytes are host bytes too);
    ``here``: whether this process runs on them (see :func:`gpu_free_bytes`). Set :data:`SKIP_ENV`
    to 1 to skip the check.
    """
    if os.environ.get(SKIP_ENV) == "1":
        return None
    gpus = [d for d in devices if d.type == "cuda"]
    for device in gpus:
        free = gpu_free_bytes(device, here)
        if _with_margin(need.device) > free:
            each = " on each of its GPUs" if need.ranks > 1 else ""
            return (f"the sizes need about {_gib(need.device)} of GPU memory{each} (estimated, plus a "
                    f"{MARGIN_PERCENT}% margin); {device} has {_gib(free)} free")
    per_rank = need.host + (0 if gpus else need.device)
    available = host_available_bytes()
    if available is not None and need.ranks * _with_margin(per_rank) > available:
        ranks = f" on {need.ranks} ranks" if need.ranks > 1 else ""
        return (f"the sizes need about {_gib(need.ranks * per_rank)} of host memory{ranks} (estimated, plus a "
                f"{MARGIN_PERCENT}% margin); {_gib(available)} is available (MemAvailable)")
    return None
