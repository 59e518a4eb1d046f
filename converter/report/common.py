"""What every rendering of the audit shares: the fields a renderer reads, colours, number formats, groupings.

The renderers (:mod:`~converter.report.markdown`, :mod:`~converter.report.html`, :mod:`~converter.report.terminal`,
:mod:`~converter.report.plots`) read a report through :class:`ReportView`, the fields of
:class:`converter.report.build.Report` they use, and never import :mod:`converter.report.build`: ``Report.to_markdown``
and ``Report.to_html`` call them, so the dependency points one way only (build -> renderers).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from converter.ir.meta import HALF_NAMES, ModesNote, note_text
from converter.ir.records import StageRecords
from converter.numerics.common import from_json_float
from converter.vocab import FLOAT_PRECISIONS

__all__ = [
    "ReportView", "COLORS", "ORDER", "precision_class", "half_count", "fmt_bytes", "fmt_flops", "fmt_db", "db_sort_key",
    "fmt_pct", "fmt_err", "fmt_ratio", "short_rule", "node_reason", "tuned_for", "calibration_rows", "module_groups",
    "module_bytes", "split_casts", "fp32_math_facts", "FP32_MATH_NOTE", "frozen_mode",
    "header_warnings", "HeaderWarning", "weight_cast_label", "narrowed_text", "ranges_text", "fp8_facts", "fp8_layer_rows",
    "FP8_NOTE",
]

#: precision -> colour, shared by the HTML strip, the plots and the badges
COLORS = {"bf16": "#2f9e66", "fp16": "#2b7bb9", "fp32": "#e3903a", "other": "#9aa3ad", "cast": "#d1453b", "weight_cast": "#5b6470"}
#: the order precisions are stacked in, in the strip legend and the plots
ORDER = ("bf16", "fp16", "fp32", "other")


class ReportView(Protocol):
    """The parts of :class:`converter.report.build.Report` that the renderers read (see docs/report.md)."""

    precision: str
    tracer: str
    summary: dict
    nodes: list[dict]
    casts: list[dict]
    rules: dict
    records: StageRecords
    model: str
    ops: list[dict]
    modules: list[dict]
    memory: dict
    numerics: dict
    calibration: dict
    fp32_math: dict
    modes: Optional[ModesNote]
    partition: Any

    @property
    def line(self) -> str: ...

    def to_json(self, **kwargs: Any) -> str: ...


def precision_class(precision: str) -> str:
    """The colour class of a precision: bf16, fp16, fp32, or ``other`` (fp64, integer, bool outputs)."""
    return precision if precision in FLOAT_PRECISIONS else "other"


def half_count(report: ReportView) -> int:
    return sum(report.summary["by_precision"].get(p, 0) for p in HALF_NAMES)


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "—"
    n = float(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_flops(n: Optional[float]) -> str:
    if not n:
        return "0"
    n = float(n)
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} FLOP"


def fmt_db(x: Any) -> str:
    """An SQNR (a float, or report.json's ``"inf"``/``"-inf"``/``"nan"``): +inf and None (no error
    measured: e.g. a local SQNR where no input dtype changes) read "exact"."""
    value = from_json_float(x)
    if value is None or value == math.inf:
        return "exact"
    return f"{value:.1f} dB"


def db_sort_key(x: Any) -> float:
    """A finite number for the HTML table's sort (exact sorts above every measured SQNR)."""
    value = from_json_float(x)
    return 999.0 if value is None or value == math.inf else (-999.0 if not math.isfinite(value) else value)


def fmt_pct(x: Optional[float]) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def fmt_err(x: Any) -> str:
    return "—" if x is None else f"{x:.3g}"


def fmt_ratio(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.2f}×"


def short_rule(rule: str) -> str:
    """``default.toml:[module_type].*RMSNorm`` -> ``[module_type] *RMSNorm`` (the file is in the tooltip)."""
    m = re.match(r"^(.*?):\[(\w+)\]\.?(.*)$", rule)
    if not m:
        return rule
    return f"[{m.group(2)}] {m.group(3)}".strip()


def node_reason(row: dict) -> str:
    """A node's reason with its stage notes (``placement: ...``), for the one-line table cells."""
    return "; ".join([row["reason"], *(note_text(stage, text) for stage, text in row.get("notes", ()))])


def tuned_for(report: ReportView, escape: Callable[[str], str]) -> str:
    """The conversion's target device and what its lowerings changed (:mod:`converter.passes.lower`)."""
    run, lowering = report.records.run, report.records.lowering
    device = run.device if run is not None else None
    all_choices = [c for c in (lowering.lowering if lowering is not None else []) if isinstance(c, dict)]
    if not device:  # converter.passes.dispatch: kernels that choose per device at run time
        attention = sum(1 for c in all_choices if c.get("lowering") == "dispatch_attention")
        gemms = [c.get("node") for c in all_choices if c.get("lowering") == "dispatch_gemm" and c.get("chosen")]
        portable = [f"{attention} attention call(s)"] * bool(attention) + [str(g) for g in gemms]
        if not portable:
            return "portable (no device named: nothing device-specific)"
        return escape(f"portable (no device named): {' and '.join(portable)} choose their kernel per device at run time "
                      "(fp32 arithmetic on a CPU whose half GEMM is slow; native elsewhere)")
    lowered = lowering.lowered if lowering is not None else []
    what = escape(", ".join(lowered)) if lowered else "nothing to lower"
    choices = [c for c in all_choices if c.get("lowering") == "recompute_attention"]
    if choices:  # the cost model's choices (converter.passes.lower.recompute_plan); each node's reason gives the sizes
        recomputed = sum(1 for c in choices if c.get("chosen"))
        what += (f" · attention probabilities recomputed in backward for {recomputed} of {len(choices)} lowered calls, "
                 f"kept for {len(choices) - recomputed} (cost model: what O2's half weights leave under autocast's "
                 f"saved activations)")
    kept_fused = [c for c in all_choices if c.get("lowering") == "lower_attention"]
    if kept_fused:
        what += f" · {len(kept_fused)} attention call(s) kept fused: their score matrices are over the size bound"
    fp32_attention = sum(1 for c in all_choices if c.get("lowering") == "upcast_attention")
    if fp32_attention:  # this CPU's half GEMM is slow: attention in fp32 arithmetic (converter.passes.dispatch)
        what += f" · {fp32_attention} attention call(s) in fp32 arithmetic on the upcast half q, k, v (UpcastAttention)"
    upcast = [c for c in all_choices if c.get("lowering") == "upcast_gemm"]
    for choice in upcast:  # converter.passes.cpu_gemm: the half GEMMs' kernels, measured on this CPU
        how = "run as fp32 GEMMs on upcast operands" if choice.get("chosen") else "native"
        what += escape(f" · GEMM kernels ({choice.get('node')}): {how}: {choice.get('why')}")
    return f"{escape(str(device))} · lowered: {what}"


def frozen_mode(report: ReportView) -> Optional[str]:
    """The capture's modes note when the converted module is frozen in one mode (train()/eval() change
    nothing: training runs without dropout, or evaluation with it); None when it follows the mode."""
    modes = report.modes
    return modes.text if modes is not None and modes.frozen else None


def weight_cast_label(summary: dict) -> str:
    """What the summary's weight casts are: every O1 weight cast, or those O2 keeps (fp32-stored parameters)."""
    if summary.get("opt_level") == "O2":
        return f"weight casts left in O2 ({summary.get('weight_casts_dropped_in_o2', 0)} weights stored in half)"
    return "weight casts (O1)"


@dataclass(frozen=True)
class HeaderWarning:
    """Something a reader must see first: ``kind`` (``modes``, ``speed``, ``sizes``), a card title and
    headline for report.html, and the one-line text (report.md, the CLI's stderr)."""

    kind: str
    title: str
    headline: str
    text: str


def header_warnings(report: ReportView) -> list[HeaderWarning]:
    """A frozen train/eval mode, a half dtype with no fast math on the device
    (:mod:`converter.numerics.device`), input dims a guard in the model pins (:mod:`converter.passes.guards`)."""
    out = []
    frozen = frozen_mode(report)
    if frozen:
        out.append(HeaderWarning("modes", "train()/eval()", "frozen", frozen))
    advice = report.records.advice.text if report.records.advice is not None else None
    if advice:
        out.append(HeaderWarning("speed", "speed", "warning", advice))
    capture = report.records.capture
    narrowed = narrowed_text(dict(capture.narrowed_dims) if capture is not None else {})
    if narrowed:
        out.append(HeaderWarning("sizes", "input sizes", "warning", narrowed))
    return out


def narrowed_text(narrowed: dict) -> str:
    """One line on the input dims a guard in the model's code pins (converter.passes.guards)."""
    parts = []
    for name, dims in narrowed.items():
        reasons: dict[str, list[str]] = {}
        for dim, why in sorted(dims.items(), key=lambda kv: int(kv[0])):
            reasons.setdefault(why, []).append(str(dim))
        parts += [f"{name} dim {', '.join(d)}: {why}" for why, d in reasons.items()]
    if not parts:
        return ""
    return ("the converted model serves only the example's size (or the range named) of "
            + "; ".join(parts) + ": a guard in the model's code pins them")


def ranges_text(ranges: dict) -> str:
    """One line on the dynamic dims served only within a range (converter.passes.guards.dim_ranges):
    ``input_ids dim 1: sizes 2..512 (guard ... at modeling_bert.py:85 in forward)``."""
    parts = []
    for name, dims in ranges.items():
        for dim, span in sorted(dims.items(), key=lambda kv: int(kv[0])):
            sizes = f"{span['min']}..{span['max']}" if span.get("max") is not None else f">= {span['min']}"
            parts.append(f"{name} dim {dim}: sizes {sizes} ({span['why']})")
    return ("dynamic within a range: " + "; ".join(parts)) if parts else ""


def calibration_rows(report: ReportView) -> tuple[list[tuple[str, str]], list[dict]]:
    """The calibration section: (fact, value) pairs and the nodes re-decided because they would overflow."""
    cal = report.calibration
    facts = ([("data", str(cal["data"]))] if cal.get("data") else []) + [("batches", str(cal.get("batches", "—"))), ("margin", f"{cal.get('margin', '—')} ({cal.get('margin_source', '')})"),
             ("overflow fallback", str(cal.get("overflow_fallback", "—")))]
    scale = cal.get("loss_scale") or {}
    if scale:
        facts.append(("recommended initial loss scale", str(scale.get("recommended_initial_scale")) + (f" ({scale['why']})" if scale.get("why") else "")))
    nonfinite = cal.get("nonfinite_in_fp32") or []
    if nonfinite:
        facts.append(("non-finite values already in fp32", ", ".join(n["name"] for n in nonfinite)))
    shared = cal.get("shared_reads_in_fp32") or []
    if shared:
        facts.append(("cast once per read, fp32 under O2 (summed gradient overflows fp16)",
                      ", ".join(f"{r['param']} ({r['reads']} reads)" for r in shared)))
    for key, label, kept in (("search", "accuracy search", "kept_fp32"), ("fp8_search", "fp8 accuracy search", "kept_bf16")):
        found = cal.get(key)
        if found and found.get("met"):
            db = found["sqnr_db"]  # a number, or "inf" (json_float) when exact
            shown = f"{db:.1f}" if isinstance(db, (int, float)) else str(db)
            names = ", ".join(found[kept][:8]) + (", ..." if len(found[kept]) > 8 else "")
            facts.append((label, f"{found['tolerance']}: {shown} dB with {len(found[kept])} kept in {kept[-4:]} "
                                 f"({names or 'none'}), {found['evaluations']} evaluations"))
    return facts, list(cal.get("risky_nodes") or [])


def split_casts(report: ReportView) -> tuple[list[dict], list[dict]]:
    """(activation casts, O1 weight casts), each in graph order."""
    return [c for c in report.casts if not c["on_weight"]], [c for c in report.casts if c["on_weight"]]


def _runs(nodes: list[dict], depth: int) -> list[tuple[str, list[dict]]]:
    """Consecutive runs of nodes whose module paths agree on their first ``depth`` parts."""
    out: list[tuple[str, list[dict]]] = []
    for row in nodes:
        key = ".".join(row["module"].split(".")[:depth]) if row["module"] else ""
        if out and out[-1][0] == key:
            out[-1][1].append(row)
        else:
            out.append((key, [row]))
    return out


def module_groups(report: ReportView) -> list[tuple[str, list[dict]]]:
    """Consecutive runs of nodes by module prefix, at a depth where no run holds over half the graph."""
    nodes = report.nodes
    if not nodes:
        return []
    max_depth = max(len(r["module"].split(".")) if r["module"] else 0 for r in nodes)
    chosen = _runs(nodes, 1)
    for depth in range(1, max(1, max_depth) + 1):
        candidate = _runs(nodes, depth)
        if len(candidate) > 150 and depth > 1:
            break
        chosen = candidate
        biggest = max(len(rows) for _, rows in candidate)
        if biggest <= 0.5 * len(nodes):
            break
    return chosen


def module_bytes(report: ReportView) -> list[tuple[str, dict]]:
    """Output bytes per precision for each module group (same grouping as the strip), largest first."""
    totals: dict[str, dict] = {}
    for name, rows in module_groups(report):
        entry = totals.setdefault(name or "(top level)", {p: 0 for p in ORDER})
        for row in rows:
            entry[precision_class(row["precision"])] += row["out_bytes"]
    return sorted(totals.items(), key=lambda kv: -sum(kv[1].values()))


#: what the fp32 math section says about its three values (markdown and HTML)
FP32_MATH_NOTE = ("The math fp32 matmul/conv nodes run with (ieee: enforced IEEE fp32; tf32: enforced reduced fp32 math, "
                  "TF32 on CUDA and bf16 in oneDNN; inherit: the global flags at run time), and the global flags at "
                  "conversion time (docs/rules.md, \"fp32 math\").")


def fp32_math_facts(report: ReportView) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(rows of setting / node counts / global flags, warnings, notes) of the fp32 math section."""
    fm = report.fp32_math or {}
    counts = fm.get("nodes", {})
    rows = [("fp32_math setting", str(fm.get("setting", ""))),
            ("fp32 matmul/conv nodes", " · ".join(f"{k} {v}" for k, v in counts.items()) or "none"),
            ("scoped regions", str(fm.get("regions", 0)))]
    rows += [(f"global {k}", str(v)) for k, v in (fm.get("global") or {}).items()]
    return rows, list(fm.get("warnings", [])), list(fm.get("notes", []))


#: what the FP8 layer table measures (HTML and Markdown)
FP8_NOTE = ("Each fp8 layer against bf16 F.linear on the same operands (its recorded input, weight and incoming "
            "gradient) on the calibration batches: SQNR of output, grad_input and grad_weight; amax, underflow (nonzero "
            "values that quantise to zero) and overflow (values the saturated cast clips) of x, weight and grad_output "
            "under the recipe's scaling. A value under its floor is marked; such a layer is kept bf16.")
_FP8_TENSORS = (("x", "x"), ("weight", "w"), ("grad_output", "g"))


def fp8_facts(report: ReportView) -> list[tuple[str, str]]:
    """The fp8 section's (fact, value) pairs; empty when the conversion has no fp8 (report.json ``"fp8"``)."""
    if report.records.fp8 is None:
        return []
    fp8 = report.records.fp8.to_dict()
    floors = fp8.get("thresholds") or {}
    facts = [("recipe", str(fp8.get("recipe"))), ("layers in fp8", str(fp8.get("count", 0))),
             ("GEMM FLOPs in fp8", f"{fmt_pct(fp8.get('flops_share'))} ({fmt_flops(fp8.get('flops'))} of "
                                   f"{fmt_flops(fp8.get('gemm_flops'))})")]
    if floors:
        facts.append(("SQNR floors (fallback to bf16)", ", ".join(
            f"{gemm} {fmt_db(floor.get('min_db'))}" for gemm, floor in floors.items())
            + f" ({', '.join(sorted({f.get('rule', '').split(':[')[0] for f in floors.values()}))} [settings])"))
    if fp8.get("numerics") is None:
        facts.append(("per-layer numerics", "not measured: convert with calibration batches"))
    else:
        facts.append(("kept bf16 by a floor", ", ".join(r["node"] for r in fp8.get("fallback") or []) or "none"))
    return facts


def fp8_layer_rows(report: ReportView) -> list[dict]:
    """One dict of display strings per measured fp8 layer: node, module, kernel (``fp8`` or ``bf16 (fallback)``),
    ``sqnr`` (gemm -> (text, under its floor)), amax, underflow, overflow, flops."""
    fp8 = report.records.fp8.to_dict() if report.records.fp8 is not None else {}
    floors = fp8.get("thresholds") or {}
    rows = []
    for layer in fp8.get("numerics") or []:
        below = set(layer.get("below") or ())
        sqnr = {}
        for gemm, value in (layer.get("sqnr") or {}).items():
            text = "—" if value is None else fmt_db(value)
            if gemm in below:
                text += f" < {fmt_db((floors.get(gemm) or {}).get('min_db'))}"
            sqnr[gemm] = (text, gemm in below)

        def per_tensor(values: dict, fmt: Callable[[Any], str]) -> str:
            return " · ".join(f"{short} {fmt(values[name])}" for name, short in _FP8_TENSORS if name in values)

        rows.append({"node": layer["node"], "module": layer.get("module", ""),
                     "kernel": "fp8" if layer.get("fp8") else "bf16 (fallback)", "sqnr": sqnr,
                     "amax": per_tensor(layer.get("amax") or {}, lambda v: f"{from_json_float(v):.3g}"),
                     "underflow": per_tensor(layer.get("underflow") or {}, fmt_pct),
                     "overflow": per_tensor(layer.get("overflow") or {}, fmt_pct),
                     "flops": fmt_flops(layer.get("flops"))})
    return rows


#: the columns of the graph-breaks table (report.md, report.html)
BREAK_COLUMNS = ("module", "class", "where", "why", "runs", "FLOPs")


def break_rows(report: ReportView) -> list[tuple[str, str, str, str, str, int]]:
    """One row per graph break of a partial conversion (none when captured whole), for the renderers."""
    partition = getattr(report, "partition", None)
    if partition is None:
        return []
    return [(b.module or "(root)", b.module_type, b.location or "?", b.reason, b.runs, b.flops) for b in partition.breaks]


def breaks_note(report: ReportView) -> str:
    """The sentence above the graph-breaks table."""
    s = report.summary
    regions = len(report.partition.regions) if getattr(report, "partition", None) is not None else 0
    return (f"No tracer captured the whole model: {regions} region(s) run converted graphs "
            f"({100 * s.get('captured_flop_fraction', 0.0):.1f}% of the FLOPs on the example); the code of the modules "
            "below runs eagerly under torch.autocast, as written.")
