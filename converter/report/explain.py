"""``explain``: the decision chain of one node, read from the report's structured rows (never parsed from text).

:func:`explain_rows` works on the ``nodes`` and ``casts`` rows alone, so ``mpconvert explain OUT_DIR
NODE`` answers from a saved report.json. This module imports torch and the report builder only
when :func:`explain` is given a conversion or a GraphModule: reading a saved report stays
torch-free (well under a second).
"""
from __future__ import annotations

import difflib
from typing import Any, Sequence

from converter.ir.notes import note_text
from converter.rules.precedence import OVERRIDE_LEVEL, SCOPED_LEVELS, USER_LEVEL, describe, rank

__all__ = ["explain", "explain_rows", "closest_names"]


def explain(conv_or_gm: Any, node_name: str) -> str:
    """The decision chain of one node: every matched rule, its precedence level, the winner and why.

    Accepts a :class:`~converter.Conversion`, a decided ``GraphModule`` or a :class:`Report`.
    Raises ``ValueError`` naming the closest node names when ``node_name`` is unknown.
    """
    report = _as_report(conv_or_gm)
    return explain_rows(report.nodes, report.casts, node_name)


def explain_rows(nodes: Sequence[dict], casts: Sequence[dict], node_name: str) -> str:
    """:func:`explain` on report.json's ``nodes`` and ``casts`` rows (no torch needed)."""
    rows = {r["name"]: r for r in nodes}
    by_name = {c["name"]: c for c in casts}
    if node_name in by_name and node_name not in rows:
        return _explain_cast(node_name, by_name[node_name])
    if node_name not in rows:
        close = difflib.get_close_matches(node_name, list(rows) + list(by_name), n=5, cutoff=0.5)
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
    lines += _match_lines(r)
    lines += _outcome_lines(r, casts)
    return "\n".join(lines)


def closest_names(name: str, nodes: Sequence[dict], casts: Sequence[dict] = (), *, n: int = 5) -> list[str]:
    """The node (and cast) names closest to ``name``, best first (difflib ratio >= 0.5)."""
    return difflib.get_close_matches(name, [r["name"] for r in nodes] + [c["name"] for c in casts], n=n, cutoff=0.5)


def _as_report(target: Any):
    import torch.fx

    from converter.ir.meta import GM_GRAPH
    from converter.report.build import Report, build_report

    if isinstance(target, Report):
        return target
    module = getattr(target, "module", None)
    if module is not None and hasattr(target, "report"):
        return target.report if isinstance(target.report, Report) and target.report.nodes else build_report(
            module, precision=getattr(target, "precision", ""), tracer=getattr(target, "tracer", ""))
    if isinstance(target, torch.fx.GraphModule):
        graph_meta = target.meta.get(GM_GRAPH)
        return build_report(target, precision=getattr(graph_meta, "precision", ""), tracer=getattr(graph_meta, "tracer", ""))
    raise TypeError(f"explain() takes a Conversion, a GraphModule or a Report, got {type(target).__name__}")


def _explain_cast(name: str, c: dict) -> str:
    return (f"{name}: a cast inserted by the rewrite ({'weight' if c['on_weight'] else 'activation'} cast)\n"
            f"  converts {c['src']} from {c['src_dtype']} to {c['dtype']}, {c['bytes']:,} bytes per forward\n"
            f"  consumers: {', '.join(c['consumers'])}\n  rule: {c['rule']}\n  why: {c['reason']}")


def _match_lines(r: dict) -> list[str]:
    """Every rule that matched the node, best first, each with why it wins or loses."""
    matches = r.get("matches", [])
    if not matches:
        return ["  matched rules: none — no rule matches this op, so it stays fp32 and is listed as unmatched"]
    lines = ["  matched rules, best first:"]
    win = matches[0]
    rule_applies = r["rule"] == win["rule"] or r["requested"] == win["precision"]
    for i, mt in enumerate(matches):
        scope = f", scope module {mt['scope']!r}" if mt["scope"] else ""
        pattern = f"{mt['pattern']!r} in " if mt["pattern"] else ""
        head = f"{pattern}{mt['file']}{scope} -> {mt['precision']}"
        if mt["level"] == USER_LEVEL:  # not a rule file: the model's own code says so
            head = f"{mt['pattern']} (in the model code) -> {mt['precision']}"
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
    return lines


def _outcome_lines(r: dict, casts: Sequence[dict]) -> list[str]:
    """The reason, the later stages' notes, the casts around the node and what was measured on it."""
    notes = r.get("notes", [])
    lines = ["", f"  why: {r['reason']}"]
    lines += [f"  {note_text(stage, text)}" for stage, text in notes]
    if r["requested"] in ("follow", "promote") and not any(stage == "place" for stage, _ in notes):
        lines.append(f"  placement: {r['requested']} resolved to {r['precision']}")
    into = [c for c in casts if r["name"] in c["consumers"]]
    out_of = [c for c in casts if c["src"] == r["name"]]
    if into:
        lines.append("  casts into this node: " + ", ".join(f"{c['name']} ({c['src_dtype']}->{c['dtype']}, {c['bytes']:,} B)" for c in into))
    if out_of:
        lines.append("  casts of its output: " + ", ".join(f"{c['name']} ({c['src_dtype']}->{c['dtype']}, {c['bytes']:,} B)" for c in out_of))
    if "sqnr_db" in r:
        lines.append(f"  measured: cumulative SQNR {_fmt_db(r['sqnr_db'])}, local SQNR {_fmt_db(r.get('local_sqnr_db'))}")
    return lines


def _why(win: dict, other: dict) -> str:
    wr, orank = rank(win["level"]), rank(other["level"])
    if win["level"] == OVERRIDE_LEVEL:
        return "calibration overrides every rule: the value measured on real inputs would overflow fp16"
    if win["level"] == USER_LEVEL and other["level"] != USER_LEVEL:
        return "the user's precision intent in the model code outranks every rule file"
    if wr < orank:
        return f"{win['level']} outranks {other['level']}"
    if wr == orank and win["scope"] != other["scope"] and win["level"] in SCOPED_LEVELS:
        return f"same level; the inner module {win['scope']!r} beats the outer {other['scope']!r}"
    if ".ops." in str(win.get("pattern", "")) and ".ops." not in str(other.get("pattern", "")):
        return "same module; an ops entry outranks the module rule's own precision"
    if win["file"] != other["file"]:
        return f"same level; {win['file']} is layered after {other['file']}"
    return "same level and scope; the entry read last wins"


def _fmt_db(x: Any) -> str:
    """An SQNR as report.json stores it: a number, or "inf"/"-inf"/"nan" (the convention of
    converter.numerics.common.json_float, read here without importing torch); None and +inf read
    "exact", like converter.report.common.fmt_db."""
    if x is None or x == "inf" or (isinstance(x, float) and x == float("inf")):
        return "exact"
    if isinstance(x, str):
        return f"{x} dB"
    return f"{x:.1f} dB"
