"""Sphinx helpers for this site (loaded by ``conf.py``); everything works offline.

- **Math as MathML.** LaTeX from ``{math}`` blocks, ``:math:`` roles and notebook Markdown is
  converted to MathML when the site is built (with the ``latex2mathml`` package), and the browser
  draws it: no MathJax, no CDN, no JavaScript. LaTeX the converter does not know is a build
  warning (an error under ``-W``), never raw text on the page.
- **References to re-exported names.** The public classes are documented once, under the name
  users import (``offload_examples.OffloadEngine``); docstrings may name them where they are
  defined (``offload_examples.core.engine.OffloadEngine``) or by a name their module imports. A
  reference that Sphinx cannot find is imported, and resolved to the documented name of the
  *same object* (members: of the same class or one of its bases). Nothing is guessed by name.
- **Each object on one page.** ``automodule`` skips the classes and functions the package root
  exports (their pages document them as ``offload_examples.X``), the classes and functions a
  module imports, even when its ``__all__`` lists them (they are documented where they are
  defined; autodoc's explicit ``:members:`` lists do not help, since ``autodoc_default_options``
  replaces them), and methods whose only docstring is inherited from outside the package
  (``nn.Module.forward``'s).
- **Source pages link back to the right anchor.** ``viewcode``'s ``[docs]`` link after each
  object of a ``_modules/`` page is built from the module name the *first* documented object of
  that module was documented under (Sphinx issue 6651): once ``offload_examples.OffloadEngine``
  is documented, every other object of ``core/engine.py`` links to ``#offload_examples.<name>``,
  an anchor that does not exist. Each link is pointed at the anchor the object has. And the
  list of source pages (``_modules/index.html``) names only modules that have one: viewcode also
  lists the modules whose source it could not read (``builtins``, for a type alias such as
  ``tuple[...]``), linking to pages it never writes.
- **Attribute docstrings are prose.** Napoleon reads the first line of an attribute's docstring
  as ``type: description``; here those lines are sentences, so napoleon leaves attributes alone.
- **A quiet build.** myst-parser logs its whole configuration at the info level each time a
  builder starts; ``QuietMyst`` drops that one record, so a build prints only its progress.
- **An entry page at the root** of the output (``index.html``) that forwards to the root
  document, which lives in ``docs/``.
- **Numbers from the stored data.** ``{stored}`bench:models[A].runs[engine,k=2].overhead|+pct```
  writes a value of a stored result into the prose when the site is built (see
  :func:`stored_value`); a value that is not there fails the build, and the page is rebuilt when
  its data changes. ``tests/test_prose_numbers.py`` checks the numbers the prose writes itself.
- **Tables from the stored data.** ``{bench-table} model-A`` writes a model's rows of a stored
  benchmark (a key of ``stored_sources``) as the benchmark's own report does
  (:func:`offload_examples.instruments.bench.tables.model_table`), in the columns and for the
  strategies the page names.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging as logging_std
import re
import xml.etree.ElementTree as ET
from html import escape, unescape
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.math import get_node_equation_number

logger = logging.getLogger(__name__)

PACKAGE = "offload_examples"


# ---------------------------------------------------------------------------------------- math
def _mathml(latex: str, display: str) -> str:
    """``latex`` as a MathML element; ``ValueError`` when the converter cannot render all of it."""
    from latex2mathml.converter import convert

    try:
        markup = convert(latex, display=display)
    except Exception as err:  # the converter's own errors say little: name the formula
        raise ValueError(f"cannot convert {latex!r} to MathML: {err!r}") from err
    try:
        tree = ET.fromstring(markup)
    except ET.ParseError as err:
        raise ValueError(f"{latex!r} converts to malformed MathML ({err})") from err
    unknown = [t for t in tree.itertext() if "\\" in t]
    if unknown:
        raise ValueError(f"{latex!r}: the MathML converter does not know {', '.join(unknown)}")
    return markup


def _fallback(self, node: nodes.Element, err: ValueError) -> str:
    logger.warning("%s", err, location=node, type="math", subtype="mathml")
    return f'<code class="math-source">{escape(node.astext())}</code>'


def visit_math(self, node: nodes.math) -> None:
    self.body.append(self.starttag(node, "span", "", CLASS="math notranslate nohighlight"))
    try:
        self.body.append(_mathml(node.astext(), "inline"))
    except ValueError as err:
        self.body.append(_fallback(self, node, err))
    self.body.append("</span>")
    raise nodes.SkipNode


def visit_displaymath(self, node: nodes.math_block) -> None:
    self.body.append(self.starttag(node, "div", CLASS="math notranslate nohighlight"))
    if node["number"]:
        self.body.append(f'<span class="eqno">({get_node_equation_number(self, node)})')
        self.add_permalink_ref(node, "Link to this equation")
        self.body.append("</span>")
    # Blank lines separate equations (as for MathJax); a part with line breaks is one split equation.
    for part in (p for p in node.astext().split("\n\n") if p.strip()):
        latex = rf"\begin{{split}}{part}\end{{split}}" if r"\\" in part else part
        try:
            self.body.append(_mathml(latex, "block"))
        except ValueError as err:
            self.body.append(_fallback(self, node, err))
    self.body.append("</div>\n")
    raise nodes.SkipNode


# ------------------------------------------------------------------------------------ references
def _import(dotted: str) -> Any:
    """The object named ``dotted`` (a module, or attributes of one), or ``None``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


_CACHE: dict[int, dict] = {}


def _is_type_alias(obj: Any) -> bool:
    return obj is not None and not inspect.isclass(obj) and type(obj).__module__ in ("typing", "types")


def _documented(env) -> dict[int, str]:
    """``id(object) -> documented name`` for the package's documented modules, classes and functions."""
    cache = _CACHE.setdefault(id(env), {})
    objects = env.get_domain("py").objects
    if cache.get("count") != len(objects):
        index: dict[int, str] = {}
        for name, entry in objects.items():
            if name.startswith(PACKAGE) and entry.objtype in ("module", "class", "exception", "function"):
                obj = _import(name)
                if obj is not None:
                    index.setdefault(id(obj), name)
        cache.update(count=len(objects), index=index)
    return cache["index"]


def _canonical(env, dotted: str) -> str | None:
    """The documented name of what ``dotted`` names, when that is one of the package's objects."""
    objects = env.get_domain("py").objects
    if dotted in objects:
        return dotted
    index = _documented(env)
    parts = dotted.split(".")
    # The longest prefix that is a documented object, then the rest as its member (or a base's).
    for cut in range(len(parts), 0, -1):
        head = _import(".".join(parts[:cut]))
        if head is None or id(head) not in index:
            continue
        rest = parts[cut:]
        if not rest:
            return index[id(head)]
        owners = inspect.getmro(head) if inspect.isclass(head) else (head,)
        for owner in owners:
            name = index.get(id(owner))
            if name and ".".join([name, *rest]) in objects:
                return ".".join([name, *rest])
        return None
    return None


def resolve_reexported(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    module, cls = node.get("py:module"), node.get("py:class")
    contexts = [target]
    if module:
        if cls:
            contexts.append(f"{module}.{cls}.{target}")
            # Docstrings are written in their defining module: look there too.
            owner = _import(f"{module}.{cls}")
            if inspect.isclass(owner) and owner.__module__.startswith(PACKAGE):
                contexts.append(f"{owner.__module__}.{owner.__qualname__}.{target}")
                contexts.append(f"{owner.__module__}.{target}")
        contexts.append(f"{module}.{target}")
        # A module of a subpackage may name what its package exports (the planner's search names apply_plan).
        parts = module.split(".")
        contexts += [".".join([*parts[:cut], target]) for cut in range(len(parts) - 1, 1, -1)]
    contexts.append(f"{PACKAGE}.{target}")  # a name the package root exports
    for dotted in contexts:
        if dotted.startswith(PACKAGE) and _is_type_alias(_import(dotted)):
            return contnode  # TypeVars and aliases such as Literal[...]: their name, as plain text
        if not dotted.startswith(PACKAGE):
            continue
        name = _canonical(env, dotted)
        if name:
            return env.get_domain("py").resolve_xref(
                env, node["refdoc"], app.builder, node["reftype"], name, node, contnode)
    return None


# ------------------------------------------------------------------------------------ autodoc
def _exported_by_root(obj: Any) -> bool:
    root = importlib.import_module(PACKAGE)
    return (inspect.isclass(obj) or inspect.isfunction(obj)) and any(
        getattr(root, name, None) is obj for name in getattr(root, "__all__", ()))


def _doc_from_outside(obj: Any) -> bool:
    """A method without a docstring of its own that would show one inherited from another package."""
    func = inspect.unwrap(getattr(obj, "__func__", obj))
    if not inspect.isfunction(func) or func.__doc__ is not None or not func.__module__.startswith(PACKAGE):
        return False
    owner = _import(f"{func.__module__}.{func.__qualname__.rsplit('.', 1)[0]}")
    if not inspect.isclass(owner):
        return False
    for base in inspect.getmro(owner)[1:]:
        inherited = base.__dict__.get(func.__name__)
        if inherited is not None and getattr(inherited, "__doc__", None):
            return not base.__module__.startswith(PACKAGE)
    return False


def _documented_module(env) -> str | None:
    """The module whose members autodoc is choosing (Sphinx 9: ``current_document``; before: ``temp_data``)."""
    current = getattr(env, "current_document", None)
    name = getattr(current, "autodoc_module", None)
    return name or getattr(env, "temp_data", {}).get("autodoc:module")


def _imported_into(obj: Any, module: str | None) -> bool:
    """A class or function that ``module`` imports from elsewhere (listed in its ``__all__`` or not)."""
    return bool(module) and (inspect.isclass(obj) or inspect.isfunction(obj)) \
        and getattr(obj, "__module__", module) != module


def skip_member(app, what, name, obj, skip, options):
    if skip:
        return None
    if what == "module" and _exported_by_root(obj):
        return True  # documented as offload_examples.<name>
    if what == "module" and _imported_into(obj, _documented_module(app.env)):
        return True  # documented where it is defined (or, from outside the package, not here)
    if what == "class" and _doc_from_outside(obj):
        return True
    return None


def _napoleon_without_attributes(app) -> None:
    from sphinx.ext import napoleon

    for listener in list(app.events.listeners.get("autodoc-process-docstring", [])):
        if listener.handler is napoleon._process_docstring:
            app.disconnect(listener.id)

            def process(app, what, name, obj, options, lines, _napoleon=listener.handler):
                if what not in ("attribute", "data", "property"):
                    _napoleon(app, what, name, obj, options, lines)

            app.connect("autodoc-process-docstring", process, priority=listener.priority)


# ------------------------------------------------------------------------ viewcode's back-links
_BACKLINK = re.compile(r'(<div class="viewcode-block" id="([^"]+)">\s*<a class="viewcode-back" href=")([^"#]*)#([^"]*)(")')


def _anchor(env, modname: str, name: str, docname: str) -> tuple[str, str] | None:
    """``(docname, anchor)`` of the object ``name`` of module ``modname`` (preferring ``docname``)."""
    objects = env.get_domain("py").objects
    candidates = [f"{modname}.{name}", _canonical(env, f"{modname}.{name}")]
    found = [objects[c] for c in candidates if c and c in objects]
    for entry in sorted(found, key=lambda e: e.docname != docname):
        return entry.docname, entry.node_id
    return None


def fix_viewcode_backlinks(app, pagename, templatename, context, doctree) -> None:
    """Point each ``[docs]`` link of a ``_modules/`` page at the anchor its object has."""
    if not pagename.startswith("_modules/") or "body" not in context:
        return
    modname = pagename.removeprefix("_modules/").replace("/", ".")
    entry = getattr(app.env, "_viewcode_modules", {}).get(modname)
    if not entry:
        return
    used = entry[2]

    def fix(m: re.Match) -> str:
        name = unescape(m.group(2))
        found = _anchor(app.env, modname, name, used.get(name, ""))
        if found is None:
            return m.group(0)  # left as viewcode wrote it: the browser test reports it
        docname, anchor = found
        return f"{m.group(1)}{app.builder.get_relative_uri(pagename, docname)}#{escape(anchor)}{m.group(5)}"

    context["body"] = _BACKLINK.sub(fix, context["body"])


def drop_unread_modules(app) -> list:
    """Before viewcode writes its pages: forget the modules it could not read (it would list them)."""
    modules = getattr(app.env, "_viewcode_modules", {})
    for modname in [name for name, entry in modules.items() if entry is False]:
        del modules[modname]
    return []


# -------------------------------------------------------------------------------- stored numbers
# Every measured number in the prose comes from a file of the repository: a JSON result or a log in
# docs/evidence/ (the benchmark's bench.json, say), or what a notebook printed (its stored outputs).
# conf.py's ``stored_sources`` names those files; the prose writes
#
#   {stored}`bench:models[A].runs[engine,k=2].overhead|+pct`   a JSON value, formatted: "+1.4 %"
#   {stored}`concepts:"d2h pageable"`                           a number a notebook printed: "13.5 GB/s"
#
# A source may name a part of a JSON file ("docs/evidence/h200-bench/bench.json#models[A]" for model
# A's results). A JSON path is keys and list positions separated by dots; ``[...]`` picks the one
# element of a list whose fields match (``key=value``, or a bare value that any field equals; ``\,``
# is a comma inside a value), or a key of a dict. A text source (a notebook's outputs, a Markdown or
# text file) takes a quoted label that occurs once in it and gives the first number after the label
# on its line, as printed (``"label"#2``: the second). Anything that does not resolve to exactly one
# value is an error.

class StoredValueError(ValueError):
    """A ``{stored}`` reference that does not name exactly one value of its source."""


#: How values are written: name -> (scale, decimals, unit, signed). ``|name:d`` sets the decimals.
FORMATS: dict[str, tuple[Any, int, str, bool]] = {
    "gib": (lambda v: v / 2**30, 2, " GiB", False),     # bytes
    "mib": (lambda v: v / 2**20, 2, " MiB", False),     # bytes
    "gb": (lambda v: v / 1e9, 2, " GB", False),         # bytes, decimal
    "ms": (lambda v: v, 1, " ms", False),               # milliseconds
    "s": (lambda v: v, 2, " s", False),                 # seconds
    "gbps": (lambda v: v, 1, " GB/s", False),           # GB/s
    "pct": (lambda v: 100 * v, 1, " %", False),         # a ratio: 0.997 -> 99.7 %
    "+pct": (lambda v: 100 * v, 1, " %", True),         # a relative change: 0.014 -> +1.4 %
    "excess": (lambda v: 100 * (v - 1), 1, " %", False),  # a ratio's excess over 1: 1.05 -> 5.0 %
    "+excess": (lambda v: 100 * (v - 1), 1, " %", True),  # the same, signed: 1.009 -> +0.9 %
    "num": (lambda v: v, 0, "", False),                 # a plain number
}

_NUMBER = r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
_PRINTED = re.compile(_NUMBER + r"(?:\s?(?:GB/s|GiB|MiB|KiB|GB|MB|KB|ms|µs|s|%|B)(?![\w/]))?")
_LOADED: dict[tuple[str, int], Any] = {}


def _notebook_text(raw: str) -> str:
    """What a notebook's stored outputs show as text: streams and plain-text results."""
    parts = []
    for cell in json.loads(raw).get("cells", []):
        for out in cell.get("outputs", []):
            text = out.get("text") if out.get("output_type") == "stream" else out.get("data", {}).get("text/plain")
            if text and not (out.get("data", {}).keys() & {"image/png", "image/svg+xml"}):
                parts.append(text if isinstance(text, str) else "".join(text))
    return "\n".join(parts)


def load_stored(path: Path) -> Any:
    """The content of a source file: parsed JSON, or the text of a notebook's outputs, or text."""
    key = (str(path), path.stat().st_mtime_ns)
    if key not in _LOADED:
        raw = path.read_text(encoding="utf-8")
        _LOADED[key] = (json.loads(raw) if path.suffix == ".json"
                        else _notebook_text(raw) if path.suffix == ".ipynb" else raw)
    return _LOADED[key]


def _scalar_equal(field: Any, wanted: str) -> bool:
    if isinstance(field, (dict, list)):
        return False
    if isinstance(field, (int, float)) and not isinstance(field, bool):
        try:
            return float(wanted) == field
        except ValueError:
            return False
    return str(field) == wanted


def _select(items: list, selector: str, where: str) -> Any:
    if re.fullmatch(r"-?\d+", selector):
        return items[int(selector)]
    # fields are separated by commas; "\\," is a comma inside a value ("no offload\\, TE's default path")
    tests = [part.replace("\\,", ",").strip().partition("=") for part in re.split(r"(?<!\\),", selector)]
    found = [item for item in items if isinstance(item, dict) and all(
        _scalar_equal(item.get(k), v) if eq else any(_scalar_equal(f, k) for f in item.values())
        for k, eq, v in tests)]
    if len(found) != 1:
        raise StoredValueError(f"{where}[{selector}] matches {len(found)} elements, not one")
    return found[0]


def lookup(data: Any, path: str) -> Any:
    """The value at ``path`` in parsed JSON (``models[A].runs[engine,k=2].overhead``)."""
    if not re.fullmatch(r"[^.\[\]]+(?:\.[^.\[\]]+|\[[^\]]*\])*", path):
        raise StoredValueError(f"cannot read the path {path!r}: keys.separated.by.dots[selector]")
    steps = list(re.finditer(r"\[([^\]]*)\]|([^.\[\]]+)", path))
    value, where = data, ""
    for m in steps:
        selector, key = m.group(1), m.group(2)
        try:
            if isinstance(value, list):
                value = _select(value, selector if selector is not None else key, where)
            elif isinstance(value, dict):
                value = value[selector if selector is not None else key]
            else:
                raise StoredValueError(f"{where} is a value ({value!r}), it has no {m.group(0)}")
        except (KeyError, IndexError):
            keys = f" (keys: {', '.join(map(str, value))})" if isinstance(value, dict) else ""
            raise StoredValueError(f"{where or 'the source'} has no {m.group(0)}{keys}") from None
        where += m.group(0) if selector is not None or not where else "." + m.group(0)
    return value


def quote(text: str, label: str, nth: int = 1) -> str:
    """The ``nth`` number printed after ``label`` on its line, with its unit, as printed."""
    count = text.count(label)
    if count != 1:
        raise StoredValueError(f"the label {label!r} occurs {count} times in the source, not once")
    start = text.index(label) + len(label)
    line = text[start:].split("\n", 1)[0]
    numbers = [m.group(0) for m in _PRINTED.finditer(line) if not (m.start() and line[m.start() - 1].isalnum())]
    if len(numbers) < nth:
        raise StoredValueError(f"the line of {label!r} has {len(numbers)} numbers after the label, not {nth}")
    return re.sub(r"(?<=\d)%", " %", numbers[nth - 1])  # percentages as the prose writes them


def format_value(value: Any, fmt: str | None) -> str:
    """``value`` as the prose writes it (see :data:`FORMATS`); strings and integers as they are."""
    if fmt is None:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise StoredValueError(f"{value!r} needs a format (|{'|'.join(FORMATS)}|met|span)")
        return str(value)
    name, _, digits = fmt.partition(":")
    if name == "met":  # a target's result
        if not isinstance(value, bool):
            raise StoredValueError(f"|met formats a boolean, not {value!r}")
        return "met" if value else "missed"
    if name == "span":  # a timeline entry: its length
        if not (isinstance(value, dict) and {"start", "end"} <= value.keys()):
            raise StoredValueError(f"|span formats an entry with a start and an end, not {value!r}")
        value, name = value["end"] - value["start"], "ms"
    if name not in FORMATS:
        raise StoredValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)}, met, span)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StoredValueError(f"|{fmt} formats a number, not {value!r}")
    scale, decimals, unit, signed = FORMATS[name]
    decimals = int(digits) if digits else decimals
    return f"{scale(value):{'+' if signed else ''}.{decimals}f}{unit}"


def parse_reference(reference: str) -> tuple[str, str, bool, int, str | None]:
    """``source:path|format`` or ``source:"label"#n`` -> (source, path or label, is a label, n, format)."""
    m = re.fullmatch(r'\s*([\w-]+):(?:"([^"]+)"(?:#(\d+))?|([^|"]+?))\s*(?:\|\s*([+\w]+(?::\d+)?))?\s*', reference)
    if not m:
        raise StoredValueError(f"cannot read {reference!r}: write source:path|format or source:\"label\"")
    source, label, nth, path, fmt = m.groups()
    return source, label if label is not None else path, label is not None, int(nth or 1), fmt or None


def stored_value(reference: str, sources: dict[str, str | Path], root: str | Path = ".") -> tuple[str, Path]:
    """The text a ``{stored}`` reference puts into the prose, and the file it comes from."""
    source, where, is_label, nth, fmt = parse_reference(reference)
    if source not in sources:
        raise StoredValueError(f"unknown source {source!r} (conf.py stored_sources: {', '.join(sources)})")
    file, _, prefix = str(sources[source]).partition("#")  # "bench.json#models[A]": a part of a file
    path = Path(root) / file
    if not path.is_file():
        raise StoredValueError(f"{source!r}: {path} does not exist")
    data = load_stored(path)
    if isinstance(data, str):
        if not is_label:
            raise StoredValueError(f"{reference!r}: {path.name} is text: quote a label, source:\"label\"")
        if fmt is not None:
            raise StoredValueError(f"{reference!r}: a number quoted from text is written as printed (no format)")
        return quote(data, where, nth), path
    if is_label:
        raise StoredValueError(f"{reference!r}: {path.name} is JSON: give a path, not a label")
    if prefix:
        where = prefix + ("" if where.startswith("[") else ".") + where
    return format_value(lookup(data, where), fmt), path


def stored_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    env = inliner.document.settings.env
    try:
        value, path = stored_value(text, env.config.stored_sources, env.srcdir)
    except (StoredValueError, OSError, ValueError) as err:
        msg = inliner.reporter.error(f"{{stored}}`{text}`: {err}", line=lineno)
        return [inliner.problematic(rawtext, rawtext, msg)], [msg]
    env.note_dependency(str(path))  # the page is read again when its data changes
    return [nodes.inline(rawtext, value, classes=["stored"])], []


def _items(option: str | None) -> list[str] | None:
    """An option's list: items separated by semicolons (a strategy's name may hold a comma)."""
    return None if option is None else [item.strip() for item in option.split(";") if item.strip()]


class BenchTable(SphinxDirective):
    """A model's rows of a stored benchmark, as a table.

    The argument is a key of ``stored_sources`` naming one model's results
    (``"model-A": "...bench.json#models[A]"``); ``:columns:`` and ``:strategies:`` (semicolons
    between items) choose what the table shows; ``:failed: no`` leaves out the runs that failed or
    were skipped.
    """

    required_arguments = 1
    option_spec = {"columns": str, "strategies": str, "failed": str}

    def run(self) -> list[nodes.Node]:
        from offload_examples.instruments.bench.tables import COLUMNS, model_table

        key = self.arguments[0]
        sources = self.config.stored_sources
        try:
            if key not in sources:
                raise StoredValueError(f"unknown source {key!r} (conf.py stored_sources: {', '.join(sources)})")
            file, _, prefix = str(sources[key]).partition("#")
            path = Path(self.env.srcdir) / file
            model = lookup(load_stored(path), prefix) if prefix else load_stored(path)
            columns = _items(self.options.get("columns")) or list(COLUMNS)
            unknown = [c for c in columns if c not in COLUMNS]
            if unknown:
                raise StoredValueError(f"unknown columns {unknown} (known: {', '.join(COLUMNS)})")
            text = model_table(model, columns, _items(self.options.get("strategies")),
                               failed=self.options.get("failed", "yes") != "no")
        except (StoredValueError, OSError, ValueError, KeyError, TypeError) as err:
            raise self.error(f"bench-table {key}: {err}") from None
        self.env.note_dependency(str(path))  # the page is read again when its data changes
        container = nodes.container(classes=["bench-table"])
        self.state.nested_parse(StringList(text.splitlines(), source=str(path)), self.content_offset, container)
        return container.children


# ------------------------------------------------------------------------------------ quiet build
class QuietMyst(logging_std.Filter):
    """Drops myst-parser's ``myst vX: MdParserConfig(...)`` line, which it logs on every build."""

    def filter(self, record: logging_std.LogRecord) -> bool:
        return "myst v%s:" not in str(record.msg)


def _quiet_myst() -> None:
    # myst_parser.sphinx_ext.main logs through sphinx.util.logging, whose loggers sit under "sphinx."
    target = logging_std.getLogger("sphinx.myst_parser.sphinx_ext.main")
    if not any(isinstance(f, QuietMyst) for f in target.filters):
        target.addFilter(QuietMyst())


# ------------------------------------------------------------------------------------ entry page
def write_root_index(app, exception) -> None:
    """``<out>/index.html``: forwards to the root document when that lives in a folder."""
    if exception or app.builder.format != "html" or app.config.root_doc == "index":
        return
    target = app.builder.get_target_uri(app.config.root_doc)
    title = escape(app.config.html_title or app.config.project)
    (app.outdir / "index.html").write_text(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{title}</title>\n"
        f"<meta http-equiv=\"refresh\" content=\"0; url={target}\">\n"
        f"<link rel=\"canonical\" href=\"{target}\">\n</head>\n"
        f"<body><p>The documentation starts at <a href=\"{target}\">{target}</a>.</p></body>\n</html>\n",
        encoding="utf-8",
    )


def setup(app):
    _quiet_myst()
    app.setup_extension("sphinx.ext.autodoc")
    app.setup_extension("sphinx.ext.napoleon")
    app.add_html_math_renderer("mathml", inline_renderers=(visit_math, None),
                               block_renderers=(visit_displaymath, None))
    _napoleon_without_attributes(app)
    app.connect("missing-reference", resolve_reexported)
    app.connect("autodoc-skip-member", skip_member)
    app.connect("html-page-context", fix_viewcode_backlinks)
    app.connect("html-collect-pages", drop_unread_modules, priority=400)  # viewcode's runs at 500
    app.connect("build-finished", write_root_index)
    app.add_config_value("stored_sources", {}, "env", types=(dict,))
    app.add_role("stored", stored_role)
    app.add_directive("bench-table", BenchTable)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
