"""Orders of forwards and backwards: written as text, a 1F1B pipeline stage's, and a schedule for one.

A pipeline stage runs its micro-batches' forwards and backwards interleaved; these helpers write
such an order down (:func:`parse_order`, :func:`one_f_one_b_order`) and build a
``synchronization_dict`` that fits it (:func:`sync_dict_for_order`), which
:class:`~offload_examples.SyncDictSchedule` then runs.
"""

from __future__ import annotations

from typing import Literal, Sequence

__all__ = ["Phase", "one_f_one_b_order", "parse_order", "sync_dict_for_order"]

Phase = Literal["forward", "backward"]


def parse_order(text: str) -> list[tuple[Phase, int]]:
    """``"0F 1F 0B 1B"`` -> ``[("forward", 0), ("forward", 1), ("backward", 0), ("backward", 1)]``."""
    out: list[tuple[Phase, int]] = []
    for tok in text.split():
        kind, num = tok[-1].upper(), tok[:-1]
        if kind not in "FB" or not num.isdigit():
            raise ValueError(f"cannot read {tok!r} in the order {text!r}: write e.g. '0F 1F 0B 1B'")
        out.append(("forward" if kind == "F" else "backward", int(num)))
    return out


def one_f_one_b_order(stage: int, num_stages: int, microbatches: int) -> list[tuple[Phase, int]]:
    """The order in which a 1F1B pipeline stage runs its micro-batches.

    As in ``torch.distributed.pipelining.Schedule1F1B``: stage ``s`` first runs
    ``min(M, num_stages - s)`` forwards, then alternates one backward and one forward, then runs
    the remaining backwards.
    """
    if not 0 <= stage < num_stages or microbatches < num_stages:
        raise ValueError(f"need 0 <= stage < num_stages <= microbatches, got {stage}, {num_stages}, {microbatches}")
    warmup = min(microbatches, num_stages - stage)
    order: list[tuple[Phase, int]] = [("forward", j) for j in range(warmup)]
    fwd, bwd = warmup, 0
    while bwd < microbatches:
        order.append(("backward", bwd))
        bwd += 1
        if fwd < microbatches:
            order.append(("forward", fwd))
            fwd += 1
    return order


def sync_dict_for_order(order: Sequence[tuple[Phase, int]], offload: Sequence[int] | None = None,
                        release_after: int = 2, reload_before: int = 1) -> dict[int, tuple[bool, int, bool, int]]:
    """Build a ``synchronization_dict`` for a given order of phases.

    Layer ``i``'s copy may run for ``release_after - 1`` phases after its forward: it is released
    at the start of the ``release_after``-th phase after its forward, and reloaded at the start of
    the phase ``reload_before`` phases before its backward. Layers for which that leaves no room
    (the release would not come before the reload) are left on the GPU.

    Parameters
    ----------
    order:
        Phases in the order they start, e.g. from :func:`parse_order` or :func:`one_f_one_b_order`.
    offload:
        Candidate layers; all layers when ``None``.
    """
    pos = {p: k for k, p in enumerate(order)}
    layers = sorted({j for _, j in order}) if offload is None else list(offload)
    out = {}
    for i in layers:
        rel, rld = pos[("forward", i)] + release_after, pos[("backward", i)] - reload_before
        if rel < rld:
            (rp, rj), (lp, lj) = order[rel], order[rld]
            if i not in (rj, lj):
                out[i] = (rp == "forward", rj, lp == "forward", lj)
    return out
