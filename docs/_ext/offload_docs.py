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
  exports (their pages document them as ``offload_examples.X``) and methods whose only docstring
  is inherited from outside the package (``nn.Module.forward``'s).
- **Attribute docstrings are prose.** Napoleon reads the first line of an attribute's docstring
  as ``type: description``; here those lines are sentences, so napoleon leaves attributes alone.
- **An entry page at the root** of the output (``index.html``) that forwards to the root
  document, which lives in ``docs/``.
"""

from __future__ import annotations

import importlib
import inspect
import xml.etree.ElementTree as ET
from html import escape
from typing import Any

from docutils import nodes
from sphinx.util import logging
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


def skip_member(app, what, name, obj, skip, options):
    if skip:
        return None
    if what == "module" and _exported_by_root(obj):
        return True  # documented as offload_examples.<name>
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
    app.setup_extension("sphinx.ext.autodoc")
    app.setup_extension("sphinx.ext.napoleon")
    app.add_html_math_renderer("mathml", inline_renderers=(visit_math, None),
                               block_renderers=(visit_displaymath, None))
    _napoleon_without_attributes(app)
    app.connect("missing-reference", resolve_reexported)
    app.connect("autodoc-skip-member", skip_member)
    app.connect("build-finished", write_root_index)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
