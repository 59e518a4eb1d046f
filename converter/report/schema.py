"""report.json's rows, one schema for the writer and every reader; torch-free.

The writer (:meth:`converter.report.build.Report.to_dict`) encodes the whole document with
:func:`encode`; the reader of ``mpconvert explain`` (:func:`converter.cli.explain.read_report`)
checks a file from disk with :func:`problem` and gets the rows back with :func:`decode`. Both go
through the same tables below and the same number codec (:mod:`converter.ir.json_numbers`):

* a *number* field (an SQNR) is a JSON number, or ``"inf"``/``"-inf"``/``"nan"`` for a value that is
  not finite, or ``null`` ("not measured"); :func:`decode` turns the strings back into floats, in
  those fields only, so that a module named ``inf`` stays a string;
* every other field has the JSON type its table gives; a field that is not in the table is passed
  through as written.

The stages' sections (``capture_errors``, ``timings``, ``dynamic_dims``, ``lowering``, ``fp8``,
``device_advice``, ``optional_inputs``...) are the typed records of :mod:`converter.ir.records`: the
writer emits ``StageRecords.to_dict()`` and :func:`problem` reads them back with
``StageRecords.from_dict`` (:func:`records` gives them to a reader), the same fields both ways.

Readers reject what the tables forbid and nothing else: whatever the writer emits reads back, value
for value (``tests/test_report_schema.py`` writes reports with every value a row can have).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from converter.ir.json_numbers import NONFINITE_JSON, from_json_float, to_json
from converter.ir.records import RecordError, StageRecords

__all__ = ["NUMBER", "NODE_FIELDS", "NODE_OPTIONAL", "MATCH_FIELDS", "CAST_FIELDS", "CAST_OPTIONAL", "TOP_OPTIONAL",
           "encode", "problem", "decode", "records"]


class _Number:
    """The type of an SQNR-like field: a JSON number, a non-finite float's string, or null."""

    def __repr__(self) -> str:
        return "NUMBER"


#: a float field written through json_float (None allowed: not measured)
NUMBER: Any = _Number()
_STR, _INT, _BOOL, _LIST, _DICT = (str,), (int,), (bool,), (list,), (dict,)
_OPT_STR = (str, type(None))

#: node rows (``nodes[i]``): the fields every row has, then those a row may have
NODE_FIELDS: Mapping[str, Any] = {
    "name": _STR, "op": _STR, "module": _STR, "module_type": _STR, "source": _STR, "precision": _STR,
    "requested": _STR, "unmatched": _BOOL, "rule": _STR, "reason": _STR, "matches": _LIST}
NODE_OPTIONAL: Mapping[str, Any] = {
    "index": _INT, "rule_level": _STR, "kind": _STR, "flops": (int, float), "out_bytes": _INT, "out_shape": _LIST,
    "notes": _LIST, "fp32_math": _OPT_STR, "gemm": _OPT_STR, "sqnr_db": NUMBER, "local_sqnr_db": NUMBER}
#: the matched rules of a node row (``nodes[i].matches[j]``)
MATCH_FIELDS: Mapping[str, Any] = {"level": _STR, "precision": _STR, "rule": _STR, "scope": _STR, "pattern": _STR,
                                   "reason": _STR, "file": _STR}
#: cast rows (``casts[i]``)
CAST_FIELDS: Mapping[str, Any] = {"name": _STR, "src": _STR, "src_dtype": _STR, "dtype": _STR, "bytes": _INT,
                                  "consumers": _LIST, "rule": _STR, "reason": _STR, "on_weight": _BOOL}
CAST_OPTIONAL: Mapping[str, Any] = {"index": _INT, "numel": _INT, "inserted": _BOOL}
#: top-level fields a reader compares with its command line (``explain MODEL.py`` reuses a fresh report)
TOP_OPTIONAL: Mapping[str, Any] = {"schema": _INT, "precision": _STR, "tracer": _STR, "device": _OPT_STR,
                                   "opt_level": _STR, "rules": _DICT}


def encode(document: Any) -> Any:
    """The document as strict JSON types: floats through ``json_float`` (non-finite ones as strings)."""
    return to_json(document)


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
        isinstance(value, str) and value in NONFINITE_JSON)


def _bad_value(value: Any, types: Any) -> bool:
    if types is NUMBER:
        return not _is_number(value)
    return not isinstance(value, types) or (isinstance(value, bool) and bool not in types)


def _bad_row(row: Any, required: Mapping[str, Any], optional: Mapping[str, Any] = {}) -> Optional[str]:  # noqa: B006
    """What is wrong with one row (None: nothing)."""
    if not isinstance(row, dict):
        return f"a row is a {type(row).__name__}, not an object"
    for key, types in {**required, **optional}.items():
        if key not in row:
            if key in required:
                return f"a row has no {key!r}"
            continue
        if _bad_value(row[key], types):
            return f"{key!r} of row {str(row.get('name'))[:40]!r} is a {type(row[key]).__name__}"
    return None


def _bad_node(row: Any) -> Optional[str]:
    why = _bad_row(row, NODE_FIELDS, NODE_OPTIONAL)
    if why is None:
        why = next(filter(None, (_bad_row(m, MATCH_FIELDS) for m in row["matches"])), None)
    if why is None and not all(isinstance(n, list) and len(n) == 2 and all(isinstance(t, str) for t in n)
                               for n in row.get("notes", [])):
        why = f"the notes of row {row['name'][:40]!r} are not [stage, text] pairs"
    return why


def _bad_cast(cast: Any) -> Optional[str]:
    why = _bad_row(cast, CAST_FIELDS, CAST_OPTIONAL)
    if why is None and not all(isinstance(c, str) for c in cast["consumers"]):
        why = f"the consumers of cast {cast['name'][:40]!r} are not names"
    return why


def problem(data: Any) -> Optional[str]:
    """What makes ``data`` (a parsed report.json) not a report mpconvert wrote; None: nothing."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not isinstance(data.get("casts", []), list):
        return "no 'nodes' list"
    for key, types in TOP_OPTIONAL.items():
        if key in data and _bad_value(data[key], types):
            return f"its {key!r} is a {type(data[key]).__name__}"
    files = data.get("rules", {}).get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return "its rule files are not a list of paths"
    for why in map(_bad_node, data["nodes"]):
        if why is not None:
            return why
    why = next(filter(None, map(_bad_cast, data.get("casts", []))), None)
    if why is None:
        try:
            StageRecords.from_dict(data)
        except RecordError as exc:
            return exc.what
    return why


def records(data: dict) -> StageRecords:
    """The stages' records of ``data`` (checked by :func:`problem`)."""
    return StageRecords.from_dict(data)


def _decoded(row: dict, optional: Mapping[str, Any]) -> dict:
    return {key: from_json_float(value) if optional.get(key) is NUMBER else value for key, value in row.items()}


def decode(data: dict) -> dict:
    """``data`` (checked by :func:`problem`) with the number fields of its rows read back as floats
    (``"inf"`` -> ``math.inf``); every other value as written."""
    out = dict(data)
    out["nodes"] = [_decoded(row, NODE_OPTIONAL) for row in data["nodes"]]
    out["casts"] = [dict(row) for row in data.get("casts", [])]
    return out
