"""Canonical op names: one name per operation, whatever the capture produced.

``nn.Linear``, ``F.linear`` and ``aten.linear`` are all ``linear``; ``nn.Conv2d``, ``F.conv2d``,
``aten.conv2d`` and ``aten.convolution`` (2-d weight) are ``conv2d``; ``Tensor.softmax``,
``F.softmax`` and ``aten._softmax`` are ``softmax``; ``operator.add``, ``torch.add`` and
``aten.add`` are ``add``. Rules match these names, so a rule file works for both tracers.
"""
from __future__ import annotations

import functools
import operator
import re
from typing import Any, Callable, Optional

import torch
import torch.fx

from converter.ir.meta import META_INFO, META_VALUE

__all__ = [
    "canonical_op",
    "known_op_names",
    "CAST_OPS",
    "NORM_OPS",
    "NATIVE_PROMOTE_OPS",
    "ACCUMULATE_OPS",
    "MATMUL_CONV_OPS",
    "RECURRENT_OPS",
    "non_weight_use",
    "LIBRARY_OPS",
    "library_op",
    "is_inplace",
    "explicit_dtype",
    "castable_arg_positions",
    "map_castable_args",
    "WEIGHT_MATMUL",
]

#: the op alias of a matmul/mm/addmm of an activation and a 2-D weight parameter (converter.ir.weight_gemm):
#: rules may name it besides the node's canonical op
WEIGHT_MATMUL = "weight_matmul"

# Module classes -> canonical op (for leaf modules that stay call_module nodes).
_MODULE_OPS = {
    "Linear": "linear",
    "Bilinear": "bilinear",
    "Conv1d": "conv1d",
    "Conv2d": "conv2d",
    "Conv3d": "conv3d",
    "ConvTranspose1d": "conv_transpose1d",
    "ConvTranspose2d": "conv_transpose2d",
    "ConvTranspose3d": "conv_transpose3d",
    "BatchNorm1d": "batch_norm",
    "BatchNorm2d": "batch_norm",
    "BatchNorm3d": "batch_norm",
    "SyncBatchNorm": "batch_norm",
    "LayerNorm": "layer_norm",
    "GroupNorm": "group_norm",
    "RMSNorm": "rms_norm",
    "InstanceNorm1d": "instance_norm",
    "InstanceNorm2d": "instance_norm",
    "InstanceNorm3d": "instance_norm",
    "Embedding": "embedding",
    "EmbeddingBag": "embedding_bag",
    "ReLU": "relu",
    "ReLU6": "hardtanh",
    "LeakyReLU": "leaky_relu",
    "GELU": "gelu",
    "SiLU": "silu",
    "Mish": "mish",
    "ELU": "elu",
    "Tanh": "tanh",
    "Sigmoid": "sigmoid",
    "Hardswish": "hardswish",
    "Softplus": "softplus",
    "Softmax": "softmax",
    "LogSoftmax": "log_softmax",
    "Dropout": "dropout",
    "Dropout1d": "dropout",
    "Dropout2d": "dropout",
    "Dropout3d": "dropout",
    "AlphaDropout": "dropout",
    "MaxPool1d": "max_pool1d",
    "MaxPool2d": "max_pool2d",
    "MaxPool3d": "max_pool3d",
    "AvgPool1d": "avg_pool1d",
    "AvgPool2d": "avg_pool2d",
    "AvgPool3d": "avg_pool3d",
    "AdaptiveAvgPool1d": "adaptive_avg_pool1d",
    "AdaptiveAvgPool2d": "adaptive_avg_pool2d",
    "AdaptiveAvgPool3d": "adaptive_avg_pool3d",
    "AdaptiveMaxPool2d": "adaptive_max_pool2d",
    "Flatten": "flatten",
    "Unflatten": "unflatten",
    "Identity": "identity",
    "Upsample": "upsample",
    "CrossEntropyLoss": "cross_entropy",
    "NLLLoss": "nll_loss",
    "MSELoss": "mse_loss",
    "L1Loss": "l1_loss",
    "SmoothL1Loss": "smooth_l1_loss",
    "HuberLoss": "huber_loss",
    "KLDivLoss": "kl_div",
    "BCELoss": "binary_cross_entropy",
    "BCEWithLogitsLoss": "binary_cross_entropy_with_logits",
    "MultiheadAttention": "multi_head_attention",
    "LSTM": "lstm",
    "GRU": "gru",
    "RNN": "rnn",
}

# Python operators and odd function names -> canonical op.
_FUNCTION_OPS = {
    operator.add: "add",
    operator.iadd: "add",
    operator.sub: "sub",
    operator.isub: "sub",
    operator.mul: "mul",
    operator.imul: "mul",
    operator.truediv: "div",
    operator.itruediv: "div",
    operator.floordiv: "floor_divide",
    operator.mod: "remainder",
    operator.pow: "pow",
    operator.matmul: "matmul",
    operator.neg: "neg",
    operator.pos: "positive",
    operator.abs: "abs",
    operator.getitem: "getitem",
    operator.eq: "eq",
    operator.ne: "ne",
    operator.lt: "lt",
    operator.le: "le",
    operator.gt: "gt",
    operator.ge: "ge",
    operator.and_: "bitwise_and",
    operator.or_: "bitwise_or",
    operator.xor: "bitwise_xor",
    operator.invert: "bitwise_not",
    getattr: "getattr",
}

# Aliases: aten internals and Python spellings -> the canonical name users write in rules.
_ALIASES = {
    "_grouped_mm": "grouped_mm",
    "_softmax": "softmax",
    "_safe_softmax": "softmax",
    "special_softmax": "softmax",
    "_log_softmax": "log_softmax",
    "native_layer_norm": "layer_norm",
    "_fused_rms_norm": "rms_norm",
    "native_group_norm": "group_norm",
    "native_batch_norm": "batch_norm",
    "_native_batch_norm_legit": "batch_norm",
    "_native_batch_norm_legit_no_training": "batch_norm",
    "_native_batch_norm_legit_functional": "batch_norm",
    "cudnn_batch_norm": "batch_norm",
    "_batch_norm_impl_index": "batch_norm",
    "_batch_norm_with_update": "batch_norm",
    "_batch_norm_no_update": "batch_norm",
    "native_dropout": "dropout",
    "feature_dropout": "dropout",
    "alpha_dropout": "dropout",
    "feature_alpha_dropout": "dropout",
    "dropout1d": "dropout",
    "dropout2d": "dropout",
    "dropout3d": "dropout",
    "true_divide": "div",
    "truediv": "div",
    "divide": "div",
    "multiply": "mul",
    "subtract": "sub",
    "rsub": "sub",
    "concat": "cat",
    "concatenate": "cat",
    "cross_entropy_loss": "cross_entropy",
    "nll_loss_forward": "nll_loss",
    "nll_loss2d_forward": "nll_loss",
    "nll_loss_nd": "nll_loss",
    "_scaled_dot_product_attention_math": "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_cudnn_attention": "scaled_dot_product_attention",
    "_to_copy": "to",
    "_to_dtype": "to",
    "float": "to",
    "double": "to",
    "half": "to",
    "bfloat16": "to",
    "type": "to",
    "type_as": "to",
    "_unsafe_view": "view",
    "_reshape_alias": "reshape",
    "upsample_nearest2d": "upsample",
    "upsample_bilinear2d": "upsample",
    "interpolate": "upsample",
    "matrix_power": "matmul",
    "__iadd__": "add",
    "__isub__": "sub",
    "__imul__": "mul",
    "__itruediv__": "div",
    "__add__": "add",
    "__radd__": "add",
    "__mul__": "mul",
    "__rmul__": "mul",
    "__sub__": "sub",
    "__rsub__": "sub",
    "__truediv__": "div",
    "__rtruediv__": "div",
    "__matmul__": "matmul",
    "__getitem__": "getitem",
    "__neg__": "neg",
    "__pow__": "pow",
}

#: ops that are casts written by the model itself; their output dtype is respected
CAST_OPS = frozenset({"to"})
#: normalisation ops: only their input is cast; weights and running statistics stay fp32
#: (the CPU and CUDA kernels accept a half input with fp32 parameters, and the running
#: statistics must keep being updated in place)
NORM_OPS = frozenset({"batch_norm", "layer_norm", "group_norm", "rms_norm", "instance_norm"})

#: the matmul class and convolutions (and attention): the ops whose fp32 math backend flags change, and the
#: only consumers for which O2 stores a parameter in half (see converter.passes.rewrite)
MATMUL_CONV_OPS = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "addr", "mv", "einsum", "grouped_mm",
    "bilinear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "scaled_dot_product_attention", "multi_head_attention",
})
#: custom ops of other libraries whose meaning is known: qualified name -> the canonical op they compute
#: (rules, FLOP counts and O2 storage treat them as that op). transformers 5 runs MoE experts through
#: its own grouped matmul when torch's cannot be used (fp32 weights, torch.export, odd strides).
LIBRARY_OPS = {"transformers::grouped_mm_fallback": "grouped_mm"}
#: operator namespaces that torch itself defines (anything else comes from another library)
TORCH_NAMESPACES = frozenset({"aten", "prims", "prim", "quantized", "_quantized", "higher_order", "mkldnn", "mkl", "onednn",
                              "profiler", "_c10d_functional", "_c10d_functional_autograd", "c10d", "rngprims",
                              "_dtensor", "debugprims", "inductor", "_inductor_test", "mpconvert"})
#: recurrent ops: matmuls inside one op, which reads the weights directly
RECURRENT_OPS = frozenset({"lstm", "gru", "rnn", "rnn_tanh", "rnn_relu"})
#: ops that write or accumulate a floating ``source`` operand into ``self`` and require both to have one
#: dtype (``index_add_(): self (BFloat16) and source (Float) must have the same scalar type``). In place,
#: ``self`` is the accumulator: decide gives its producer the precision the op's rule asks for (promote:
#: its dtype in the fp32 model, as autocast leaves it) and rewrite casts the operands to its dtype.
ACCUMULATE_OPS = frozenset({"index_add", "scatter_add", "scatter_reduce", "scatter", "index_put", "put", "index_copy",
                            "masked_scatter"})
#: pointwise ops whose kernels promote mixed floating inputs themselves (TensorIterator): a
#: ``promote`` node of these needs no cast when a non-scalar input already has the widest dtype
NATIVE_PROMOTE_OPS = frozenset({"add", "sub", "mul", "div", "where", "maximum", "minimum", "addcmul", "addcdiv", "atan2"})

# In-place ops whose name has no trailing underscore.
_INPLACE_NAMES = frozenset({"copy_", "__iadd__", "__isub__", "__imul__", "__itruediv__"})


def _aten_name(target: Any) -> Optional[str]:
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket.__name__)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target.__name__)
    return None


def _normalise(name: str) -> str:
    name = _ALIASES.get(name, name)
    if name.endswith("_") and not name.endswith("__") and len(name) > 1:
        base = name[:-1]
        name = _ALIASES.get(base, base)
    return name


def _conv_name(node: torch.fx.Node) -> str:
    """``aten.convolution``/``_convolution`` carry the rank in the weight; name it like conv2d."""
    weight = node.args[1] if len(node.args) > 1 else None
    rank = 2
    val = weight.meta.get("val") if isinstance(weight, torch.fx.Node) else None
    if val is not None and hasattr(val, "dim"):
        rank = val.dim() - 2
    transposed = bool(node.args[6]) if len(node.args) > 6 and isinstance(node.args[6], bool) else False
    return f"conv_transpose{rank}d" if transposed else f"conv{rank}d"


def canonical_op(node: torch.fx.Node, root: Optional[torch.nn.Module] = None) -> str:
    """The canonical op name of an FX node (see module docstring)."""
    if node.op == "call_module":
        sub = root.get_submodule(str(node.target)) if root is not None else None
        cls = type(sub).__name__ if sub is not None else str(node.target)
        if cls in _MODULE_OPS:
            return _MODULE_OPS[cls]
        return re.sub(r"(?<!^)(?=[A-Z])", "_", cls).lower()
    if node.op == "call_method":
        return _normalise(str(node.target))
    if node.op == "call_function":
        target = node.target
        aten = _aten_name(target)
        if isinstance(target, torch._ops.OpOverload) and target._schema.name in LIBRARY_OPS:
            return LIBRARY_OPS[target._schema.name]
        if aten is not None:
            if aten in ("convolution", "_convolution"):
                return _conv_name(node)
            return _normalise(aten)
        if target in _FUNCTION_OPS:
            return _FUNCTION_OPS[target]
        function = getattr(target, "autograd_function", None)  # a custom autograd Function (passes.autograd_fns)
        if isinstance(function, type):
            return function.__name__
        name = getattr(target, "__name__", str(target))
        return _normalise(name)
    return node.op


def is_inplace(node: torch.fx.Node, op_name: str) -> bool:
    """True for nodes that mutate their first argument (their output aliases it)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        return bool(schema.arguments) and schema.arguments[0].is_write
    if target in (operator.iadd, operator.isub, operator.imul, operator.itruediv):
        return True
    raw = str(target) if node.op == "call_method" else getattr(target, "__name__", "")
    return raw in _INPLACE_NAMES or (raw.endswith("_") and not raw.endswith("__") and node.op == "call_method")


def explicit_dtype(node: torch.fx.Node, op_name: str) -> Optional[Any]:
    """The floating dtype the node's own arguments fix for its output, if any.

    Returns a ``torch.dtype`` for a constant dtype argument, the dtype-producing ``Node`` for a
    dynamic one (``x.to(y.dtype)``), or ``None`` when the op follows its inputs' dtype.
    """
    if op_name == "to" and node.op == "call_method":
        method = str(node.target)
        fixed = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}
        if method in fixed:
            return fixed[method]
    for value in list(node.args[1:]) + list(node.kwargs.values()):
        if isinstance(value, torch.dtype):
            return value if value.is_floating_point else None
        if isinstance(value, torch.fx.Node) and op_name == "to" and isinstance(value.meta.get(META_VALUE), torch.dtype):
            return value
    return None


def castable_arg_positions(op_name: str, nargs: int) -> Optional[tuple[int, ...]]:
    """Positional arguments the rewrite may cast; ``None`` means all floating tensor arguments."""
    if op_name in NORM_OPS:
        return (0,)
    return None


def map_castable_args(node: torch.fx.Node, op_name: str, fn: Callable[[torch.fx.Node], Any]) -> None:
    """Apply ``fn`` to every node the op's precision applies to, in place (see castable_arg_positions).

    ``node.args`` is only reassigned when ``fn`` replaced something: every assignment makes FX
    re-walk the arguments and update use lists, which dominates the rewrite on large graphs.
    """
    from torch.fx.node import map_arg

    changed = False

    def track(arg: torch.fx.Node) -> Any:
        nonlocal changed
        new = fn(arg)
        if new is not arg:
            changed = True
        return new

    positions = castable_arg_positions(op_name, len(node.args))
    if positions is None:
        args = map_arg(node.args, track)
        # never the ``out=`` tensor: the op writes it, and a cast copy would take the write instead
        # (spectral_norm's power iteration updates its u/v buffers with div(..., out=u))
        kwargs = {k: v if k == "out" else map_arg(v, track) for k, v in node.kwargs.items()}
        if changed:
            node.args, node.kwargs = args, kwargs
        return
    listed = list(node.args)
    for pos in positions:
        if pos < len(listed):
            listed[pos] = map_arg(listed[pos], track)
    if changed:
        node.args = tuple(listed)


@functools.lru_cache(maxsize=1)
def known_op_names() -> frozenset[str]:
    """Every canonical op name a rule may use: aten's ops, ``torch`` and ``F`` functions, modules."""
    names: set[str] = set(_MODULE_OPS.values()) | set(_FUNCTION_OPS.values()) | set(_ALIASES.values())
    names |= {"getitem", "getattr", "to", "identity", "scaled_dot_product_attention", "einsum", WEIGHT_MATMUL}
    names |= set(LIBRARY_OPS.values())
    for qualified in torch._C._dispatch_get_all_op_names():
        ns, _, op = qualified.partition("::")
        if ns == "aten":
            names.add(_normalise(op.split(".")[0]))
    for mod in (torch, torch.nn.functional, torch.Tensor):
        for attr in dir(mod):
            if not attr.startswith("_") and callable(getattr(mod, attr, None)):
                names.add(_normalise(attr))
    # a capitalised name is a class (torch.Tensor, torch.Size, torch.Generator), never an op: in a rule
    # file it names a custom autograd Function (passes.autograd_fns), and the loader refuses one whose
    # lower-case form is an op (``Tensor`` for ``tensor``)
    return frozenset(n for n in names if n and not n.startswith("_") and not n[:1].isupper())


#: layout-only ops between a weight and its matmul (``x @ w.t()``, a reshaped conv kernel)
_WEIGHT_LAYOUT_OPS = frozenset({"t", "transpose", "permute", "view", "reshape", "unsqueeze", "squeeze", "contiguous",
                                "flatten", "alias"})


def non_weight_use(node: torch.fx.Node) -> Optional[tuple[str, str]]:
    """(op, node name) of the first reader of ``node`` (through layout-only ops) that is not a matmul,
    convolution or recurrent op, i.e. that does not use it as a weight; None when every reader does.
    O2 stores a parameter in half only when this is None (see converter.passes.rewrite)."""
    for reader in node.users:
        info = reader.meta.get(META_INFO)
        op = info.op if info is not None else str(reader.target)
        if op in _WEIGHT_LAYOUT_OPS:
            found = non_weight_use(reader)
            if found is not None:
                return found
        elif op not in MATMUL_CONV_OPS and op not in RECURRENT_OPS:
            return op, reader.name
    return None


def library_op(node: torch.fx.Node) -> Optional[tuple[str, str]]:
    """(qualified op name, the Python module that registers it) for a call of a custom op that another
    library defines (``torch.ops.transformers.grouped_mm_fallback``); None for torch's own ops. Code
    that calls it needs that module imported first."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target.namespace in TORCH_NAMESPACES:
        return None
    qualified = target._schema.name
    from torch._library import custom_ops

    opdef = custom_ops.OPDEFS.get(qualified)
    module = getattr(getattr(opdef, "_init_fn", None), "__module__", None) or target.namespace
    return qualified, module
