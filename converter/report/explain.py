"""The decision chain of one node, as text, from the rows of a report (no torch needed).

``mpconvert explain OUT_DIR NODE`` reads report.json and calls :func:`explain_rows` on its
``nodes`` and ``casts``; :func:`converter.report.render.explain` calls it on an in-memory
:class:`~converter.report.build.Report`. Each node row carries ``matches`` (every rule that
matched, best first) and ``notes`` (``[stage, text]`` pairs), see docs/report.md. This module
imports only the standard library and torch-free modules (the precedence table, the note labels),
so answering from a saved report does not pay for importing torch.
"""
from __future__ import annotations

import difflib
from typing import Any, Sequence

from converter.ir.notes import note_text
from converter.rules.precedence import OVERRIDE_LEVEL, SCOPED_LEVELS, describe, rank

__all__ = ["explain_rows", "closest_names"]


def _format_db(x: Any) -> str:
    """An SQNR as report.json stores it (a number, or "inf"/"-inf"/"nan"); None and +inf read "exact"."""
    if x is None or x == "inf" or (isinstance(x, float) and x == float("inf")):
        return "exact"
    if isinstance(x, str):
        return f"{x} dB"
    return f"{x:.1f} dB"


def closest_names(name: str, nodes: Sequence[dict], casts: Sequence[dict] = (), *, n: int = 5) -> list[str]:
    """The node (and cast) names closest to ``name``, best first (difflib ratio >= 0.5)."""
    names = [r["name"] for r in nodes] + [c["name"] for c in casts]
    return difflib.get_close_matches(name, names, n=n, cutoff=0.5)


def _why(win: dict, other: dict) -> str:
    wr, orank = rank(win["level"]), rank(other["level"])
    if win["level"] == OVERRIDE_LEVEL:
        return "calibration overrides every rule: the value measured on real inputs would overflow fp16"
    if wr < orank:
        return f"{win['level']} outranks {other['level']}"
    if wr == orank and win["scope"] != other["scope"] and win["level"] in SCOPED_LEVELS:
        return f"same level; the inner module {win['scope']!r} beats the outer {other['scope']!r}"
    if ".ops." in str(win.get("pattern", "")) and ".ops." not in str(other.get("pattern", "")):
        return "same module; an ops entry outranks the module rule's own precision"
    if win["file"] != other["file"]:
        return f"same level; {win['file']} is layered after {other['file']}"
    return "same level and scope; the entry read last wins"



def explain_rows(nodes: Sequence[dict], casts: Sequence[dict], node_name: str) -> str:
    """The decision chain of ``node_name``: every matched rule, its precedence level, the winner and why.

    Raises ``ValueError`` naming the closest node names when ``node_name`` is unknown.
    """
    rows = {r["name"]: r for r in nodes}
    by_name = {c["name"]: c for c in casts}
    if node_name in by_name and node_name not in rows:
        c = by_name[node_name]
        return (f"{node_name}: a cast inserted by the rewrite ({'weight' if c['on_weight'] else 'activation'} cast)\n"
                f"  converts {c['src']} from {c['src_dtype']} to {c['dtype']}, {c['bytes']:,} bytes per forward\n"
                f"  consumers: {', '.join(c['consumers'])}\n  rule: {c['rule']}\n  why: {c['reason']}")
    if node_name not in rows:
        names = list(rows) + list(by_name)
        close = difflib.get_close_matches(node_name, names, n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"no compute node named {node_name!r} in the graph ({len(rows)} compute nodes){hint}")
    r = rows[node_name]
    lines = [f"{r['name']}: op {r['op']} in module {r['module'] or '(top level)'} ({r['module_type']})"
             + (f", source {r['source']}" if r["source"] else "")]
    lines.append(f"  precision: {r['precision']} (rule asked for {r['requested']})" + ("  [UNMATCHED: kept fp32]" if r["unmatched"] else ""))
    lines.append(f"  decided by: {r['rule']}")
    lines.append("")
    lines.append(f"  precedence, highest first: {describe()}"
                 + (" (calibration overrides them all)" if any(m["level"] == OVERRIDE_LEVEL for m in r.get("matches", [])) else ""))
    lines.append("  (within a level the innermost module wins, then the rule read last: a later file overrides an earlier one)")
    lines.append("")
    matches = r.get("matches", [])
    if not matches:
        lines.append("  matched rules: none — no rule matches this op, so it stays fp32 and is listed as unmatched")
    else:
        lines.append("  matched rules, best first:")
        win = matches[0]
        rule_applies = r["rule"] == win["rule"] or r["requested"] == win["precision"]
        for i, mt in enumerate(matches):
            scope = f", scope module {mt['scope']!r}" if mt["scope"] else ""
            pattern = f"{mt['pattern']!r} in " if mt["pattern"] else ""
            head = f"{pattern}{mt['file']}{scope} -> {mt['precision']}"
            if i == 0:
                verdict = "WINS" + (f": {_why(mt, matches[1])}" if len(matches) > 1 else ": the only rule that matches")
                if not rule_applies:
                    verdict = "would win, but was overridden (see below)"
            else:
                verdict = f"loses to rule 1: {_why(win, mt)}"
            lines.append(f"  {'*' if i == 0 else ' '} {i + 1}. [{mt['level']}] {head}")
            lines.append(f"       {verdict}")
            if mt["reason"]:
                lines.append(f"       reason: {mt['reason']}")
    notes = r.get("notes", [])
    lines.append("")
    lines.append(f"  why: {r['reason']}")
    for stage, text in notes:
        lines.append(f"  {note_text(stage, text)}")
    if r["requested"] in ("follow", "promote") and not any(stage == "place" for stage, _ in notes):
        lines.append(f"  placement: {r['requested']} resolved to {r['precision']}")
    into = [c for c in casts if r["name"] in c["consumers"]]
    out_of = [c for c in casts if c["src"] == r["name"]]
    if into:
        lines.append("  casts into this node: " + ", ".join(f"{c['name']} ({c['src_dtype']}->{c['dtype']}, {c['bytes']:,} B)" for c in into))
    if out_of:
        lines.append("  casts of its output: " + ", ".join(f"{c['name']} ({c['src_dtype']}->{c['dtype']}, {c['bytes']:,} B)" for c in out_of))
    if "sqnr_db" in r:
        lines.append(f"  measured: cumulative SQNR {_format_db(r['sqnr_db'])}, local SQNR {_format_db(r.get('local_sqnr_db'))}")
    return "\n".join(lines)
