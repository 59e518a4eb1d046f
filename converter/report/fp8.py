"""report.json's ``"fp8"`` section, from the graph facts the fp8 stages recorded (``GraphMeta.fp8_*``).

* ``recipe``, ``layers`` (the linear nodes that run their GEMMs in fp8, after the fallback), ``count``;
* ``flops`` / ``gemm_flops`` / ``flops_share``: the forward FLOPs of those layers, of every GEMM of the graph
  (the nodes whose op is in :data:`converter.report.flops.GEMM_OPS`), and their ratio, from the per-node rows
  (a node row's ``gemm`` is ``"fp8"`` exactly for the fp8 layers; its ``precision`` stays bf16);
* ``thresholds``: the fallback's SQNR floors per GEMM (``min_db``, ``rule``);
* ``numerics``: with calibration, one row per layer the fp8 stage made (fallbacks included): node, module,
  recipe, flops, ``sqnr`` {output, grad_input, grad_weight}, ``amax``/``underflow``/``overflow`` {x, weight,
  grad_output}, batches, ``fp8`` (still fp8) and ``below`` (the GEMMs under their floor); null without;
* ``fallback``: the layers kept bf16 by a floor, with the measured dB, the floor and its rule.
"""
from __future__ import annotations

import math
from typing import Optional

import torch.fx

from converter.ir.meta import GM_GRAPH
from converter.numerics.common import from_json_float
from converter.report.flops import GEMM_OPS

__all__ = ["fp8_section", "fp8_line", "below_floor"]


def below_floor(sqnr: dict, thresholds: dict) -> list[str]:
    """The GEMMs of a numerics row whose SQNR is under its floor (NaN is; an unmeasured None is not)."""
    found = []
    for gemm, value in sqnr.items():
        db, floor = from_json_float(value), from_json_float((thresholds.get(gemm) or {}).get("min_db"))
        if db is not None and floor is not None and (math.isnan(db) or db < floor):
            found.append(gemm)
    return found


def _kept_bf16(nodes: list[dict], settings: dict) -> list[dict]:
    """The linear layers that do not run fp8, grouped by the rule that kept them bf16 (most first): a gate
    (``[settings].fp8_min_flops_per_token``, with its value) or a module rule of the fp8 rules."""
    found: dict[str, dict] = {}
    for row in nodes:
        if row["op"] != "linear" or row.get("gemm") == "fp8":
            continue
        entry = found.setdefault(row["rule"], {"rule": row["rule"], "count": 0})
        entry["count"] += 1
        if row.get("rule_level") == "settings":
            key = row["rule"].rpartition(".")[2]
            entry.update(setting=key, value=settings.get(key))
    return sorted(found.values(), key=lambda e: -e["count"])


def _kept_text(kept: dict) -> str:
    setting, value, count = kept.get("setting"), kept.get("value"), kept["count"]
    if setting == "fp8_min_flops_per_token":
        return f"{count} below {setting} = {value!r} (2·K·N per token; lower it in a rule file to run them in fp8)"
    if setting is not None:
        return f"{count} by {setting} = {value!r}"
    return f"{count} by {kept['rule']}"


def fp8_line(section: Optional[dict]) -> str:
    """The fp8 clause of the summary line: how many linear layers run fp8 GEMMs and, when none does, why
    (each gate with its value: ``7 below fp8_min_flops_per_token = 2097152``); '' for a conversion without fp8."""
    if not section:
        return ""
    kept = section.get("kept_bf16") or []
    total = section["count"] + sum(k["count"] for k in kept)
    text = f"; fp8: {section['count']} of {total} linear layers run fp8 GEMMs ({section['recipe']})"
    if section["count"] == 0:
        text += ", none: " + ("; ".join(map(_kept_text, kept)) if kept else "the model has no linear layer")
    return text


def fp8_section(gm: torch.fx.GraphModule, nodes: list[dict], settings: Optional[dict] = None) -> Optional[dict]:
    """The ``"fp8"`` section of the report of ``gm`` whose node rows are ``nodes`` (None: not an fp8 conversion);
    ``settings``: the rule files' settings (the gates' values)."""
    graph_meta = gm.meta.get(GM_GRAPH)
    if graph_meta is None or graph_meta.fp8_recipe is None:
        return None
    fp8_flops = sum(row["flops"] for row in nodes if row.get("gemm") == "fp8")
    gemm_flops = sum(row["flops"] for row in nodes if row["op"] in GEMM_OPS)
    thresholds = {gemm: dict(floor) for gemm, floor in graph_meta.fp8_thresholds.items()}
    numerics = None
    if graph_meta.fp8_numerics is not None:
        layers = set(graph_meta.fp8_layers)
        numerics = []
        for record in graph_meta.fp8_numerics:
            row = record.to_dict()
            row["fp8"] = row["node"] in layers
            row["below"] = below_floor(row["sqnr"], thresholds)
            numerics.append(row)
    return {
        "recipe": graph_meta.fp8_recipe,
        "layers": list(graph_meta.fp8_layers),
        "count": len(graph_meta.fp8_layers),
        "flops": fp8_flops,
        "gemm_flops": gemm_flops,
        "flops_share": fp8_flops / gemm_flops if gemm_flops else 0.0,
        "thresholds": thresholds,
        "numerics": numerics,
        "fallback": [dict(row) for row in graph_meta.fp8_fallback],
        "kept_bf16": _kept_bf16(nodes, settings or {}),
    }
