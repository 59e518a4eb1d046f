"""ONNX graph inspection and post-processing on a ``ModelProto`` (the :mod:`onnx` package only).

The export (:mod:`converter.export.onnx`) runs these on the exporter's model before it writes it:
Casts on initializers folded into initializers of the target dtype, identity Casts dropped, node
names made unique, the exporter's debug metadata stripped; and reads from it the Casts, their
round trips, the dtypes of the graph's values, inputs and outputs, and its half initializers.
Subgraphs (If/Loop/Scan bodies) are included wherever a pass walks nodes.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "all_graphs",
    "onnx_casts",
    "cast_pairs",
    "cast_to",
    "fold_initializer_casts",
    "onnx_type",
    "type_name",
    "value_types",
    "drop_identity_casts",
    "strip_debug_metadata",
    "set_model_metadata",
    "unique_node_names",
    "io_dtypes",
    "half_initializers",
]

# ONNX TensorProto element types
_FLOAT, _FLOAT16, _BFLOAT16, _DOUBLE = 1, 10, 16, 11
_ONNX_DTYPE_NAMES = {_FLOAT: "fp32", _FLOAT16: "fp16", _BFLOAT16: "bf16", _DOUBLE: "fp64"}
_ONNX_TYPE_NAMES = {**_ONNX_DTYPE_NAMES, 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool"}
_TORCH_TO_ONNX = {
    torch.float32: _FLOAT, torch.uint8: 2, torch.int8: 3, torch.int16: 5, torch.int32: 6, torch.int64: 7,
    torch.bool: 9, torch.float16: _FLOAT16, torch.float64: _DOUBLE, torch.bfloat16: _BFLOAT16,
}


def all_graphs(graph) -> list:
    """The graph and every subgraph (If/Loop/Scan bodies)."""
    found = [graph]
    for node in graph.node:
        for attr in node.attribute:
            if attr.g is not None and attr.g.node:
                found.extend(all_graphs(attr.g))
            for sub in attr.graphs:
                found.extend(all_graphs(sub))
    return found


def onnx_casts(model) -> list:
    """Every Cast/CastLike node of ``model`` (subgraphs included)."""
    return [n for g in all_graphs(model.graph) for n in g.node if n.op_type in ("Cast", "CastLike")]


def cast_pairs(model) -> list[tuple[str, str]]:
    """(producer, consumer) for every Cast whose input is produced by another Cast."""
    pairs: list[tuple[str, str]] = []
    for g in all_graphs(model.graph):
        producer = {out: n for n in g.node for out in n.output}
        for n in g.node:
            if n.op_type in ("Cast", "CastLike") and n.input and n.input[0] in producer:
                p = producer[n.input[0]]
                if p.op_type in ("Cast", "CastLike"):
                    pairs.append((p.name, n.name))
    return pairs


def cast_to(node) -> Optional[int]:
    """The element type a Cast node converts to (its ``to`` attribute; None without one)."""
    for attr in node.attribute:
        if attr.name == "to":
            return int(attr.i)
    return None


def fold_initializer_casts(model) -> int:
    """Replace Cast(initializer or Constant) by an initializer of the target dtype. Returns the count."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    constants = {}
    for n in graph.node:
        if n.op_type == "Constant" and len(n.output) == 1:
            for attr in n.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    constants[n.output[0]] = (n, attr.t)
    graph_inputs = {i.name for i in graph.input}
    folded = 0
    keep = []
    new_inits = []
    for n in graph.node:
        source = n.input[0] if n.op_type == "Cast" and n.input else None
        tensor = None
        if source is not None and source not in graph_inputs:
            tensor = inits[source] if source in inits else (constants[source][1] if source in constants else None)
        to = cast_to(n) if tensor is not None else None
        if tensor is None or to is None:
            keep.append(n)
            continue
        array = numpy_helper.to_array(tensor)
        new = numpy_helper.from_array(_np_cast(array, to), name=n.output[0])
        new_inits.append(new)
        folded += 1
    if not folded:
        return 0
    del graph.node[:]
    graph.node.extend(keep)
    graph.initializer.extend(new_inits)
    # drop initializers and Constants nothing reads any more
    used = {i for g in all_graphs(graph) for n in g.node for i in n.input} | {o.name for o in graph.output}
    alive = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(alive)
    nodes = [n for n in graph.node if not (n.op_type == "Constant" and n.output[0] not in used)]
    del graph.node[:]
    graph.node.extend(nodes)
    return folded


def _np_cast(array, to: int):
    import numpy as np
    from onnx import helper

    if to == _BFLOAT16:
        import ml_dtypes  # onnx depends on it

        return np.asarray(array).astype(ml_dtypes.bfloat16)
    return np.asarray(array).astype(helper.tensor_dtype_to_np_dtype(to))


def onnx_type(dtype: torch.dtype) -> Optional[int]:
    """The ONNX element type of a torch dtype (None for one without)."""
    return _TORCH_TO_ONNX.get(dtype)


def value_types(model) -> dict[str, int]:
    """Element type of every value of the main graph (inputs, initializers, inferred values)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # type inference is best effort; the Casts' sources then stay unknown
        inferred = model
    types = {t.name: t.data_type for t in model.graph.initializer}
    for v in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            types[v.name] = v.type.tensor_type.elem_type
    return types


def drop_identity_casts(model) -> int:
    """Remove Casts to the type their input already has (the TorchScript exporter writes some)."""
    types = value_types(model)
    graph = model.graph
    outputs = {o.name for o in graph.output}
    replace: dict[str, str] = {}
    keep = []
    for n in graph.node:
        if (n.op_type == "Cast" and n.input and n.output[0] not in outputs
                and types.get(n.input[0]) is not None and types.get(n.input[0]) == cast_to(n)):
            replace[n.output[0]] = replace.get(n.input[0], n.input[0])
            continue
        keep.append(n)
    if not replace:
        return 0
    for g in all_graphs(graph):
        for n in g.node:
            for i, name in enumerate(n.input):
                if name in replace:
                    n.input[i] = replace[name]
    del graph.node[:]
    graph.node.extend(keep)
    return len(replace)


def strip_debug_metadata(model) -> None:
    """Drop the exporter's per-node debug metadata (FX node text, stack traces, module names).

    It is ~40% of a small model's file; the Casts keep their provenance in their names."""
    for g in all_graphs(model.graph):
        for n in g.node:
            del n.metadata_props[:]


def set_model_metadata(model, entries: dict) -> None:
    """Add ``entries`` to the model's metadata properties (replacing those of the same key)."""
    import onnx

    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, **entries})


def unique_node_names(model) -> int:
    """Make every node name in the model (subgraphs included) unique and non-empty."""
    taken: set[str] = set()
    renamed = 0
    for g in all_graphs(model.graph):
        for i, n in enumerate(g.node):
            base = n.name or f"{n.op_type}_{i}"
            name = base
            k = 1
            while name in taken:
                name = f"{base}__{k}"
                k += 1
            if name != n.name:
                renamed += 1
                n.name = name
            taken.add(name)
    return renamed


def io_dtypes(model) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(name, dtype name) of each graph input, and of each graph output."""
    def elem(v):
        return _ONNX_DTYPE_NAMES.get(v.type.tensor_type.elem_type, str(v.type.tensor_type.elem_type))

    return [(v.name, elem(v)) for v in model.graph.input], [(v.name, elem(v)) for v in model.graph.output]


def half_initializers(model) -> tuple[int, int, list[str]]:
    """(#half initializers, #fp32 initializers, fp32 initializers that only half ops consume)."""
    graph = model.graph
    consumers: dict[str, list] = {}
    for g in all_graphs(graph):
        for n in g.node:
            for i in n.input:
                consumers.setdefault(i, []).append(n)
    half = sum(1 for t in graph.initializer if t.data_type in (_FLOAT16, _BFLOAT16))
    fp32 = [t for t in graph.initializer if t.data_type == _FLOAT]
    only_cast = [
        t.name for t in fp32
        if consumers.get(t.name) and all(n.op_type == "Cast" and cast_to(n) in (_FLOAT16, _BFLOAT16) for n in consumers[t.name])
    ]
    return half, len(fp32), only_cast


def type_name(t: Optional[int]) -> str:
    """A short name of an ONNX element type (``fp16``, ``int64``; ``type N`` for others)."""
    return _ONNX_TYPE_NAMES.get(t, f"type {t}") if t is not None else f"type {t}"
