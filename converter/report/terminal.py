"""The audit in the terminal, with rich tables; every model-supplied name is a ``rich.text.Text``, never markup."""
from __future__ import annotations

from typing import Any, Literal, Optional

from converter.numerics.gap import below_autocast
from converter.report.common import (
    ReportView,
    fmt_bytes,
    fmt_db,
    fmt_err,
    fmt_flops,
    fmt_ratio,
    fp8_facts,
    fp8_layer_rows,
    short_rule,
    split_casts,
)

__all__ = ["print_report"]

#: precision -> rich style of the precision cells
_STYLES = {"bf16": "green", "fp16": "blue", "fp32": "dark_orange"}


class _Printable:
    """``report`` with the control bytes of every string it gives escaped (rich passes ESC through)."""

    def __init__(self, report: Any):
        self._report = report

    def __getattr__(self, name: str) -> Any:
        from converter.ir.text import printable_tree

        return printable_tree(getattr(self._report, name))


_Justify = Literal["left", "right"]  # rich.Table.add_column(justify=)

def print_report(report: ReportView, console: Optional[Any] = None, *, nodes: bool = False) -> None:
    """Print the report with rich: summary, memory, numerics, ops, worst nodes, unmatched, casts (``nodes``: every node)."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

    console = console or Console()
    report = _Printable(report)  # names and reasons from the model and rule files are data (converter/ir/text.py)
    s = report.summary
    head = Text()
    head.append(report.line, style="bold")
    head.append(f"\ntarget {report.precision} · tracer {report.tracer} · {s['nodes']} graph nodes · "
                f"FLOPs {fmt_flops(s['flops'])} · unmatched ops: {', '.join(s['unmatched_ops']) or 'none'}")
    console.print(Panel(head, title=Text(f"mpconvert audit · {report.model or 'model'}"), border_style="cyan", expand=False))
    facts = _facts_table(report)
    if facts.row_count:
        console.print(facts)
    console.print(_ops_table(report))
    for table in (_fp8_table(report), _worst_table(report), _casts_table(report), _nodes_table(report) if nodes else None):
        if table is not None:
            console.print(table)
    if s["unmatched_ops"]:
        console.print(Text(f"Unmatched ops (kept fp32, add rules for them): {', '.join(s['unmatched_ops'])}", style="yellow"))
    for warning in (report.fp32_math or {}).get("warnings", []):
        console.print(Text(f"fp32 math: {warning}", style="yellow"))
    gap = below_autocast(report.numerics or {})
    if gap is not None:
        console.print(Text(f"Under autocast: {gap}", style="yellow"))


def _facts_table(report: ReportView):
    """Memory and numerics, one fact a row (empty when nothing was measured)."""
    from rich.table import Table

    m, n = report.memory, report.numerics
    facts = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    facts.add_column("memory / numerics")
    facts.add_column("value", justify="right")
    if m:
        facts.add_row("parameters O1 → O2", f"{fmt_bytes(m.get('param_bytes_o1'))} → {fmt_bytes(m.get('param_bytes_o2'))}")
        saved = m.get("saved_activation_bytes")
        if saved:
            facts.add_row("saved activations fp32", fmt_bytes(saved.get("fp32")))
            facts.add_row("saved activations converted", f"{fmt_bytes(saved.get('converted'))} ({fmt_ratio(m.get('saved_ratio'))})")
            if "autocast" in saved:
                facts.add_row("saved activations autocast", f"{fmt_bytes(saved.get('autocast'))} ({fmt_ratio(m.get('saved_ratio_autocast'))})")
    if n:
        facts.add_row("SQNR converted vs fp32", f"{fmt_db(n['vs_fp32']['sqnr_db'])} (max |err| {fmt_err(n['vs_fp32']['max_abs_err'])})")
        if "autocast_vs_fp32" in n:
            auto = n["autocast_vs_fp32"]
            facts.add_row("SQNR autocast vs fp32", f"{fmt_db(auto['sqnr_db'])} (max |err| {fmt_err(auto['max_abs_err'])})")
            facts.add_row("SQNR converted vs autocast", fmt_db(n["vs_autocast"]["sqnr_db"]))
    return facts


def _ops_table(report: ReportView):
    from rich.table import Table
    from rich.text import Text

    ops = Table(title="Ops", title_justify="left", header_style="bold")
    columns: tuple[tuple[str, _Justify], ...] = (("Op", "left"), ("Total", "right"), ("FP16", "right"), ("BF16", "right"),
                                                ("FP32", "right"), ("Deciding rules", "left"))
    for col, just in columns:
        ops.add_column(col, justify=just, overflow="fold", max_width=18 if col == "Op" else None,
                       min_width=24 if col == "Deciding rules" else None)
    for o in report.ops:
        ops.add_row(Text(o["op"], style="red" if o["unmatched"] else ""), str(o["total"]), str(o["fp16"]), str(o["bf16"]), str(o["fp32"]),
                    Text("\n".join(f"{short_rule(r['rule'])} ×{r['count']}" for r in o["rules"])))
    return ops


def _worst_table(report: ReportView):
    """The 8 nodes that add the most error, or None when numerics were not measured."""
    from rich.table import Table
    from rich.text import Text

    worst_rows = (report.numerics or {}).get("worst")
    if not worst_rows:
        return None
    worst = Table(title="Nodes that add the most error (local SQNR)", title_justify="left", header_style="bold")
    for col in ("Node", "Op", "Module", "Precision", "Local SQNR", "Cumulative SQNR"):
        worst.add_column(col)
    for w in worst_rows[:8]:
        worst.add_row(Text(w["name"]), Text(w["op"]), Text(w["module"]), Text(w["precision"], style=_STYLES.get(w["precision"], "")),
                      fmt_db(w["local_sqnr_db"]), fmt_db(w["sqnr_db"]))
    return worst


def _fp8_table(report: ReportView):
    """The fp8 facts and, with calibration, each fp8 layer's SQNRs (red: under its floor); None without fp8."""
    from rich.table import Table
    from rich.text import Text

    facts = fp8_facts(report)
    if not facts:
        return None
    table = Table(title=Text("FP8: " + " · ".join(f"{k} {v}" for k, v in facts)), title_justify="left", header_style="bold")
    for col in ("Node", "Kernel", "Output", "grad_input", "grad_weight", "underflow"):
        table.add_column(col, justify="right" if col in ("Output", "grad_input", "grad_weight") else "left")
    for r in fp8_layer_rows(report):
        dbs = [Text(text, style="red" if below else "") for text, below in
               (r["sqnr"][g] for g in ("output", "grad_input", "grad_weight"))]
        table.add_row(Text(r["node"]), r["kernel"], *dbs, r["underflow"])
    return table


def _casts_table(report: ReportView):
    """The 12 largest activation casts, or None when there are none."""
    from rich.table import Table
    from rich.text import Text

    act, _ = split_casts(report)
    if not act:
        return None
    casts = Table(title=f"Activation casts ({len(act)}, {fmt_bytes(report.summary['cast_bytes'])} per forward)",
                  title_justify="left", header_style="bold")
    cast_columns: tuple[tuple[str, _Justify], ...] = (("Cast", "left"), ("From → to", "left"), ("Bytes", "right"),
                                                      ("Consumers", "left"))
    for col, just in cast_columns:
        casts.add_column(col, justify=just)
    for c in sorted(act, key=lambda c: -c["bytes"])[:12]:
        casts.add_row(Text(c["name"]), f"{c['src_dtype']} → {c['dtype']}", f"{c['bytes']:,}", Text(", ".join(c["consumers"])))
    return casts


def _nodes_table(report: ReportView):
    from rich.table import Table
    from rich.text import Text

    table = Table(title="Nodes", title_justify="left", header_style="bold")
    for col in ("#", "Node", "Op", "Module", "Precision", "Rule", "FLOPs"):
        table.add_column(col)
    for r in report.nodes:
        table.add_row(str(r["index"]), Text(r["name"]), Text(r["op"]), Text(r["module"]),
                      Text(r["precision"] + (" (fp8 GEMMs)" if r.get("gemm") == "fp8" else ""),
                           style=_STYLES.get(r["precision"], "")), Text(r["rule"]), fmt_flops(r["flops"]))
    return table
