"""How every JSON file mpconvert writes spells numbers: the one codec of writers and readers, torch-free.

JSON has no infinity or NaN; report.json (and the benchmark results) must stay strict JSON (``allow_nan=False``). A non-finite float is written as the string
``"inf"``, ``"-inf"`` or ``"nan"``; ``null`` means "not measured". Writers go through
:func:`json_float` / :func:`to_json`; readers through :func:`from_json_float` (one typed field) or
:func:`from_json` (a whole document whose strings are never those three words otherwise).
:mod:`converter.report.schema` says which fields of report.json are such numbers, so that its
reader decodes exactly those. This module imports nothing but the standard library: ``mpconvert
explain`` reads a report without importing torch.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Union

__all__ = ["NONFINITE_JSON", "json_float", "to_json", "from_json_float", "from_json"]


#: how report.json (and every other JSON file mpconvert writes) spells a non-finite float
NONFINITE_JSON = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def json_float(x: float) -> Union[float, str]:
    """A float for JSON: finite values as numbers, ``+inf``/``-inf``/NaN as ``"inf"``/``"-inf"``/``"nan"``.

    The convention of report.json: strict JSON (no ``Infinity`` tokens), and lossless, so a reader
    tells an exact match (SQNR ``"inf"``) from a missing value (``null``). Read it back with
    :func:`from_json_float`.
    """
    x = float(x)
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def to_json(value: Any) -> Any:
    """``value`` as plain JSON types: floats through :func:`json_float`, tuples as lists, dict keys
    as strings, other objects (dtypes, paths) as their ``str``."""
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return json_float(value)
    return str(value)


def from_json_float(value: Any) -> Optional[float]:
    """Read a number written by :func:`json_float`: ``"inf"``/``"-inf"``/``"nan"`` and numbers give
    a float, ``None`` stays ``None``; anything else is a ``ValueError``."""
    if value is None:
        return None
    if isinstance(value, str):
        if value in NONFINITE_JSON:
            return NONFINITE_JSON[value]
        raise ValueError(f"not a JSON number of report.json: {value!r}")
    if isinstance(value, bool):
        raise ValueError(f"not a JSON number of report.json: {value!r}")
    return float(value)


def from_json(value: Any) -> Any:
    """A JSON document read back: every ``"inf"``/``"-inf"``/``"nan"`` string becomes its float.

    For documents written through :func:`to_json` whose strings are never those three words
    otherwise (report.json, the benchmark results).
    """
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, str) and value in NONFINITE_JSON:
        return NONFINITE_JSON[value]
    return value
