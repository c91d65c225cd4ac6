"""The documentation builds with warnings as errors, and a real browser can read it offline."""

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
import time
from html import unescape
from pathlib import Path
from urllib.parse import unquote, urljoin, urldefrag, urlparse
from urllib.request import urlopen

import pytest

import background

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def build() -> tuple[Path, subprocess.CompletedProcess]:
    """One build for every test here: warnings as errors, every reference checked (``-n``, nitpicky),
    started in the background when the run was collected (``tests/background.py``)."""
    return background.docs_build()


@pytest.fixture(scope="module")
def site(build) -> Path:
    out, proc = build
    assert (out / "docs" / "index.html").is_file(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


def _source_pages() -> list[str]:
    """Every page the site is built from, as its path without suffix (``docs/api/engine``)."""
    skipped = ("snippets", "evidence")  # included files and data, not pages (conf.py's exclude_patterns)
    docs = [p for p in (ROOT / "docs").rglob("*.md")
            if not any(part.startswith("_") or part in skipped for part in p.relative_to(ROOT / "docs").parts)]
    return sorted([p.relative_to(ROOT).with_suffix("").as_posix() for p in docs]
                  + [f"notebooks/{p.stem}" for p in (ROOT / "notebooks").glob("*.ipynb")])


def test_docs_build_without_warnings(build):
    """No warning at all, broken cross-references included (nitpicky), and every page written."""
    site, proc = build
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert proc.returncode == 0 and not warnings, "\n".join(warnings[:50]) or proc.stderr[-5000:]
    for page in _source_pages():
        assert (site / f"{page}.html").is_file(), page


# ------------------------------------------------------------------ the site speaks of the product
#: The word the pages, sources and tests must not use for a stretch of work (spelled in two parts so
#: that this file does not contain it).
WORK_WORD = "sess" + "ion"
#: Lines that may keep it: a genuine technical term (pytest's fixture scope).
TECHNICAL = (re.compile(r"""scope=["']""" + WORK_WORD + r"""["']"""),)
#: Where the word is looked for: the site's sources, the package, the tests, the README.
SOURCES = ("docs", "notebooks", "offload_examples", "tests", "conf.py", "README.md")
#: A commit id as prose would quote one: 7 to 40 hex digits, at least one digit and one letter.
COMMIT = re.compile(r"(?<![\w./#-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/-])")


def _source_files() -> list[Path]:
    files = []
    for name in SOURCES:
        path = ROOT / name
        files += [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()
                                                 and p.suffix in (".py", ".md", ".ipynb", ".txt", ".json", ".log", ".css")]
    return sorted(f for f in files if "__pycache__" not in f.parts)


def test_sources_speak_of_the_product():
    """No page, notebook (sources and stored outputs), evidence file, module, test or README speaks
    of a stretch of work: the site says what is true now."""
    found = []
    for path in _source_files():
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if WORK_WORD in line.lower() and not any(t.search(line) for t in TECHNICAL):
                found.append(f"{rel}:{number}: {line.strip()[:120]}")
    assert not found, "\n".join(found)


def _page_texts(site: Path) -> dict[str, str]:
    """The text a reader sees on every page of the built site (the article, scripts and styles left out)."""
    texts = {}
    for page in sorted(site.rglob("*.html")):
        rel = page.relative_to(site).as_posix()
        if rel.startswith(("_", ".")) or rel in ("index.html", "search.html", "genindex.html", "py-modindex.html"):
            continue
        html = page.read_text()
        body = re.search(r"<article[^>]*>(.*)</article>", html, re.S)
        html = re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", body.group(1) if body else html, flags=re.S)
        texts[rel] = re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html)))
    return texts


def test_pages_do_not_speak_of_work_history(site):
    """The rendered text of every page: no stretches of work and no commit ids (those belong in the
    evidence folders' READMEs)."""
    texts = _page_texts(site)
    assert len(texts) >= len(_source_pages())
    found = [f"{page}: ...{text[max(0, m.start() - 60):m.end() + 60]}..." for page, text in texts.items()
             for m in (*re.finditer(WORK_WORD, text, re.I), *COMMIT.finditer(text))]
    assert not found, "\n".join(found)


def test_commit_pattern():
    assert [m.group(0) for m in COMMIT.finditer("at caeb103, fb08e7f and 0123abcd; not 1234567, cafebabe, 1.5e10")] \
        == ["caeb103", "fb08e7f", "0123abcd"]


# --------------------------------------------------------------------------------- the evidence
EVIDENCE = ROOT / "docs" / "evidence"
#: What the evidence may weigh in all: it travels with every run of the working tree.
EVIDENCE_BYTES = 3 * 2**20


def _stored_sources() -> dict[str, str]:
    for node in ast.parse((ROOT / "conf.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "stored_sources" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("conf.py defines no stored_sources")


def _referring_texts() -> dict[str, str]:
    """Every text that may refer to an evidence file: conf.py's stored sources, the pages and the
    notebooks' cells (their sources)."""
    texts = {f"stored_sources[{k!r}]": v for k, v in _stored_sources().items()}
    for page in (ROOT / "docs").rglob("*.md"):
        if EVIDENCE not in page.parents:
            texts[page.relative_to(ROOT).as_posix()] = page.read_text()
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        texts[nb.relative_to(ROOT).as_posix()] = "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"])
    return texts


def test_every_stored_source_and_evidence_path_exists():
    """A ``{stored}`` key or a page naming an evidence file that is not there fails."""
    missing = [f"stored_sources[{k!r}]: {v}" for k, v in _stored_sources().items()
               if not (ROOT / v.partition("#")[0]).is_file()]
    for where, text in _referring_texts().items():
        for m in re.finditer(r"evidence/([\w.-]+(?:/[\w.-]+)*)", text):
            if not (EVIDENCE / m.group(1).rstrip(".")).exists():
                missing.append(f"{where}: evidence/{m.group(1)}")
    assert not missing, "\n".join(missing)


def test_every_evidence_file_is_quoted_or_shown():
    """Each evidence folder holds a README (command, commit, GPU, software, date) and only files that
    a page, a notebook or a ``{stored}`` key refers to; all of it together stays small."""
    texts = "\n".join(_referring_texts().values())
    unused, readmes = [], []
    for path in sorted(p for p in EVIDENCE.rglob("*") if p.is_file()):
        rel = path.relative_to(EVIDENCE).as_posix()
        if path.name == "README.md":
            readme = path.read_text().lower()
            readmes.append(path.parent.name)
            absent = [w for w in ("gpu", "commit", "date", "torch") if w not in readme]
            absent += [] if re.search(r"`[^`]*\b(python|pytest)\b", readme) else ["a command"]
            assert not absent, f"evidence/{rel} does not say: {absent}"
        elif f"evidence/{rel}" not in texts:
            unused.append(rel)
    assert not unused, f"evidence no page, notebook or stored source refers to: {unused}"
    folders = sorted(p.name for p in EVIDENCE.iterdir() if p.is_dir())
    assert readmes and set(readmes) == set(folders), f"folders without a README: {set(folders) - set(readmes)}"
    total = sum(p.stat().st_size for p in EVIDENCE.rglob("*") if p.is_file())
    assert total <= EVIDENCE_BYTES, f"docs/evidence holds {total / 2**20:.1f} MiB, more than {EVIDENCE_BYTES / 2**20:.0f}"


# ------------------------------------------------------------------------------ stored outputs
#: What no stored output may show: machine paths, other libraries' warnings.
NOT_IN_OUTPUTS = re.compile(r"/tmp/|/root/|/home/|/opt/|site-packages|\b(?:Runtime|User|Deprecation|Future)Warning\b|\bJax\b")


def test_stored_outputs_hold_no_machine_paths_or_third_party_warnings():
    found = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            for out in cell.get("outputs", []):
                text = out.get("text") or out.get("data", {}).get("text/plain") or ""
                for line in ("".join(text) if isinstance(text, list) else text).splitlines():
                    if NOT_IN_OUTPUTS.search(line):
                        found.append(f"{nb.name}, cell {i}: {line[:120]}")
    assert not found, "\n".join(found)


def test_the_runner_cleans_outputs(tmp_path):
    """What the notebook runner keeps of a stream: this package's warnings (their paths relative),
    nothing of other libraries' warnings, file names instead of temporary paths."""
    from offload_examples.instruments.notebooks import clean_text

    root = tmp_path / "repo"
    text = (f"/site/transformer_engine/__init__.py:130: RuntimeWarning: Detected a Jax installation\n"
            f"  warnings.warn(\n"
            f"step 1 done\n"
            f"{root}/offload_examples/core/engine.py:12: OffloadWarning: kept a tensor\n"
            f"  warnings.warn(\n"
            f"/venv/lib/python3.12/site-packages/torch/profiler/profiler.py:224: UserWarning: cycles\n"
            f"  _warn_once(\n"
            f"wrote /tmp/tmpbugwj_cd/dist.json\n")
    assert clean_text(text, root) == ("step 1 done\n"
                                      "offload_examples/core/engine.py:12: OffloadWarning: kept a tensor\n"
                                      "  warnings.warn(\n"
                                      "wrote dist.json\n")


def test_docs_entry_page_at_the_root(site):
    """``<out>/index.html`` exists and leads to the root document, which lives in docs/."""
    entry = (site / "index.html").read_text()
    assert 'http-equiv="refresh"' in entry and 'href="docs/index.html"' in entry


def test_api_reference_is_complete(site):
    """Every module of the package is in the reference, and so is every name a module's ``__all__``
    lists with a docstring (or a ``#:`` comment), under the name users import it by."""
    import inspect
    import pkgutil
    import zlib

    from sphinx.pycode import ModuleAnalyzer

    import offload_examples as root

    body = zlib.decompress((site / "objects.inv").read_bytes().split(b"\n", 4)[4]).decode()
    documented = {line.split(" ", 1)[0] for line in body.splitlines() if line.split(" ", 2)[1].startswith("py:")}
    by_root = {id(getattr(root, name)): f"{root.__name__}.{name}" for name in root.__all__}
    missing = []
    for info in pkgutil.walk_packages(root.__path__, f"{root.__name__}."):
        if info.name.endswith(".__main__"):
            continue
        module = importlib.import_module(info.name)
        if info.name not in documented:
            missing.append(info.name)
        comments = ModuleAnalyzer.for_module(info.name).find_attr_docs()
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if id(obj) in by_root and (inspect.isclass(obj) or inspect.isfunction(obj)):
                expected = by_root[id(obj)]
            elif (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ != info.name:
                continue  # imported: documented where it is defined
            elif obj.__doc__ if inspect.isclass(obj) or inspect.isfunction(obj) else False:
                expected = f"{info.name}.{name}"
            elif ("", name) in comments:
                expected = f"{info.name}.{name}"
            else:
                continue  # nothing written about it: autodoc leaves it out, and so may the reference
            if expected not in documented:
                missing.append(expected)
    assert not missing, f"not in the API reference (docs/api.md, docs/api/**/*.md): {missing}"


@pytest.mark.parametrize("snippet", sorted((ROOT / "docs" / "snippets").glob("*.py")), ids=lambda p: p.name)
def test_docs_snippet_runs(snippet, capsys):
    runpy.run_path(str(snippet), run_name="__main__")
    assert capsys.readouterr().out.strip(), "a snippet shows its result"


def test_docs_code_blocks_come_from_tested_files():
    """Code on the site is either included from a file the tests run, or not Python at all."""
    for page in (ROOT / f"{p}.md" for p in _source_pages() if p.startswith("docs/")):
        for lang in re.findall(r"^```[ \t]*(\S*)", page.read_text(), re.M):
            assert not lang or lang.startswith("{"), f"{page.name}: inline ```{lang} block; use literalinclude"


def test_readme_example_runs():
    """The README's API example runs as copied: in a fresh interpreter, with nothing around it."""
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    check = ("\nassert ctx.offloaded_bytes > 0"
             "\nassert all(p.grad is None for layer in layers for p in layer.parameters())  # reset after each step\n")
    proc = subprocess.run([sys.executable, "-c", code + check], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Failed to initialize NumPy" not in proc.stderr


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server(site):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


#: How to install the browser (what `make test` prints where it cannot install it itself).
BROWSER_HINT = "sudo apt-get install --no-install-recommends chromium chromium-driver"
#: The page width the layout is checked at: a laptop screen, both of the theme's sidebars shown.
WIDTH = 1400
#: The most columns a line of code on a page may take: what the content column shows at ``WIDTH``
#: without scrolling.
CODE_COLUMNS = 88
#: Pictures are drawn for the content column: one shown at less than this share of its natural
#: width is a large picture squeezed, its text too small to read.
MIN_IMAGE_SCALE = 0.5
#: The tallest a page of each kind may be at ``WIDTH``, in pixels: an API page longer than this is
#: split by module, a page of prose into pages.
MAX_HEIGHT = {"api": 15_000, "page": 25_000, "notebook": 20_000, "source": 25_000}


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
                 "--disable-dev-shm-usage", f"--window-size={WIDTH},900"):
        opts.add_argument(flag)
    b = webdriver.Chrome(options=opts, service=Service(driver))
    yield b
    b.quit()


# What one page looks like in the browser, measured in one script: the page must not need the
# network, must not show LaTeX source, must lay its formulas out as math, and must keep its wide
# tables, code blocks, formulas and images inside the content column (scrolling, if wider). Also
# its height, its code blocks' widths (each line's columns, and whether the block scrolls), each
# picture's natural and shown width, the anchors it has, its links and the navigation's entries.
PAGE_FACTS = r"""
const art = document.querySelector('article');
const prose = art ? art.cloneNode(true) : document.createElement('div');
prose.querySelectorAll('pre, code, script, style, math').forEach(e => e.remove());
const here = location.origin;
const outside = [...document.querySelectorAll('script[src], link[rel~="stylesheet"][href], img[src], iframe[src]')]
  .map(e => e.src || e.href).filter(u => new URL(u, location.href).origin !== here);
const maths = art ? [...art.querySelectorAll('math')] : [];
const unlaid = maths.filter(m => { const r = m.getBoundingClientRect(); return !(r.width > 0 && r.height > 0); })
  .map(m => m.textContent);
const flat = [...(art ? art.querySelectorAll('mfrac') : [])].filter(f => f.children.length === 2 &&
  f.children[0].getBoundingClientRect().bottom > f.children[1].getBoundingClientRect().top + 1)
  .map(f => f.textContent);
const column = art && art.getBoundingClientRect();
const overflowing = [];
for (const el of art ? art.querySelectorAll('table, pre, div.math, img, .highlight') : []) {
  if (el.getBoundingClientRect().width === 0) continue;   // empty prompts of notebook cells
  let box = el;                                           // what shows: el or the container scrolling it
  for (let a = el; a && a !== art; a = a.parentElement) {
    if (['auto', 'scroll', 'hidden'].includes(getComputedStyle(a).overflowX)) { box = a; break; }
  }
  const r = box.getBoundingClientRect();
  if (r.left < column.left - 1 || r.right > column.right + 1)
    overflowing.push(`${el.tagName.toLowerCase()}.${el.className} spans ${Math.round(r.left)}..${Math.round(r.right)}`
                     + ` in a column ${Math.round(column.left)}..${Math.round(column.right)}`);
}
return {
  heading: (document.querySelector('article h1') || {}).textContent || null,
  broken: [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src),
  images: art ? art.querySelectorAll('img').length : 0,
  maths: maths.length, unlaid, flat, outside, overflowing,
  latex: (prose.textContent.match(/\\(frac|cdot|le|ge|leq|geq|sum|mathrm|text|begin|end|\[|\(|\]|\))|\$\$/g) || []),
  pageWidth: document.documentElement.scrollWidth, viewport: window.innerWidth,
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  height: document.documentElement.scrollHeight,
  code: [...(art ? art.querySelectorAll('pre') : [])].filter(p => p.clientWidth > 0).map(p => ({
    scrolls: p.scrollWidth > p.clientWidth, scrollWidth: p.scrollWidth, clientWidth: p.clientWidth,
    columns: Math.max(0, ...p.textContent.split('\n').map(line => line.length)),
    start: p.textContent.trim().split('\n')[0].slice(0, 50)})),
  pictures: [...(art ? art.querySelectorAll('img') : [])].filter(i => i.naturalWidth > 0)
    .map(i => ({src: i.src.split('/').pop(), natural: i.naturalWidth, shown: i.getBoundingClientRect().width}))
    .filter(i => i.shown > 0),
  ids: [...document.querySelectorAll('[id]')].map(e => e.id)
    .concat([...document.querySelectorAll('a[name]')].map(a => a.name)),
  nav: [...document.querySelectorAll('.sidebar-tree a.reference')].map(a => [a.textContent.trim(), a.href]),
};
"""


def _page_kind(page: str) -> str:
    """Which height bound holds for ``page``: an API page, a notebook, a source page or another page."""
    if page == "docs/api.html" or page.startswith("docs/api/"):
        return "api"
    if page.startswith("notebooks/"):
        return "notebook"
    return "source" if page.startswith("_modules/") else "page"


def _anchors(url: str) -> set[str] | None:
    """The ids of the page at ``url`` as served (``None``: it is not served)."""
    try:
        with urlopen(url) as r:
            body = r.read().decode("utf-8", "replace") if r.status == 200 else None
    except OSError:
        return None
    return None if body is None else {unescape(m) for m in re.findall(r'\b(?:id|name)="([^"]+)"', body)}


def test_every_page_renders_with_images_and_links(browser, site, server):  # browser first: skips before the build
    """Every page of the site, the source pages (``_modules/``) included, in a browser at ``WIDTH``.

    Asserted on every page: a heading, images loaded (as many as a notebook stores), nothing from
    the network, formulas laid out as math, nothing wider than the content column, a height within
    its kind's bound (``MAX_HEIGHT``), pictures shown at ``MIN_IMAGE_SCALE`` of their width or
    more, and every link inside the site leading to a page that is served and to an anchor that
    page has. On the documentation's pages (``docs/``) code also fits in ``CODE_COLUMNS`` and no
    code block scrolls sideways. Reported, not asserted: the notebooks' wider cells (their
    stored sources are what a GPU run executed) and every page's height.
    """
    # The search and index pages are left out, and the entry page, which forwards (test below).
    pages = sorted(rel for rel in (p.relative_to(site).as_posix() for p in site.rglob("*.html"))
                   if rel.split("/")[0] not in ("_static", "_sources", "_images") and not rel.startswith(".")
                   and rel not in ("search.html", "genindex.html", "index.html"))
    assert len(pages) >= 8 and any(p.startswith("_modules/") for p in pages)
    images_seen, maths_seen, problems, wide_cells, heights, links, anchors = 0, 0, [], [], {}, {}, {}
    nav: list[tuple[str, str]] = []
    for page in pages:
        url = urljoin(server, page)
        browser.get(url)
        assert browser.execute_script("return document.readyState") == "complete"
        facts = browser.execute_script(PAGE_FACTS)
        checks = [
            (facts["heading"], "no heading rendered"),
            (not facts["broken"], f"images that did not load: {facts['broken']}"),
            (facts["images"] >= _stored_images(page), f"shows {facts['images']} images, its notebook stores more"),
            (not facts["outside"], f"needs the network (the site must work offline): {facts['outside']}"),
            (not facts["latex"], f"LaTeX source shown as text instead of math: {facts['latex']}"),
            (facts["maths"] >= _written_math(page), f"{facts['maths']} formulas rendered, its source has more"),
            (not facts["unlaid"], f"formulas the browser did not lay out: {facts['unlaid']}"),
            (not facts["flat"], f"fractions not drawn as fractions: {facts['flat']}"),
            (facts["pageWidth"] <= facts["viewport"], f"the page scrolls sideways at {WIDTH} px"),
            (not facts["overflowing"], f"wider than the content column at {WIDTH} px: {facts['overflowing']}"),
        ]
        kind, height = heights[page] = _page_kind(page), facts["height"]
        checks.append((height <= MAX_HEIGHT[kind],
                       f"{height} px high at {WIDTH} px wide, above the {MAX_HEIGHT[kind]} px of a page of kind {kind!r}"))
        checks += [(pic["shown"] >= MIN_IMAGE_SCALE * pic["natural"],
                    f"picture {pic['src']} shown {pic['shown']:.0f} px wide, {pic['shown'] / pic['natural']:.0%} of its "
                    f"{pic['natural']} px: draw it narrower") for pic in facts["pictures"]]
        wide = [f"{c['columns']} columns{', scrolls' if c['scrolls'] else ''}: {c['start']}" for c in facts["code"]
                if c["scrolls"] or c["columns"] > CODE_COLUMNS]
        if page.startswith("docs/"):
            checks += [(False, f"code wider than {CODE_COLUMNS} columns or scrolling sideways: {w}") for w in wide]
        elif page.startswith("notebooks/"):
            wide_cells += [f"{page}: {w}" for w in wide]
        problems += [f"{page}: {message}" for ok, message in checks if not ok]
        images_seen += facts["images"]
        maths_seen += facts["maths"]
        anchors[url] = set(facts["ids"])
        links[page] = facts["links"]
        nav = nav or [(label, urldefrag(href)[0]) for label, href in facts["nav"]]
    # Links and anchors, once the anchors of every page are known; other files are fetched once each.
    for page, hrefs in links.items():
        for href in dict.fromkeys(hrefs):
            target, fragment = urldefrag(href)
            if urlparse(target).netloc != urlparse(server).netloc:
                continue
            if target not in anchors:
                anchors[target] = _anchors(target)
            if anchors[target] is None:
                problems.append(f"{page}: broken link {href}")
            elif fragment and fragment not in anchors[target] and unquote(fragment) not in anchors[target]:
                problems.append(f"{page}: link to a missing anchor {href}")
    # The navigation: one title for one page.
    titles: dict[str, set[str]] = {}
    for label, href in nav:
        titles.setdefault(" ".join(label.lower().split()), set()).add(href)
    assert nav, "no navigation found (.sidebar-tree)"
    problems += [f"navigation: {len(hrefs)} pages titled {label!r}: {sorted(hrefs)}"
                 for label, hrefs in titles.items() if len(hrefs) > 1]
    report = "\n".join(f"{height:>7} px  {kind:<8} {page}"
                        for page, (kind, height) in sorted(heights.items(), key=lambda kv: -kv[1][1]))
    print(f"page heights at {WIDTH} px wide:\n{report}")
    print(f"notebook code wider than {CODE_COLUMNS} columns (reported, not asserted):\n" + "\n".join(wide_cells))
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)
    assert images_seen >= 1 + sum(_stored_images(f"notebooks/{nb.stem}.html") for nb in (ROOT / "notebooks").glob("*.ipynb"))
    assert maths_seen >= 1, "the hardware page's inequality, at least, is rendered as math"


def test_entry_page_opens_the_docs(browser, site, server):
    """The root of the output forwards to the documentation's first page."""
    browser.get(server)
    deadline = time.monotonic() + 10
    while not browser.current_url.endswith("docs/index.html") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert browser.current_url == urljoin(server, "docs/index.html")
    assert browser.execute_script("const h = document.querySelector('article h1'); return h && h.textContent")


def _stored_images(page: str) -> int:
    """How many images the notebook behind ``page`` has in its stored outputs (0 for other pages)."""
    nb = ROOT / Path(page).with_suffix(".ipynb")
    if not page.startswith("notebooks/") or not nb.is_file():
        return 0
    cells = json.loads(nb.read_text())["cells"]
    return sum("image/png" in out.get("data", {}) for c in cells for out in c.get("outputs", []))


def _written_math(page: str) -> int:
    """How many formulas the source of ``page`` writes: ``{math}`` blocks and roles in Markdown
    pages, ``$...$`` and ``$$...$$`` in notebooks' Markdown cells (0 for generated pages)."""
    source = ROOT / Path(page).with_suffix(".md")
    if source.is_file():
        return len(re.findall(r"\{math\}", source.read_text()))
    nb = source.with_suffix(".ipynb")
    if not nb.is_file():
        return 0
    text = "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "markdown")
    text = re.sub(r"```.*?```|`[^`]*`", "", text, flags=re.S)  # dollars in code are not math
    return len(re.findall(r"\$\$.+?\$\$|\$[^$\s][^$]*?\$", text, flags=re.S))


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
CPU_SCOPE = {"layers", "x", "k", "batches", "optimizer", "get_cpu_offload_context"}


def test_code_in_notebook_text_runs():
    """Code blocks in the notebooks' prose import what they use; those that need no GPU run as written.
    A block that steps an optimizer shows the whole loop: every weight moved, every gradient reset."""
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
        before = [layer.weight.detach().clone() for layer in layers]
        x = torch.randn(2, 16, requires_grad=True)
        optimizer = torch.optim.SGD([p for layer in layers for p in layer.parameters()], lr=0.1)
        scope = {"layers": layers, "x": x, "k": 2, "batches": [torch.randn(2, 16) for _ in range(2)],
                 "optimizer": optimizer, "get_cpu_offload_context": get_cpu_offload_context}
        exec(compile(code, name, "exec"), scope)
        if "optimizer" in free:
            assert all(not torch.equal(layer.weight, w) for layer, w in zip(layers, before)), name
            assert all(p.grad is None for layer in layers for p in layer.parameters()), name
        else:
            scope["x"].sum().backward()
            assert all(layer.weight.grad is not None for layer in layers), name
        ran += 1
    assert ran, "the basic notebook shows the lines a training loop needs"
