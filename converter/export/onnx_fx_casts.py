"""The Casts an ONNX export of a converted model should contain, read from its FX graph's meta only,
and how the export's Casts compare with them.

:func:`expected_casts` counts the casts of ``gm`` that become ONNX Casts (by kind: inserted, the
model's own, implicit promotions, the model's own integer/bool casts; weight casts are folded into
half initializers and are not Casts). :func:`match_casts` pairs them with the exported model's
Casts, :func:`cast_difference` and :func:`cast_explanation` put the comparison into words for the
notes of :class:`~converter.export.onnx.OnnxResult`.
"""
from __future__ import annotations

import collections
from typing import Any, NamedTuple

import torch
import torch.fx

from converter.export.onnx_graph import cast_to, onnx_type, type_name, value_types
from converter.fp8.kernels import fp8_linear
from converter.ir.meta import DTYPES, META_CAST, META_DECISION, META_INFO, META_VALUE, TensorSpec, name_of
from converter.ir.ops import CAST_OPS

__all__ = ["expected_casts", "match_casts", "cast_difference", "cast_explanation"]


class _FxCast(NamedTuple):
    """One cast of the FX graph that the ONNX export should contain as a Cast."""

    name: str
    kind: str  # inserted | model | implicit | model-nonfloat | weight | fp8
    src: torch.dtype
    dst: torch.dtype
    constant: bool  # the value cast depends on no graph input: an exporter may constant-fold it


def _input_dependent(gm: torch.fx.GraphModule) -> set:
    """The nodes whose value depends on a graph input (the others are computed from constants and weights)."""
    dependent: set = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
    return dependent


def _cast_nodes_in_order(gm: torch.fx.GraphModule) -> list[_FxCast]:
    """What in the FX graph becomes an ONNX Cast, in graph order (see :class:`_FxCast`).

    kind is

    * ``inserted``: a cast the rewrite inserted on an activation (a :class:`CastRecord`);
    * ``model``: the model's own cast that now converts between float dtypes (a CastRecord with
      ``inserted=False``), or a float cast of the model's own that converts in fp32 already;
    * ``implicit``: a ``promote`` node whose op promotes mixed float inputs natively, so the
      rewrite inserted no cast (``x_fp32 + y_fp16``); ONNX ops take one dtype, so the exporter's
      type promotion writes a Cast for each narrower activation input;
    * ``model-nonfloat``: the model's own cast of an integer/bool tensor or to one (the fp32 model
      has it too);
    * ``weight``: a cast of a parameter/buffer: the weight is stored in the target dtype (folded
      into a half initializer), so it is not an ONNX Cast;
    * ``fp8``: the Casts of an fp8 linear's export (:mod:`converter.export.onnx_fp8`): its input to fp32
      before it is quantised (one per distinct input: linears reading one tensor share it), the fp32
      MatMul back to the input's dtype.
    """
    from converter.passes.rewrite import runtime_dtype

    cache: dict = {}
    dependent = _input_dependent(gm)
    out: list[_FxCast] = []
    fp8_inputs: set = set()
    for node in gm.graph.nodes:
        rec = node.meta.get(META_CAST)
        if rec is not None:
            kind = "weight" if rec.on_weight else ("inserted" if rec.inserted else "model")
            source = node.args[0] if node.args else None
            out.append(_FxCast(node.name, kind, DTYPES[rec.src_dtype], DTYPES[rec.dtype], source not in dependent))
            continue
        if node.op == "call_function" and node.target is fp8_linear:
            have = runtime_dtype(node.args[0], cache)
            if have is not None and have != torch.float32:
                constant = node not in dependent
                if node.args[0] not in fp8_inputs:  # linears reading one tensor share its quantisation (onnx_fp8)
                    out.append(_FxCast(f"{node.name}/x_to_fp32", "fp8", have, torch.float32, constant))
                out.append(_FxCast(f"{node.name}/to_half", "fp8", torch.float32, have, constant))
            fp8_inputs.add(node.args[0])
            continue
        info = node.meta.get(META_INFO)
        decision = node.meta.get(META_DECISION)
        if info is None or node.op not in ("call_method", "call_function", "call_module"):
            continue
        if info.kind == "compute" and decision is not None and decision.requested == "promote" and decision.precision in DTYPES:
            want = DTYPES[decision.precision]
            seen: set = set()
            for arg in node.all_input_nodes:
                value = arg.meta.get(META_VALUE)
                if arg in seen or not (isinstance(value, TensorSpec) and value.is_convertible):
                    continue
                seen.add(arg)
                have = runtime_dtype(arg, cache)
                if have is not None and have.is_floating_point and have != want:
                    kind = "weight" if arg.op == "get_attr" else "implicit"
                    out.append(_FxCast(f"{arg.name}_to_{name_of(want)}_in_{node.name}", kind, have, want,
                                       arg not in dependent))
            continue
        if info.op == "scaled_dot_product_attention":
            out.extend(_mask_cast(node, cache, dependent))
            continue
        if info.op not in CAST_OPS or node.op == "call_module":
            continue
        src = node.args[0] if node.args else None
        have = src.meta.get(META_VALUE) if isinstance(src, torch.fx.Node) else None
        got = node.meta.get(META_VALUE)
        if not (isinstance(have, TensorSpec) and isinstance(got, TensorSpec)) or have.dtype == got.dtype:
            continue
        assert isinstance(src, torch.fx.Node)  # (have is its spec)
        if src.op == "get_attr":
            kind = "weight"
        elif have.is_convertible and got.is_convertible:
            kind = "model"
        else:
            kind = "model-nonfloat"
        out.append(_FxCast(node.name, kind, have.dtype, got.dtype, src not in dependent))
    return out


def _mask_cast(node: torch.fx.Node, cache: dict, dependent: set) -> list[_FxCast]:
    """The Casts of an attention given an fp32 mask with half q/k/v, which the exported copy runs in fp32
    (:func:`converter.export.onnx_exporter.fp32_attention`): q, k, v up to fp32, the output back down."""
    from converter.passes.rewrite import runtime_dtype

    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    if not isinstance(mask, torch.fx.Node) or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return []
    have, want = runtime_dtype(mask, cache), runtime_dtype(node.args[0], cache)
    if have != torch.float32 or want not in (torch.float16, torch.bfloat16):
        return []
    qkv = list(dict.fromkeys(a for a in node.args[:3] if isinstance(a, torch.fx.Node)))
    ups = [_FxCast(f"{a.name}_to_fp32_in_{node.name}", "implicit", want, torch.float32, a not in dependent) for a in qkv]
    return [*ups, _FxCast(f"{node.name}_to_{name_of(want)}", "implicit", torch.float32, want, node not in dependent)]


def expected_casts(gm: torch.fx.GraphModule) -> dict:
    """The number of ONNX Casts the export of ``gm`` must contain, and its breakdown by kind."""
    nodes = _cast_nodes_in_order(gm)
    counts: dict[str, Any] = {"inserted": 0, "model": 0, "implicit": 0, "model-nonfloat": 0, "weight": 0, "fp8": 0}
    for entry in nodes:
        counts[entry.kind] += 1
    counts["recorded"] = sum(
        1 for n in gm.graph.nodes if META_CAST in n.meta and not n.meta[META_CAST].on_weight
    )
    counts["expected"] = (counts["inserted"] + counts["model"] + counts["implicit"] + counts["model-nonfloat"]
                          + counts["fp8"])
    counts["order"] = [entry for entry in nodes if entry.kind != "weight"]
    return counts


def match_casts(model, fx_order: list) -> dict:
    """Compare the ONNX Casts with the casts the FX graph implies.

    * ``dtypes_match``: the multisets of (source dtype, target dtype) are equal — every Cast
      converts what the FX graph says, whatever order the exporter wrote them in;
    * ``in_order``: they also pair up one to one in graph order, and are then named after the FX
      casts (``mp/<cast>``, ``mp_promote/<src>_to_<dtype>_in_<node>``, ``model/<node>``).
    """
    types = value_types(model)
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    got = [(types.get(c.input[0]) if c.input else None, cast_to(c)) for c in casts]
    want = [(onnx_type(entry.src), onnx_type(entry.dst)) for entry in fx_order]
    dtypes_match = collections.Counter(got) == collections.Counter(want)
    in_order = len(got) == len(want) and all(g == w for g, w in zip(got, want))
    if in_order:
        prefix = {"inserted": "mp/", "implicit": "mp_promote/", "model": "model/", "model-nonfloat": "model/", "fp8": "fp8/"}
        for c, entry in zip(casts, fx_order):
            c.name = prefix[entry.kind] + entry.name
    return {"dtypes_match": dtypes_match, "in_order": in_order, "onnx": got, "fx": want}


def cast_difference(count: int, expected: dict, matched: dict) -> str:
    """Why the Casts of the export differ from the FX graph's, as far as the FX graph tells.

    A Cast the FX graph has and the export lacks is put down to the exporter's constant folding
    when the value it casts depends on no graph input (rotary-embedding tables, masks built from
    the example's fixed shape); any other difference is reported as added or dropped by the exporter.
    """
    order = expected["order"]
    got = collections.Counter(matched["onnx"])
    want = collections.Counter((onnx_type(e.src), onnx_type(e.dst)) for e in order)
    parts = []
    for pair, n in sorted((want - got).items(), key=str):
        what = f"{type_name(pair[0])}→{type_name(pair[1])}"
        entries = [e for e in order if (onnx_type(e.src), onnx_type(e.dst)) == pair]
        constant = [e.name for e in entries if e.constant]
        folded = min(n, len(constant))
        if folded:
            parts.append(f"the exporter's optimizer folded {folded} {what} Cast(s) of values computed from constants "
                         f"only ({', '.join(constant[:4])}{', ...' if len(constant) > 4 else ''})")
        if n > folded:
            others = [e.name for e in entries if not e.constant]
            parts.append(f"the exporter dropped or merged {n - folded} {what} Cast(s) of the FX graph "
                         f"(among {', '.join(others[:4])}{', ...' if len(others) > 4 else ''})")
    for pair, n in sorted((got - want).items(), key=str):
        parts.append(f"the exporter added {n} {type_name(pair[0])}→{type_name(pair[1])} Cast(s) the FX graph does not have")
    head = (f"Cast count {count} differs from the {expected['expected']} the FX graph implies"
            if count != expected["expected"] else "Cast dtypes differ from the FX graph's")
    return f"{head}: {'; '.join(parts) or 'the exporter reordered them'}"


def cast_explanation(count: int, expected: dict, folded: int, n_half: int, n_fp32: int, target: str) -> str:
    """The note that accounts for the export's Cast count, kind by kind, and for its initializers."""
    text = (f"{count} Cast node(s), expected {expected['expected']}: {expected['inserted']} inserted on activations"
            f" + {expected['model']} of the model's own that change float dtype"
            f" + {expected['implicit']} implicit promotion(s) (a promote op such as a residual add with an fp32 and a "
            f"half input: the rewrite inserts no cast because torch promotes natively, ONNX needs one)"
            f" + {expected['model-nonfloat']} of the model's own on integer/bool tensors (in the fp32 model too)"
            + (f" + {expected['fp8']} around the fp8 GEMMs (each fp8 linear's input to fp32 before QuantizeLinear, its "
               f"fp32 MatMul back)" if expected.get("fp8") else "") + "; "
            f"the {expected['weight']} weight cast(s) of the FX graph are not Casts: the weights are stored as "
            f"{n_half} {target} initializer(s) ({n_fp32} stay fp32: norms, embeddings and other fp32 consumers)")
    if folded:
        text += f"; {folded} Cast(s) on initializers were folded into {target} initializers after export"
    return text
