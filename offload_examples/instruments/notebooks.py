"""Execute the tutorial notebooks with injected parameters (``python -m offload_examples.instruments.notebooks``).

Each notebook has a first code cell tagged ``parameters``. To run it with other values, a cell
tagged ``injected-parameters`` is placed right after it (the convention papermill uses), then the
notebook is executed top to bottom with ``nbclient``. Needs the ``notebooks`` extra. The outputs
are cleaned before the notebook is written (:func:`clean_outputs`): they are stored and read as
documentation.

Examples
--------
Re-execute every notebook in place at full size on a GPU node (what ``make notebooks`` does)::

    python -m offload_examples.instruments.notebooks notebooks/*.ipynb --inplace

Run one small on the CPU, writing its results::

    python -m offload_examples.instruments.notebooks notebooks/02_basic.ipynb \\
        -p device cpu -p size small -o /tmp/out.ipynb
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

__all__ = ["as_committed", "cells_missing_figures", "clean_outputs", "clean_text", "execute_notebook", "has_outputs"]

INJECTED = "injected-parameters"
#: The kernel draws figures inline, whatever MPLBACKEND says outside (``Agg`` would leave every
#: ``plt.show()`` without an image, and the docs site without pictures).
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"


#: The repository the notebooks belong to (a checkout: the package sits at its top).
ROOT = Path(__file__).resolve().parents[2]

# Stored outputs are documentation: whoever reads them must not see the machine they ran on, nor
# other libraries' warnings (Transformer Engine's missing Jax extension, the profiler's notices), which
# carry that machine's paths and say nothing about offloading. The filter works on the outputs, not
# on the kernel's warning filters, because ranks spawned by a notebook do not inherit those.
_WARNING = re.compile(r"^(?P<path>\S+?\.py):\d+: \w*Warning: .*\n(?:[ \t]+.*\n?)*", re.M)


def clean_text(text: str, root: str | Path = ROOT) -> str:
    """``text`` without warnings raised outside ``root`` and without machine paths.

    A warning block (``path.py:line: SomeWarning: message`` and the indented source lines after it)
    stays only when ``path`` lies inside ``root``, and then with ``path`` relative to it; any other
    path inside ``root`` becomes relative too, and a path inside the temporary folder becomes its
    file name.
    """
    root = str(Path(root).resolve())

    def keep(m: re.Match) -> str:
        path = m.group("path")
        return m.group(0) if path.startswith(root + os.sep) and "site-packages" not in path else ""

    text = _WARNING.sub(keep, text)
    text = text.replace(root + os.sep, "")
    temp = {tempfile.gettempdir().rstrip(os.sep), "/tmp"}
    for folder in sorted(temp, key=len, reverse=True):
        text = re.sub(re.escape(folder) + r"/(?:[^\s'\"]*/)?([^\s/'\"]+)", r"\1", text)
    return text


def clean_outputs(nb, root: str | Path = ROOT) -> int:
    """Apply :func:`clean_text` to every stream and plain-text output of ``nb`` (an nbformat
    notebook), dropping streams left empty; returns how many outputs changed."""
    changed = 0
    for cell in nb.cells:
        kept = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text = clean_text(out["text"], root)
                changed += text != out["text"]
                out["text"] = text
                if not text:
                    continue
            elif "text/plain" in out.get("data", {}) and len(out["data"]) == 1:
                text = clean_text(out["data"]["text/plain"], root)
                changed += text != out["data"]["text/plain"]
                out["data"]["text/plain"] = text
            kept.append(out)
        if "outputs" in cell:
            cell.outputs = kept
    return changed


def _inject(nb, parameters: Mapping[str, Any]) -> None:
    import nbformat

    nb.cells = [c for c in nb.cells if INJECTED not in c.get("metadata", {}).get("tags", [])]
    index = next((i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if index is None:
        raise ValueError("the notebook has no cell tagged 'parameters'")
    if parameters:
        source = "# Injected parameters\n" + "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
        cell = nbformat.v4.new_code_cell(source, metadata={"tags": [INJECTED]})
        nb.cells.insert(index + 1, cell)


def execute_notebook(
    path: str | Path,
    parameters: Mapping[str, Any] | None = None,
    output: str | Path | None = None,
    *,
    timeout: int = 1800,
    kernel_name: str = "python3",
) -> Path:
    """Execute ``path`` with ``parameters`` and write the executed notebook to ``output``.

    ``output`` defaults to ``path`` itself (in place). The working directory is the notebook's
    folder. Raises ``nbclient.exceptions.CellExecutionError`` naming the failing cell.
    """
    import nbclient
    import nbformat

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    _inject(nb, dict(parameters or {}))
    start = time.perf_counter()
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name=kernel_name, resources={"metadata": {"path": str(path.parent)}}
    )
    outside = os.environ.get("MPLBACKEND")
    os.environ["MPLBACKEND"] = INLINE_BACKEND  # the kernel inherits the environment when it starts
    try:
        client.execute()
    finally:
        if outside is None:
            os.environ.pop("MPLBACKEND")
        else:
            os.environ["MPLBACKEND"] = outside
    clean_outputs(nb)
    stamp = nb.metadata.setdefault("offload_examples", {})
    stamp["executed_seconds"] = round(time.perf_counter() - start, 1)
    stamp["device"] = _device_name()
    stamp["parameters"] = dict(parameters or {})
    out = Path(output) if output else path
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return out


def as_committed(executed: str | Path, target: str | Path) -> Path:
    """Store a notebook executed with injected parameters as if it had run with its own: the
    injected cell goes (its values are in the stamp), so the GPU test's execution can be the one
    committed. Returns ``target``."""
    import nbformat

    nb = nbformat.read(Path(executed), as_version=4)
    nb.cells = [c for c in nb.cells if INJECTED not in c.get("metadata", {}).get("tags", [])]
    stamp = nb.metadata.get("offload_examples", {})
    stamp["parameters"] = {k: v for k, v in stamp.get("parameters", {}).items() if k != "results_json"}  # a temp path
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)
    return target


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def has_outputs(path: str | Path) -> bool:
    """Whether every code cell of a notebook was executed and at least one produced output."""
    import nbformat

    nb = nbformat.read(Path(path), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    return bool(code) and all(c.execution_count for c in code) and any(c.outputs for c in code)


def cells_missing_figures(path: str | Path) -> list[str]:
    """Ids of code cells that call ``plt.show()`` but hold no image output."""
    import nbformat

    nb = nbformat.read(Path(path), as_version=4)
    return [c.get("id", "?") for c in nb.cells if c.cell_type == "code" and "plt.show()" in c.source
            and not any("image/png" in o.get("data", {}) for o in c.outputs)]


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m offload_examples.instruments.notebooks", description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--inplace", action="store_true", help="overwrite each notebook with its executed copy")
    where.add_argument("-o", "--output", type=Path, help="output file (one notebook) or folder (several)")
    args = parser.parse_args(argv)
    params = {k: _literal(v) for k, v in args.parameter}
    for nb in args.notebooks:
        out = None
        if args.output:
            out = args.output / nb.name if len(args.notebooks) > 1 or args.output.is_dir() else args.output
        print(f"executing {nb} {params or ''}", flush=True)
        start = time.perf_counter()
        done = execute_notebook(nb, params, out)
        print(f"  wrote {done} in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
