"""Putting outside text into generated Python source safely, and reading the template files.

Generated files (model.py, train.py) never contain raw text from file names, module names, class
names or paths: such text enters as a ``repr()`` literal, as a one-line comment with every
non-printable character escaped (:func:`comment_text`), or as docstring text with backslashes,
quotes and non-ASCII escaped (:func:`doc_text`). Templates are ``string.Template`` files in
``templates/``; the values put into them are code this package generates.
"""
from __future__ import annotations

import string
from importlib import resources

from converter.export.errors import EmitError

__all__ = ["comment_text", "doc_text", "render_template", "check_attribute_path"]

_UNSAFE_IN_ATTRIBUTE = frozenset('"\\')


def comment_text(text: object) -> str:
    """``text`` as one line that is safe after ``#``: non-printable characters become escapes."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))


def doc_text(text: object) -> str:
    """``text`` as safe content of a ``\"\"\"`` docstring: one line that reads back as ``text``.

    Backslashes and quotes are escaped, and so is every non-printable character (newlines, lone
    surrogates); printable non-ASCII text stays readable.
    """
    out = []
    for c in str(text):
        if c in '\\"':
            out.append("\\" + c)
        elif not c.isprintable():
            out.append(c.encode("unicode_escape").decode("ascii"))
        else:
            out.append(c)
    return "".join(out)


def render_template(name: str, **values: str) -> str:
    """Fill ``templates/NAME`` (a ``string.Template``: ``${key}`` placeholders) with ``values``."""
    text = resources.files("converter.export").joinpath("templates").joinpath(name).read_text(encoding="utf-8")
    return string.Template(text).substitute(values)


def check_attribute_path(path: str, what: str) -> None:
    """Refuse a dotted attribute path that torch.fx's code generator would paste into source unsafely.

    FX writes ``self.a.b`` for identifiers and ``getattr(self, "0")`` otherwise, with the name
    between double quotes as it is. :mod:`converter.ir.fx_names` makes it write a ``repr()`` literal
    for a part holding a quote, a backslash or a control character, so any name is data (model.py
    writes such names as literals and comments them escaped); only where that helper could not be
    installed (a torch without it) is such a name refused.
    """
    import torch.fx.graph as fx_graph

    from converter.ir.fx_names import format_target

    if getattr(fx_graph, "_format_target", None) is format_target:
        return
    for part in str(path).split("."):
        if any(c in _UNSAFE_IN_ATTRIBUTE or not c.isprintable() for c in part):
            raise EmitError(
                f"cannot emit model.py: {what} {path!r} has a quote, backslash or control character in its name, "
                "which cannot be written safely into Python source with this torch; rename it"
            )
