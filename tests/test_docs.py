"""The documentation builds with warnings as errors, and a real browser can read it."""

from __future__ import annotations

import ast
import builtins
import functools
import json
import http.server
import importlib.util
import os
import re
import runpy
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urljoin, urldefrag, urlparse
from urllib.request import urlopen

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("html")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(ROOT), str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def test_docs_build_without_warnings(site):
    pages = ["docs/index", *(f"docs/{p.stem}" for p in (ROOT / "docs").glob("*.md")), *(f"notebooks/{p.stem}" for p in (ROOT / "notebooks").glob("*.ipynb"))]
    for page in pages:
        assert (site / f"{page}.html").is_file(), page


@pytest.mark.parametrize("snippet", sorted((ROOT / "docs" / "snippets").glob("*.py")), ids=lambda p: p.name)
def test_docs_snippet_runs(snippet, capsys):
    runpy.run_path(str(snippet), run_name="__main__")
    assert capsys.readouterr().out.strip(), "a snippet shows its result"


def test_docs_code_blocks_come_from_tested_files():
    """Code on the site is either included from a file the tests run, or not Python at all."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        for lang in re.findall(r"^```[ \t]*(\S*)", page.read_text(), re.M):
            assert not lang or lang.startswith("{"), f"{page.name}: inline ```{lang} block; use literalinclude"


def test_readme_example_runs():
    """The README's API example runs as copied: in a fresh interpreter, with nothing around it."""
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    check = "\nassert all(p.grad is not None for layer in layers for p in layer.parameters())\n"
    proc = subprocess.run([sys.executable, "-c", code + check], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Failed to initialize NumPy" not in proc.stderr


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


#: How to install the browser (what `make test` prints where it cannot install it itself).
BROWSER_HINT = "sudo apt-get install chromium chromium-driver"


@pytest.fixture(scope="module")
def browser():
    """Headless chromium. Missing, the test skips saying what to install, or fails where
    ``OFFLOAD_EXAMPLES_REQUIRE_BROWSER=1`` (``make test`` sets it under CI)."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    missing = [] if chromium and driver else [f"chromium and chromedriver ({BROWSER_HINT})"]
    if importlib.util.find_spec("selenium") is None:
        missing.append("selenium (pip install -e '.[test]')")
    if missing:
        why = f"the browser test needs {' and '.join(missing)}"
        if os.environ.get("OFFLOAD_EXAMPLES_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{why}; OFFLOAD_EXAMPLES_REQUIRE_BROWSER=1 requires it")
        pytest.skip(f"{why}; set OFFLOAD_EXAMPLES_REQUIRE_BROWSER=1 to fail instead of skipping")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,900"):
        opts.add_argument(flag)
    b = webdriver.Chrome(options=opts, service=Service(driver))
    yield b
    b.quit()


def test_every_page_renders_with_images_and_links(browser, site, server):  # browser first: skips before the build
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html")
                   if not p.relative_to(site).parts[0].startswith(("_", ".")) and p.name not in ("search.html", "genindex.html"))
    assert len(pages) >= 8
    images_seen, checked = 0, set()
    for page in pages:
        url = urljoin(server, page)
        browser.get(url)
        assert browser.execute_script("return document.readyState") == "complete"
        heading = browser.execute_script("const h = document.querySelector('article h1'); return h && h.textContent")
        assert heading, f"{page}: no heading rendered"
        broken = browser.execute_script(
            "return [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)")
        assert not broken, f"{page}: images that did not load: {broken}"
        shown = browser.execute_script("return document.querySelectorAll('article img').length")
        assert shown >= _stored_images(page), f"{page}: shows {shown} images, its notebook stores more"
        images_seen += shown
        for href in browser.execute_script("return [...document.querySelectorAll('a[href]')].map(a => a.href)"):
            target, fragment = urldefrag(href)
            if urlparse(target).netloc != urlparse(server).netloc or (target, fragment) in checked:
                continue
            checked.add((target, fragment))
            with urlopen(target) as r:
                assert r.status == 200, f"{page}: broken link {href}"
                body = r.read().decode("utf-8", "replace")
            if fragment:
                assert f'id="{fragment}"' in body, f"{page}: link to a missing anchor {href}"
    assert images_seen >= 1 + sum(_stored_images(f"notebooks/{nb.stem}.html") for nb in (ROOT / "notebooks").glob("*.ipynb"))


def _stored_images(page: str) -> int:
    """How many images the notebook behind ``page`` has in its stored outputs (0 for other pages)."""
    nb = ROOT / Path(page).with_suffix(".ipynb")
    if not page.startswith("notebooks/") or not nb.is_file():
        return 0
    cells = json.loads(nb.read_text())["cells"]
    return sum("image/png" in out.get("data", {}) for c in cells for out in c.get("outputs", []))


def _free_names(code: str) -> set[str]:
    """Names a code block reads without defining or importing them."""
    tree = ast.parse(code)
    defined = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    defined |= {a.asname or a.name.split(".")[0] for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    defined |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args}
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return read - defined - set(dir(builtins))


# What a prose snippet may leave to the reader: the model, its data and the training loop around it.
SNIPPET_PLACEHOLDERS = {"layers", "x", "k", "model", "loss", "torch", "batches", "example_batch",
                        "optimizer", "host_optimizer", "get_cpu_offload_context"}
CPU_SCOPE = {"layers", "x", "k", "get_cpu_offload_context"}


def test_code_in_notebook_text_runs():
    """Code blocks in the notebooks' prose import what they use; those that need no GPU run as written."""
    import nbformat
    import torch

    from offload_examples import get_cpu_offload_context

    blocks = [(nb.name, code) for nb in sorted((ROOT / "notebooks").glob("*.ipynb"))
              for cell in nbformat.read(nb, as_version=4).cells if cell.cell_type == "markdown"
              for code in re.findall(r"```python\n(.*?)```", cell.source, re.S)]
    ran = 0
    for name, code in blocks:
        free = _free_names(code)
        assert free <= SNIPPET_PLACEHOLDERS, (name, free - SNIPPET_PLACEHOLDERS)
        imports = [n for n in ast.parse(code).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        exec(compile(ast.Module(body=imports, type_ignores=[]), name, "exec"), {})  # the names exist
        if not free <= CPU_SCOPE:
            continue  # needs a GPU model and a data loop: names checked above, the notebook runs it
        layers = [torch.nn.Linear(16, 16) for _ in range(4)]
        x = torch.randn(2, 16, requires_grad=True)
        scope = {"layers": layers, "x": x, "k": 2, "get_cpu_offload_context": get_cpu_offload_context}
        exec(compile(code, name, "exec"), scope)
        scope["x"].sum().backward()
        assert all(layer.weight.grad is not None for layer in layers), name
        ran += 1
    assert ran, "the basic notebook shows the four lines a training loop needs"
