"""Telling Transformer Engine's layers that an offload is active.

Transformer Engine's modules ask ``transformer_engine.pytorch.cpu_offload.is_cpu_offload_enabled()``
during their forward, and when it answers yes they take the path TE wrote for offloading: the
attention slices q, k and v off the fused projection instead of handing the packed buffer to
``DotProductAttention``, and tensors are marked for TE's offload (weights to skip, activations ready to
copy; the engine does not read these marks).
TE's own offload context turns that answer on for as long as it is entered (TE 2.x: by setting the
module's ``OFFLOAD_SYNCHRONIZER``); the engine does the same, so that TE's layers run the same
computation under either offload, and comparing the two compares their offloading only.

The path matters for speed, not for the result: gradients on it are bitwise those of the default
path in the GPU tests (bf16 and both FP8 recipes). Only the
presence of a value is read by TE 2.x, so the engine sets :data:`ENGINE_ACTIVE`, a marker that
refuses every attribute access with a clear error should a later TE version expect a real
synchronizer there. Like TE's own context, the switch is global to the process, not to a thread:
while any engine entry is open, TE's layers in every thread take the offload path (the last entry to
close turns it off). With ``NVTE_CPU_OFFLOAD_V1=1`` TE reads another switch, and nothing changes.
Nothing happens when Transformer Engine is not imported.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

__all__ = ["ENGINE_ACTIVE", "offload_path", "path_is_on", "recompute_on_same_path", "switch_off", "switch_on"]

_MODULE = "transformer_engine.pytorch.cpu_offload"
_ATTR = "OFFLOAD_SYNCHRONIZER"


class _EngineActive:
    """What TE's ``is_cpu_offload_enabled()`` sees while the engine's context is open."""

    __slots__ = ()

    def __getattr__(self, name: str):
        raise AttributeError(f"Transformer Engine asked offload_examples' engine for {name!r}: the engine only tells "
                             "TE's layers that an offload is active, it is not a TE offload synchronizer")

    def __repr__(self) -> str:
        return "<offload_examples engine: an offload is active>"


ENGINE_ACTIVE = _EngineActive()


def _te_module():
    module = sys.modules.get(_MODULE)
    return module if module is not None and hasattr(module, _ATTR) else None


# Engine entries open in the process, and whether an engine (not offload_path, not TE) set the switch:
# the last engine to leave turns it off, whatever order entries in several threads close in.
_lock = threading.Lock()
_open_entries = 0
_set_by_engines = False


def switch_on() -> None:
    """An engine entry begins: turn TE's "offload enabled" on, unless it is on already (TE's own
    context is open, or :func:`offload_path`): then it is left as it is."""
    global _open_entries, _set_by_engines
    module = _te_module()
    with _lock:
        _open_entries += 1
        if module is not None and getattr(module, _ATTR) is None:
            setattr(module, _ATTR, ENGINE_ACTIVE)
            _set_by_engines = True


def switch_off() -> None:
    """An engine entry ends: the last one open turns the switch off again if an engine turned it on."""
    global _open_entries, _set_by_engines
    module = _te_module()
    with _lock:
        _open_entries = max(0, _open_entries - 1)
        if _open_entries == 0 and _set_by_engines:
            _set_by_engines = False
            if module is not None and getattr(module, _ATTR) is ENGINE_ACTIVE:
                setattr(module, _ATTR, None)


def path_is_on() -> bool:
    """Whether TE's layers would take their offload path now (``False`` when TE is not imported)."""
    module = _te_module()
    return module is not None and getattr(module, _ATTR) is not None


@contextlib.contextmanager
def offload_path(on: bool = True) -> Iterator[None]:
    """Run TE's layers on their offload path (``on``) or on their default path; an engine entered
    inside turns the path on for its entries only when ``on`` is false. Restores what it found.

    The benchmark runs its baseline and recomputation on the offload path, so that every strategy
    computes the same thing; ``offload_path(False)`` measures the default path beside them.
    """
    module = _te_module()
    if module is None:
        yield
        return
    previous = getattr(module, _ATTR)
    setattr(module, _ATTR, (previous or ENGINE_ACTIVE) if on else None)
    try:
        yield
    finally:
        setattr(module, _ATTR, previous)


class _SamePath:
    """Re-enterable: torch recomputes once per backward, and a graph may be walked twice (``retain_graph``)."""

    def __init__(self, on: bool):
        self.on = on
        self._open: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> None:
        cm = offload_path(self.on)
        cm.__enter__()
        self._open.append(cm)

    def __exit__(self, *exc) -> None:
        self._open.pop().__exit__(*exc)


def recompute_on_same_path() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint``: the recomputation takes the path the forward took.

    A layer recomputed in backward runs outside the engine's context; on the other path it would
    save other tensors than its first forward did, which non-reentrant checkpointing refuses.
    """
    return contextlib.nullcontext(), _SamePath(path_is_on())
