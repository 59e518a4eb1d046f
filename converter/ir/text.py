"""Names are data: text from rule reasons, module names, file names or a hand-edited report.json is
shown, never obeyed, by a terminal or a Markdown viewer.

:func:`printable` writes every control character (C0 but the kept line breaks/tabs, DEL, C1: ESC,
BEL, backspace, carriage return, ...) as a visible ``\\x1b`` escape, so an ESC sequence in a module
name cannot recolour, move the cursor, retitle the terminal or hide a line. :func:`printable_tree`
does it for every string (keys included) of a JSON-like value. Imports nothing.
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["printable", "printable_tree"]

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_ALL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _escape(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group(0)):02x}"


def printable(text: Any, *, lines: bool = True) -> str:
    """``text`` with its control characters escaped; ``lines``: keep newlines and tabs."""
    return (_CONTROL if lines else _CONTROL_ALL).sub(_escape, str(text))


def printable_tree(value: Any) -> Any:
    """``value`` with every string in it (dict keys too) passed through :func:`printable`."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_tree(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable_tree(v) for v in value]
    if isinstance(value, tuple):
        return tuple(printable_tree(v) for v in value)
    return value
