"""The precision audit report, built only from ``node.meta`` (see :mod:`converter.ir.meta`).

``build_report(gm, ...)`` reads the records the stages left on the graph and collects:

* ``nodes`` — one row per compute node (every call node of the model itself; inserted casts and
  passive nodes are not rows): name, canonical op, module path and class, precision, deciding
  rule, reason, source location, FLOPs (:mod:`converter.report.flops`), output bytes, and every rule
  that matched (for ``explain``);
* ``casts`` — one row per cast: activation casts and O1 weight casts (``on_weight``) apart;
* ``summary`` — docs/report.md: counts by precision (they sum to ``compute_nodes``), ``casts`` and
  ``cast_bytes`` for the activation casts only, ``weight_casts``/``weight_cast_bytes`` for the
  others, the FLOP share in half and the unmatched ops;
* ``ops`` — per op type: Op | Total | FP16 | BF16 | FP32 | deciding rules;
* ``modules`` — the module tree rolled up (every node counts towards each enclosing module);
* ``memory`` — parameter bytes in O1 (fp32, cast in the graph) and O2 (stored as
  ``gm.meta["mp_param_dtypes"]`` says);
* ``calibration`` — ``gm.meta["mp_calibration"]`` as the calibrate stage left it (risky nodes,
  loss-scale advice), when it ran;
* ``fp32_math`` — the rules' ``fp32_math`` setting, the process-wide fp32 math flags at conversion
  time, how many fp32 matmul/conv nodes run with each math (``nodes[i]["fp32_math"]``), and a
  warning when fp32-pinned nodes would silently run in reduced precision
  (:mod:`converter.passes.fp32_math`).

Measured numbers (saved activations, SQNR, per-node error, cast counts at run time) come from
:func:`converter.numerics.measure.measure` and are attached with :meth:`Report.add_measurements`.
The renderings read a :class:`Report` and never import this module (it imports them):
:mod:`converter.report.markdown`, :mod:`converter.report.html`, :mod:`converter.report.terminal`,
:mod:`converter.report.explain` (which builds a report when given a graph) and :mod:`converter.report.render`
(``write_reports``).
"""
from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch
import torch.fx

from converter.fp8.kernels import fp8_linear
from converter.ir.meta import (
    GM_CALIBRATION,
    GM_GRAPH,
    GM_PARAM_DTYPES,
    GM_PARAM_STORAGE,
    HALF_NAMES,
    META_CAST,
    META_DECISION,
    META_INFO,
    META_MATH,
    CastRecord,
    Decision,
    ModesNote,
    NodeInfo,
    itemsize,
    name_of,
)
from converter.ir.records import Fp8Facts, RunFacts, StageRecords
from converter.numerics.profile import DeviceProfile
from converter.passes.fp32_math import DEFAULT_FP32_MATH, global_math_settings, reduced_globals
from converter.report.flops import node_flops
from converter.report.fp8 import fp8_line, fp8_section
from converter.report.html import to_html
from converter.report.markdown import to_markdown
from converter.report.schema import encode
from converter.rules.precedence import PRECEDENCE
from converter.vocab import FLOAT_PRECISIONS

__all__ = ["Report", "build_report", "merge_reports", "summary_line", "SCHEMA", "PRECEDENCE", "MODULE_RULE_FP32_SHARE"]

SCHEMA = 1
_PRECISIONS = FLOAT_PRECISIONS


@dataclass
class Report:
    """Everything the audit knows; ``to_dict()`` is report.json (schema 1, docs/report.md).

    report.json is strict JSON: a non-finite number is written as the string ``"inf"``, ``"-inf"``
    or ``"nan"`` (an exact SQNR is ``"inf"``) and ``null`` means "not measured"; the rows' fields and
    this codec are :mod:`converter.report.schema`, which ``mpconvert explain``'s reader shares.
    """

    precision: str
    tracer: str
    summary: dict
    nodes: list[dict]
    casts: list[dict]
    rules: dict = field(default_factory=dict)
    #: what the stages found (capture, lowering, fp8, advice...): typed records, report.json's other top-level keys
    records: StageRecords = field(default_factory=StageRecords)
    model: str = ""
    ops: list[dict] = field(default_factory=list)
    modules: list[dict] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    numerics: dict = field(default_factory=dict)
    measured_casts: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    fp32_math: dict = field(default_factory=dict)
    #: capture's train/eval note, typed (code reads ``modes.kind``; report.json has its text as ``modes``)
    modes: Optional[ModesNote] = None
    #: the regions, glue and breaks of a model converted region by region (converter.partition.Partition), or None
    partition: Any = None
    #: the device profile the conversion's kernel choices and advice read (converter.numerics.profile), or None
    device_profile: Optional[DeviceProfile] = None

    def to_dict(self) -> dict:
        out = {
            "schema": SCHEMA,
            "model": self.model,
            "precision": self.precision,
            "tracer": self.tracer,
            "summary_line": self.line,
            "summary": self.summary,
            "nodes": self.nodes,
            "casts": self.casts,
            "ops": self.ops,
            "modules": self.modules,
            "memory": self.memory,
            "numerics": self.numerics,
            "measured_casts": self.measured_casts,
            "calibration": self.calibration,
            "fp32_math": self.fp32_math,
            "rules": self.rules,
            "device_profile": self.device_profile.to_dict() if self.device_profile is not None else None,
            "graph_breaks": [b.to_dict() for b in self.partition.breaks] if self.partition is not None else [],
            "regions": [r.to_dict() for r in self.partition.regions] if self.partition is not None else [],
        }
        for key, value in self.records.to_dict().items():
            out.setdefault(key, value)
        return encode(out)  # the schema's codec (converter.report.schema), which the readers share

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), indent=kwargs.pop("indent", 2), allow_nan=False, **kwargs)

    @property
    def extra(self) -> Mapping[str, Any]:
        """Deprecated (read-only, for one release): the records' report.json keys; read ``records`` instead."""
        warnings.warn("Report.extra is deprecated and read-only; read the typed Report.records instead "
                      "(records.capture.dynamic_dims, records.fp8...)", DeprecationWarning, stacklevel=2)
        return MappingProxyType(self.records.to_dict())

    @property
    def line(self) -> str:
        fp8 = self.records.fp8  # how many layers run fp8, and why none does (the gate and its value)
        return summary_line(self.summary, self.precision) + fp8_line(fp8.to_dict() if fp8 is not None else None)

    @property
    def measured(self) -> bool:
        return bool(self.numerics or self.measured_casts)

    def add_measurements(self, measured: dict) -> "Report":
        """Attach the result of :func:`converter.numerics.measure.measure`; returns ``self``."""
        self.memory = {**self.memory, **measured.get("memory", {})}
        self.numerics = dict(measured.get("numerics", {}))
        self.measured_casts = dict(measured.get("measured_casts", {}))
        per_node = self.numerics.get("per_node", {})
        for row in self.nodes:
            stats = per_node.get(row["name"])
            if stats is not None:
                row["sqnr_db"] = stats.get("sqnr_db")
                row["local_sqnr_db"] = stats.get("local_sqnr_db")
        if "measure_s" in measured:
            run = self.records.run or RunFacts()
            if isinstance(run.timings, dict):  # the pipeline's own mapping (Conversion.timings, the CLI's --json)
                run.timings["measure_s"] = measured["measure_s"]
            else:
                run = replace(run, timings={**run.timings, "measure_s": measured["measure_s"]})
            self.records = replace(self.records, run=run)
        return self

    def node(self, name: str) -> dict:
        for row in self.nodes:
            if row["name"] == name:
                return row
        raise KeyError(name)

    def to_markdown(self) -> str:
        """report.md (:func:`converter.report.markdown.to_markdown`)."""
        return to_markdown(self)

    def to_html(self) -> str:
        """report.html, one self-contained page (:func:`converter.report.html.to_html`)."""
        return to_html(self)

    def __str__(self) -> str:
        return self.line


def summary_line(summary: dict, precision: str) -> str:
    """'Converted X/Y compute nodes (Z% of FLOPs) to bf16 with N casts, M MiB per forward'."""
    by = summary["by_precision"]
    half = sum(by.get(p, 0) for p in HALF_NAMES)
    mib = summary["cast_bytes"] / 2**20
    target = precision
    if all(by.get(p, 0) for p in HALF_NAMES):  # e.g. fp16 with calibration's bf16 fallbacks
        target = f"{precision} ({by['fp16']} fp16 + {by['bf16']} bf16)"
    return (
        f"Converted {half}/{summary['compute_nodes']} compute nodes "
        f"({100 * summary['half_flop_fraction']:.1f}% of FLOPs) to {target} with {summary['casts']} casts, "
        f"{mib:.2f} MiB per forward ({_weight_part(summary)})"
        + (f"; {summary['break_count']} graph break(s), {100 * summary.get('captured_flop_fraction', 0.0):.1f}% of FLOPs "
           "in converted graphs" if summary.get("break_count") else "")
        + "".join(f"; warning: {w['message']}" for w in summary.get("warnings", ()))
    )


def _weight_part(summary: dict) -> str:
    """O1: the weight casts every forward runs; O2: the weights stored in half (no cast) and the casts left."""
    left = f"{summary.get('weight_casts', 0)} weight casts, {summary.get('weight_cast_bytes', 0) / 2**20:.2f} MiB"
    if summary.get("opt_level") != "O2":
        return f"+{left}"
    return f"O2: {summary.get('weight_casts_dropped_in_o2', 0)} weights stored in half, no cast; +{left} on fp32-stored parameters"


# ---------------------------------------------------------------------------------------------
# rows

_TORCH_DIR = re.escape(str(torch.__file__).rsplit("/", 1)[0])


def _source(node: torch.fx.Node, info: NodeInfo) -> str:
    """``file:line`` of the model code that made the node: the innermost frame of
    ``node.meta["stack_trace"]`` outside torch itself (fx's proxy.py, nn.Module, F.*), else
    capture's own ``NodeInfo.source``."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    for path, line in reversed(frames):
        if not re.match(_TORCH_DIR, path):
            return f"{path.rsplit('/', 1)[-1]}:{line}"
    return info.source


def _match_rows(decision: Decision) -> list[dict]:
    return [
        {
            "level": m.level_name,
            "rule": str(m.rule),
            "pattern": m.rule.pattern,
            "file": m.rule.file,
            "precision": m.precision,
            "scope": m.scope,
            "reason": m.reason,
        }
        for m in decision.matches
    ]


def _node_row(index: int, node: torch.fx.Node, info: NodeInfo, decision: Decision) -> dict:
    return {
        "name": node.name,
        "index": index,
        "op": info.op,
        "module": info.module,
        "module_type": info.module_type,
        "precision": decision.precision,
        "rule": str(decision.rule),
        "rule_level": decision.rule.table,
        "reason": decision.reason,
        "notes": [[stage, text] for stage, text in decision.notes],  # (stage, text) pairs, oldest first
        "requested": decision.requested,
        "source": _source(node, info),
        "kind": info.kind,
        "flops": node_flops(node, info.op),
        "out_bytes": info.out_bytes,
        "out_shape": [list(t.shape) for t in info.outputs],
        "unmatched": decision.unmatched,
        "matches": _match_rows(decision),
        "fp32_math": node.meta[META_MATH].mode if META_MATH in node.meta else None,
        "gemm": "fp8" if node.target is fp8_linear else None,  # precision stays bf16: fp8 is the GEMMs' compute mode
    }


def _cast_row(index: int, node: torch.fx.Node, rec: CastRecord) -> dict:
    return {
        "name": node.name,
        "index": index,
        "src": rec.src,
        "dtype": rec.dtype,
        "src_dtype": rec.src_dtype,
        "bytes": rec.bytes,
        "numel": rec.numel,
        "consumers": list(rec.consumers),
        "rule": str(rec.rule),
        "reason": rec.reason,
        "on_weight": rec.on_weight,
        "inserted": rec.inserted,
    }


# ---------------------------------------------------------------------------------------------
# rollups


def _op_table(nodes: list[dict]) -> list[dict]:
    """Op | Total | FP16 | BF16 | FP32 | deciding rules, most frequent op first."""
    table: dict[str, dict] = {}
    for row in nodes:
        entry = table.setdefault(row["op"], {"op": row["op"], "total": 0, "fp16": 0, "bf16": 0, "fp32": 0, "other": 0,
                                              "flops": 0, "unmatched": 0, "rules": {}})
        entry["total"] += 1
        key = row["precision"] if row["precision"] in _PRECISIONS else "other"
        entry[key] += 1
        entry["flops"] += row["flops"]
        entry["unmatched"] += int(bool(row["unmatched"]))
        entry["rules"][row["rule"]] = entry["rules"].get(row["rule"], 0) + 1
    out = []
    for entry in sorted(table.values(), key=lambda e: (-e["total"], e["op"])):
        entry["rules"] = [{"rule": r, "count": c} for r, c in sorted(entry["rules"].items(), key=lambda kv: -kv[1])]
        out.append(entry)
    return out


def _module_tree(rows: list[tuple[dict, tuple[tuple[str, str], ...]]], casts: list[dict], cast_module: dict[str, str]) -> list[dict]:
    """Roll nodes up the module tree: each node counts towards every module enclosing it."""
    modules: dict[str, dict] = {}
    order: list[str] = []
    for row, stack in rows:
        for depth, (path, cls) in enumerate(stack):
            entry = modules.get(path)
            if entry is None:
                entry = modules[path] = {
                    "path": path, "type": cls, "depth": depth, "parent": stack[depth - 1][0] if depth else None,
                    "nodes": 0, "fp16": 0, "bf16": 0, "fp32": 0, "other": 0,
                    "flops": 0, "half_flops": 0, "out_bytes": 0, "casts": 0, "cast_bytes": 0,
                }
                order.append(path)
            entry["nodes"] += 1
            key = row["precision"] if row["precision"] in _PRECISIONS else "other"
            entry[key] += 1
            entry["flops"] += row["flops"]
            entry["out_bytes"] += row["out_bytes"]
            if row["precision"] in HALF_NAMES:
                entry["half_flops"] += row["flops"]
    for cast in casts:
        if cast["on_weight"]:
            continue
        where: Optional[str] = cast_module.get(cast["name"], "")
        while where is not None and where not in modules:
            where = where.rsplit(".", 1)[0] if "." in where else ("" if where else None)
        while where is not None:
            modules[where]["casts"] += 1
            modules[where]["cast_bytes"] += cast["bytes"]
            where = modules[where]["parent"]
    # depth-first order, children in order of first appearance
    children: dict[Optional[str], list[str]] = {}
    for path in order:
        children.setdefault(modules[path]["parent"], []).append(path)
    out: list[dict] = []

    def visit(path: str) -> None:
        out.append(modules[path])
        for child in children.get(path, []):
            visit(child)

    for root in children.get(None, []):
        visit(root)
    return out


def _memory(gm: torch.fx.GraphModule, casts: list[dict]) -> dict:
    dtypes = gm.meta.get(GM_PARAM_DTYPES)
    o1 = o2 = 0
    half = 0
    for name, param in gm.named_parameters():
        o1 += param.numel() * param.element_size()
        if dtypes is not None:
            dtype = dtypes.get(name, param.dtype)
            o2 += param.numel() * itemsize(dtype)
            half += param.numel() if dtype != param.dtype else 0
    weight_copies = sum(c["numel"] * itemsize(_dtype(c["dtype"])) for c in casts if c["on_weight"])
    return {
        "param_count": sum(p.numel() for p in gm.parameters()),
        "param_bytes_o1": o1,
        "param_bytes_o2": o2 if dtypes is not None else None,
        "params_half_in_o2": half,
        "buffer_bytes": sum(b.numel() * b.element_size() for b in gm.buffers()),
        "o1_weight_copy_bytes": weight_copies,
        # parameters the graph casts to half that O2 still stores in fp32, and why
        "o2_fp32_params": dict(gm.meta.get(GM_PARAM_STORAGE) or {}),
    }


def _dtype(name: str) -> torch.dtype:
    from converter.ir.meta import DTYPES

    return DTYPES.get(name, torch.float32)


# ---------------------------------------------------------------------------------------------


def _fp32_math(gm: torch.fx.GraphModule, nodes: list[dict]) -> dict:
    """The fp32 math section: setting, global flags now, per-math counts, and the silent-reduction warning."""
    graph_meta = gm.meta.get(GM_GRAPH)
    counts = {"ieee": 0, "tf32": 0, "inherit": 0}
    inherit: dict[bool, list[str]] = {False: [], True: []}  # conv? -> node names running with the global math
    for row in nodes:
        mode = row.get("fp32_math")
        if mode is None:
            continue
        counts[mode] += 1
        if mode == "inherit":
            inherit[row["op"].startswith("conv")].append(row["name"])
    warnings = []
    for conv, names in inherit.items():
        flags = reduced_globals(conv=conv) if names else []
        if flags:
            what = "convolution" if conv else "matmul"
            warnings.append(
                f"{len(names)} fp32-pinned {what} node(s) ({', '.join(names[:5])}{' …' if len(names) > 5 else ''}) will run in "
                f"reduced precision: fp32_math = 'inherit' and the global flags say {', '.join(flags)}; "
                "set [settings] fp32_math = \"ieee\" to run them in IEEE fp32")
    flags = reduced_globals(conv=False) + reduced_globals(conv=True)
    notes = []
    if flags and counts["ieee"]:
        notes.append(f"the global fp32 math is reduced ({', '.join(flags)}): the {counts['ieee']} IEEE-enforced node(s) run "
                     "their forward in IEEE fp32, but their backward matmuls run under the global flags at backward time")
    return {
        "setting": (graph_meta.fp32_math if graph_meta is not None else None) or DEFAULT_FP32_MATH,
        "regions": graph_meta.fp32_math_regions if graph_meta is not None else 0,
        "global": global_math_settings(),
        "nodes": counts,
        "warnings": warnings,
        "notes": notes,
    }


#: a module rule that pins more than this share of the model's FLOPs to fp32 is reported
MODULE_RULE_FP32_SHARE = 0.25


def _module_rule_warnings(nodes: list[dict], total_flops: int) -> list[dict]:
    """One record per module rule that pins more than :data:`MODULE_RULE_FP32_SHARE` of FLOPs to fp32."""
    pinned: dict[str, int] = {}
    for row in nodes:
        if row["precision"] == "fp32" and row["rule_level"] in ("module", "module_type"):
            pinned[row["rule"]] = pinned.get(row["rule"], 0) + row["flops"]
    out = []
    for rule, flops in sorted(pinned.items(), key=lambda item: -item[1]):
        share = flops / total_flops if total_flops else 0.0
        if share > MODULE_RULE_FP32_SHARE:
            out.append({
                "kind": "module_rule_pins_flops",
                "rule": rule,
                "fp32_flops": flops,
                "share": share,
                "message": f"module rule {rule} pins {100 * share:.0f}% of FLOPs to fp32 (over "
                           f"{100 * MODULE_RULE_FP32_SHARE:.0f}%): check that it names the module you mean "
                           "(scope = \"self\" keeps it off child modules)",
            })
    return out


def build_report(gm: torch.fx.GraphModule, *, precision: str, tracer: str, rules: Optional[dict] = None,
                 records: Optional[StageRecords] = None, modes: Optional[ModesNote] = None) -> Report:
    """Read ``node.meta`` of the converted (or only decided) graph into a :class:`Report`; ``records``: the
    stages' facts (the fp8 section is added here), ``modes`` capture's typed train/eval note (its text is
    ``records.capture.modes``)."""
    nodes: list[dict] = []
    casts: list[dict] = []
    stacks: list[tuple[dict, tuple]] = []
    cast_module: dict[str, str] = {}
    model = ""
    for index, node in enumerate(gm.graph.nodes):
        info = node.meta.get(META_INFO)
        if not model and info is not None and info.module_stack:
            model = info.module_stack[0][1]
        rec = node.meta.get(META_CAST)
        if rec is not None:
            casts.append(_cast_row(index, node, rec))
            cast_module[node.name] = info.module if info is not None else ""
        decision = node.meta.get(META_DECISION)
        if info is None or decision is None or info.kind in ("cast", "passive"):
            continue
        row = _node_row(index, node, info, decision)
        nodes.append(row)
        stacks.append((row, info.module_stack or (("", model),)))
    by_precision = {"fp16": 0, "bf16": 0, "fp32": 0}
    for row in nodes:
        by_precision[row["precision"]] = by_precision.get(row["precision"], 0) + 1
    total_flops = sum(r["flops"] for r in nodes)
    half_flops = sum(r["flops"] for r in nodes if r["precision"] in HALF_NAMES)
    act = [c for c in casts if not c["on_weight"]]
    weight = [c for c in casts if c["on_weight"]]
    records = records or StageRecords()
    o2 = records.run is not None and records.run.opt_level == "O2"
    if o2:  # a cast of a weight O2 stores in that very dtype is an identity, which the trainer drops
        stored = dict(gm.meta.get(GM_PARAM_DTYPES) or {})
        targets = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        weight = [c for c in weight if name_of(stored.get(targets.get(c["src"], ""), torch.float32)) != c["dtype"]]
    unmatched = sorted({r["op"] for r in nodes if r["unmatched"]})
    fp32_math = _fp32_math(gm, nodes)
    summary = {
        "nodes": len(gm.graph.nodes),
        "compute_nodes": len(nodes),
        "by_precision": by_precision,
        "casts": len(act),
        "cast_bytes": sum(c["bytes"] for c in act),
        "weight_casts": len(weight),
        "weight_cast_bytes": sum(c["bytes"] for c in weight),
        "opt_level": "O2" if o2 else "O1",
        "weight_casts_dropped_in_o2": sum(1 for c in casts if c["on_weight"]) - len(weight) if o2 else 0,
        "flops": total_flops,
        "half_flops": half_flops,
        "half_flop_fraction": (half_flops / total_flops) if total_flops else 0.0,
        "unmatched_ops": unmatched,
        "unmatched_nodes": sum(1 for r in nodes if r["unmatched"]),
        "out_bytes": sum(r["out_bytes"] for r in nodes),
        "warnings": _module_rule_warnings(nodes, total_flops)
        + [{"kind": "fp32_math_reduced", "message": text} for text in fp32_math["warnings"]],
        "captured_flop_fraction": 1.0,
        "break_count": 0,
    }
    return Report(
        precision=precision,
        tracer=tracer,
        summary=summary,
        nodes=nodes,
        casts=casts,
        rules=rules or {},
        records=replace(records, fp8=_fp8_facts(gm, nodes, rules)),
        model=model,
        ops=_op_table(nodes),
        modules=_module_tree(stacks, casts, cast_module),
        memory=_memory(gm, casts),
        calibration=dict(gm.meta.get(GM_CALIBRATION) or {}),
        fp32_math=fp32_math,
        modes=modes,
    )


def _fp8_facts(gm: torch.fx.GraphModule, nodes: list[dict], rules: Optional[dict]) -> Optional[Fp8Facts]:
    section = fp8_section(gm, nodes, (rules or {}).get("settings"))
    return Fp8Facts.from_dict(section) if section is not None else None


#: summary fields that add up over the regions of a partial conversion
_SUMMED = ("nodes", "compute_nodes", "casts", "cast_bytes", "weight_casts", "weight_cast_bytes",
           "weight_casts_dropped_in_o2", "flops", "half_flops", "unmatched_nodes", "out_bytes")
_MEMORY_SUMMED = ("param_count", "param_bytes_o1", "param_bytes_o2", "params_half_in_o2", "buffer_bytes",
                  "o1_weight_copy_bytes")


def _scoped(path: str, name: str) -> str:
    return f"{path}/{name}"


def merge_reports(parts: list[tuple[str, Report]], *, partition: Any, precision: str, rules: dict, opt_level: str,
                  device: Optional[str], timings: dict, capture_errors: dict) -> Report:
    """One report for a model converted region by region: each region's rows (node names ``region/node``,
    module paths the model's), summaries added up, and the partition (breaks, captured FLOP share)."""
    nodes: list[dict] = []
    casts: list[dict] = []
    modules: list[dict] = []
    by_precision = {p: 0 for p in _PRECISIONS}
    summary: dict = {key: 0 for key in _SUMMED}
    memory: dict = {key: 0 for key in _MEMORY_SUMMED}
    memory["o2_fp32_params"] = {}
    unmatched: set = set()
    warnings: list = []
    for path, report in parts:
        nodes += [{**row, "name": _scoped(path, row["name"])} for row in report.nodes]
        casts += [{**row, "name": _scoped(path, row["name"]), "src": _scoped(path, row["src"]),
                   "consumers": [_scoped(path, c) for c in row.get("consumers") or ()]} for row in report.casts]
        modules += report.modules
        for key in _SUMMED:
            summary[key] += report.summary.get(key, 0) or 0
        for key, count in report.summary["by_precision"].items():
            by_precision[key] = by_precision.get(key, 0) + count
        unmatched |= set(report.summary.get("unmatched_ops") or ())
        warnings += report.summary.get("warnings") or []
        for key in _MEMORY_SUMMED:
            value = report.memory.get(key)
            memory[key] = None if value is None or memory[key] is None else memory[key] + value
        memory["o2_fp32_params"].update({f"{path}.{k}": v for k, v in (report.memory.get("o2_fp32_params") or {}).items()})
    summary.update(by_precision=by_precision, unmatched_ops=sorted(unmatched), warnings=warnings,
                   opt_level="O2" if opt_level == "O2" else "O1",
                   half_flop_fraction=(summary["half_flops"] / summary["flops"]) if summary["flops"] else 0.0,
                   captured_flop_fraction=partition.captured_flop_fraction, break_count=len(partition.breaks))
    tracers = sorted({report.tracer for _, report in parts})
    return Report(precision=precision, tracer="+".join(tracers) or "eager", summary=summary, nodes=nodes, casts=casts,
                  rules=rules, model=parts[0][1].model if parts else "", ops=_op_table(nodes), modules=modules,
                  memory=memory, partition=partition,
                  device_profile=next((r.device_profile for _, r in parts if r.device_profile is not None), None),
                  records=StageRecords(run=RunFacts(capture_errors=capture_errors, timings=timings, opt_level=opt_level,
                                                    device=device), merged=True))
