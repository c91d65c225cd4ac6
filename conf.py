"""Sphinx configuration for the offload_examples documentation (``make docs``).

The source folder is the repository root so that nbsphinx can render ``notebooks/`` next to the
pages in ``docs/``; ``include_patterns`` keeps everything else out.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))  # offload_docs: offline math, references, entry page

# nbsphinx converts notebook Markdown with pandoc; the pypandoc_binary package (docs extra) ships one.
try:
    import pypandoc

    os.environ["PATH"] = str(Path(pypandoc.get_pandoc_path()).parent) + os.pathsep + os.environ.get("PATH", "")
except (ImportError, OSError):
    pass

import offload_examples  # noqa: E402

project = "offload_examples"
author = "the offload_examples authors"
copyright = "2026, the offload_examples authors"
release = version = offload_examples.__version__

root_doc = "docs/index"
include_patterns = ["docs/**", "notebooks/*.ipynb"]
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "docs/snippets/**", "docs/bench/**", "docs/runs/**", "notebooks/drafts/**"]

# The files the prose takes its numbers from: {stored}`bench:models[A].runs[engine,k=2].overhead|+pct`
# writes that value of docs/bench/bench.json into the page when the site is built, and a value that
# is not there fails the build (docs/_ext/offload_docs.py; tests/test_prose_numbers.py checks the
# numbers the prose writes by itself). A notebook's numbers are what its stored outputs printed.
stored_sources = {
    "bench": "docs/bench/bench.json",  # the benchmark on the H100 (docs/benchmarks.md)
    "model-A": "docs/bench/bench.json#models[A]",  # its model A (the basic scenario: TE layers when installed)
    "model-A-torch": "docs/bench/bench.json#models[A-torch]",  # model A's shapes with PyTorch's layers
    "model-A-wide": "docs/bench/bench.json#models[A-wide]",  # TE layers at twice the width, half the batch
    # model A with Transformer Engine's layers, before and after 170f3b7 (hook-free non-offloaded layers)
    "te-bench-67a2151": "docs/runs/2026-11-23-h100-session2/bench_A_te_k2_k4_at_67a2151.md",
    "te-bench-1b7a591": "docs/runs/2026-11-23-h100-session2/bench_A_te_k2_k4_at_1b7a591.md",
    "fsdp": "docs/runs/2026-11-24-h100-session4/gpu_fsdp.json",  # FSDP2 on one H100
    "fsdp-cpu-params": "docs/runs/2026-11-24-h100-session4/gpu_fsdp_cpu_params.json",  # ... with CPUOffloadPolicy
    "fsdp-plan": "docs/runs/2026-11-24-h100-session4/gpu_fsdp_plan.json",  # ... with the planner's plan
    # three models, engine / TE / checkpoint / planner, one run (docs/planner.md)
    "plan-bench": "docs/runs/2026-11-24-h100-session4/bench/bench.json",
    "pipeline-te": "docs/runs/2026-11-24-h100-session4/pipeline_te.json",  # one TE layer, 1F1B order
    "concepts": "notebooks/01_concepts.ipynb",  # its stored outputs: copies, bandwidths, pinning
    # the GPU runs docs/reliability.md reports: the basic scenario on TE layers, the second session's record
    "basic-te": "docs/runs/2026-11-23-h100/basic_te_layers.json",
    "gpu-session2": "docs/runs/2026-11-23-h100-session2/README.md",
    "gpu-session3": "docs/runs/2026-11-23-h100-session3/README.md",
    "gpu-session4": "docs/runs/2026-11-24-h100-session4/README.md",
    # model A on TE layers, 20 layers, engine / TE's offload / TE's context alone, one run (docs/benchmarks.md)
    "te-bench5": "docs/runs/2026-11-24-h100-session5/bench_A20/bench.json#models[A]",
    "te-bench5-md": "docs/runs/2026-11-24-h100-session5/bench_A20/bench.md",
    "gpu-session5": "docs/runs/2026-11-24-h100-session5/README.md",
    # model A on TE layers, 20 layers, with the engine and TE's offload alternating step by step
    "te-bench7": "docs/runs/2026-11-24-h100-session7/bench_A20/bench.json#models[A]",
    "gpu-session6": "docs/runs/2026-11-24-h100-session6/README.md",
    "gpu-session7": "docs/runs/2026-11-24-h100-session7/README.md",
    "plan-bench7": "docs/runs/2026-11-24-h100-session7/bench_planner/bench.json",
    # two H200s of one host, NCCL: the two-stage pipeline and FSDP2 on two ranks
    "pipeline-2gpu": "docs/runs/2026-11-24-h100-session7/h200x2/pipeline_dist_nccl.json",
    "fsdp-2gpu": "docs/runs/2026-11-24-h100-session7/h200x2/fsdp_2gpu_nccl.json",
    "te-bench8": "docs/runs/2026-11-24-h100-session8/bench_A20/bench.json#models[A]",
    "te-bench8-md": "docs/runs/2026-11-24-h100-session8/bench_A20/bench.md",
    "gpu-session8": "docs/runs/2026-11-24-h100-session8/README.md",
    "plan-bench8": "docs/runs/2026-11-24-h100-session8/bench_planner/bench.json",
    "paths8": "docs/runs/2026-11-24-h100-session8/paths_prof15.txt",
    "reload9": "docs/runs/2026-11-24-h100-session9/prof17_reload_timing.txt",
    "te-bench9": "docs/runs/2026-11-24-h100-session9/bench_A20_early_first_reload/bench.json#models[A]",
    "plan-bench9": "docs/runs/2026-11-24-h100-session9/bench_planner_cost_differences/bench.json#models[A]",
    "gpu-session10": "docs/runs/2026-11-24-h100-session10/README.md",
    "plan-bench10": "docs/runs/2026-11-24-h100-session10/bench_planner/bench.json#models[A]",
    "gpu-session11": "docs/runs/2026-11-24-h100-session11/README.md",
    # the planner's costs from one layer's own phases (c8e7d6f), then from the whole step (39da591)
    "plan-bench11a": "docs/runs/2026-11-24-h100-session11/bench_planner_c8e7d6f/bench.json#models[A]",
    "plan-bench11": "docs/runs/2026-11-24-h100-session11/bench_planner/bench.json#models[A]",
    # why TE-layer steps vary; plan-bench11's code again, with A-wide (TE layers, twice the width) beside
    "gpu-session12": "docs/runs/2026-11-24-h100-session12/README.md",
    # the reload order: the same round robin before (diag22) and after (diag23) the change, and the bench with it
    "order-before13": "docs/runs/2026-11-24-h100-session13/diag22.json#results",
    "order13": "docs/runs/2026-11-24-h100-session13/diag23.json#results",
    "te-bench13": "docs/runs/2026-11-24-h100-session13/bench_A20/bench.json#models[A]",
    "gpu-session13": "docs/runs/2026-11-24-h100-session13/README.md",
    # k = 2 on model A: where the forward still differs from TE's offload; the copies alone (diag25)
    "copies14": "docs/runs/2026-11-24-h100-session14/diag25.json#summary",
    "layers14": "docs/runs/2026-11-24-h100-session14/diag25_layers.json",
    # notebook 02's comparison model (TE's tutorial shape, 8 layers), a model per variant, in turns (diag27)
    "tutorial14": "docs/runs/2026-11-24-h100-session14/diag27.json#summary",
    # Python's garbage collector in a training process with TE layers (diag28)
    "gc14": "docs/runs/2026-11-24-h100-session14/diag28.json",
    # the leaner pack hook against the engine before it and TE's offload, in turns (diag29), and the bench with it
    "lean15": "docs/runs/2026-11-24-h100-session15/diag29.json",
    "te-bench15": "docs/runs/2026-11-24-h100-session15/bench_A20/bench.json#models[A]",
    "gpu-session15": "docs/runs/2026-11-24-h100-session15/README.md",
    "plan-bench16": "docs/runs/2026-11-24-h100-session16/bench_planner/bench.json",
    "uncapped16": "docs/runs/2026-11-24-h100-session16/uncapped_plans.txt",
    "gpu-session16": "docs/runs/2026-11-24-h100-session16/README.md",
    # each plan alternating step by step with its best rival (the planner's time check since dd22984)
    "plan-bench17": "docs/runs/2026-11-25-h100-session17/bench_planner/bench.json",
    "gpu-session17": "docs/runs/2026-11-25-h100-session17/README.md",
    # pairs taking turns at going first, cost rounds in balanced orders, the link's fastest round (b1b2647)
    "plan-bench18": "docs/runs/2026-11-25-h100-session18/bench_planner/bench.json",
    "te-bench18": "docs/runs/2026-11-25-h100-session18/bench_planner/bench.json#models[A]",
    "gpu-session18": "docs/runs/2026-11-25-h100-session18/README.md",
    # the full benchmark's session (docs/bench/ holds its run): torchtune's gradients against no offloading,
    # on four of model A's layers, TE's and PyTorch's (the latter also under deterministic kernels)
    "tt-probe19": "docs/runs/2026-11-25-h100-session19/torchtune_probe.txt",
    "tt-probe19-det": "docs/runs/2026-11-25-h100-session19/torchtune_probe_deterministic.txt",
    # a short run (4 layers) of the benchmark once each row compared its gradients with a plain step's
    "grads19-A": "docs/runs/2026-11-25-h100-session19/bench_grads.json#models[A]",
    "grads19-A-torch": "docs/runs/2026-11-25-h100-session19/bench_grads.json#models[A-torch]",
    # plans that recompute one submodule of a layer (eba0b93)
    "plan-bench20": "docs/runs/2026-11-25-h100-session20/bench_planner/bench.json",
    "gpu-session20": "docs/runs/2026-11-25-h100-session20/README.md",
    # model A on TE layers, 20 layers, engine against TE's offload, on an H200
    "te-bench21": "docs/runs/2026-11-28-h200-session21/bench/bench.json#models[A]",
    "bench21": "docs/runs/2026-11-28-h200-session21/bench/bench.json",
}

extensions = [
    "myst_parser",
    "nbsphinx",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "matplotlib.sphinxext.plot_directive",
    "offload_docs",
]
myst_enable_extensions = ["colon_fence", "deflist"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}

# Every reference must resolve (-W makes a broken one an error). Nothing is downloaded at build
# time, so there is no intersphinx: names from outside the package (torch, matplotlib, the
# standard library) stay plain text. Names of this package never need an entry here.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|nn|matplotlib|numpy)(\..*)?"),
    (r"py:.*", rf"({'|'.join(sorted(sys.stdlib_module_names))})\..*"),
    (r"py:.*", r"Axes|Figure"),  # matplotlib's, as plots.py's annotations name them (imported under TYPE_CHECKING)
    (r"py:obj", r"True|False"),  # "bool, default False" in a parameter's type
]

# Math is MathML made at build time (offload_docs), so the site needs no MathJax and no network.
html_math_renderer = "mathml"

# Notebooks are committed with the outputs of a real GPU run: render those, never re-execute.
nbsphinx_execute = "never"
nbsphinx_prompt_width = "0"
# require.js only serves Jupyter widgets, which the notebooks have none of; it would load from a CDN.
nbsphinx_requirejs_path = ""

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True}
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_ivar = False  # "Attributes" sections become attribute entries that references can find
napoleon_preprocess_types = True  # "int, default 1" is a type and a default, not two type names
napoleon_attr_annotations = False  # an attribute's annotation is not split into type names (list[tuple[...]])

plot_include_source = False
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 110)]

html_theme = "furo"
html_title = "offload_examples"
html_static_path = ["docs/_static"]
html_css_files = ["offload_docs.css"]
