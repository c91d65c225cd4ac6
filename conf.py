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
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "docs/snippets/**", "docs/evidence/**"]

# The files the prose takes its numbers from: {stored}`bench:models[A].runs[engine,k=2].overhead|+pct`
# writes that value of the benchmark's bench.json into the page when the site is built, and a value
# that is not there fails the build (docs/_ext/offload_docs.py; tests/test_prose_numbers.py checks the
# numbers the prose writes by itself). A notebook's numbers are what its stored outputs printed.
# Each folder of docs/evidence/ holds one body of measurements, named by what and where it measures,
# with a README (command, commit, GPU, software, date): a new run replaces the folder's files, and
# every page that quotes them through these keys follows. (Plain strings: the tests read this dict
# without running conf.py.)
stored_sources = {
    # the benchmark on one H200: every strategy, models A and A-torch, 20 layers, k = 2 and 4 (docs/benchmarks.md)
    "bench": "docs/evidence/h200-bench/bench.json",
    "model-A": "docs/evidence/h200-bench/bench.json#models[A]",  # Transformer Engine's layers
    "model-A-torch": "docs/evidence/h200-bench/bench.json#models[A-torch]",  # model A's shapes, PyTorch's layers
    "graphed-a2": "docs/evidence/h200-bench/graphed_a_k2.json#models[A]",  # model A's graphed column at k = 2
    # the same column with the copies out between the graphs' replays, the bound from layer spans taken in turns
    "graphed-between": "docs/evidence/h200-bench/graphed_between_a_k2.json#models[A]",
    # GPU timelines of steps through those graphs with and without the engine, and the host's waits compared
    "between-step": "docs/evidence/h200-bench/between_a_step.json",
    # the copies out of those graphs beside a step, the backward launched at once or after the host slept
    "copies-beside": "docs/evidence/h200-bench/copies_beside_a_step.json",
    # output and gradients of one step against a plain step, bit for bit: four layers of models A and A-torch
    "grads-A": "docs/evidence/h200-bench/bench_grads.json#models[A]",
    "grads-A-torch": "docs/evidence/h200-bench/bench_grads.json#models[A-torch]",
    # torchtune's gradients against a plain step, with and without deterministic kernels
    "torchtune-grads": "docs/evidence/h200-bench/torchtune_probe.txt",
    "torchtune-grads-det": "docs/evidence/h200-bench/torchtune_probe_deterministic.txt",
    # model A-torch's plain step in a fresh process, without and with Transformer Engine imported
    "attention-te": "docs/evidence/h200-bench/attention_with_te.txt",
    # the planner against pure offloading and pure recomputation, two models of 12 layers, one H200
    "planner-bench": "docs/evidence/h200-planner-bench/bench.json",
    # where the host time goes on Transformer Engine's launch-bound layers (model A, one H100)
    "te-forward": "docs/evidence/h100-te-host-time/diag25.json#summary",  # a step's forward, variant by variant
    "te-forward-layers": "docs/evidence/h100-te-host-time/diag25_layers.json",  # the same, layer by layer
    "te-gc": "docs/evidence/h100-te-host-time/diag28.json",  # Python's garbage collector over 150 steps
    "reload-order": "docs/evidence/h100-te-host-time/diag23.json#results",  # early_first_reload, 12 layers
    # the GPU test suite on one H200, with and without Transformer Engine (docs/reliability.md)
    "basic-h200": "docs/evidence/h200-gpu-tests/basic_te.json",  # the basic scenario in the H200's GPU suite
    # two H200s of one host, NCCL: the two-stage pipeline, FSDP2 on two ranks, the two-GPU tests
    "pipeline-2gpu": "docs/evidence/2xh200-nccl/pipeline_dist_nccl.json",
    "fsdp-2gpu": "docs/evidence/2xh200-nccl/fsdp_2gpu_nccl.json",
    "tests-2gpu": "docs/evidence/2xh200-nccl/tests_2gpu.log",
    # the longest sequence: Llama 3 8B's shape on one H200 capped at 32 GiB (docs/long_context.md)
    "long-context": "docs/evidence/h200-long-context/long_context.json",  # every strategy's search
    "long-context-turns": "docs/evidence/h200-long-context/at_checkpoint.json",  # at checkpointing's longest
    "long-context-full": "docs/evidence/h200-long-context-full/checkpoint_no_offload.json",  # the whole GPU
    "long-context-planner": "docs/evidence/h200-long-context-full/planner_405504.json",  # the planner, whole GPU
    "long-context-planner-search": "docs/evidence/h200-long-context-full/planner_search.json",  # uncapped search
    "long-context-engine": "docs/evidence/h200-long-context-full/engine_checkpoint_offload.json",  # engine, c + o
    # per-layer CUDA graphs with offloading at model A's shapes, one H200 (docs/caveats.md)
    "graphs-te": "docs/evidence/h200-graphs/graphs_te.json",  # Transformer Engine's layers
    "graphs-torch": "docs/evidence/h200-graphs/graphs_torch.json",  # PyTorch's layers
    # notebooks: their stored outputs
    "concepts": "notebooks/01_concepts.ipynb",  # copies, bandwidths, pinning
    "fsdp-notebook": "notebooks/08_fsdp.ipynb",  # FSDP2 and DDP on one H200
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
