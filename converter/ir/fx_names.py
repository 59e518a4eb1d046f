"""torch.fx writes attribute names into generated source as they are; this makes any name inert.

FX's code generator writes ``self.a.b`` for identifier parts and ``getattr(self, "PART")`` for the
others, pasting PART between double quotes unescaped: a module or parameter name holding a quote,
a backslash or a newline (``add_module('we"ird\\nname', ...)``, legal in torch) gives a SyntaxError
(an internal error, exit 3) or, worse, code. :func:`install` replaces that one formatting helper
(``torch.fx.graph._format_target``, private) with one that writes the same text for every name FX
already wrote correctly and a ``repr()`` literal for the rest, so a name is always data. It is
installed when :mod:`converter.ir.graphmodule` is imported (every conversion imports it) and is
idempotent.
"""
from __future__ import annotations

__all__ = ["install", "format_target"]


def _safe_in_quotes(part: str) -> bool:
    return all(c.isprintable() and c not in '"\\' for c in part)


def format_target(base: str, target: str) -> str:
    """``base.TARGET`` as Python source, each non-identifier part through ``getattr(..., literal)``."""
    out = base
    for part in target.split("."):
        if part.isidentifier():
            out = f"{out}.{part}"
        elif _safe_in_quotes(part):
            out = f'getattr({out}, "{part}")'  # what torch writes: the generated code is unchanged
        else:
            out = f"getattr({out}, {part!r})"
    return out


def install() -> None:
    """Put :func:`format_target` in place of torch.fx's helper (where this torch has it)."""
    import torch.fx.graph as fx_graph

    if getattr(fx_graph, "_format_target", None) is not None and fx_graph._format_target is not format_target:
        fx_graph._format_target = format_target
