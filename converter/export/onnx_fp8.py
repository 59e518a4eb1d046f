"""ONNX export of an fp8 conversion: each fp8 linear as float8e4m3fn QuantizeLinear/DequantizeLinear around an fp32 MatMul.

An fp8 conversion (``precision="fp8"``) runs the linears the rules selected through
:func:`converter.fp8.kernels.fp8_linear`; everything else is its bf16 conversion. For inference the
export writes each such linear as the kernel's forward GEMM, in standard ONNX (float8 QuantizeLinear is
opset 19; the export writes :data:`FP8_MIN_OPSET` = 20 or later):

::

    x (bf16) ─ Cast(fp32) ─ Abs ─ ReduceMax ─ Max(EPS) ─ Div(448 / ·) = s   [rowwise: per row, power-of-2 floor]
      tensorwise: Mul(x, s) ─ QuantizeLinear(1, zp float8e4m3fn, saturate=1) ─ DequantizeLinear(1/s) ─┐
      rowwise:    Reshape(rows, K) ─ QuantizeLinear(1/s, axis=0, saturate=1) ─ DequantizeLinear(1/s) ─ Reshape ─┤
    W8ᵀ (float8e4m3fn initializer, K x N) ─ DequantizeLinear(s_w) ─────────────────────────────────── MatMul (fp32)
                                                                                  ─ Cast(bf16) ─ Add(bias, bf16)

* the input is quantised with a dynamic scale computed in the graph, as the kernel computes it
  (``s = 448 / max(amax, EPS)``): ``tensorwise`` one scale per tensor; ``rowwise`` and ``rowwise_gw_hp``
  (the same forward) one per row, rounded down to a power of two, as a per-axis QuantizeLinear
  (``axis=0``) on the input reshaped to (rows, K). QuantizeLinear divides by its scale where the kernel
  multiplies by ``s``: with power-of-2 scales ``x / (1/s)`` is ``x * s`` exactly, but with tensorwise's
  ``448 / amax`` and bf16 inputs ``x * s`` lands exactly on a float8 rounding tie for about 1 % of the
  elements (``x`` and ``amax`` share few mantissa bits) and ``x / (1/s)``, one fp32 ulp off, rounds the
  other way. So tensorwise multiplies first and quantises with scale 1; its DequantizeLinear has ``1/s``;
* the weight is quantised once, at export, by the kernel's own code: it is stored as a float8e4m3fn
  initializer (transposed, K x N) with its inverse scale (a scalar, or one per output feature:
  ``axis=1``), so the file holds fp8 weights, and only its DequantizeLinear runs;
* the GEMM is an fp32 MatMul of the two dequantised operands (the kernel's fp32 accumulation), cast to
  the input's dtype, then the bias is added in that dtype, as the kernel adds it.

So the file computes what the kernel computes, bit for bit where no bf16 op precedes a quantisation
(tests/test_fp8_onnx.py). Every fp8 linear has one QuantizeLinear and two DequantizeLinear nodes
(:data:`QDQ_PER_LAYER`), named ``fp8/<node>/...`` after the FX node (:func:`name_fp8_nodes`), except that
linears reading the same tensor (q, k, v) share its quantisation (the exporter's optimizer merges
identical subgraphs); no other node of the graph is a Q/DQ (:func:`fp8_checks`).

How: before ``torch.onnx.export`` (dynamo only: the TorchScript exporter cannot translate it), each
``fp8_linear`` call of the export copy becomes a call of the custom op ``mpconvert::fp8_linear_qdq`` on
the weight's float8 buffers (:func:`prepare_fp8`), and :func:`translation_table` tells the exporter how to
write that op in ONNX. What cannot be exported this way (the ``blockwise`` recipe, an fp16 export of an
fp8 conversion, the TorchScript exporter, an opset below 20) is refused in one line by
:func:`check_fp8_export` before anything is written (:class:`Fp8OnnxRefused`, exit 2).

onnxruntime's CPU provider cannot run the file (no bf16 MatMul/Add kernels, the same as any bf16 export;
it has float8 QuantizeLinear/DequantizeLinear), so :func:`converter.export.onnx_verify.verify_with_reference`
runs it with ``onnx.reference.ReferenceEvaluator`` instead.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
import torch.fx

from converter.fp8.kernels import EPS, RECIPES, fp8_linear, quantize_operand
from converter.ir.errors import EXIT_BAD_INPUT, MpconvertError

__all__ = [
    "FP8_MIN_OPSET",
    "ONNX_RECIPES",
    "QDQ_PER_LAYER",
    "Fp8Layer",
    "Fp8OnnxRefused",
    "check_fp8_export",
    "fp8_nodes",
    "fp8_recipe",
    "prepare_fp8",
    "translation_table",
    "name_fp8_nodes",
    "qdq_counts",
    "fp8_checks",
]

#: QuantizeLinear with float8 outputs (and ``saturate``) exists from opset 19, but torch's dynamo exporter
#: builds at opset 20 and converts only upwards ("downstream version conversion not currently handled")
FP8_MIN_OPSET = 20
#: the recipes whose forward GEMM the export writes as Q/DQ; ``rowwise_gw_hp`` differs from ``rowwise``
#: only in its weight-gradient GEMM, which inference does not run
ONNX_RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp")
#: (QuantizeLinear, DequantizeLinear) nodes per fp8 linear: the input's pair and the weight's DequantizeLinear
QDQ_PER_LAYER = (1, 2)

_FLOAT, _FLOAT8E4M3FN = 1, 17
_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_WEIGHT, _SCALE = "mp_fp8_weight__", "mp_fp8_scale__"


class Fp8OnnxRefused(MpconvertError, ValueError):
    """An ONNX export of an fp8 conversion that cannot be written as float8 Q/DQ; the message says what to do."""

    exit_code = EXIT_BAD_INPUT


def fp8_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The ``fp8_linear`` calls of ``gm`` (what the fp8 stage made), in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fp8_linear]


def fp8_recipe(gm: torch.fx.GraphModule) -> Optional[str]:
    """The recipe name of ``gm``'s fp8 linears (None: it has none)."""
    recipes = {_recipe_arg(n) for n in fp8_nodes(gm)}
    if len(recipes) > 1:
        raise Fp8OnnxRefused(f"the fp8 linears use several recipes ({', '.join(sorted(recipes))}); ONNX export "
                             "writes one: convert with a single fp8 recipe")
    return next(iter(recipes), None)


def _recipe_arg(node: torch.fx.Node) -> str:
    recipe = node.args[3] if len(node.args) > 3 else node.kwargs.get("recipe", "tensorwise")
    return recipe if isinstance(recipe, str) else getattr(recipe, "name", str(recipe))


def _input_tensors(value: Any, where: str):
    """(where, tensor) for every floating tensor in ``value`` (nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and not value.is_meta:
            yield where, value
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _input_tensors(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _input_tensors(item, f"{where}[{key!r}]")


def _bad_values(tensor: torch.Tensor, *, inf: bool = True) -> Optional[str]:
    """What ``tensor`` holds that an fp8 scale cannot take (NaN, and inf with ``inf``), or None."""
    bad = torch.isnan(tensor) | (torch.isinf(tensor) if inf else False)
    count = int(bad.sum())
    if not count:
        return None
    first = tuple(int(i) for i in torch.nonzero(bad)[0].tolist())
    return f"{count} non-finite value(s) ({tensor[first].item()} first, at {list(first)})"


def check_fp8_finite(gm: torch.fx.GraphModule, example_inputs: Any) -> None:
    """Refuse (one line, exit 2) an fp8 ONNX export whose example inputs hold inf/NaN or whose parameters (or
    buffers) hold NaN/inf (buffers: NaN only; an inf mask fill is deliberate): the float8 Q/DQ scales are the
    amax of what each fp8 linear reads, which such a value makes inf or NaN, so the file could not be verified
    (before, exit 1 "please report this bug")."""
    args, kwargs = example_inputs if isinstance(example_inputs, tuple) and len(example_inputs) == 2 else (example_inputs, {})
    for where, tensor in [*_input_tensors(args, "args"), *_input_tensors(kwargs, "kwargs")]:
        what = _bad_values(tensor)
        if what is not None:
            raise Fp8OnnxRefused(f"the example input {where} holds {what}; the fp8 ONNX export scales each fp8 linear "
                                 "by the amax of its input, which that makes inf/NaN: give example inputs with finite "
                                 "values (a mask as a large finite number, not inf)")
    named = [*((n, t, True) for n, t in gm.named_parameters()), *((n, t, False) for n, t in gm.named_buffers())]
    for name, tensor, is_param in named:
        what = _bad_values(tensor, inf=is_param) if tensor.is_floating_point() and not tensor.is_meta else None
        if what is not None:
            raise Fp8OnnxRefused(f"the {'parameter' if is_param else 'buffer'} {name!r} holds {what}; the fp8 ONNX export "
                                 "scales each fp8 weight by its amax and every output would be NaN: repair the weights "
                                 "(load a good checkpoint) before converting")


def check_fp8_export(gm: torch.fx.GraphModule, *, fp8: bool, precision: Optional[str], exporter: str = "auto",
                     opset: int = 20, example_inputs: Any = None) -> None:
    """Refuse, in one line and before anything is written, an ONNX export of an fp8 conversion that the
    float8 Q/DQ export cannot write. ``fp8``: the conversion is an fp8 one (``options.fp8_recipe`` set);
    ``precision``: the requested ONNX dtype (None: the conversion's); ``example_inputs``: ``(args, kwargs)``,
    checked with the weights for inf/NaN (:func:`check_fp8_finite`) when given."""
    if not fp8:
        return
    if precision not in (None, "bf16"):
        raise Fp8OnnxRefused(f"an fp8 conversion exports bf16 with float8 Q/DQ GEMMs, not {precision}: drop "
                             f"--onnx-precision {precision} (precision={precision!r}), or export a --precision "
                             f"{precision} conversion instead")
    if example_inputs is not None:
        check_fp8_finite(gm, example_inputs)
    recipe = fp8_recipe(gm)
    if recipe is None:
        return  # every linear was gated to bf16: a plain bf16 export
    if recipe not in ONNX_RECIPES:
        raise Fp8OnnxRefused(f"fp8 recipe {recipe!r} cannot be exported to ONNX: its 1x128 and 128x128 tile scales have "
                             "no QuantizeLinear/DequantizeLinear form in this export (per-tensor and per-axis scales; "
                             "opset 21's block_size is not written); use fp8_recipe = \"tensorwise\" or \"rowwise\" (a "
                             "rule file's [settings], or convert(fp8_recipe=...)), or export the bf16 conversion "
                             "(--precision bf16) instead")
    if exporter == "torchscript":
        raise Fp8OnnxRefused("the TorchScript exporter cannot write the fp8 GEMMs as float8 Q/DQ; use exporter='auto' "
                             "or 'dynamo'")
    if opset < FP8_MIN_OPSET:
        raise Fp8OnnxRefused(f"the fp8 export needs opset >= {FP8_MIN_OPSET} (float8 QuantizeLinear exists from 19, and "
                             f"torch's exporter converts only up from its opset {FP8_MIN_OPSET}), got opset {opset}; export "
                             f"with opset {FP8_MIN_OPSET} or later")


# ---------------------------------------------------------------------------------------------
# before export: fp8_linear -> mpconvert::fp8_linear_qdq on a float8 weight buffer


@dataclass(frozen=True)
class Fp8Layer:
    """One fp8 linear of the export: its FX node, the names of its float8 weight and scale buffers, its recipe."""

    node: str
    weight: str
    scale: str
    recipe: str
    in_features: int
    out_features: int


@functools.lru_cache(maxsize=None)
def _qdq_op():
    """The custom op the export copy calls in place of ``fp8_linear`` (defined once, on first use)."""

    @torch.library.custom_op("mpconvert::fp8_linear_qdq", mutates_args=())
    def fp8_linear_qdq(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                       bias: Optional[torch.Tensor], recipe: str) -> torch.Tensor:
        """``fp8_linear``'s forward on a weight quantised beforehand (``weight_fp8`` K x N, its inverse scale)."""
        rec = RECIPES[recipe]
        x2 = x.reshape(-1, x.shape[-1])
        a8, a_inv = quantize_operand(x2, rec.input_dtype, rec, contract_dim=1)
        y = torch.matmul(a8.to(torch.float32) * a_inv, weight_fp8.to(torch.float32) * weight_scale).to(x.dtype)
        y = y.reshape(x.shape[:-1] + (weight_fp8.shape[1],))
        return y if bias is None else y + bias.to(y.dtype)

    @fp8_linear_qdq.register_fake
    def _(x, weight_fp8, weight_scale, bias, recipe):
        return x.new_empty(x.shape[:-1] + (weight_fp8.shape[1],))

    return torch.ops.mpconvert.fp8_linear_qdq.default


def _weights_seen(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> dict:
    """The weight tensor each fp8 linear receives (its parameter through the graph's own casts), computed from
    the parameters alone: the fp8 stage rewrites only linears whose weight is a parameter."""
    interpreter = torch.fx.Interpreter(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    seen: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for node in nodes:
            weight = cast(torch.fx.Node, node.args[1])  # the fp8 stage rewrites linears whose weight is a parameter
            needed: set[torch.fx.Node] = set()
            stack: list[torch.fx.Node] = [weight]
            while stack:
                current = stack.pop()
                if current in needed or current in interpreter.env:
                    continue
                if current.op == "placeholder":
                    raise Fp8OnnxRefused(f"fp8 linear {node.name}: its weight is computed from the model's inputs, so it "
                                         "cannot be stored as a float8 initializer; export the bf16 conversion instead")
                needed.add(current)
                stack.extend(current.all_input_nodes)
            for current in sorted(needed, key=order.__getitem__):
                interpreter.env[current] = interpreter.run_node(current)
            seen[node.name] = interpreter.env[weight].detach()
    return seen


def prepare_fp8(gm: torch.fx.GraphModule) -> list[Fp8Layer]:
    """Replace each ``fp8_linear`` call of ``gm`` (an export copy, changed in place) by the custom op
    ``mpconvert::fp8_linear_qdq`` on the weight quantised by the kernel's own ``quantize_operand``
    (float8e4m3fn, transposed to K x N, registered as a buffer with its inverse scale)."""
    nodes = fp8_nodes(gm)
    if not nodes:
        return []
    op = _qdq_op()
    weights = _weights_seen(gm, nodes)
    layers = []
    for node in nodes:
        recipe = _recipe_arg(node)
        rec = RECIPES[recipe]
        weight = weights[node.name]
        w8, w_inv = quantize_operand(weight.t(), rec.weight_dtype, rec, contract_dim=0, is_weight=True)
        layer = Fp8Layer(node.name, _WEIGHT + node.name, _SCALE + node.name, recipe, weight.shape[1], weight.shape[0])
        gm.register_buffer(layer.weight, w8.contiguous())
        gm.register_buffer(layer.scale, w_inv.reshape(-1) if rec.granularity == "row" else w_inv.reshape(()))
        x, old, bias = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        with gm.graph.inserting_before(node):
            w_node, s_node = gm.graph.get_attr(layer.weight), gm.graph.get_attr(layer.scale)
        node.target, node.args, node.kwargs = op, (x, w_node, s_node, bias, recipe), {}
        _erase_unused(gm.graph, old)
        layers.append(layer)
    gm.graph.lint()
    gm.recompile()
    return layers


def _erase_unused(graph: torch.fx.Graph, node: object) -> None:
    """Erase the weight's old chain (its casts and ``get_attr``) where nothing else reads it, so that the
    export does not carry the high-precision weight beside the float8 one."""
    while isinstance(node, torch.fx.Node) and not node.users and node.op in ("get_attr", "call_method", "call_function"):
        inputs = node.all_input_nodes
        graph.erase_node(node)
        node = inputs[0] if len(inputs) == 1 else None


# ---------------------------------------------------------------------------------------------
# the translation of mpconvert::fp8_linear_qdq to ONNX (onnxscript, traced by torch.onnx)


def translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export``: the custom op to its Q/DQ graph."""
    return {_qdq_op(): _translate}


def _translate(x, weight_fp8, weight_scale, bias, recipe: str):
    """The ONNX nodes of one fp8 linear (module docstring)."""
    import numpy as np
    import onnx_ir as ir
    from onnxscript import opset20

    # onnxscript's opset is typed for scripted functions; here it is traced on torch.onnx's symbolic tensors
    op: Any = opset20

    rec = RECIPES[recipe]
    row = rec.granularity == "row"
    xf = op.Cast(x, to=_FLOAT)
    operand = op.Reshape(xf, op.Constant(value_ints=[-1, int(weight_fp8.shape[0])])) if row else xf
    amax = op.ReduceMax(op.Abs(operand), op.Constant(value_ints=[1]), keepdims=0) if row else \
        op.ReduceMax(op.Abs(operand), keepdims=0)
    scale = op.Div(op.Constant(value_float=_E4M3_MAX), op.Max(amax, op.Constant(value_float=EPS)))
    if rec.power_of_2:
        scale = _floor_power_of_2(op, scale)
    inverse = op.Reciprocal(scale)
    float8 = ir.DataType.FLOAT8E4M3FN.numpy()
    if row:  # a per-axis zero point has the scale's shape: float8 zeros, one per row
        rows = [d for d in x.shape[:-1]] if x.shape is not None else [None]
        if all(isinstance(d, int) for d in rows):  # a static export (the default): a constant
            zero = op.Constant(value=ir.tensor(np.zeros((math.prod(cast(list[int], rows)),), dtype=float8)))
        else:
            zero = op.Cast(op.ConstantOfShape(op.Shape(inverse)), to=_FLOAT8E4M3FN)
        quantised = op.QuantizeLinear(operand, inverse, zero, axis=0, saturate=1)
        dequantised = op.Reshape(op.DequantizeLinear(quantised, inverse, axis=0), op.Shape(xf))
    else:  # QuantizeLinear divides by its scale where the kernel multiplies: multiply first, quantise with scale 1
        zero = op.Constant(value=ir.tensor(np.zeros((), dtype=float8)))
        quantised = op.QuantizeLinear(op.Mul(operand, scale), op.Constant(value_float=1.0), zero, saturate=1)
        dequantised = op.DequantizeLinear(quantised, inverse)
    weight = op.DequantizeLinear(weight_fp8, weight_scale, axis=1) if row else op.DequantizeLinear(weight_fp8, weight_scale)
    y = op.Cast(op.MatMul(dequantised, weight), to=int(x.dtype))
    if bias is None:
        return y
    return op.Add(y, bias if bias.dtype == x.dtype else op.Cast(bias, to=int(x.dtype)))  # the kernel: bias.to(y.dtype)


def _floor_power_of_2(op, scale):
    """Each positive scale rounded down to a power of two, exactly (ONNX has no bitcast to mask the mantissa):
    ``2 ** floor(log2 s)`` from Log, corrected by one step either way where Log's rounding lands it off."""
    two, half = op.Constant(value_float=2.0), op.Constant(value_float=0.5)
    p = op.Pow(two, op.Floor(op.Div(op.Log(scale), op.Constant(value_float=0.6931471805599453))))
    p = op.Where(op.Greater(p, scale), op.Mul(p, half), p)
    doubled = op.Mul(p, two)
    return op.Where(op.LessOrEqual(doubled, scale), doubled, p)


# ---------------------------------------------------------------------------------------------
# after export: names and counts


def _producers(graph) -> dict:
    return {out: n for n in graph.node for out in n.output}


def _consumers(graph) -> dict:
    found: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            found.setdefault(i, []).append(n)
    return found


def name_fp8_nodes(model, layers: list[Fp8Layer]) -> dict[str, dict[str, Any]]:
    """Name each fp8 linear's nodes ``fp8/<node>/...`` (found from its float8 weight initializer: the weight's
    DequantizeLinear, the MatMul it feeds, the input's DequantizeLinear, QuantizeLinear and Cast, the output
    Cast); returns, per layer, the nodes found by role (a role missing is absent). Linears that read the same
    tensor (q, k and v) share one input chain: the exporter's optimizer merges their identical
    quantisations (same tensor, same scale), and the first of them names it."""
    graph = model.graph
    producer, consumers = _producers(graph), _consumers(graph)
    found: dict[str, dict[str, Any]] = {}
    for layer in layers:
        roles: dict[str, Any] = {}
        weight_dq = [n for n in consumers.get(layer.weight, []) if n.op_type == "DequantizeLinear"]
        if len(weight_dq) == 1:
            roles["dequantize_w"] = weight_dq[0]
            matmul = [n for n in consumers.get(weight_dq[0].output[0], []) if n.op_type == "MatMul"]
            if len(matmul) == 1:
                roles["matmul"] = matmul[0]
                out = consumers.get(matmul[0].output[0], [])
                if len(out) == 1 and out[0].op_type == "Cast":
                    roles["to_half"] = out[0]
                roles.update(_input_chain(matmul[0].input[0], producer))
        for role, node in roles.items():
            if not node.name.startswith("fp8/"):  # an input chain shared by linears reading one tensor: the first names it
                node.name = f"fp8/{layer.node}/{role}"
        found[layer.node] = roles
    return found


def _input_chain(name: str, producer: dict) -> dict[str, Any]:
    """The input's DequantizeLinear, QuantizeLinear and fp32 Cast upstream of a MatMul input (through the Reshape
    or Mul between them)."""
    roles: dict[str, Any] = {}
    node = producer.get(name)
    if node is not None and node.op_type == "Reshape":
        node = producer.get(node.input[0])
    if node is None or node.op_type != "DequantizeLinear":
        return roles
    roles["dequantize_x"] = node
    quantise = producer.get(node.input[0])
    if quantise is None or quantise.op_type != "QuantizeLinear":
        return roles
    roles["quantize_x"] = quantise
    source = producer.get(quantise.input[0])
    if source is not None and source.op_type in ("Reshape", "Mul"):  # rowwise's 2-D view; tensorwise's x * scale
        source = producer.get(source.input[0])
    if source is not None and source.op_type == "Cast":
        roles["x_to_fp32"] = source
    return roles


def qdq_counts(model) -> dict[str, int]:
    """QuantizeLinear and DequantizeLinear nodes of ``model``, and those whose float8 side is float8e4m3fn."""
    from converter.export.onnx_graph import all_graphs, value_types

    types = value_types(model)
    nodes = [n for g in all_graphs(model.graph) for n in g.node]
    quantise = [n for n in nodes if n.op_type == "QuantizeLinear"]
    dequantise = [n for n in nodes if n.op_type == "DequantizeLinear"]
    e4m3 = sum(1 for n in quantise if len(n.input) > 2 and types.get(n.input[2]) == _FLOAT8E4M3FN)
    e4m3 += sum(1 for n in dequantise if types.get(n.input[0]) == _FLOAT8E4M3FN)
    return {"QuantizeLinear": len(quantise), "DequantizeLinear": len(dequantise), "float8e4m3fn": e4m3}


def fp8_checks(model, layers: list[Fp8Layer], roles: dict[str, dict[str, Any]], checks: dict, notes: list[str]) -> dict:
    """The ``fp8_qdq`` check (a verdict check): every fp8 linear has its chain (the input's QuantizeLinear and
    DequantizeLinear, its weight's DequantizeLinear, the MatMul), every Q/DQ node of the graph is in one (no
    other linear has any) and reads or writes float8e4m3fn; returns ``OnnxResult.fp8``.

    The counts: a QuantizeLinear/DequantizeLinear pair per distinct input tensor (linears reading one tensor
    share it, :func:`name_fp8_nodes`) and a DequantizeLinear per linear (:data:`QDQ_PER_LAYER` when no two
    read the same tensor)."""
    counts = qdq_counts(model)
    n = len(layers)
    needed = ("quantize_x", "dequantize_x", "dequantize_w", "matmul")
    incomplete = [layer.node for layer in layers if any(role not in roles.get(layer.node, {}) for role in needed)]
    inputs = len({id(r["quantize_x"]) for r in roles.values() if "quantize_x" in r})
    want = {"QuantizeLinear": inputs, "DequantizeLinear": inputs + n, "float8e4m3fn": 2 * inputs + n}
    checks["fp8_qdq"] = counts == want and not incomplete
    stored = {t.name: t for t in model.graph.initializer if t.data_type == _FLOAT8E4M3FN}
    weight_bytes = sum(math.prod(stored[layer.weight].dims) for layer in layers if layer.weight in stored)  # 1 byte each
    recipe = layers[0].recipe if layers else None
    notes.append(f"{n} fp8 linear(s) (recipe {recipe}) written as float8e4m3fn Q/DQ: {counts['QuantizeLinear']} "
                 f"QuantizeLinear + {counts['DequantizeLinear']} DequantizeLinear (expected {want['QuantizeLinear']} + "
                 f"{want['DequantizeLinear']}: a QuantizeLinear/DequantizeLinear pair, its scale computed in the graph, "
                 f"for each of the {inputs} distinct input(s), and the DequantizeLinear of each linear's float8e4m3fn "
                 f"weight initializer); fp8 weights {weight_bytes} bytes")
    if incomplete:
        notes.append(f"fp8 linear(s) whose Q/DQ chain was not found in the exported graph: {', '.join(incomplete[:5])}")
    elif counts != want:
        notes.append(f"Q/DQ counts {counts} differ from the expected {want}: a Q/DQ node outside the fp8 linears")
    return {"recipe": recipe, "layers": n, "inputs": inputs, "nodes": [layer.node for layer in layers], **counts,
            "weight_bytes": weight_bytes}
