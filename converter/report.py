"""The precision audit report, built only from ``node.meta`` (see :mod:`converter.meta`).

``build_report(gm, ...)`` collects one row per compute node, one per cast, and the summary of
DESIGN §6; :class:`Report` renders it as a dict (report.json, schema 1) and Markdown.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.fx

from .flops import node_flops
from .meta import HALF_NAMES, CastRecord, Decision, NodeInfo

__all__ = ["Report", "build_report", "summary_line"]

SCHEMA = 1


@dataclass
class Report:
    """Everything the audit knows; ``to_dict()`` is report.json."""

    precision: str
    tracer: str
    summary: dict
    nodes: list[dict]
    casts: list[dict]
    rules: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {
            "schema": SCHEMA,
            "precision": self.precision,
            "tracer": self.tracer,
            "summary": self.summary,
            "nodes": self.nodes,
            "casts": self.casts,
            "rules": self.rules,
        }
        out.update(self.extra)
        return out

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), indent=kwargs.pop("indent", 2), default=str, **kwargs)

    @property
    def line(self) -> str:
        return summary_line(self.summary, self.precision)

    def to_markdown(self) -> str:
        from .render import to_markdown

        return to_markdown(self)

    def to_html(self) -> str:
        from .render import to_html

        return to_html(self)

    def __str__(self) -> str:
        return self.line


def summary_line(summary: dict, precision: str) -> str:
    by = summary["by_precision"]
    half = sum(by.get(p, 0) for p in HALF_NAMES)
    mib = summary["cast_bytes"] / 2**20
    return (
        f"Converted {half}/{summary['compute_nodes']} compute nodes "
        f"({100 * summary['half_flop_fraction']:.1f}% of FLOPs) to {precision} with {summary['casts']} casts, "
        f"{mib:.2f} MiB per forward (+{summary.get('weight_casts', 0)} weight casts, "
        f"{summary.get('weight_cast_bytes', 0) / 2**20:.2f} MiB)"
    )


def _node_row(node: torch.fx.Node, info: NodeInfo, decision: Decision) -> dict:
    return {
        "name": node.name,
        "op": info.op,
        "module": info.module,
        "module_type": info.module_type,
        "precision": decision.precision,
        "rule": str(decision.rule),
        "reason": decision.reason,
        "requested": decision.requested,
        "source": info.source,
        "kind": info.kind,
        "flops": node_flops(node, info.op),
        "out_bytes": info.out_bytes,
        "unmatched": decision.unmatched,
    }


def _cast_row(node: torch.fx.Node, rec: CastRecord) -> dict:
    return {
        "name": node.name,
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


def build_report(gm: torch.fx.GraphModule, *, precision: str, tracer: str, rules: Optional[dict] = None, extra: Optional[dict] = None) -> Report:
    nodes: list[dict] = []
    casts: list[dict] = []
    for node in gm.graph.nodes:
        rec = node.meta.get("mp_cast")
        if rec is not None:
            casts.append(_cast_row(node, rec))
        info = node.meta.get("mp_info")
        decision = node.meta.get("mp")
        if info is None or decision is None or info.kind in ("cast", "passive"):
            continue
        nodes.append(_node_row(node, info, decision))
    by_precision = {"fp16": 0, "bf16": 0, "fp32": 0}
    for row in nodes:
        by_precision[row["precision"]] = by_precision.get(row["precision"], 0) + 1
    total_flops = sum(r["flops"] for r in nodes)
    half_flops = sum(r["flops"] for r in nodes if r["precision"] in HALF_NAMES)
    act = [c for c in casts if not c["on_weight"]]
    weight = [c for c in casts if c["on_weight"]]
    unmatched = sorted({r["op"] for r in nodes if r["unmatched"]})
    summary = {
        "nodes": len(gm.graph.nodes),
        "compute_nodes": len(nodes),
        "by_precision": by_precision,
        "casts": len(act),
        "cast_bytes": sum(c["bytes"] for c in act),
        "weight_casts": len(weight),
        "weight_cast_bytes": sum(c["bytes"] for c in weight),
        "flops": total_flops,
        "half_flops": half_flops,
        "half_flop_fraction": (half_flops / total_flops) if total_flops else 0.0,
        "unmatched_ops": unmatched,
    }
    return Report(precision=precision, tracer=tracer, summary=summary, nodes=nodes, casts=casts, rules=rules or {}, extra=extra or {})


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
