"""Renderers of the audit :class:`~converter.report.Report`: Markdown, HTML, terminal, and ``explain``.

* :func:`to_markdown` — report.md;
* :func:`to_html` — report.html: ONE self-contained file that works offline and makes no network
  request (inline CSS, a small inline script pinned by a Content-Security-Policy hash, inline SVG
  only: no CDN, no web font, no external image). It has summary cards, a precision picture (a
  per-layer strip coloured by precision with the casts marked), matplotlib plots rendered to
  inline SVG, and a sortable, filterable node table;
* :func:`print_report` — a rich terminal rendering;
* :func:`write_reports` — report.json, report.md and report.html into a directory;
* :func:`explain` — the decision chain of one node.

Every name that comes from the model (node, module, class, op, rule pattern, reason, source) is
escaped: :func:`html.escape` in HTML, :func:`md_escape` in Markdown, ``rich.text.Text`` (never
markup) in the terminal.
"""
from __future__ import annotations

import base64
import bisect
import difflib
import hashlib
import html
import io
import math
import re
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from converter.ir.meta import HALF_NAMES, note_text
from converter.report.build import Report, build_report
from converter.rules.precedence import OVERRIDE_LEVEL, SCOPED_LEVELS, describe, rank
from converter.ir.meta import GM_GRAPH
from converter.ir.meta import HALF_NAMES
from converter.numerics.common import from_json_float
from converter.report.build import PRECEDENCE, Report, build_report

__all__ = ["to_markdown", "to_html", "print_report", "write_reports", "explain", "md_escape", "COLORS"]

#: precision -> colour, shared by the HTML strip, the plots and the badges
COLORS = {"bf16": "#2f9e66", "fp16": "#2b7bb9", "fp32": "#e3903a", "other": "#9aa3ad", "cast": "#d1453b", "weight_cast": "#5b6470"}
_ORDER = ("bf16", "fp16", "fp32", "other")


# ---------------------------------------------------------------------------------------------
# formatting


def _bytes(n: Optional[float]) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _flops(n: Optional[float]) -> str:
    if not n:
        return "0"
    n = float(n)
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} FLOP"


def _db(x: Any) -> str:
    """An SQNR (a float, or report.json's ``"inf"``/``"-inf"``/``"nan"``): +inf and None (no error
    measured: e.g. a local SQNR where no input dtype changes) read "exact"."""
    value = from_json_float(x)
    if value is None or value == math.inf:
        return "exact"
    return f"{value:.1f} dB"


def _db_sort_key(x: Any) -> float:
    """A finite number for the HTML table's sort (exact sorts above every measured SQNR)."""
    value = from_json_float(x)
    return 999.0 if value is None or value == math.inf else (-999.0 if not math.isfinite(value) else value)


def _pct(x: Optional[float]) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _err(x: Any) -> str:
    return "—" if x is None else f"{x:.3g}"


def _cls(precision: str) -> str:
    return precision if precision in ("bf16", "fp16", "fp32") else "other"


def _half_count(report: Report) -> int:
    return sum(report.summary["by_precision"].get(p, 0) for p in HALF_NAMES)


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


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _groups(report: Report) -> list[tuple[str, list[dict]]]:
    """Consecutive runs of nodes by module prefix, at a depth where no run holds over half the graph."""
    nodes = report.nodes
    if not nodes:
        return []

    def key(row: dict, depth: int) -> str:
        parts = row["module"].split(".") if row["module"] else []
        return ".".join(parts[:depth])

    def runs(depth: int) -> list[tuple[str, list[dict]]]:
        out: list[tuple[str, list[dict]]] = []
        for row in nodes:
            k = key(row, depth)
            if out and out[-1][0] == k:
                out[-1][1].append(row)
            else:
                out.append((k, [row]))
        return out

    max_depth = max(len(r["module"].split(".")) if r["module"] else 0 for r in nodes)
    chosen = runs(1)
    for depth in range(1, max(1, max_depth) + 1):
        candidate = runs(depth)
        if len(candidate) > 150 and depth > 1:
            break
        chosen = candidate
        biggest = max(len(rows) for _, rows in candidate)
        if biggest <= 0.5 * len(nodes):
            break
    return chosen


def _module_bytes(report: Report) -> list[tuple[str, dict]]:
    """Output bytes per precision for each module group (same grouping as the strip)."""
    totals: dict[str, dict] = {}
    for name, rows in _groups(report):
        entry = totals.setdefault(name or "(top level)", {p: 0 for p in _ORDER})
        for row in rows:
            entry[_cls(row["precision"])] += row["out_bytes"]
    return sorted(totals.items(), key=lambda kv: -sum(kv[1].values()))


# ---------------------------------------------------------------------------------------------
# Markdown


def _md_table(header: list[str], rows: Iterable[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def _tuned_for(report: Report, escape) -> str:
    """The conversion's target device and what its lowerings changed (converter/lower.py)."""
    device = report.extra.get("device")
    if not device:
        return "portable (no device named: nothing device-specific)"
    lowered = report.extra.get("lowered") or []
    what = escape(", ".join(lowered)) if lowered else "nothing to lower"
    return f"{escape(str(device))} · lowered: {what}"


def to_markdown(report: Report) -> str:
    """report.md: the summary line, memory, numerics, ops, modules, casts and every node."""
    s = report.summary
    by = s["by_precision"]
    out: list[str] = []
    out.append(f"# Precision audit: {md_escape(report.model or 'model')}")
    out.append("")
    out.append(f"**{md_escape(report.line)}**")
    out.append("")
    out.append(f"Target precision `{md_escape(report.precision)}` · tracer `{md_escape(report.tracer)}` · "
               f"{s['nodes']} graph nodes, {s['compute_nodes']} compute nodes · rule files: "
               f"{md_escape(', '.join(report.rules.get('files', [])) or 'defaults')}")
    out.append("")
    out.append("## Summary")
    out.append("")
    out.append(_md_table(["", "value"], [
        ["compute nodes", s["compute_nodes"]],
        ["by precision", f"bf16 {by.get('bf16', 0)} · fp16 {by.get('fp16', 0)} · fp32 {by.get('fp32', 0)}"],
        ["FLOPs in half", f"{_pct(s['half_flop_fraction'])} of {_flops(s['flops'])}"],
        ["activation casts", f"{s['casts']} ({_bytes(s['cast_bytes'])} per forward)"],
        ["weight casts (O1)", f"{s.get('weight_casts', 0)} ({_bytes(s.get('weight_cast_bytes', 0))} per forward)"],
        ["unmatched ops", md_escape(", ".join(s["unmatched_ops"])) or "none"],
        ["tuned for", _tuned_for(report, md_escape)],
    ]))
    out.append("")
    out.extend(_md_memory(report))
    out.extend(_md_numerics(report))
    if report.calibration:
        facts, risky = _calibration_rows(report)
        out += ["## Calibration", "", _md_table(["", "value"], ([md_escape(k), md_escape(v)] for k, v in facts)), ""]
        out.append(f"Nodes re-decided because they would overflow fp16: {len(risky)}")
        out.append("")
        if risky:
            out.append(_md_table(["Node", "Op", "Module", "Evidence", "absmax"], (
                [md_escape(r.get("name", "")), md_escape(r.get("op", "")), md_escape(r.get("module", "")),
                 md_escape(f"{r.get('evidence', '')} {r.get('source') or ''}".strip()), md_escape(r.get("absmax", ""))] for r in risky)))
            out.append("")
    out.append("## Ops")
    out.append("")
    out.append(_md_table(["Op", "Total", "FP16", "BF16", "FP32", "Deciding rules"], (
        [md_escape(o["op"]), o["total"], o["fp16"], o["bf16"], o["fp32"],
         "<br>".join(f"{md_escape(r['rule'])} ×{r['count']}" for r in o["rules"])]
        for o in report.ops
    )))
    out.append("")
    if s["unmatched_ops"]:
        out.append("## Unmatched ops")
        out.append("")
        out.append("No rule matches these ops; their nodes stay fp32 (never lowered silently). Add them to a rule file.")
        out.append("")
        for op in s["unmatched_ops"]:
            names = [r["name"] for r in report.nodes if r["op"] == op and r["unmatched"]]
            out.append(f"- {md_escape(op)}: {md_escape(', '.join(names[:10]))}{' …' if len(names) > 10 else ''}")
        out.append("")
    out.append("## Modules")
    out.append("")
    out.append(_md_table(["Module", "Type", "Nodes", "BF16", "FP16", "FP32", "FLOPs", "Half FLOPs", "Out bytes", "Casts"], (
        [("&nbsp;&nbsp;" * mod["depth"]) + (md_escape(mod["path"].rsplit(".", 1)[-1]) or "(model)"), md_escape(mod["type"]),
         mod["nodes"], mod["bf16"], mod["fp16"], mod["fp32"], _flops(mod["flops"]),
         _pct(mod["half_flops"] / mod["flops"]) if mod["flops"] else "—", _bytes(mod["out_bytes"]),
         f"{mod['casts']} ({_bytes(mod['cast_bytes'])})" if mod["casts"] else "0"]
        for mod in report.modules
    )))
    out.append("")
    act = [c for c in report.casts if not c["on_weight"]]
    weight = [c for c in report.casts if c["on_weight"]]
    out.append("## Casts")
    out.append("")
    out.append(f"### Activation casts ({len(act)}, {_bytes(sum(c['bytes'] for c in act))} per forward)")
    out.append("")
    if act:
        out.append(_md_table(["Cast", "Source", "From", "To", "Bytes", "Consumers", "Rule"], (
            [md_escape(c["name"]), md_escape(c["src"]), c["src_dtype"], c["dtype"], c["bytes"],
             md_escape(", ".join(c["consumers"])), md_escape(c["rule"])] for c in act)))
    else:
        out.append("None.")
    out.append("")
    out.append(f"### Weight casts, O1 ({len(weight)}, {_bytes(sum(c['bytes'] for c in weight))} per forward)")
    out.append("")
    if weight:
        out.append(_md_table(["Cast", "Parameter", "From", "To", "Bytes", "Consumers"], (
            [md_escape(c["name"]), md_escape(c["src"]), c["src_dtype"], c["dtype"], c["bytes"],
             md_escape(", ".join(c["consumers"]))] for c in weight)))
    else:
        out.append("None.")
    out.append("")
    out.append("## Nodes")
    out.append("")
    measured = any("sqnr_db" in r for r in report.nodes)
    header = ["#", "Node", "Op", "Module", "Type", "Precision", "Rule", "FLOPs", "Out bytes"]
    header += ["SQNR", "Local SQNR"] if measured else []
    header += ["Source", "Reason"]

    def node_row(r: dict) -> list:
        cells = [r["index"], md_escape(r["name"]), md_escape(r["op"]), md_escape(r["module"]), md_escape(r["module_type"]),
                 r["precision"] + (" (unmatched)" if r["unmatched"] else ""), md_escape(r["rule"]), r["flops"], r["out_bytes"]]
        if measured:
            cells += [_db(r.get("sqnr_db")), _db(r.get("local_sqnr_db"))] if "sqnr_db" in r else ["—", "—"]
        return cells + [md_escape(r["source"]), md_escape(_reason(r))]

    out.append(_md_table(header, (node_row(r) for r in report.nodes)))
    out.append("")
    return "\n".join(out)


def _md_memory(report: Report) -> list[str]:
    m = report.memory
    if not m:
        return []
    out = ["## Memory", ""]
    rows = [["parameters, O1 (fp32, cast in the graph)", _bytes(m.get("param_bytes_o1"))],
            ["parameters, O2 (stored in half where every use is half)", _bytes(m.get("param_bytes_o2"))],
            ["O1 weight copies per forward", _bytes(m.get("o1_weight_copy_bytes"))]]
    saved = m.get("saved_activation_bytes")
    if saved:
        rows.append(["saved activations, fp32 model (measured)", _bytes(saved.get("fp32"))])
        rows.append(["saved activations, converted (measured)", f"{_bytes(saved.get('converted'))} ({_ratio(m.get('saved_ratio'))} of fp32)"])
        if "autocast" in saved:
            rows.append(["saved activations, torch.autocast (measured)", f"{_bytes(saved.get('autocast'))} ({_ratio(m.get('saved_ratio_autocast'))} of fp32)"])
        copies = m.get("saved_weight_copy_bytes", {})
        rows.append(["saved half weight copies, converted / autocast", f"{_bytes(copies.get('converted'))} / {_bytes(copies.get('autocast'))}"])
    else:
        rows.append(["saved activations", "not measured (run converter.measure.measure)"])
    out.append(_md_table(["", "bytes"], rows))
    out.append("")
    return out


def _ratio(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _md_numerics(report: Report) -> list[str]:
    n = report.numerics
    out = ["## Numerics", ""]
    if not n:
        out += ["Not measured (run `converter.measure.measure`).", ""]
        return out
    rows = [["converted vs fp32", _db(n["vs_fp32"]["sqnr_db"]), _err(n["vs_fp32"]["max_abs_err"])]]
    if "autocast_vs_fp32" in n:
        rows.append(["torch.autocast vs fp32", _db(n["autocast_vs_fp32"]["sqnr_db"]), _err(n["autocast_vs_fp32"]["max_abs_err"])])
        rows.append(["converted vs torch.autocast", _db(n["vs_autocast"]["sqnr_db"]), _err(n["vs_autocast"]["max_abs_err"])])
    out.append(f"Outputs on the example inputs ({md_escape(n.get('mode', ''))} mode); SQNR = 20·log10(‖ref‖/‖ref−out‖).")
    out.append("")
    out.append(_md_table(["comparison", "SQNR", "max abs error"], rows))
    out.append("")
    if n.get("worst"):
        out.append("### Error attribution: nodes that add the most error")
        out.append("")
        out.append("Local SQNR: the node run on fp32 inputs rounded to its converted input dtypes, against fp32. "
                   "Cumulative SQNR: its output in the converted model against fp32.")
        out.append("")
        out.append(_md_table(["Node", "Op", "Module", "Precision", "Local SQNR", "Cumulative SQNR", "max abs error"], (
            [md_escape(w["name"]), md_escape(w["op"]), md_escape(w["module"]), w["precision"], _db(w["local_sqnr_db"]),
             _db(w["sqnr_db"]), _err(w["max_abs_err"])] for w in n["worst"])))
        out.append("")
    return out


# ---------------------------------------------------------------------------------------------
# HTML


_CSS = """
:root{--fg:#1d232b;--muted:#5f6b78;--line:#e3e7ec;--bg:#f6f8fa;--card:#fff;--bf16:#2f9e66;--fp16:#2b7bb9;--fp32:#e3903a;--other:#9aa3ad;--cast:#d1453b}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;color:var(--fg);background:var(--bg)}
header{background:#17202b;color:#fff;padding:22px 32px 18px}
header h1{margin:0 0 4px;font-size:22px;font-weight:600}
header .meta{color:#b5c0cc;font-size:13px}
header .line{margin-top:10px;font-size:15px;color:#fff;font-weight:500}
nav{position:sticky;top:0;z-index:5;background:#fff;border-bottom:1px solid var(--line);padding:8px 32px;display:flex;gap:18px;flex-wrap:wrap}
nav a{color:var(--muted);text-decoration:none;font-size:13px}
nav a:hover{color:var(--fg)}
main{padding:20px 32px 40px;max-width:1500px}
section{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:16px 20px;margin:0 0 18px}
h2{font-size:16px;margin:0 0 12px;font-weight:600}
h3{font-size:14px;margin:14px 0 8px;font-weight:600}
p.note{color:var(--muted);margin:4px 0 10px;font-size:13px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(190px,1fr));gap:12px;margin-bottom:18px}
.card{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:12px 14px}
.card .k{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:22px;font-weight:600;margin-top:2px}
.card .s{color:var(--muted);font-size:12px;margin-top:2px}
.card.warn{border-color:#e9b44c;background:#fffaf0}
.bar{display:flex;height:8px;border-radius:4px;overflow:hidden;margin-top:8px;background:var(--line)}
.bar span{display:block;height:100%}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid var(--line);vertical-align:top}
th{background:#fafbfc;font-weight:600;color:#39424d;white-space:nowrap}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tbody tr:hover{background:#f3f6f9}
.badge{display:inline-block;padding:0 7px;border-radius:9px;font-size:12px;font-weight:600;color:#fff}
.badge.bf16{background:var(--bf16)}.badge.fp16{background:var(--fp16)}.badge.fp32{background:var(--fp32)}.badge.other{background:var(--other)}
.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
.reason{max-width:320px;color:var(--muted);white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.nw{white-space:nowrap}
.tablewrap{max-height:640px;overflow:auto;border:1px solid var(--line);border-radius:6px}
.tablewrap thead th{position:sticky;top:0;z-index:1}
#node-table th{cursor:pointer;user-select:none}
#node-table th[data-d=a]::after{content:" \\25B2";font-size:10px}
#node-table th[data-d=d]::after{content:" \\25BC";font-size:10px}
.filters{display:flex;gap:12px;align-items:center;margin-bottom:10px;flex-wrap:wrap}
.filters input[type=search]{padding:6px 10px;border:1px solid #cdd4dc;border-radius:6px;min-width:280px;font:inherit}
.filters select{padding:5px 8px;border:1px solid #cdd4dc;border-radius:6px;font:inherit}
.count{color:var(--muted);font-size:12px}
.legend{display:flex;gap:16px;flex-wrap:wrap;font-size:12px;color:var(--muted);margin:0 0 10px}
.legend i{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:-2px;margin-right:5px}
.plots{display:grid;grid-template-columns:repeat(auto-fit,minmax(460px,1fr));gap:16px}
.plots svg{width:100%;height:auto}
.strip{overflow-x:auto}
details{margin-left:14px}
details>summary{cursor:pointer;padding:2px 0;list-style-position:outside}
.tree .path{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
.tree .type{color:var(--muted);margin-left:6px}
.tree .stats{color:var(--muted);font-size:12px;margin-left:8px}
.tree .mini{display:inline-flex;width:90px;height:7px;border-radius:3px;overflow:hidden;vertical-align:middle;margin-left:8px;background:var(--line)}
.tree .mini span{display:block;height:100%}
.ok{color:var(--bf16)}.bad{color:var(--cast)}
footer{color:var(--muted);font-size:12px;padding:0 32px 30px}
"""

_JS = """
(function(){
var t=document.getElementById('node-table');if(!t)return;
var tb=t.tBodies[0],rows=Array.prototype.slice.call(tb.rows);
var q=document.getElementById('q'),p=document.getElementById('prec'),u=document.getElementById('unm'),c=document.getElementById('count');
function f(){var s=q.value.toLowerCase(),pv=p.value,uv=u.checked,n=0;
rows.forEach(function(r){var ok=(!s||r.textContent.toLowerCase().indexOf(s)>=0)&&(!pv||r.getAttribute('data-p')===pv)&&(!uv||r.getAttribute('data-u')==='1');r.hidden=!ok;if(ok)n++;});
c.textContent=n+' of '+rows.length+' nodes';}
q.addEventListener('input',f);p.addEventListener('change',f);u.addEventListener('change',f);
var ths=t.tHead.rows[0].cells;
Array.prototype.forEach.call(ths,function(th,i){th.addEventListener('click',function(){
var num=th.getAttribute('data-t')==='n',dir=th.getAttribute('data-d')==='a'?'d':'a';
Array.prototype.forEach.call(ths,function(h){h.removeAttribute('data-d');});th.setAttribute('data-d',dir);
function k(r){var cell=r.cells[i],v=cell.getAttribute('data-v');if(v===null)v=cell.textContent;if(num){var x=parseFloat(v);return isNaN(x)?-Infinity:x;}return v.toLowerCase();}
rows.sort(function(a,b){var x=k(a),y=k(b);return (x<y?-1:x>y?1:0)*(dir==='a'?1:-1);});
rows.forEach(function(r){tb.appendChild(r);});});});
f();
})();
"""


def _short_rule(rule: str) -> str:
    """``default.toml:[module_type].*RMSNorm`` -> ``[module_type] *RMSNorm`` (the file is in the tooltip)."""
    m = re.match(r"^(.*?):\[(\w+)\]\.?(.*)$", rule)
    if not m:
        return rule
    return f"[{m.group(2)}] {m.group(3)}".strip()


def _badge(precision: str) -> str:
    return f'<span class="badge {_cls(precision)}">{_e(precision)}</span>'


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


def _cards(report: Report) -> str:
    s, m, n = report.summary, report.memory, report.numerics
    by = s["by_precision"]
    counts = {"bf16": by.get("bf16", 0), "fp16": by.get("fp16", 0), "fp32": by.get("fp32", 0)}
    counts["other"] = s["compute_nodes"] - sum(counts.values())
    half_flops = s.get("half_flops", 0)
    cards = [
        _card(f"{report.precision} compute nodes", f"{_half_count(report)} / {s['compute_nodes']}",
              f"bf16 {counts['bf16']} · fp16 {counts['fp16']} · fp32 {counts['fp32']}", bar=_bar(counts)),
        _card("FLOPs in half", _pct(s["half_flop_fraction"]), f"{_flops(half_flops)} of {_flops(s['flops'])}",
              bar=_bar({report.precision if report.precision in COLORS else "bf16": half_flops, "fp32": s["flops"] - half_flops})),
        _card("Activation casts", str(s["casts"]), f"{_bytes(s['cast_bytes'])} per forward"),
        _card("Weight casts (O1)", str(s.get("weight_casts", 0)), f"{_bytes(s.get('weight_cast_bytes', 0))} per forward"),
        _card("Unmatched ops", str(len(s["unmatched_ops"])), ", ".join(s["unmatched_ops"][:4]) or "every op has a rule",
              warn=bool(s["unmatched_ops"])),
    ]
    if m:
        cards.append(_card("Parameters (O2)", _bytes(m.get("param_bytes_o2")), f"O1 (fp32 storage): {_bytes(m.get('param_bytes_o1'))}"))
    saved = m.get("saved_activation_bytes") if m else None
    if saved:
        sub = f"{_bytes(saved.get('converted'))} vs fp32 {_bytes(saved.get('fp32'))}"
        if m.get("saved_ratio_autocast") is not None:
            sub += f" · autocast {_ratio(m['saved_ratio_autocast'])}"
        cards.append(_card("Saved activations", _ratio(m.get("saved_ratio")), sub))
    if n:
        sub = f"max |err| {_err(n['vs_fp32']['max_abs_err'])}"
        if "autocast_vs_fp32" in n:
            sub += f" · autocast {_db(n['autocast_vs_fp32']['sqnr_db'])}"
        cards.append(_card("Output SQNR vs fp32", _db(n["vs_fp32"]["sqnr_db"]), sub))
    return '<div class="cards" id="summary-cards">' + "".join(cards) + "</div>"


def _strip_svg(report: Report) -> str:
    """The precision picture: one row per module group, one cell per node, casts marked."""
    groups = _groups(report)
    if not groups:
        return "<p class=note>No compute nodes.</p>"
    act_before: dict[int, list[dict]] = {}
    weight_before: dict[int, list[dict]] = {}
    node_indices = [r["index"] for r in report.nodes]
    for cast in report.casts:
        # a cast is drawn just before the first compute node that follows it in the graph
        pos = bisect.bisect_right(node_indices, cast["index"])
        nxt = node_indices[pos] if pos < len(node_indices) else node_indices[-1] + 1  # output casts: after the last node
        (weight_before if cast["on_weight"] else act_before).setdefault(nxt, []).append(cast)
    longest = max(min(len(name or "(top level)"), 32) for name, _ in groups)
    label_w, cell, gap, row_h, max_width = int(min(250, 7.4 * longest + 28)), 13, 4, 30, 1380
    per_line = max(8, (max_width - label_w - 10) // (cell + gap))
    widest = min(per_line, max(len(rows) for _, rows in groups))
    width = label_w + widest * (cell + gap) + 12
    parts: list[str] = []
    y = 8
    end_index = node_indices[-1] + 1
    for gi, (name, rows) in enumerate(groups):
        label = name or "(top level)"
        short = label if len(label) <= 32 else "…" + label[-31:]
        types = {r["module_type"] for r in rows if r["module"] == name}
        parts.append(f'<text x="{label_w - 10}" y="{y + 13}" text-anchor="end" class="lbl"><title>{_e(label)}'
                     f'{(" (" + _e(", ".join(sorted(types))) + ")") if types else ""}</title>{_e(short)}</text>')
        for k, row in enumerate(rows):
            line, col = divmod(k, per_line)
            x = label_w + col * (cell + gap)
            yy = y + line * row_h
            if row["index"] in act_before:
                casts = act_before[row["index"]]
                tip = "; ".join(f"{c['name']}: {c['src_dtype']}→{c['dtype']} {c['bytes']} B" for c in casts)
                parts.append(_cast_mark(x - gap / 2, yy, "activation cast: " + tip))
            if row["index"] in weight_before:
                casts = weight_before[row["index"]]
                tip = "; ".join(f"{c['src']}: {c['src_dtype']}→{c['dtype']}" for c in casts)
                parts.append(f'<circle cx="{x + cell / 2}" cy="{yy - 5}" r="2.2" fill="{COLORS["weight_cast"]}">'
                             f'<title>{_e("weight cast (O1): " + tip)}</title></circle>')
            color = COLORS[_cls(row["precision"])]
            tip = (f"{row['name']} · {row['op']} · {row['precision']}\n{row['module'] or '(top level)'} ({row['module_type']})\n"
                   f"{row['rule']}\nFLOPs {row['flops']:,} · out {row['out_bytes']:,} B")
            stroke = ' stroke="#1d232b" stroke-width="1.2"' if row["flops"] > 0 else ""
            parts.append(f'<a href="#n{row["index"]}"><rect x="{x}" y="{yy}" width="{cell}" height="18" rx="2" fill="{color}"'
                         f'{stroke}><title>{_e(tip)}</title></rect></a>')
            if row["unmatched"]:
                parts.append(f'<text x="{x + cell / 2}" y="{yy + 13}" text-anchor="middle" class="um">?</text>')
        lines = (len(rows) - 1) // per_line + 1
        last_x = label_w + ((len(rows) - 1) % per_line + 1) * (cell + gap)
        last_y = y + (lines - 1) * row_h
        # output casts after the very last node
        if gi == len(groups) - 1 and end_index in act_before:
            tip = "; ".join(f"{c['name']}: {c['src_dtype']}→{c['dtype']} {c['bytes']} B" for c in act_before[end_index])
            parts.append(_cast_mark(last_x - gap / 2, last_y, "activation cast: " + tip))
        y += lines * row_h + 6
    height = y + 4
    style = ("<style>.lbl{font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;fill:#39424d}"
             ".um{font:bold 11px system-ui,sans-serif;fill:#fff;pointer-events:none}</style>")
    return (f'<svg class="strip-svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="precision of every compute node, by module">{style}{"".join(parts)}</svg>')


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


def _svg_figure(fig, prefix: str) -> str:
    """A matplotlib figure as inline SVG: no XML prolog, no metadata, no namespace URLs, unique ids."""
    from matplotlib.backends.backend_svg import FigureCanvasSVG

    buf = io.StringIO()
    FigureCanvasSVG(fig).print_svg(buf, metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg)
    svg = re.sub(r'\s+version="1\.1"', "", svg)
    ids = re.findall(r'\bid="([^"]+)"', svg)
    for ident in sorted(set(ids), key=len, reverse=True):
        svg = svg.replace(f'id="{ident}"', f'id="{prefix}{ident}"').replace(f"#{ident})", f"#{prefix}{ident})") \
                 .replace(f'"#{ident}"', f'"#{prefix}{ident}"')
    svg = re.sub(r'<svg([^>]*?)\swidth="[^"]*"\s+height="[^"]*"', r"<svg\1", svg, count=1)
    return svg


def _plots(report: Report) -> str:
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - matplotlib is a dependency of the HTML report
        return "<p class=note>matplotlib is not installed: no plots.</p>"
    rc = {"svg.fonttype": "none", "svg.hashsalt": "mpconvert", "text.parse_math": False, "font.size": 9,
          "font.family": ["DejaVu Sans", "sans-serif"], "axes.spines.top": False, "axes.spines.right": False,
          "axes.edgecolor": "#9aa3ad", "axes.labelcolor": "#39424d", "xtick.color": "#5f6b78", "ytick.color": "#39424d"}
    s = report.summary
    out = []
    with matplotlib.rc_context(rc):
        # 1. share by precision: FLOPs, nodes, output bytes
        metrics = {"FLOPs": "flops", "compute nodes": None, "output bytes": "out_bytes"}
        fig = Figure(figsize=(6.4, 2.5), dpi=100)
        ax = fig.add_subplot()
        labels = list(metrics)
        for y, (label, key) in enumerate(metrics.items()):
            totals = {p: 0.0 for p in _ORDER}
            for r in report.nodes:
                totals[_cls(r["precision"])] += 1 if key is None else r[key]
            total = sum(totals.values()) or 1.0
            left = 0.0
            for p in _ORDER:
                share = totals[p] / total
                if share <= 0:
                    continue
                ax.barh(y, share, left=left, color=COLORS[p], height=0.62)
                if share >= 0.07:
                    ax.text(left + share / 2, y, f"{100 * share:.0f}%", ha="center", va="center", color="white", fontsize=8.5, fontweight="bold")
                left += share
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.set_title(f"Share by precision ({_flops(s['flops'])} total)", fontsize=10, loc="left")
        from matplotlib.patches import Patch

        present = [p for p in _ORDER if any(_cls(r["precision"]) == p for r in report.nodes)]
        if present:
            ax.legend([Patch(color=COLORS[p]) for p in present], present, ncol=len(present), frameon=False,
                      loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, handlelength=1.0)
        fig.tight_layout()
        out.append(_svg_figure(fig, "pa-"))
        # 2. bytes per module, stacked by precision
        groups = _module_bytes(report)[:18]
        fig = Figure(figsize=(6.4, max(2.4, 0.32 * len(groups) + 1.0)), dpi=100)
        ax = fig.add_subplot()
        names = [g if len(g) <= 34 else "…" + g[-33:] for g, _ in groups]
        scale, unit = _byte_unit(max((sum(v.values()) for _, v in groups), default=1))
        for i, (_, values) in enumerate(groups):
            left = 0.0
            for p in _ORDER:
                v = values[p] / scale
                if v > 0:
                    ax.barh(i, v, left=left, color=COLORS[p], height=0.66, label=p if p not in ax.get_legend_handles_labels()[1] else None)
                    left += v
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"output bytes per forward ({unit})")
        ax.set_title("Activation bytes per module", fontsize=10, loc="left")
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            ax.legend(handles, labels, ncol=len(labels), frameon=False, fontsize=8, handlelength=1.0,
                      loc="lower right", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        out.append(_svg_figure(fig, "pb-"))
    return '<div class="plots">' + "".join(f"<div>{svg}</div>" for svg in out) + "</div>"


def _byte_unit(n: float) -> tuple[float, str]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return float(size), unit
    return 1.0, "B"


def _tree_html(report: Report) -> str:
    mods = report.modules
    if not mods:
        return ""
    children: dict[Optional[str], list[dict]] = {}
    for mod in mods:
        children.setdefault(mod["parent"], []).append(mod)

    def mini(mod: dict) -> str:
        spans = "".join(f'<span style="width:{100 * mod[p] / mod["nodes"]:.2f}%;background:{COLORS[p]}"></span>'
                        for p in _ORDER if mod.get(p))
        return f'<span class="mini">{spans}</span>'

    def render(mod: dict) -> str:
        name = mod["path"].rsplit(".", 1)[-1] if mod["path"] else "(model)"
        stats = (f"{mod['nodes']} nodes · bf16 {mod['bf16']} · fp16 {mod['fp16']} · fp32 {mod['fp32']}"
                 f" · {_flops(mod['flops'])}" + (f" · {mod['casts']} casts ({_bytes(mod['cast_bytes'])})" if mod["casts"] else ""))
        head = (f'<span class="path" title="{_e(mod["path"] or "(model)")}">{_e(name)}</span><span class="type">{_e(mod["type"])}</span>'
                f"{mini(mod)}<span class=stats>{_e(stats)}</span>")
        kids = children.get(mod["path"], [])
        if not kids:
            return f'<div style="margin-left:14px">{head}</div>'
        return f'<details{" open" if mod["depth"] < 2 else ""}><summary>{head}</summary>{"".join(render(k) for k in kids)}</details>'

    return '<div class="tree">' + "".join(render(root) for root in children.get(None, [])) + "</div>"


def _ops_html(report: Report) -> str:
    rows = []
    for o in report.ops:
        rules = "<br>".join(f'<span class="mono">{_e(r["rule"])}</span> ×{r["count"]}' for r in o["rules"])
        rows.append(f'<tr><td class="mono">{_e(o["op"])}{" <span class=bad>(unmatched)</span>" if o["unmatched"] else ""}</td>'
                    f'<td class=n>{o["total"]}</td><td class=n>{o["fp16"]}</td><td class=n>{o["bf16"]}</td><td class=n>{o["fp32"]}</td>'
                    f'<td class=n>{_e(_flops(o["flops"]))}</td><td>{rules}</td></tr>')
    return ('<div class="tablewrap"><table><thead><tr><th>Op</th><th class=n>Total</th><th class=n>FP16</th><th class=n>BF16</th>'
            '<th class=n>FP32</th><th class=n>FLOPs</th><th>Deciding rules</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table></div>")


def _nodes_html(report: Report) -> str:
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
            f'<td data-v="{_e(r["precision"])}">{_badge(r["precision"])}{unmatched if r["unmatched"] else ""}</td>',
            f'<td class="mono nw" title="{_e(r["rule"])}">{_e(_short_rule(r["rule"]))}</td>',
            f'<td class=n data-v="{r["flops"]}">{_e(_flops(r["flops"]))}</td>',
            f'<td class=n data-v="{r["out_bytes"]}">{_e(_bytes(r["out_bytes"]))}</td>',
        ]
        if measured:
            for key in ("sqnr_db", "local_sqnr_db"):
                v = r.get(key)
                cells.append(f'<td class=n data-v="{_db_sort_key(v)}">{_e(_db(v)) if key in r else "—"}</td>')
        cells.append(f'<td class="mono nw">{_e(r["source"])}</td>')
        reason = _e(_reason(r))
        cells.append(f'<td data-v="{reason}"><div class="reason" title="{reason}">{reason}</div></td>')
        rows.append(f'<tr id="n{r["index"]}" data-p="{_e(_cls(r["precision"]))}" data-u="{int(bool(r["unmatched"]))}">{"".join(cells)}</tr>')
    filters = ('<div class="filters"><input type="search" id="q" placeholder="Filter by name, op, module, rule…" aria-label="filter">'
               '<select id="prec" aria-label="precision"><option value="">all precisions</option><option value="bf16">bf16</option>'
               '<option value="fp16">fp16</option><option value="fp32">fp32</option><option value="other">other</option></select>'
               '<label><input type="checkbox" id="unm"> unmatched only</label><span class="count" id="count"></span></div>')
    return (filters + '<div class="tablewrap"><table id="node-table"><thead><tr>' + ths + "</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table></div>")


def _casts_html(report: Report) -> str:
    act = [c for c in report.casts if not c["on_weight"]]
    weight = [c for c in report.casts if c["on_weight"]]
    out = [f"<h3>Activation casts: {len(act)}, {_e(_bytes(sum(c['bytes'] for c in act)))} per forward</h3>"]
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
               f"{_e(_bytes(sum(c['bytes'] for c in weight)))} per forward</h3>")
    if weight:
        out.append('<div class="tablewrap" style="max-height:260px"><table><thead><tr><th>Parameter</th><th>From → to</th>'
                   "<th class=n>Bytes</th><th>Consumers</th></tr></thead><tbody>")
        for c in weight:
            out.append(f'<tr><td class="mono">{_e(c["src"])}</td><td>{_e(c["src_dtype"])} → {_e(c["dtype"])}</td>'
                       f'<td class=n>{c["bytes"]:,}</td><td class="mono">{_e(", ".join(c["consumers"]))}</td></tr>')
        out.append("</tbody></table></div>")
    return "".join(out)


def _memory_html(report: Report) -> str:
    m = report.memory
    rows = [("Parameters, O1 (fp32, cast in the graph)", _bytes(m.get("param_bytes_o1")), ""),
            ("Parameters, O2 (half where every use is half)", _bytes(m.get("param_bytes_o2")),
             f"{m.get('params_half_in_o2', 0):,} of {m.get('param_count', 0):,} parameters in half"),
            ("O1 half weight copies made per forward", _bytes(m.get("o1_weight_copy_bytes")), "")]
    saved = m.get("saved_activation_bytes")
    if saved:
        copies = m.get("saved_weight_copy_bytes", {})
        rows += [("Saved activations, fp32 original (measured)", _bytes(saved.get("fp32")), "baseline"),
                 ("Saved activations, converted (measured)", _bytes(saved.get("converted")), f"{_ratio(m.get('saved_ratio'))} of fp32"
                  + (f"; plus {_bytes(copies.get('converted'))} half weight copies" if copies.get("converted") else ""))]
        if "autocast" in saved:
            rows.append(("Saved activations, torch.autocast (measured)", _bytes(saved.get("autocast")),
                         f"{_ratio(m.get('saved_ratio_autocast'))} of fp32"
                         + (f"; plus {_bytes(copies.get('autocast'))} half weight copies" if copies.get("autocast") else "")))
    body = "".join(f"<tr><td>{_e(a)}</td><td class=n>{_e(b)}</td><td class=note>{_e(c)}</td></tr>" for a, b, c in rows)
    note = (f"<p class=note>{_e(m.get('saved_method', ''))}</p>" if saved else
            "<p class=note>Saved activations not measured: run <span class=mono>converter.measure.measure(conv)</span>.</p>")
    return f"<table><tbody>{body}</tbody></table>{note}"


def _numerics_html(report: Report) -> str:
    n = report.numerics
    if not n:
        return "<p class=note>Not measured: run <span class=mono>converter.measure.measure(conv)</span>.</p>"
    rows = [("converted vs fp32", n["vs_fp32"])]
    if "autocast_vs_fp32" in n:
        rows += [("torch.autocast vs fp32", n["autocast_vs_fp32"]), ("converted vs torch.autocast", n["vs_autocast"])]
    body = "".join(f"<tr><td>{_e(a)}</td><td class=n>{_e(_db(v['sqnr_db']))}</td><td class=n>{_e(_err(v['max_abs_err']))}</td>"
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
                       f'<td>{_badge(w["precision"])}</td><td class=n>{_e(_db(w["local_sqnr_db"]))}</td>'
                       f'<td class=n>{_e(_db(w["sqnr_db"]))}</td><td class=n>{_e(_err(w["max_abs_err"]))}</td></tr>')
        out.append("</tbody></table>")
    return "".join(out)


def _calibration_rows(report: Report) -> tuple[list[tuple[str, str]], list[dict]]:
    cal = report.calibration
    facts = [("batches", str(cal.get("batches", "—"))), ("margin", f"{cal.get('margin', '—')} ({cal.get('margin_source', '')})"),
             ("overflow fallback", str(cal.get("overflow_fallback", "—")))]
    scale = cal.get("loss_scale") or {}
    if scale:
        facts.append(("recommended initial loss scale", str(scale.get("recommended_initial_scale")) + (f" ({scale['why']})" if scale.get("why") else "")))
    nonfinite = cal.get("nonfinite_in_fp32") or []
    if nonfinite:
        facts.append(("non-finite values already in fp32", ", ".join(n["name"] for n in nonfinite)))
    return facts, list(cal.get("risky_nodes") or [])


def _calibration_html(report: Report) -> str:
    facts, risky = _calibration_rows(report)
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


def _unmatched_html(report: Report) -> str:
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


def to_html(report: Report) -> str:
    """report.html: one self-contained page, no network access (see the module docstring)."""
    script_hash = base64.b64encode(hashlib.sha256(_JS.encode("utf-8")).digest()).decode("ascii")
    csp = (f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'sha256-{script_hash}'; "
           "base-uri 'none'; form-action 'none'")
    s = report.summary
    title = f"Precision audit — {report.model or 'model'}"
    files = ", ".join(report.rules.get("files", [])) or "defaults"
    sections = [
        ("summary", "Summary", _cards(report) + f'<p class="note">Rule files: <span class="mono">{_e(files)}</span>. '
         f'Precedence: {_e(describe())}.</p>'),
        ("picture", "Precision picture",
         "<p class=note>Every compute node in graph order, one row per module; hover a cell for its rule, click to jump to its row.</p>"
         + _legend() + f'<div class="strip">{_strip_svg(report)}</div>'),
        ("plots", "FLOPs and bytes", _plots(report)),
        ("numerics", "Numerics", _numerics_html(report)),
        ("memory", "Memory", _memory_html(report)),
        *([("calibration", "Calibration", _calibration_html(report))] if report.calibration else []),
        ("ops", "Ops", _ops_html(report)),
        ("unmatched", f"Unmatched ops ({len(s['unmatched_ops'])})", _unmatched_html(report)),
        ("modules", "Modules", _tree_html(report)),
        ("casts", "Casts", _casts_html(report)),
        ("nodes", f"Nodes ({s['compute_nodes']})", _nodes_html(report)),
    ]
    nav = "".join(f'<a href="#{sid}">{_e(name)}</a>' for sid, name, _ in sections)
    body = "".join(f'<section id="{sid}"><h2>{_e(name)}</h2>{content}</section>' for sid, name, content in sections)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{_e(csp)}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        f'<header><h1>{_e(title)}</h1><div class="meta">target {_e(report.precision)} · tracer {_e(report.tracer)} · '
        f'{s["nodes"]} graph nodes · {s["compute_nodes"]} compute nodes · tuned for {_tuned_for(report, _e)}</div>'
        f'<div class="line" id="summary-line">{_e(report.line)}</div></header>'
        f"<nav>{nav}</nav><main>{body}</main>"
        '<footer>Generated by mpconvert from node.meta only; measurements on the example inputs. '
        "This page is self-contained and makes no network requests.</footer>"
        f"<script>{_JS}</script></body></html>\n"
    )


# ---------------------------------------------------------------------------------------------
# terminal


def print_report(report: Report, console=None, *, nodes: bool = False) -> None:
    """Print the report with rich: summary, memory, numerics, ops, worst nodes, unmatched, casts."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    s, m, n = report.summary, report.memory, report.numerics
    head = Text()
    head.append(report.line, style="bold")
    head.append(f"\ntarget {report.precision} · tracer {report.tracer} · {s['nodes']} graph nodes · "
                f"FLOPs {_flops(s['flops'])} · unmatched ops: {', '.join(s['unmatched_ops']) or 'none'}")
    console.print(Panel(head, title=Text(f"mpconvert audit · {report.model or 'model'}"), border_style="cyan", expand=False))

    facts = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    facts.add_column("memory / numerics")
    facts.add_column("value", justify="right")
    if m:
        facts.add_row("parameters O1 → O2", f"{_bytes(m.get('param_bytes_o1'))} → {_bytes(m.get('param_bytes_o2'))}")
        saved = m.get("saved_activation_bytes")
        if saved:
            facts.add_row("saved activations fp32", _bytes(saved.get("fp32")))
            facts.add_row("saved activations converted", f"{_bytes(saved.get('converted'))} ({_ratio(m.get('saved_ratio'))})")
            if "autocast" in saved:
                facts.add_row("saved activations autocast", f"{_bytes(saved.get('autocast'))} ({_ratio(m.get('saved_ratio_autocast'))})")
    if n:
        facts.add_row("SQNR converted vs fp32", f"{_db(n['vs_fp32']['sqnr_db'])} (max |err| {_err(n['vs_fp32']['max_abs_err'])})")
        if "autocast_vs_fp32" in n:
            facts.add_row("SQNR autocast vs fp32", f"{_db(n['autocast_vs_fp32']['sqnr_db'])} (max |err| {_err(n['autocast_vs_fp32']['max_abs_err'])})")
            facts.add_row("SQNR converted vs autocast", _db(n["vs_autocast"]["sqnr_db"]))
    if facts.row_count:
        console.print(facts)

    colors = {"bf16": "green", "fp16": "blue", "fp32": "dark_orange"}
    ops = Table(title="Ops", title_justify="left", header_style="bold")
    for col, just in (("Op", "left"), ("Total", "right"), ("FP16", "right"), ("BF16", "right"), ("FP32", "right"), ("Deciding rules", "left")):
        ops.add_column(col, justify=just, overflow="fold", max_width=18 if col == "Op" else None,
                       min_width=24 if col == "Deciding rules" else None)
    for o in report.ops:
        ops.add_row(Text(o["op"], style="red" if o["unmatched"] else ""), str(o["total"]), str(o["fp16"]), str(o["bf16"]), str(o["fp32"]),
                    Text("\n".join(f"{_short_rule(r['rule'])} ×{r['count']}" for r in o["rules"])))
    console.print(ops)

    if n.get("worst") if n else False:
        worst = Table(title="Nodes that add the most error (local SQNR)", title_justify="left", header_style="bold")
        for col in ("Node", "Op", "Module", "Precision", "Local SQNR", "Cumulative SQNR"):
            worst.add_column(col)
        for w in n["worst"][:8]:
            worst.add_row(Text(w["name"]), Text(w["op"]), Text(w["module"]), Text(w["precision"], style=colors.get(w["precision"], "")),
                          _db(w["local_sqnr_db"]), _db(w["sqnr_db"]))
        console.print(worst)

    act = [c for c in report.casts if not c["on_weight"]]
    if act:
        casts = Table(title=f"Activation casts ({len(act)}, {_bytes(s['cast_bytes'])} per forward)", title_justify="left", header_style="bold")
        for col, just in (("Cast", "left"), ("From → to", "left"), ("Bytes", "right"), ("Consumers", "left")):
            casts.add_column(col, justify=just)
        for c in sorted(act, key=lambda c: -c["bytes"])[:12]:
            casts.add_row(Text(c["name"]), f"{c['src_dtype']} → {c['dtype']}", f"{c['bytes']:,}", Text(", ".join(c["consumers"])))
        console.print(casts)

    if nodes:
        table = Table(title="Nodes", title_justify="left", header_style="bold")
        for col in ("#", "Node", "Op", "Module", "Precision", "Rule", "FLOPs"):
            table.add_column(col)
        for r in report.nodes:
            table.add_row(str(r["index"]), Text(r["name"]), Text(r["op"]), Text(r["module"]),
                          Text(r["precision"], style=colors.get(r["precision"], "")), Text(r["rule"]), _flops(r["flops"]))
        console.print(table)
    if s["unmatched_ops"]:
        console.print(Text(f"Unmatched ops (kept fp32, add rules for them): {', '.join(s['unmatched_ops'])}", style="yellow"))


# ---------------------------------------------------------------------------------------------
# files


def write_reports(report: Report, out_dir: Union[str, Path]) -> list[Path]:
    """Write report.json, report.md and report.html into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md", out / "report.html"]
    paths[0].write_text(report.to_json() + "\n", encoding="utf-8")
    # backslashreplace: a path that is not valid UTF-8 (a lone surrogate in Python) is shown escaped
    paths[1].write_text(to_markdown(report), encoding="utf-8", errors="backslashreplace")
    paths[2].write_text(to_html(report), encoding="utf-8", errors="backslashreplace")
    return paths


# ---------------------------------------------------------------------------------------------
# explain

def _reason(row: dict) -> str:
    """A node's reason with its stage notes (``placement: ...``), for the one-line table cells."""
    return "; ".join([row["reason"], *(note_text(stage, text) for stage, text in row.get("notes", ()))])


def _as_report(target: Any) -> Report:
    if isinstance(target, Report):
        return target
    module = getattr(target, "module", None)
    if module is not None and hasattr(target, "report"):
        return target.report if isinstance(target.report, Report) and target.report.nodes else build_report(
            module, precision=getattr(target, "precision", ""), tracer=getattr(target, "tracer", ""))
    import torch.fx

    if isinstance(target, torch.fx.GraphModule):
        graph_meta = target.meta.get(GM_GRAPH)
        return build_report(target, precision=getattr(graph_meta, "precision", ""), tracer=getattr(graph_meta, "tracer", ""))
    raise TypeError(f"explain() takes a Conversion, a GraphModule or a Report, got {type(target).__name__}")


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


def explain(conv_or_gm: Any, node_name: str) -> str:
    """The decision chain of one node: every matched rule, its precedence level, the winner and why.

    Accepts a :class:`~converter.Conversion`, a decided ``GraphModule`` or a :class:`Report`.
    Raises ``ValueError`` naming the closest node names when ``node_name`` is unknown.
    """
    report = _as_report(conv_or_gm)
    rows = {r["name"]: r for r in report.nodes}
    casts = {c["name"]: c for c in report.casts}
    if node_name in casts and node_name not in rows:
        c = casts[node_name]
        return (f"{node_name}: a cast inserted by the rewrite ({'weight' if c['on_weight'] else 'activation'} cast)\n"
                f"  converts {c['src']} from {c['src_dtype']} to {c['dtype']}, {c['bytes']:,} bytes per forward\n"
                f"  consumers: {', '.join(c['consumers'])}\n  rule: {c['rule']}\n  why: {c['reason']}")
    if node_name not in rows:
        names = list(rows) + list(casts)
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
    into = [c for c in report.casts if r["name"] in c["consumers"]]
    out_of = [c for c in report.casts if c["src"] == r["name"]]
    if into:
        lines.append("  casts into this node: " + ", ".join(f"{c['name']} ({c['src_dtype']}->{c['dtype']}, {c['bytes']:,} B)" for c in into))
    if out_of:
        lines.append("  casts of its output: " + ", ".join(f"{c['name']} ({c['src_dtype']}->{c['dtype']}, {c['bytes']:,} B)" for c in out_of))
    if "sqnr_db" in r:
        lines.append(f"  measured: cumulative SQNR {_db(r['sqnr_db'])}, local SQNR {_db(r.get('local_sqnr_db'))}")
    return "\n".join(lines)
