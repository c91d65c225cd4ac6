"""Offloading strategies side by side, on the same model, data and GPU, in one run.

For each model of the grid and each number ``k`` of treated layers (the first ``k`` of ``N``),
every strategy runs the same training step:

- ``no offload``: the baseline;
- ``engine``: this package, default schedule, pinned buffers reused from step to step;
- ``engine (fresh pinned)``: the same, with the pool emptied after every step;
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the ``k`` layers
  (skipped on Transformer Engine's layers, where it crashes);
- ``torchtune``: torchtune's ``OffloadActivations`` around the ``k`` layers, when installed;
- ``transformer_engine``: Transformer Engine's ``get_cpu_offload_context``, when installed;
- ``checkpoint``: recomputation (``torch.utils.checkpoint``) of the ``k`` layers instead;
- ``planner``: :func:`~offload_examples.features.planner.plan`'s choice of keep, offload or recompute
  per layer, under two budgets per ``k``: the predicted peak of offloading the first ``k`` layers and
  that of recomputing them (see ``_planner_budgets``). ``engine`` and ``checkpoint`` at every
  ``k`` are its offload-only and recompute-only curves; :func:`check_planner` compares them.

Each result has the peak memory, the saving against the theoretical saving (what the engine's
schedule predicts for the same ``k`` from the bytes each layer's forward holds, measured by the CUDA
allocator; on a CPU, from the engine's own count), the median step time (CUDA events, after
warm-up) and its ratio to the baseline. For the engine it also has the *copy bound*: the step
time the schedule allows when copies run at the pinned bandwidth measured at the start of the
run (the fastest of three rounds) and compute takes what the baseline's layers took (:meth:`DefaultSchedule.predict_step_ms`),
and the bandwidth its copies achieved. Output: JSON, a Markdown table and plots.

Run it::

    python -m offload_examples bench  # the full grid on a GPU, tiny on a CPU
    python -m offload_examples bench --models A --ks 2 4 --out results/bench
    python -m offload_examples bench --models A A-torch B \\
        --strategies "no offload" engine checkpoint planner

A module per part: the models and what a run measures (``grid``), the strategies (``strategies``),
how one strategy's run is measured (``protocol``), failures that leave the device unusable
(``faults``), the planner's runs and checks (``planner_bench``), one model's grid (``model_grid``), a
process per model (``isolation``), the whole run (``runner``), the targets and tables (``tables``),
the files a run writes (``plots``) and the command line (``cli``).
"""

from __future__ import annotations

from offload_examples.instruments.bench.cli import main
from offload_examples.instruments.bench.faults import DeviceLost, device_usable
from offload_examples.instruments.bench.grid import MODELS, BenchConfig, ModelSpec, memory_need
from offload_examples.instruments.bench.planner_bench import (
    PLAN_PAIRS_RUN, PLANNER_BUDGETS, PLANNER_PEAK_NOISE, PLANNER_PREDICTION_ERROR, PLANNER_TIME_NOISE, PlannerSetup,
    check_planner,
)
from offload_examples.instruments.bench.plots import PLOTS_MISSING, write_outputs
from offload_examples.instruments.bench.protocol import HEAD_TO_HEAD, HEAD_TO_HEAD_RUN
from offload_examples.instruments.bench.runner import run
from offload_examples.instruments.bench.strategies import (
    SAVE_ON_CPU_ON_TE, STRATEGIES, TE_CONTEXT_ONLY, TE_DEFAULT_PATH, TE_ON_TORCH_LAYERS, Forward, available,
    make_forward,
)
from offload_examples.instruments.bench.tables import GiB, check_targets, markdown

__all__ = [
    "MODELS", "PLOTS_MISSING", "STRATEGIES", "BenchConfig", "DeviceLost", "ModelSpec", "check_planner", "main", "run",
    "write_outputs",
]
