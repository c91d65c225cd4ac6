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
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "docs/snippets/**", "docs/bench/**"]

extensions = [
    "myst_parser",
    "nbsphinx",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "matplotlib.sphinxext.plot_directive",
]
myst_enable_extensions = ["colon_fence", "deflist"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}

# Notebooks are committed with the outputs of a real GPU run: render those, never re-execute.
nbsphinx_execute = "never"
nbsphinx_prompt_width = "0"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_ivar = True

plot_include_source = False
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 110)]

html_theme = "furo"
html_title = "offload_examples"
html_static_path = []
