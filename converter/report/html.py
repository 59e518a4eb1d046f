"""report.html: ONE self-contained page that works offline and makes no network request.

Inline CSS and a small inline script (the files in ``converter/report/assets/``, read at render time and pinned by a
Content-Security-Policy hash), inline SVG only: no CDN, no web font, no external image. The page has summary cards,
a precision picture (a per-layer strip coloured by precision with the casts marked), the matplotlib plots of
:mod:`converter.report.plots`, and a sortable, filterable node table. Every name that comes from the model (node,
module, class, op, rule pattern, reason, source) goes through :func:`html.escape`.
"""
from __future__ import annotations

import base64
import bisect
import hashlib
import html
from importlib import resources
from typing import Any, Optional

from converter.report.common import (
    BREAK_COLUMNS,
    COLORS,
    FP8_NOTE,
    FP32_MATH_NOTE,
    ORDER,
    ReportView,
    break_rows,
    breaks_note,
    calibration_rows,
    db_sort_key,
    fmt_bytes,
    fmt_db,
    fmt_err,
    fmt_flops,
    fmt_pct,
    fmt_ratio,
    fp8_facts,
    fp8_layer_rows,
    fp32_math_facts,
    half_count,
    header_warnings,
    module_groups,
    node_reason,
    precision_class,
    short_rule,
    split_casts,
    tuned_for,
    weight_cast_label,
)
from converter.report.plots import plots_html
from converter.rules.precedence import describe

__all__ = ["to_html"]


def _asset_text(name: str) -> str:
    """The text of ``converter/report/assets/<name>`` (package data: report.css, report.js)."""
    return (resources.files("converter.report") / "assets" / name).read_text(encoding="utf-8")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _badge(precision: str) -> str:
    return f'<span class="badge {precision_class(precision)}">{_e(precision)}</span>'


def _card(key: str, value: str, sub: str = "", *, warn: bool = False, bar: str = "") -> str:
    return (f'<div class="card{" warn" if warn else ""}"><div class="k">{_e(key)}</div><div class="v">{_e(value)}</div>'
            f'{f"<div class=s>{_e(sub)}</div>" if sub else ""}{bar}</div>')


def _bar(parts: dict[str, float]) -> str:
    total = sum(parts.values())
    if not total:
        return ""
    spans = "".join(f'<span style="width:{100 * v / total:.3f}%;background:{COLORS[k]}" title="{_e(k)}: {v}"></span>'
                    for k, v in parts.items() if v)
    return f'<div class="bar">{spans}</div>'


def _cards(report: ReportView) -> str:
    s, m, n = report.summary, report.memory, report.numerics
    by = s["by_precision"]
    counts = {"bf16": by.get("bf16", 0), "fp16": by.get("fp16", 0), "fp32": by.get("fp32", 0)}
    counts["other"] = s["compute_nodes"] - sum(counts.values())
    half_flops = s.get("half_flops", 0)
    cards = [
        _card(f"{report.precision} compute nodes", f"{half_count(report)} / {s['compute_nodes']}",
              f"bf16 {counts['bf16']} · fp16 {counts['fp16']} · fp32 {counts['fp32']}", bar=_bar(counts)),
        _card("FLOPs in half", fmt_pct(s["half_flop_fraction"]), f"{fmt_flops(half_flops)} of {fmt_flops(s['flops'])}",
              bar=_bar({report.precision if report.precision in COLORS else "bf16": half_flops, "fp32": s["flops"] - half_flops})),
        _card("Activation casts", str(s["casts"]), f"{fmt_bytes(s['cast_bytes'])} per forward"),
        _card(weight_cast_label(s).capitalize(), str(s.get("weight_casts", 0)), f"{fmt_bytes(s.get('weight_cast_bytes', 0))} per forward"),
        _card("Unmatched ops", str(len(s["unmatched_ops"])), ", ".join(s["unmatched_ops"][:4]) or "every op has a rule",
              warn=bool(s["unmatched_ops"])),
    ]
    for warning in header_warnings(report):
        cards.append(_card(warning.title, warning.headline, warning.text, warn=True))
    if m:
        cards.append(_card("Parameters (O2)", fmt_bytes(m.get("param_bytes_o2")), f"O1 (fp32 storage): {fmt_bytes(m.get('param_bytes_o1'))}"))
    saved = m.get("saved_activation_bytes") if m else None
    if saved:
        sub = f"{fmt_bytes(saved.get('converted'))} vs fp32 {fmt_bytes(saved.get('fp32'))}"
        if m.get("saved_ratio_autocast") is not None:
            sub += f" · autocast {fmt_ratio(m['saved_ratio_autocast'])}"
        cards.append(_card("Saved activations", fmt_ratio(m.get("saved_ratio")), sub))
    if n:
        sub = f"max |err| {fmt_err(n['vs_fp32']['max_abs_err'])}"
        if "autocast_vs_fp32" in n:
            sub += f" · autocast {fmt_db(n['autocast_vs_fp32']['sqnr_db'])}"
        cards.append(_card("Output SQNR vs fp32", fmt_db(n["vs_fp32"]["sqnr_db"]), sub))
    return '<div class="cards" id="summary-cards">' + "".join(cards) + "</div>"


#: the strip's geometry in px: node cell width, gap between cells, height of one line of cells, widest drawing
_CELL, _GAP, _ROW_H, _MAX_WIDTH = 13, 4, 30, 1380


def _strip_svg(report: ReportView) -> str:
    """The precision picture: one row per module group, one cell per node, casts marked."""
    groups = module_groups(report)
    if not groups:
        return "<p class=note>No compute nodes.</p>"
    act_before, weight_before = _casts_by_next_node(report)
    longest = max(min(len(name or "(top level)"), 32) for name, _ in groups)
    label_w = int(min(250, 7.4 * longest + 28))
    per_line = max(8, (_MAX_WIDTH - label_w - 10) // (_CELL + _GAP))
    widest = min(per_line, max(len(rows) for _, rows in groups))
    width = label_w + widest * (_CELL + _GAP) + 12
    parts: list[str] = []
    y = 8
    end_index = report.nodes[-1]["index"] + 1
    for gi, (name, rows) in enumerate(groups):
        label = name or "(top level)"
        short = label if len(label) <= 32 else "…" + label[-31:]
        types = {r["module_type"] for r in rows if r["module"] == name}
        parts.append(f'<text x="{label_w - 10}" y="{y + 13}" text-anchor="end" class="lbl"><title>{_e(label)}'
                     f'{(" (" + _e(", ".join(sorted(types))) + ")") if types else ""}</title>{_e(short)}</text>')
        for k, row in enumerate(rows):
            line, col = divmod(k, per_line)
            parts += _strip_cell(row, label_w + col * (_CELL + _GAP), y + line * _ROW_H, act_before, weight_before)
        lines = (len(rows) - 1) // per_line + 1
        if gi == len(groups) - 1 and end_index in act_before:  # output casts: after the very last node
            last_x = label_w + ((len(rows) - 1) % per_line + 1) * (_CELL + _GAP)
            parts.append(_cast_mark(last_x - _GAP / 2, y + (lines - 1) * _ROW_H, _act_tip(act_before[end_index])))
        y += lines * _ROW_H + 6
    height = y + 4
    style = ("<style>.lbl{font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;fill:#39424d}"
             ".um{font:bold 11px system-ui,sans-serif;fill:#fff;pointer-events:none}</style>")
    return (f'<svg class="strip-svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="precision of every compute node, by module">{style}{"".join(parts)}</svg>')


def _casts_by_next_node(report: ReportView) -> tuple[dict[int, list[dict]], dict[int, list[dict]]]:
    """Activation and weight casts keyed by the index of the compute node they are drawn before.

    A cast is drawn just before the first compute node that follows it in the graph; a cast after the last node
    (an output cast) is keyed by the last node's index + 1.
    """
    act_before: dict[int, list[dict]] = {}
    weight_before: dict[int, list[dict]] = {}
    node_indices = [r["index"] for r in report.nodes]
    for cast in report.casts:
        pos = bisect.bisect_right(node_indices, cast["index"])
        nxt = node_indices[pos] if pos < len(node_indices) else node_indices[-1] + 1
        (weight_before if cast["on_weight"] else act_before).setdefault(nxt, []).append(cast)
    return act_before, weight_before


def _act_tip(casts: list[dict]) -> str:
    return "activation cast: " + "; ".join(f"{c['name']}: {c['src_dtype']}→{c['dtype']} {c['bytes']} B" for c in casts)


def _strip_cell(row: dict, x: int, y: int, act_before: dict, weight_before: dict) -> list[str]:
    """One node's cell at (x, y), with the casts drawn before it and a ``?`` when no rule matched it."""
    parts = []
    if row["index"] in act_before:
        parts.append(_cast_mark(x - _GAP / 2, y, _act_tip(act_before[row["index"]])))
    if row["index"] in weight_before:
        tip = "; ".join(f"{c['src']}: {c['src_dtype']}→{c['dtype']}" for c in weight_before[row["index"]])
        parts.append(f'<circle cx="{x + _CELL / 2}" cy="{y - 5}" r="2.2" fill="{COLORS["weight_cast"]}">'
                     f'<title>{_e("weight cast (O1): " + tip)}</title></circle>')
    color = COLORS[precision_class(row["precision"])]
    tip = (f"{row['name']} · {row['op']} · {row['precision']}\n{row['module'] or '(top level)'} ({row['module_type']})\n"
           f"{row['rule']}\nFLOPs {row['flops']:,} · out {row['out_bytes']:,} B")
    stroke = ' stroke="#1d232b" stroke-width="1.2"' if row["flops"] > 0 else ""
    parts.append(f'<a href="#n{row["index"]}"><rect x="{x}" y="{y}" width="{_CELL}" height="18" rx="2" fill="{color}"'
                 f'{stroke}><title>{_e(tip)}</title></rect></a>')
    if row["unmatched"]:
        parts.append(f'<text x="{x + _CELL / 2}" y="{y + 13}" text-anchor="middle" class="um">?</text>')
    return parts


def _cast_mark(x: float, y: float, tip: str) -> str:
    """A red bar between two cells with a small triangle on top: an activation cast."""
    c = COLORS["cast"]
    return (f'<g><title>{_e(tip)}</title><rect x="{x - 1.25:.2f}" y="{y - 2}" width="2.5" height="22" fill="{c}"/>'
            f'<path d="M{x - 4:.2f} {y - 8} L{x + 4:.2f} {y - 8} L{x:.2f} {y - 2} Z" fill="{c}"/></g>')


def _legend() -> str:
    items = [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("other", "other dtype")]
    out = "".join(f'<span><i style="background:{COLORS[k]}"></i>{_e(t)}</span>' for k, t in items)
    out += f'<span><i style="background:{COLORS["cast"]};width:3px"></i>activation cast</span>'
    out += f'<span><i style="background:{COLORS["weight_cast"]};border-radius:6px;width:6px;height:6px;vertical-align:1px"></i>weight cast (O1)</span>'
    out += '<span><i style="background:#fff;border:1.5px solid #1d232b"></i>node with FLOPs</span>'
    out += '<span>? unmatched (kept fp32)</span>'
    return f'<div class="legend">{out}</div>'


def _tree_html(report: ReportView) -> str:
    mods = report.modules
    if not mods:
        return ""
    children: dict[Optional[str], list[dict]] = {}
    for mod in mods:
        children.setdefault(mod["parent"], []).append(mod)

    def mini(mod: dict) -> str:
        spans = "".join(f'<span style="width:{100 * mod[p] / mod["nodes"]:.2f}%;background:{COLORS[p]}"></span>'
                        for p in ORDER if mod.get(p))
        return f'<span class="mini">{spans}</span>'

    def render(mod: dict) -> str:
        name = mod["path"].rsplit(".", 1)[-1] if mod["path"] else "(model)"
        stats = (f"{mod['nodes']} nodes · bf16 {mod['bf16']} · fp16 {mod['fp16']} · fp32 {mod['fp32']}"
                 f" · {fmt_flops(mod['flops'])}" + (f" · {mod['casts']} casts ({fmt_bytes(mod['cast_bytes'])})" if mod["casts"] else ""))
        head = (f'<span class="path" title="{_e(mod["path"] or "(model)")}">{_e(name)}</span><span class="type">{_e(mod["type"])}</span>'
                f"{mini(mod)}<span class=stats>{_e(stats)}</span>")
        kids = children.get(mod["path"], [])
        if not kids:
            return f'<div style="margin-left:14px">{head}</div>'
        return f'<details{" open" if mod["depth"] < 2 else ""}><summary>{head}</summary>{"".join(render(k) for k in kids)}</details>'

    return '<div class="tree">' + "".join(render(root) for root in children.get(None, [])) + "</div>"


def _ops_html(report: ReportView) -> str:
    rows = []
    for o in report.ops:
        rules = "<br>".join(f'<span class="mono">{_e(r["rule"])}</span> ×{r["count"]}' for r in o["rules"])
        rows.append(f'<tr><td class="mono">{_e(o["op"])}{" <span class=bad>(unmatched)</span>" if o["unmatched"] else ""}</td>'
                    f'<td class=n>{o["total"]}</td><td class=n>{o["fp16"]}</td><td class=n>{o["bf16"]}</td><td class=n>{o["fp32"]}</td>'
                    f'<td class=n>{_e(fmt_flops(o["flops"]))}</td><td>{rules}</td></tr>')
    return ('<div class="tablewrap"><table><thead><tr><th>Op</th><th class=n>Total</th><th class=n>FP16</th><th class=n>BF16</th>'
            '<th class=n>FP32</th><th class=n>FLOPs</th><th>Deciding rules</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table></div>")


def _nodes_html(report: ReportView) -> str:
    measured = any("sqnr_db" in r for r in report.nodes)
    head = [("#", "n"), ("Node", ""), ("Op", ""), ("Module", ""), ("Type", ""), ("Precision", ""), ("Rule", ""),
            ("FLOPs", "n"), ("Out bytes", "n")]
    if measured:
        head += [("SQNR", "n"), ("Local SQNR", "n")]
    head += [("Source", ""), ("Reason", "")]
    ths = "".join(f'<th{" class=n data-t=n" if t == "n" else ""}>{_e(h)}</th>' for h, t in head)
    rows = []
    unmatched = ' <span class=bad title="no rule matches this op">unmatched</span>'
    for r in report.nodes:
        cells = [
            f'<td class=n data-v="{r["index"]}">{r["index"]}</td>',
            f'<td class="mono">{_e(r["name"])}</td>',
            f'<td class="mono">{_e(r["op"])}</td>',
            f'<td class="mono">{_e(r["module"])}</td>',
            f'<td>{_e(r["module_type"])}</td>',
            f'<td data-v="{_e(r["precision"])}">{_badge(r["precision"])}{unmatched if r["unmatched"] else ""}'
            + (f' <span class="mono" title="fp32 math">{_e(r["fp32_math"])}</span>' if r.get("fp32_math") else "")
            + (' <span class="mono" title="its GEMMs run in float8 (storage and IO bf16)">fp8</span>'
               if r.get("gemm") == "fp8" else "") + "</td>",
            f'<td class="mono nw" title="{_e(r["rule"])}">{_e(short_rule(r["rule"]))}</td>',
            f'<td class=n data-v="{r["flops"]}">{_e(fmt_flops(r["flops"]))}</td>',
            f'<td class=n data-v="{r["out_bytes"]}">{_e(fmt_bytes(r["out_bytes"]))}</td>',
        ]
        if measured:
            for key in ("sqnr_db", "local_sqnr_db"):
                v = r.get(key)
                cells.append(f'<td class=n data-v="{db_sort_key(v)}">{_e(fmt_db(v)) if key in r else "—"}</td>')
        cells.append(f'<td class="mono nw">{_e(r["source"])}</td>')
        reason = _e(node_reason(r))
        cells.append(f'<td data-v="{reason}"><div class="reason" title="{reason}">{reason}</div></td>')
        rows.append(f'<tr id="n{r["index"]}" data-p="{_e(precision_class(r["precision"]))}" data-u="{int(bool(r["unmatched"]))}">{"".join(cells)}</tr>')
    filters = ('<div class="filters"><input type="search" id="q" placeholder="Filter by name, op, module, rule…" aria-label="filter">'
               '<select id="prec" aria-label="precision"><option value="">all precisions</option><option value="bf16">bf16</option>'
               '<option value="fp16">fp16</option><option value="fp32">fp32</option><option value="other">other</option></select>'
               '<label><input type="checkbox" id="unm"> unmatched only</label><span class="count" id="count"></span></div>')
    return (filters + '<div class="tablewrap"><table id="node-table"><thead><tr>' + ths + "</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table></div>")


def _casts_html(report: ReportView) -> str:
    act, weight = split_casts(report)
    out = [f"<h3>Activation casts: {len(act)}, {_e(fmt_bytes(sum(c['bytes'] for c in act)))} per forward</h3>"]
    if act:
        out.append('<div class="tablewrap"><table><thead><tr><th>Cast</th><th>Source</th><th>From → to</th><th class=n>Bytes</th>'
                   "<th>Consumers</th><th>Rule</th></tr></thead><tbody>")
        for c in act:
            out.append(f'<tr><td class="mono">{_e(c["name"])}{"" if c["inserted"] else " <span class=note>(model&#39;s own)</span>"}</td>'
                       f'<td class="mono">{_e(c["src"])}</td><td>{_e(c["src_dtype"])} → {_e(c["dtype"])}</td>'
                       f'<td class=n>{c["bytes"]:,}</td><td class="mono">{_e(", ".join(c["consumers"]))}</td>'
                       f'<td class="mono">{_e(c["rule"])}</td></tr>')
        out.append("</tbody></table></div>")
    else:
        out.append("<p class=note>None.</p>")
    out.append(f"<h3>Weight casts (O1, parameters stay fp32 and are cast in the graph): {len(weight)}, "
               f"{_e(fmt_bytes(sum(c['bytes'] for c in weight)))} per forward</h3>")
    if weight:
        out.append('<div class="tablewrap" style="max-height:260px"><table><thead><tr><th>Parameter</th><th>From → to</th>'
                   "<th class=n>Bytes</th><th>Consumers</th></tr></thead><tbody>")
        for c in weight:
            out.append(f'<tr><td class="mono">{_e(c["src"])}</td><td>{_e(c["src_dtype"])} → {_e(c["dtype"])}</td>'
                       f'<td class=n>{c["bytes"]:,}</td><td class="mono">{_e(", ".join(c["consumers"]))}</td></tr>')
        out.append("</tbody></table></div>")
    return "".join(out)


def _memory_html(report: ReportView) -> str:
    m = report.memory
    rows = [("Parameters, O1 (fp32, cast in the graph)", fmt_bytes(m.get("param_bytes_o1")), ""),
            ("Parameters, O2 (half where every use is a half matmul/conv weight)", fmt_bytes(m.get("param_bytes_o2")),
             f"{m.get('params_half_in_o2', 0):,} of {m.get('param_count', 0):,} parameters in half"),
            ("O1 half weight copies made per forward", fmt_bytes(m.get("o1_weight_copy_bytes")), "")]
    saved = m.get("saved_activation_bytes")
    if saved:
        copies = m.get("saved_weight_copy_bytes", {})
        rows += [("Saved activations, fp32 original (measured)", fmt_bytes(saved.get("fp32")), "baseline"),
                 ("Saved activations, converted (measured)", fmt_bytes(saved.get("converted")), f"{fmt_ratio(m.get('saved_ratio'))} of fp32"
                  + (f"; plus {fmt_bytes(copies.get('converted'))} half weight copies" if copies.get("converted") else ""))]
        if "autocast" in saved:
            rows.append(("Saved activations, torch.autocast (measured)", fmt_bytes(saved.get("autocast")),
                         f"{fmt_ratio(m.get('saved_ratio_autocast'))} of fp32"
                         + (f"; plus {fmt_bytes(copies.get('autocast'))} half weight copies" if copies.get("autocast") else "")))
    body = "".join(f"<tr><td>{_e(a)}</td><td class=n>{_e(b)}</td><td class=note>{_e(c)}</td></tr>" for a, b, c in rows)
    note = (f"<p class=note>{_e(m.get('saved_method', ''))}</p>" if saved else
            "<p class=note>Saved activations not measured: run <span class=mono>converter.numerics.measure.measure(conv)</span>.</p>")
    return f"<table><tbody>{body}</tbody></table>{note}"


def _fp32_math_html(report: ReportView) -> str:
    rows, warnings, notes = fp32_math_facts(report)
    table = "".join(f'<tr><td>{_e(k)}</td><td class="mono">{_e(v)}</td></tr>' for k, v in rows)
    warn = "".join(f"<p class=note><span class=bad>warning</span> {_e(w)}</p>" for w in warnings)
    note = "".join(f"<p class=note>{_e(n)}</p>" for n in notes)
    return f"<p class=note>{_e(FP32_MATH_NOTE)}</p>{warn}{note}<table><tbody>{table}</tbody></table>"


def _numerics_html(report: ReportView) -> str:
    n = report.numerics
    if not n:
        return "<p class=note>Not measured: run <span class=mono>converter.numerics.measure.measure(conv)</span>.</p>"
    rows = [("converted vs fp32", n["vs_fp32"])]
    if "autocast_vs_fp32" in n:
        rows += [("torch.autocast vs fp32", n["autocast_vs_fp32"]), ("converted vs torch.autocast", n["vs_autocast"])]
    body = "".join(f"<tr><td>{_e(a)}</td><td class=n>{_e(fmt_db(v['sqnr_db']))}</td><td class=n>{_e(fmt_err(v['max_abs_err']))}</td>"
                   f"<td class=n>{v['numel']:,}</td></tr>" for a, v in rows)
    out = [f"<p class=note>Outputs on the example inputs ({_e(n.get('mode', ''))} mode). SQNR = 20·log10(‖ref‖/‖ref−out‖); higher is better.</p>",
           "<table><thead><tr><th>Comparison</th><th class=n>SQNR</th><th class=n>max |error|</th><th class=n>elements</th></tr></thead>"
           f"<tbody>{body}</tbody></table>"]
    if n.get("worst"):
        out.append("<h3>Error attribution: the nodes that add the most error</h3><p class=note>Local SQNR: the node run on fp32 values "
                   "rounded to the dtypes its inputs have in the converted model, against fp32 — the error it adds by itself. "
                   "Cumulative: its converted output against fp32.</p>")
        out.append("<table><thead><tr><th>Node</th><th>Op</th><th>Module</th><th>Precision</th><th class=n>Local SQNR</th>"
                   "<th class=n>Cumulative SQNR</th><th class=n>max |error|</th></tr></thead><tbody>")
        for w in n["worst"]:
            out.append(f'<tr><td class="mono">{_e(w["name"])}</td><td class="mono">{_e(w["op"])}</td><td class="mono">{_e(w["module"])}</td>'
                       f'<td>{_badge(w["precision"])}</td><td class=n>{_e(fmt_db(w["local_sqnr_db"]))}</td>'
                       f'<td class=n>{_e(fmt_db(w["sqnr_db"]))}</td><td class=n>{_e(fmt_err(w["max_abs_err"]))}</td></tr>')
        out.append("</tbody></table>")
    return "".join(out)


def _calibration_html(report: ReportView) -> str:
    facts, risky = calibration_rows(report)
    out = ["<table><tbody>" + "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in facts) + "</tbody></table>"]
    out.append(f"<h3>Nodes re-decided because they would overflow fp16: {len(risky)}</h3>")
    if risky:
        out.append("<table><thead><tr><th>Node</th><th>Op</th><th>Module</th><th>Evidence</th><th class=n>absmax</th></tr></thead><tbody>")
        for row in risky:
            out.append(f'<tr><td class="mono">{_e(row.get("name", ""))}</td><td class="mono">{_e(row.get("op", ""))}</td>'
                       f'<td class="mono">{_e(row.get("module", ""))}</td><td>{_e(row.get("evidence", ""))} {_e(row.get("source") or "")}</td>'
                       f'<td class=n>{_e(row.get("absmax", ""))}</td></tr>')
        out.append("</tbody></table>")
    return "".join(out)


def _fp8_html(report: ReportView) -> str:
    facts = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in fp8_facts(report))
    out = [f"<table><tbody>{facts}</tbody></table>"]
    rows = fp8_layer_rows(report)
    if rows:
        out.append(f"<p class=note>{_e(FP8_NOTE)}</p>")
        out.append('<div class="tablewrap"><table id="fp8-table"><thead><tr><th>Node</th><th>Module</th><th>Kernel</th>'
                   "<th class=n>Output</th><th class=n>grad_input</th><th class=n>grad_weight</th><th>amax</th>"
                   "<th>underflow</th><th>overflow</th><th class=n>FLOPs</th></tr></thead><tbody>")
        for r in rows:
            dbs = "".join(f'<td class="n{" fp8-below" if below else ""}">'
                          + (f'<span class=bad title="under the SQNR floor">{_e(text)}</span>' if below else _e(text)) + "</td>"
                          for text, below in (r["sqnr"][g] for g in ("output", "grad_input", "grad_weight")))
            out.append(f'<tr><td class="mono">{_e(r["node"])}</td><td class="mono">{_e(r["module"])}</td><td>{_e(r["kernel"])}</td>'
                       f'{dbs}<td class="mono nw">{_e(r["amax"])}</td><td class="mono nw">{_e(r["underflow"])}</td>'
                       f'<td class="mono nw">{_e(r["overflow"])}</td><td class=n>{_e(r["flops"])}</td></tr>')
        out.append("</tbody></table></div>")
    return "".join(out)


def _unmatched_html(report: ReportView) -> str:
    ops = report.summary["unmatched_ops"]
    if not ops:
        return "<p class=note><span class=ok>✓</span> Every compute node matched a rule.</p>"
    items = []
    for op in ops:
        names = [r["name"] for r in report.nodes if r["op"] == op and r["unmatched"]]
        items.append(f'<li><span class="mono">{_e(op)}</span>: {len(names)} node(s) kept fp32 — '
                     f'<span class="mono">{_e(", ".join(names[:8]))}{" …" if len(names) > 8 else ""}</span></li>')
    return ("<p class=note>No rule matches these ops; their nodes stay fp32 (never lowered silently). "
            "Add them to a rule file to decide them.</p><ul>" + "".join(items) + "</ul>")


def to_html(report: ReportView) -> str:
    """report.html: one self-contained page, no network access (see the module docstring)."""
    css, js = "\n" + _asset_text("report.css"), "\n" + _asset_text("report.js")
    script_hash = base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode("ascii")
    csp = (f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'sha256-{script_hash}'; "
           "base-uri 'none'; form-action 'none'")
    s = report.summary
    title = f"Precision audit — {report.model or 'model'}"
    sections = _sections(report)
    nav = "".join(f'<a href="#{sid}">{_e(name)}</a>' for sid, name, _ in sections)
    body = "".join(f'<section id="{sid}"><h2>{_e(name)}</h2>{content}</section>' for sid, name, content in sections)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{_e(csp)}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{css}</style></head><body>"
        f'<header><h1>{_e(title)}</h1><div class="meta">target {_e(report.precision)} · tracer {_e(report.tracer)} · '
        f'{s["nodes"]} graph nodes · {s["compute_nodes"]} compute nodes · tuned for {tuned_for(report, _e)}</div>'
        f'<div class="line" id="summary-line">{_e(report.line)}</div></header>'
        f"<nav>{nav}</nav><main>{body}</main>"
        '<footer>Generated by mpconvert from node.meta only; measurements on the example inputs. '
        "This page is self-contained and makes no network requests.</footer>"
        f"<script>{js}</script></body></html>\n"
    )


def _breaks_html(report: ReportView) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in BREAK_COLUMNS)
    body = "".join("<tr>" + "".join(f'<td class="mono">{_e(str(c))}</td>' for c in row[:5])
                   + f"<td class=n>{row[5]:,}</td></tr>" for row in break_rows(report))
    return (f"<p class=note>{_e(breaks_note(report))}</p>"
            f'<div class="tablewrap"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>')


def _sections(report: ReportView) -> list[tuple[str, str, str]]:
    """(id, title, inner HTML) of every section, in page order."""
    s = report.summary
    files = ", ".join(report.rules.get("files", [])) or "defaults"
    return [
        ("summary", "Summary", _cards(report) + f'<p class="note">Rule files: <span class="mono">{_e(files)}</span>. '
         f'Precedence: {_e(describe())}.</p>'),
        *([("breaks", f"Graph breaks ({len(break_rows(report))})", _breaks_html(report))] if break_rows(report) else []),
        ("picture", "Precision picture",
         "<p class=note>Every compute node in graph order, one row per module; hover a cell for its rule, click to jump to its row.</p>"
         + _legend() + f'<div class="strip">{_strip_svg(report)}</div>'),
        ("plots", "FLOPs and bytes", plots_html(report)),
        ("numerics", "Numerics", _numerics_html(report)),
        ("memory", "Memory", _memory_html(report)),
        *([("fp32math", "fp32 math", _fp32_math_html(report))] if report.fp32_math else []),
        *([("calibration", "Calibration", _calibration_html(report))] if report.calibration else []),
        *([("fp8", "FP8", _fp8_html(report))] if report.records.fp8 is not None else []),
        ("ops", "Ops", _ops_html(report)),
        ("unmatched", f"Unmatched ops ({len(s['unmatched_ops'])})", _unmatched_html(report)),
        ("modules", "Modules", _tree_html(report)),
        ("casts", "Casts", _casts_html(report)),
        ("nodes", f"Nodes ({s['compute_nodes']})", _nodes_html(report)),
    ]
