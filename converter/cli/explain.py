"""``mpconvert explain``: answer from a saved report.json whenever one fits, without importing torch.

* ``explain OUT_DIR NODE``: OUT_DIR is what ``mpconvert`` or ``mpconvert audit`` wrote; its
  report.json has, for every node, every rule that matched (``nodes[i].matches``), so the answer
  takes milliseconds.
* ``explain MODEL.py NODE``: the default output directories of that model (``./MODEL_mp`` and
  ``./MODEL_audit``) are reused when their report.json is *fresh*: newer than the model file and
  every rule file given, and made with the same precision, rule files, device, opt level and
  tracer. Otherwise the caller audits the model (nothing is written).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from converter.ir.errors import MpconvertError
from converter.options import ConvertOptions
from converter.report import schema

__all__ = ["ReportNotUsable", "read_report", "fresh_report", "report_dir_of"]


class ReportNotUsable(MpconvertError, ValueError):
    """report.json is missing or malformed; the message is one line."""


def report_dir_of(target: Path) -> Optional[Path]:
    """``target`` itself when it is an output directory (it holds report.json), else None."""
    return target if target.is_dir() and (target / "report.json").is_file() else None


#: larger than any report mpconvert writes for a real model; json.loads of more is a denial of service
_MAX_REPORT_BYTES = 512 << 20


def read_report(path: Path) -> dict:
    """Parse report.json, check it against the schema its writer uses (:mod:`converter.report.schema`),
    so that a damaged or hostile file is one line of bad input, never an internal error, and return it
    with the rows' numbers read back (an exact SQNR ``"inf"`` is ``math.inf`` again)."""
    try:
        if path.stat().st_size > _MAX_REPORT_BYTES:
            raise ReportNotUsable(f"{path}: larger than {_MAX_REPORT_BYTES >> 20} MiB, which no mpconvert report is; "
                                  "rerun mpconvert or mpconvert audit to write it again")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ReportNotUsable(f"{path}: cannot read it as JSON ({why}); rerun mpconvert or mpconvert audit to write it again") from None
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not isinstance(data.get("casts", []), list):
        raise ReportNotUsable(f"{path}: not an mpconvert report (no 'nodes' list); pass an output directory of mpconvert or mpconvert audit")
    for row in data["nodes"]:
        if not isinstance(row, dict) or "name" not in row or "matches" not in row:
            raise ReportNotUsable(f"{path}: its nodes carry no matched rules (written by an older mpconvert); "
                                  "rerun mpconvert audit to write it again")
    problem = schema.problem(data)
    if problem is not None:
        raise ReportNotUsable(f"{path}: not a report mpconvert wrote ({problem}); rerun mpconvert or mpconvert audit to write it again")
    return schema.decode(data)


def _newest_input(model: Path, rules: list[str]) -> float:
    """The latest modification time among the model (a file, or a folder's files) and the rule files."""
    paths = [model]
    if model.is_dir():
        paths = [p for p in model.iterdir() if p.is_file()]
    paths += [Path(r) for r in rules if Path(r).is_file()]
    return max((p.stat().st_mtime for p in paths if p.exists()), default=0.0)


def _matches_options(data: dict, options: ConvertOptions, rules: list[str], entry: Optional[str]) -> bool:
    """Was the report made with the options of this command line? (Conservative: any doubt is no.)
    ``options.precision`` is canonical (a report stores ``bf16``, never ``bfloat16``)."""
    files = data.get("rules", {}).get("files", [])
    if [Path(str(f)).stem for f in files] != ["default"] + [Path(r).stem for r in rules]:
        return False
    return (
        data.get("precision") == options.precision
        and data.get("device") == options.device
        and data.get("opt_level", "O1") == options.opt_level
        and options.tracer in ("auto", data.get("tracer"))
        and entry is None
    )


def fresh_report(model: Path, options: ConvertOptions, *, rules: Sequence[str] = (), entry: Optional[str] = None,
                 cwd: Path) -> Optional[Path]:
    """The newest fresh report.json among the default output directories of ``model``, if any: made with
    ``options`` (precision, device, opt level, tracer), the rule files ``rules`` and no ``entry``."""
    rules = list(rules)
    stem = model.resolve().name if model.is_dir() else model.stem
    newest_input = _newest_input(model, rules)
    found: list[tuple[float, Path]] = []
    for suffix in ("_mp", "_audit"):
        path = cwd / f"{stem}{suffix}" / "report.json"
        if not path.is_file():
            continue
        mtime = path.stat().st_mtime
        if mtime < newest_input:
            continue
        try:
            data = read_report(path)
        except ReportNotUsable:
            continue
        if _matches_options(data, options, rules, entry):
            found.append((mtime, path))
    return max(found)[1] if found else None
