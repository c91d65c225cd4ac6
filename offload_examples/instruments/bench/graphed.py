"""The engine inside CUDA graphs: the benchmark's graphed column.

On a launch-bound model the host paces the eager step, and the engine's hooks add host work to it.
Graphs take that work away, so what offloading costs inside them is what its copies cost. At a given
``k`` the benchmark measures, alternating step by step as everywhere else:

- per-layer graphs (:func:`~offload_examples.features.graphs.make_graphed_layers`, each layer's
  forward and backward captured in graphs of their own, as Megatron-LM captures them) with the
  engine against the same graphs without it, and the copy bound of the graphs' compute (the
  schedule's copies at the link's speed beside it);
- on Transformer Engine's layers, the whole step captured with the engine against the whole step
  captured with Transformer Engine's offload, the way TE documents its offloading under CUDA graphs
  (its context cannot run in per-layer graphs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from offload_examples import get_cpu_offload_context
from offload_examples.features.graphs import make_graphed_layers
from offload_examples.instruments.bench.faults import _failed, _free, _tidy
from offload_examples.instruments.bench.protocol import _alternating, _paired
from offload_examples.instruments.bench.strategies import _through
from offload_examples.instruments.graph_variants import (
    capture_training_step, graphed_copy_bound_ms, graphed_copy_waits_ms, graphed_layer_ms, over_the_larger,
    te_graph_context,
)
from offload_examples.instruments.measure import measure_paired
from offload_examples.instruments.models import TE_LAYER

__all__ = ["GRAPHED_RUN", "graphed_run"]

#: The name under which the graphed runs are reported, and left out after one left the device unusable.
GRAPHED_RUN = "the engine inside CUDA graphs"


def graphed_run(model: nn.ModuleList, x: torch.Tensor, k: int, device: torch.device, kind: str, steps: dict,
                link: dict | None) -> dict[str, Any]:
    """The graphed column at ``k``: per-layer graphs with the engine against without (and the copy bound),
    and on Transformer Engine's layers the whole step captured with the engine against with TE's offload."""
    if device.type != "cuda":
        return {"k": k, "status": "skipped", "reason": "CUDA graphs need CUDA"}
    try:
        out = {"k": k, "status": "ok", **_per_layer(model, x, k, device, kind, steps, link)}
        _free(run=GRAPHED_RUN, k=k)  # the per-layer graphs' pools, before the whole-step graphs take theirs
        if kind == TE_LAYER:
            out.update(_whole_step_against_te(model, x, k, device, steps))
        return out
    except Exception as err:  # reported in its note; the benchmark goes on
        return _failed(device, GRAPHED_RUN, k, err)
    finally:
        _tidy(model, x, run=GRAPHED_RUN, k=k)  # the graphs and their pools went with the frames above


def _per_layer(model: nn.ModuleList, x: torch.Tensor, k: int, device: torch.device, kind: str, steps: dict,
               link: dict | None) -> dict[str, Any]:
    backend = "te" if kind == TE_LAYER else "torch"
    plain = make_graphed_layers(list(model), x, *get_cpu_offload_context(enabled=False), backend=backend)
    engine, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=len(model), device=device,
                                           retain_pinned_cpu_buffers=True)  # the graphs keep the warm-up's buffers
    graphed = make_graphed_layers(list(model), x, engine, sync, backend=backend)
    a = _alternating(model, x, lambda h: _through(plain, h), lambda h: _through(graphed, h), "per-layer graphs",
                     steps)
    # Each layer's graphs in a step, with and without the engine, in turns, right after the timed steps and in
    # steps like theirs: the compute the copies hide behind (the bound's) runs at the speed it ran at there, and
    # the spans with offloading show which graphs the copies or their waits lengthen.
    spans = graphed_layer_ms({"plain": plain, "offload": graphed}, model, x)
    (forward_ms, backward_ms), (offload_forward_ms, offload_backward_ms) = spans["plain"], spans["offload"]
    bound = graphed_copy_bound_ms(engine, forward_ms, backward_ms, link) if link else None
    waits = None if bound is None else graphed_copy_waits_ms(bound, forward_ms, backward_ms)
    return {"per_layer_overhead": a["ratio"], "per_layer_quartiles": a["quartiles"], "per_layer_pairs": a["pairs"],
            "per_layer_ms": a["reference_ms"], "per_layer_offload_ms": a["candidate_ms"], "bound_ms": bound,
            "over_reference": over_the_larger(a["candidate_ms"], a["reference_ms"], bound), "waits_ms": waits,
            "over_reference_and_waits": None if waits is None else a["candidate_ms"] / (a["reference_ms"] + waits) - 1,
            "forward_ms": sum(forward_ms), "backward_ms": sum(backward_ms),
            "offload_forward_ms": sum(offload_forward_ms), "offload_backward_ms": sum(offload_backward_ms),
            "moved_bytes": sum(stats.offloaded_bytes for stats in engine.stats)}


def _whole_step_against_te(model: nn.ModuleList, x: torch.Tensor, k: int, device: torch.device, steps: dict
                           ) -> dict[str, Any]:
    n = len(model)
    engine, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n, device=device,
                                           retain_pinned_cpu_buffers=True)
    ours = capture_training_step(model, x, engine, sync)
    theirs = capture_training_step(model, x, *te_graph_context(k, n))
    a = _paired(*measure_paired(model, x, theirs.replay, ours.replay, label="whole step", **steps))
    return {"whole_step_vs_te": a["ratio"], "whole_step_quartiles": a["quartiles"], "whole_step_pairs": a["pairs"],
            "whole_step_ms": a["candidate_ms"], "te_whole_step_ms": a["reference_ms"]}
