"""The bounded cost of reading a rule file: a size limit and a nesting limit, checked before parsing.

A rule file needs three or four levels (``[module]``, a pattern, ``{ precision = ..., ops = { ... } }``),
but TOML lets a dotted key (``a.b.c... = 1``) or nested inline tables make one key thousands of levels
deep, and the parser's cost grows with the square of that depth (20,000 levels: gigabytes). So,
before :mod:`tomllib` sees the text:

* a file over :data:`MAX_RULES_BYTES` is refused (a rule per module of a 100,000-module model is
  well under it);
* nesting deeper than :data:`MAX_RULES_DEPTH` (table-header parts + dotted-key parts + inline
  table/array brackets) is refused, naming the line.

Both are one line (:class:`~converter.rules.loader.RulesError`, exit 2). The depth is measured by one
pass over the characters outside strings and comments (linear in the file's size).
"""
from __future__ import annotations

from typing import Optional

__all__ = ["MAX_RULES_BYTES", "MAX_RULES_DEPTH", "too_large", "too_deep"]

#: the largest rule file read, in bytes (16 MiB)
MAX_RULES_BYTES = 16 << 20
#: the deepest nesting a rule file may have (a rule file needs 4)
MAX_RULES_DEPTH = 32


def too_large(size: int) -> Optional[str]:
    """Why a rule file of ``size`` bytes is refused (None: it is not)."""
    if size > MAX_RULES_BYTES:
        return (f"is {size / 2**20:,.1f} MiB, over the {MAX_RULES_BYTES >> 20} MiB limit on rule files; "
                "use glob patterns (\"model.layers.*.mlp\") instead of one entry per module")
    return None


def too_deep(text: str) -> Optional[str]:
    """Why ``text`` nests too deeply (None: it does not): the first line past :data:`MAX_RULES_DEPTH`."""
    depth_at = _first_too_deep(text)
    if depth_at is None:
        return None
    depth, line = depth_at
    return (f"line {line} nests too deeply: more than {MAX_RULES_DEPTH} levels ({depth} reached); a rule file needs at most 4 "
            "([table], pattern, { precision = ..., ops = { ... } }): quote a dotted module path (\"a.b.c\" = \"fp32\")")


def _first_too_deep(text: str) -> Optional[tuple[int, int]]:
    """(depth, line) where the nesting first exceeds the limit, in one pass over ``text``."""
    line, brackets, header, chain = 1, 0, 0, 0
    in_header = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            i = _skip_string(text, i)
            continue
        if c == "#":
            while i < n and text[i] != "\n":
                i += 1
            continue
        if c == "\n":
            line += 1
            if brackets == 0:
                chain = 0
        elif c == "[":
            if brackets == 0 and _at_line_start(text, i):
                in_header, header = True, 1
                if text.startswith("[[", i):
                    i += 1
            else:
                brackets += 1
        elif c == "]":
            if in_header and brackets == 0:
                in_header, chain = False, 0
            else:
                brackets = max(0, brackets - 1)
        elif c == "{":
            brackets += 1
            chain = 0
        elif c == "}":
            brackets = max(0, brackets - 1)
        elif c in "=,":
            chain = 0
        elif c == ".":
            if in_header:
                header += 1
            else:
                chain += 1
        depth = header + chain + brackets + 1
        if depth > MAX_RULES_DEPTH:
            return depth, line
        i += 1
    return None


def _at_line_start(text: str, i: int) -> bool:
    """Whether only blanks precede position ``i`` on its line (a table header, not an array value)."""
    j = i - 1
    while j >= 0 and text[j] in " \t":
        j -= 1
    return j < 0 or text[j] == "\n"


def _skip_string(text: str, i: int) -> int:
    """The position after the string starting at ``i`` (basic, literal, or multi-line)."""
    quote = text[i]
    triple = text.startswith(quote * 3, i)
    end_mark = quote * 3 if triple else quote
    j = i + len(end_mark)
    n = len(text)
    while j < n:
        if quote == '"' and text[j] == "\\":
            j += 2
            continue
        if text.startswith(end_mark, j):
            return j + len(end_mark)
        if not triple and text[j] == "\n":
            return j  # an unterminated string: the parser reports it
        j += 1
    return n
