"""report.md: the audit as Markdown tables, every model-supplied name escaped with :func:`md_escape`."""
from __future__ import annotations

import re
from typing import Any, Iterable

from converter.report.common import (
    BREAK_COLUMNS,
    FP8_NOTE,
    FP32_MATH_NOTE,
    ReportView,
    break_rows,
    breaks_note,
    calibration_rows,
    fmt_bytes,
    fmt_db,
    fmt_err,
    fmt_flops,
    fmt_pct,
    fmt_ratio,
    fp8_facts,
    fp8_layer_rows,
    fp32_math_facts,
    header_warnings,
    node_reason,
    ranges_text,
    split_casts,
    tuned_for,
    weight_cast_label,
)

__all__ = ["to_markdown", "md_escape"]

_MD_SPECIAL = re.compile(r"([\\`*\[\]|~]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")


def md_escape(value: Any) -> str:
    """Text safe inside a Markdown table cell: no markup, no HTML, no cell break.

    Backslashes, backticks, ``*``, brackets, pipes and ``~`` are backslash-escaped, ``&``/``<``/``>``
    become entities, newlines spaces. An underscore between two letters or digits cannot start
    emphasis (CommonMark), so ``layers_0_attn`` stays readable.
    """
    text = str(value).replace("\r", " ").replace("\n", " ")
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", text)


def to_markdown(report: ReportView) -> str:
    """report.md: the summary line, memory, numerics, ops, modules, casts and every node."""
    out: list[str] = []
    for section in (_header, _summary, _graph_breaks, _user_intent, _fp32_math, _memory, _numerics, _calibration, _fp8, _ops, _unmatched, _modules, _casts, _nodes):
        out.extend(section(report))
    from converter.ir.text import printable

    return printable("\n".join(out))  # control bytes from names and reasons are shown, not obeyed


def _table(header: list[str], rows: Iterable[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def _header(report: ReportView) -> list[str]:
    s = report.summary
    files = md_escape(", ".join(report.rules.get("files", [])) or "defaults")
    return [f"# Precision audit: {md_escape(report.model or 'model')}", "", f"**{md_escape(report.line)}**", "",
            f"Target precision `{md_escape(report.precision)}` · tracer `{md_escape(report.tracer)}` · "
            f"{s['nodes']} graph nodes, {s['compute_nodes']} compute nodes · rule files: {files}", ""] + [
            line for warning in header_warnings(report) for line in (f"> **Warning:** {md_escape(warning.text)}", "")] + [
            line for text in [ranges_text(dict(report.records.capture.dynamic_ranges) if report.records.capture else {})] if text
            for line in (f"Input sizes: {md_escape(text)}", "")]


def _graph_breaks(report: ReportView) -> list[str]:
    rows = break_rows(report)
    if not rows:
        return []
    return ["## Graph breaks", "", md_escape(breaks_note(report)), "",
            _table(list(BREAK_COLUMNS), ([md_escape(str(c)) for c in row[:5]] + [f"{row[5]:,}"] for row in rows)), ""]


def _summary(report: ReportView) -> list[str]:
    s = report.summary
    by = s["by_precision"]
    return ["## Summary", "", _table(["", "value"], [
        ["compute nodes", s["compute_nodes"]],
        ["by precision", f"bf16 {by.get('bf16', 0)} · fp16 {by.get('fp16', 0)} · fp32 {by.get('fp32', 0)}"],
        ["FLOPs in half", f"{fmt_pct(s['half_flop_fraction'])} of {fmt_flops(s['flops'])}"],
        ["activation casts", f"{s['casts']} ({fmt_bytes(s['cast_bytes'])} per forward)"],
        [weight_cast_label(s), f"{s.get('weight_casts', 0)} ({fmt_bytes(s.get('weight_cast_bytes', 0))} per forward)"],
        ["unmatched ops", md_escape(", ".join(s["unmatched_ops"])) or "none"],
        ["tuned for", tuned_for(report, md_escape)],
    ] + ([["key/value cache", md_escape(cache)]] if (cache := _cache(report)) else [])), ""]


def _cache(report: ReportView) -> str:
    """Why the graph returns no key/value cache ('' when it does, or capture did not say)."""
    capture = report.records.capture
    return (capture.cache or "") if capture is not None else ""


def _fp32_math(report: ReportView) -> list[str]:
    if not report.fp32_math:
        return []
    rows, warnings, notes = fp32_math_facts(report)
    out = ["## fp32 math", "", FP32_MATH_NOTE, "", _table(["", "value"], ([md_escape(k), md_escape(v)] for k, v in rows)), ""]
    out += [f"> **Warning:** {md_escape(w)}" for w in warnings] + ([""] if warnings else [])
    out += [f"> Note: {md_escape(n)}" for n in notes] + ([""] if notes else [])
    return out


def _memory(report: ReportView) -> list[str]:
    m = report.memory
    if not m:
        return []
    rows = [["parameters, O1 (fp32, cast in the graph)", fmt_bytes(m.get("param_bytes_o1"))],
            ["parameters, O2 (half where every use is a half matmul/conv weight)", fmt_bytes(m.get("param_bytes_o2"))],
            ["O1 weight copies per forward", fmt_bytes(m.get("o1_weight_copy_bytes"))]]
    saved = m.get("saved_activation_bytes")
    if saved:
        rows.append(["saved activations, fp32 model (measured)", fmt_bytes(saved.get("fp32"))])
        rows.append(["saved activations, converted (measured)",
                     f"{fmt_bytes(saved.get('converted'))} ({fmt_ratio(m.get('saved_ratio'))} of fp32)"])
        if "autocast" in saved:
            rows.append(["saved activations, torch.autocast (measured)",
                         f"{fmt_bytes(saved.get('autocast'))} ({fmt_ratio(m.get('saved_ratio_autocast'))} of fp32)"])
        copies = m.get("saved_weight_copy_bytes", {})
        rows.append(["saved half weight copies, converted / autocast",
                     f"{fmt_bytes(copies.get('converted'))} / {fmt_bytes(copies.get('autocast'))}"])
    else:
        rows.append(["saved activations", "not measured (run converter.numerics.measure.measure)"])
    kept = m.get("o2_fp32_params") or {}
    notes = [f"- `{md_escape(name)}`: {md_escape(why)}" for name, why in kept.items()]
    if notes:
        notes = ["Cast to half in the graph, but stored in fp32 under O2:", ""] + notes + [""]
    return ["## Memory", "", _table(["", "bytes"], rows), ""] + notes


def _numerics(report: ReportView) -> list[str]:
    n = report.numerics
    out = ["## Numerics", ""]
    if not n:
        return out + ["Not measured (run `converter.numerics.measure.measure`).", ""]
    rows = [["converted vs fp32", fmt_db(n["vs_fp32"]["sqnr_db"]), fmt_err(n["vs_fp32"]["max_abs_err"])]]
    if "autocast_vs_fp32" in n:
        rows.append(["torch.autocast vs fp32", fmt_db(n["autocast_vs_fp32"]["sqnr_db"]), fmt_err(n["autocast_vs_fp32"]["max_abs_err"])])
        rows.append(["converted vs torch.autocast", fmt_db(n["vs_autocast"]["sqnr_db"]), fmt_err(n["vs_autocast"]["max_abs_err"])])
    out += [f"Outputs on the example inputs ({md_escape(n.get('mode', ''))} mode); SQNR = 20·log10(‖ref‖/‖ref−out‖).", "",
            _table(["comparison", "SQNR", "max abs error"], rows), ""]
    method = n.get("method")
    if isinstance(method, dict) and method.get("note"):
        out += [f"Method: {md_escape(method.get('scope', ''))}, {md_escape(method.get('memory', ''))} — "
                f"{md_escape(method['note'])}.", ""]
    if n.get("worst"):
        out += ["### Error attribution: nodes that add the most error", "",
                "Local SQNR: the node run on fp32 inputs rounded to its converted input dtypes, against fp32. "
                "Cumulative SQNR: its output in the converted model against fp32.", ""]
        out.append(_table(["Node", "Op", "Module", "Precision", "Local SQNR", "Cumulative SQNR", "max abs error"], (
            [md_escape(w["name"]), md_escape(w["op"]), md_escape(w["module"]), w["precision"], fmt_db(w["local_sqnr_db"]),
             fmt_db(w["sqnr_db"]), fmt_err(w["max_abs_err"])] for w in n["worst"])))
        out.append("")
    return out


def _calibration(report: ReportView) -> list[str]:
    if not report.calibration:
        return []
    facts, risky = calibration_rows(report)
    out = ["## Calibration", "", _table(["", "value"], ([md_escape(k), md_escape(v)] for k, v in facts)), "",
           f"Nodes re-decided because they would overflow fp16: {len(risky)}", ""]
    if risky:
        out.append(_table(["Node", "Op", "Module", "Evidence", "absmax"], (
            [md_escape(r.get("name", "")), md_escape(r.get("op", "")), md_escape(r.get("module", "")),
             md_escape(f"{r.get('evidence', '')} {r.get('source') or ''}".strip()), md_escape(r.get("absmax", ""))] for r in risky)))
        out.append("")
    return out


def _fp8(report: ReportView) -> list[str]:
    facts = fp8_facts(report)
    if not facts:
        return []
    out = ["## FP8", "", _table(["", "value"], ([md_escape(k), md_escape(v)] for k, v in facts)), ""]
    rows = fp8_layer_rows(report)
    if rows:
        def db(cell: tuple) -> str:
            return f"**{cell[0]}**" if cell[1] else cell[0]

        out += [FP8_NOTE, "", _table(
            ["Node", "Module", "Kernel", "Output", "grad_input", "grad_weight", "amax", "underflow", "overflow", "FLOPs"],
            ([md_escape(r["node"]), md_escape(r["module"]), r["kernel"], *(db(r["sqnr"][g]) for g in
              ("output", "grad_input", "grad_weight")), r["amax"], r["underflow"], r["overflow"], r["flops"]]
             for r in rows)), ""]
    return out


def _user_intent(report: ReportView) -> list[str]:
    """The decisions the model's own code made (autocast regions, ``_keep_in_fp32_modules``): above every rule file."""
    found: dict[str, dict[str, int]] = {}
    for r in report.nodes:
        if r.get("rule_level") == "user":
            counts = found.setdefault(r["rule"], {})
            counts[r["precision"]] = counts.get(r["precision"], 0) + 1
    if not found:
        return []
    return ["## The model's own precision intent", "",
            "Decided by the model code itself; this outranks every rule file (docs/rules.md, Precedence).", "",
            _table(["Rule", "Nodes"], ([md_escape(rule), " · ".join(f"{p} {n}" for p, n in sorted(counts.items()))]
                                       for rule, counts in found.items())), ""]


def _ops(report: ReportView) -> list[str]:
    return ["## Ops", "", _table(["Op", "Total", "FP16", "BF16", "FP32", "Deciding rules"], (
        [md_escape(o["op"]), o["total"], o["fp16"], o["bf16"], o["fp32"],
         "<br>".join(f"{md_escape(r['rule'])} ×{r['count']}" for r in o["rules"])]
        for o in report.ops
    )), ""]


def _unmatched(report: ReportView) -> list[str]:
    ops = report.summary["unmatched_ops"]
    if not ops:
        return []
    out = ["## Unmatched ops", "", "No rule matches these ops; their nodes stay fp32 (never lowered silently). Add them to a rule file.", ""]
    for op in ops:
        names = [r["name"] for r in report.nodes if r["op"] == op and r["unmatched"]]
        out.append(f"- {md_escape(op)}: {md_escape(', '.join(names[:10]))}{' …' if len(names) > 10 else ''}")
    return out + [""]


def _modules(report: ReportView) -> list[str]:
    return ["## Modules", "", _table(["Module", "Type", "Nodes", "BF16", "FP16", "FP32", "FLOPs", "Half FLOPs", "Out bytes", "Casts"], (
        [("&nbsp;&nbsp;" * mod["depth"]) + (md_escape(mod["path"].rsplit(".", 1)[-1]) or "(model)"), md_escape(mod["type"]),
         mod["nodes"], mod["bf16"], mod["fp16"], mod["fp32"], fmt_flops(mod["flops"]),
         fmt_pct(mod["half_flops"] / mod["flops"]) if mod["flops"] else "—", fmt_bytes(mod["out_bytes"]),
         f"{mod['casts']} ({fmt_bytes(mod['cast_bytes'])})" if mod["casts"] else "0"]
        for mod in report.modules
    )), ""]


def _casts(report: ReportView) -> list[str]:
    act, weight = split_casts(report)
    out = ["## Casts", "", f"### Activation casts ({len(act)}, {fmt_bytes(sum(c['bytes'] for c in act))} per forward)", ""]
    if act:
        out.append(_table(["Cast", "Source", "From", "To", "Bytes", "Consumers", "Rule"], (
            [md_escape(c["name"]), md_escape(c["src"]), c["src_dtype"], c["dtype"], c["bytes"],
             md_escape(", ".join(c["consumers"])), md_escape(c["rule"])] for c in act)))
    else:
        out.append("None.")
    out += ["", f"### Weight casts, O1 ({len(weight)}, {fmt_bytes(sum(c['bytes'] for c in weight))} per forward)", ""]
    if weight:
        out.append(_table(["Cast", "Parameter", "From", "To", "Bytes", "Consumers"], (
            [md_escape(c["name"]), md_escape(c["src"]), c["src_dtype"], c["dtype"], c["bytes"],
             md_escape(", ".join(c["consumers"]))] for c in weight)))
    else:
        out.append("None.")
    return out + [""]


def _nodes(report: ReportView) -> list[str]:
    measured = any("sqnr_db" in r for r in report.nodes)
    header = ["#", "Node", "Op", "Module", "Type", "Precision", "Rule", "FLOPs", "Out bytes"]
    header += ["SQNR", "Local SQNR"] if measured else []
    header += ["Source", "Reason"]

    def row(r: dict) -> list:
        cells = [r["index"], md_escape(r["name"]), md_escape(r["op"]), md_escape(r["module"]), md_escape(r["module_type"]),
                 r["precision"] + (" (fp8 GEMMs)" if r.get("gemm") == "fp8" else "")
                 + (f" ({r['fp32_math']} math)" if r.get("fp32_math") else "")
                 + (" (unmatched)" if r["unmatched"] else ""), md_escape(r["rule"]), r["flops"], r["out_bytes"]]
        if measured:
            cells += [fmt_db(r.get("sqnr_db")), fmt_db(r.get("local_sqnr_db"))] if "sqnr_db" in r else ["—", "—"]
        return cells + [md_escape(r["source"]), md_escape(node_reason(r))]

    return ["## Nodes", "", _table(header, (row(r) for r in report.nodes)), ""]
