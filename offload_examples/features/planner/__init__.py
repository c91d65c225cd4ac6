"""A memory budget in, the fastest plan out: keep, offload or recompute each layer.

The step modelled is :class:`~offload_examples.core.schedule.DefaultSchedule`'s: the forwards of layers
``0 .. N-1``, then their backwards in reverse. Per layer:

- ``KEEP``: its ``saved_bytes`` stay on the device from its forward to the end of its backward.
- ``RECOMPUTE``: only its ``input_bytes`` stay; its backward first re-runs the forward
  (``LayerCost.recompute_extra_ms`` more) and holds ``saved_bytes`` on top of the input while it runs.
- ``RECOMPUTE`` of one submodule (``Plan.modules``): the layer keeps what it saves outside that module
  and the module's input (:attr:`ModuleCost.kept_bytes`, measured with the module checkpointed); its
  backward re-runs the module's forward (:attr:`ModuleCost.recompute_ms` more) and holds what the module
  saves (:attr:`ModuleCost.module_bytes`) on top while it runs. The options come from
  ``LayerCost.recompute_modules`` (:func:`~offload_examples.instruments.plan_costs.measure_costs`
  measures them); :func:`apply_plan` wraps the module in checkpointing inside the unchanged layer.
- ``OFFLOAD``: its ``saved_bytes`` are copied out from the end of its forward and released, and
  reloaded, at :class:`SubsetSchedule`'s points (for the first ``k`` layers these are exactly
  ``DefaultSchedule(k, N)``'s; :func:`apply_plan` runs any set on the engine). A release waits for its copy
  out, a backward for its whole reload (the engine's backward starts on the tensors that come back
  first, so where reloads are the bound this errs long); copies run one at a time per direction
  (:meth:`DefaultSchedule.predict_step_ms`). Its forward and backward take
  ``LayerCost.offloaded_forward_ms`` and ``offloaded_backward_ms`` where they were measured. The last
  layer is never offloaded.
- ``RECOMPUTE_OFFLOAD``: RECOMPUTE whose input waits in pinned host memory: the layer is checkpointed
  inside the engine's context, so the engine copies out what the checkpoint keeps (``input_bytes``)
  and the layer holds nothing on the device from its release to its reload; its backward re-runs
  the forward and holds ``saved_bytes`` on top of the reloaded input while it runs. This is how the
  longest sequences train: checkpointing alone keeps every layer's input on the device.
- ``OFFLOAD`` with a byte cap (``Plan.caps``), for the last offloaded layer only: the engine copies the
  storages it saves first, each while it fits under the cap (``max_offload_bytes_per_layer``), and the
  rest stay on the device as when kept. The sizes come from ``LayerCost.storage_bytes``; a cap tops up
  what the other layers free by just the bytes a budget still needs, with copies that may fit behind
  compute where a whole layer's would not. Where ``LayerCost.storage_modules`` is known, the plan
  also says which submodules saved what the cap takes (``Plan.parts``, :func:`cap_in_modules`).

Pinned host memory is what the offloaded layers copy out, rounded up as pinning reserves it, all of
it held at once (:func:`plan_host_bytes`); :func:`plan` keeps it within a host budget
(:func:`host_budget`: half of what the host has available, shared among the node's processes).

Peak memory is ``base_bytes`` plus the most saved bytes resident at any phase
(:meth:`DefaultSchedule.simulate`, plus a recomputed layer's ``saved_bytes`` during its backward);
the step time is ``predict_step_ms`` with each layer's times under its choice
(:meth:`LayerCost.phase_ms`). :func:`simulate_plan` is that model; :func:`plan` and :func:`pareto` search it.

``LinkCost.both_gb_per_s`` never binds here: every release waits for its copy out and comes before
the last forward, every reload starts at a backward, so the two directions are never busy at once.

The package, a module per part: :mod:`~offload_examples.features.planner.costs` (what a layer costs,
the copy link), :mod:`~offload_examples.features.planner.model` (:func:`simulate_plan`, :class:`Plan`),
:mod:`~offload_examples.features.planner.search` (:func:`plan`, :func:`pareto`) and
:mod:`~offload_examples.features.planner.apply` (:func:`apply_plan`, :func:`apply_plan_to_model`,
:class:`Checkpointed`).
"""

from __future__ import annotations

from .apply import Checkpointed, PlannedLayers, apply_plan, apply_plan_to_model
from .costs import (
    KEEP, OFFLOAD, OFFLOADED, RECOMPUTE, RECOMPUTE_OFFLOAD, RECOMPUTED, TIME_FIELDS, Choice, LayerCost, LinkCost,
    ModuleCost, cap_in_modules, capped_bytes, host_budget, partial_caps,
)
from .model import Plan, SubsetSchedule, copied_bytes, offload_schedule, plan_host_bytes, simulate_plan
from .search import EXHAUSTIVE_MAX_LAYERS, pareto, plan

__all__ = [
    "KEEP", "OFFLOAD", "OFFLOADED", "RECOMPUTE", "RECOMPUTED", "RECOMPUTE_OFFLOAD", "Checkpointed", "Choice",
    "LayerCost", "LinkCost", "ModuleCost", "Plan",
    "PlannedLayers", "SubsetSchedule",
    "apply_plan", "apply_plan_to_model", "cap_in_modules", "capped_bytes", "copied_bytes", "host_budget",
    "offload_schedule", "pareto",
    "partial_caps", "plan", "plan_host_bytes", "simulate_plan",
]
