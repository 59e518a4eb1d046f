"""Rewrite: insert the casts that the decisions require, reading only ``meta["mp"]``.

* A node running in precision P gets each floating input in P; a cast is inserted only where the
  producer's dtype differs, and there is one cast per (producer, dtype), shared by all consumers.
* fp64, integer and bool tensors are never touched; normalisation ops only get their input cast
  (weights and running statistics stay fp32).
* A cast is not shared between consumers inside and outside a ``no_grad``/autocast region that
  capture inlined (``meta["mp_region"]``): made under ``no_grad``, it would cut the gradient of
  the consumers outside; nor across a checkpoint region's edge (``meta["mp_checkpoint"]``): a
  checkpointed consumer's cast runs, and is recomputed, inside the region.
* Casts the model already performs (``x.float()``, ``softmax(..., dtype=)``) are respected; a
  dtype computed at run time (``x.to(y.dtype)``) is folded to the dtype observed in fp32.
* Parameters stay fp32 and are cast in the graph (O1); ``gm.meta["mp_param_dtypes"]`` records the
  dtype each parameter may be stored in for O2 (half only if every consumer wants that half dtype and
  reads it directly as a matmul/conv weight; ``gm.meta["mp_param_storage"]`` says why others stay fp32).
* Graph outputs get their original dtype back when ``keep_io_types``.
* In-place accumulation ops (``index_add_``, ``scatter_add_``…: ``ACCUMULATE_OPS``) run in the dtype of
  the tensor they mutate; their floating operands are cast to it (the ops refuse mixed dtypes).
* ``aten._assert_tensor_metadata`` checks that torch.export records (before a ``.to()``) are kept
  true: their expected dtype becomes the tensor's dtype after the rewrite.

Every inserted cast carries a :class:`~converter.meta.CastRecord` naming the rule that made it
necessary.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Optional

import torch
import torch.fx
from torch.fx.node import map_arg

from converter.ir.graphmodule import pauses_gc
from converter.ir.meta import (
    BUILTIN,
    DTYPES,
    GM_PARAM_DTYPES,
    GM_PARAM_STORAGE,
    GM_READ_CASTS,
    META_CAST,
    META_CHECKPOINT,
    META_DECISION,
    META_INFO,
    META_REGION,
    META_VALUE,
    CastRecord,
    NodeInfo,
    Precision,
    RuleRef,
    TensorSpec,
    name_of,
)
from converter.ir.ops import (
    ACCUMULATE_OPS,
    CAST_OPS,
    NATIVE_PROMOTE_OPS,
    explicit_dtype,
    map_castable_args,
    non_weight_use,
)

__all__ = ["rewrite", "inserted_casts", "runtime_dtype"]



def _name(dtype: Optional[torch.dtype]) -> Precision:
    """A cast's dtype by name (the convertible floating dtypes: fp32, fp16, bf16)."""
    return typing.cast(Precision, name_of(typing.cast(torch.dtype, dtype)))

def runtime_dtype(node: torch.fx.Node, cache: dict) -> Optional[torch.dtype]:
    """The dtype a producer's tensor has after the rewrite (None for non-tensors)."""
    if node in cache:
        return cache[node]
    value = node.meta.get(META_VALUE)
    dtype = value.dtype if isinstance(value, TensorSpec) else None
    decision = node.meta.get(META_DECISION)
    info = node.meta.get(META_INFO)
    if decision is not None and dtype is not None and dtype.is_floating_point and decision.precision in DTYPES:
        if info is not None and info.kind == "alias" and info.inplace and isinstance(node.args[0], torch.fx.Node):
            dtype = runtime_dtype(node.args[0], cache)
        else:
            dtype = DTYPES[decision.precision]
    cache[node] = dtype
    return dtype


def _casts_inputs(node: torch.fx.Node) -> bool:
    """Whether the rewrite converts this node's inputs to its precision."""
    info: NodeInfo = node.meta[META_INFO]
    if info.kind == "compute":
        return True
    if info.kind == "fixed":
        # casts and ops with their own dtype argument convert by themselves
        return info.op not in CAST_OPS and explicit_dtype(node, info.op) is None
    return False


class _Casts:
    """The casts one rewrite inserts: one per (producer, dtype, region, checkpoint), shared by its consumers
    (one per consumer too for a parameter cast once per read), and each producer's dtype after the rewrite."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.graph = gm.graph
        #: producer -> its dtype after the rewrite (see :func:`runtime_dtype`)
        self.cache: dict = {}
        self.casts: dict[tuple, torch.fx.Node] = {}
        self.per_read = gm.meta.get(GM_READ_CASTS) or {}  # parameters cast once per read (calibration)

    def get(self, src: torch.fx.Node, dtype: torch.dtype, consumer: torch.fx.Node, rule: RuleRef, reason: str) -> torch.fx.Node:
        """The cast of ``src`` to ``dtype`` for ``consumer``: an existing one it may share, or a new one."""
        region = consumer.meta.get(META_REGION, ())
        checkpoint = consumer.meta.get(META_CHECKPOINT)
        # never share a cast across a no_grad region's edge (see passes.regions) nor a checkpoint's:
        # a cast for a checkpointed consumer runs inside the region (passes.checkpoint)
        key: tuple[Any, ...] = (src, dtype, region, checkpoint)
        if src.op == "get_attr" and str(src.target) in self.per_read:
            key += (consumer,)  # the reads' gradients then add in fp32, in the parameter
        if key in self.casts:
            cast = self.casts[key]
            rec: CastRecord = cast.meta[META_CAST]
            cast.meta[META_CAST] = dataclasses.replace(rec, consumers=rec.consumers + (consumer.name,))
            return cast
        cast = self._insert(src, dtype, consumer, rule, reason, region, checkpoint)
        self.casts[key] = cast
        return cast

    def _insert(self, src: torch.fx.Node, dtype: torch.dtype, consumer: torch.fx.Node, rule: RuleRef, reason: str,
                region: tuple, checkpoint: object) -> torch.fx.Node:
        """A new cast node of ``src`` to ``dtype`` just before ``consumer``, with its metadata and CastRecord."""
        src_dtype = runtime_dtype(src, self.cache)
        spec: TensorSpec = src.meta[META_VALUE]
        if src_dtype == torch.bfloat16 and dtype == torch.float16:  # two half dtypes meet: say so
            reason = f"{reason} (a bf16 value meets an fp16 consumer: magnitudes above 65504 become inf)"
        with self.graph.inserting_before(consumer):
            # created without args, which are then assigned: torch 2.13's create_node scans args with
            # pytree for raw SymInts (a warning we cannot trigger: the args are a Node and a dtype),
            # and that scan alone was ~40 % of the rewrite on a 9k-node graph
            cast = self.graph.create_node("call_method", "to", name=f"{src.name}_to_{name_of(dtype)}")
        cast.args = (src, dtype)
        if region:
            cast.meta[META_REGION] = region
        if checkpoint is not None:
            cast.meta[META_CHECKPOINT] = checkpoint
        out = TensorSpec(spec.shape, dtype)
        cast.meta[META_VALUE] = out
        cast.meta[META_INFO] = NodeInfo(op="to", module=consumer.meta.get(META_INFO, NodeInfo("")).module, kind="cast", outputs=(out,))
        cast.meta[META_CAST] = CastRecord(
            src=src.name,
            dtype=_name(dtype),
            src_dtype=_name(src_dtype),
            numel=spec.numel,
            consumers=(consumer.name,),
            rule=rule,
            reason=reason,
            on_weight=src.op == "get_attr",
        )
        self.cache[cast] = dtype
        return cast


@pauses_gc
def rewrite(gm: torch.fx.GraphModule, *, keep_io_types: bool = True, check: bool = False) -> None:
    """Insert the casts. ``check`` runs ``Graph.lint`` afterwards (``ConvertOptions.check_graph``, which the
    test suite sets; it costs ~15 % of the pass on large graphs).
    FX code generation is requested with ``gm.recompile()``; on the lazy GraphModules that capture
    builds it happens once, later (see :mod:`converter.graphmodule`)."""
    casts = _Casts(gm)
    native: list[tuple[torch.fx.Node, torch.dtype]] = []  # promote nodes left to promote natively
    for node in list(gm.graph.nodes):
        info: Optional[NodeInfo] = node.meta.get(META_INFO)
        if info is None or info.kind == "cast":
            continue
        if node.target is _ASSERT_METADATA:
            _retarget_metadata_assert(node, casts.cache)
        elif node.op == "output":
            if keep_io_types:
                _keep_output_dtypes(node, casts)
        else:
            _cast_inputs(node, info, casts, native)
    _share_casts_with_promotes(native, casts.casts, casts.cache)
    _record_param_dtypes(gm)
    if check:
        gm.graph.lint()
    gm.recompile()


def _keep_output_dtypes(output: torch.fx.Node, casts: _Casts) -> None:
    """``keep_io_types``: each graph output gets its original dtype back."""
    def back(arg):
        if not isinstance(arg, torch.fx.Node):
            return arg
        value = arg.meta.get(META_VALUE)
        if not (isinstance(value, TensorSpec) and value.is_convertible):
            return arg
        now = runtime_dtype(arg, casts.cache)
        if now is None or now == value.dtype:
            return arg
        return casts.get(arg, value.dtype, output, RuleRef(BUILTIN, "builtin", "keep_io_types"),
                         f"graph output {arg.name!r} keeps its original {name_of(value.dtype)} (keep_io_types)")
    output.args = map_arg(output.args, back)


def _cast_inputs(node: torch.fx.Node, info: NodeInfo, casts: _Casts, native: list) -> None:
    """Cast ``node``'s floating inputs to the dtype its decision asks for (or the one it accumulates in);
    a promote node whose own type promotion already gives it goes to ``native`` instead."""
    decision = node.meta.get(META_DECISION)
    if decision is None or node.op in ("placeholder", "get_attr"):
        return
    if info.kind == "fixed" and info.op in CAST_OPS:
        _fold_dynamic_dtype(node, info)
    accumulates = info.kind == "alias" and info.inplace and info.op in ACCUMULATE_OPS and isinstance(node.args[0], torch.fx.Node)
    if accumulates:  # the operands take the dtype of the tensor it mutates
        want = runtime_dtype(typing.cast(torch.fx.Node, node.args[0]), casts.cache)
        if want is None or not want.is_floating_point:
            return
        reason = f"{node.name} ({info.op}_) accumulates in place in {name_of(want)}: {decision.full_reason}"
    elif not _casts_inputs(node) or decision.precision not in DTYPES:
        _record_user_cast(node, info, casts.cache)
        return
    else:
        want = DTYPES[decision.precision]
        if decision.requested == "promote" and _promotes_natively(node, info, want, casts.cache):
            native.append((node, want))
            return
        reason = f"{node.name} ({info.op}) runs in {decision.precision}: {decision.full_reason}"
    mutated = node.args[0] if accumulates else None
    mask = _attention_mask(node, info)

    def convert(arg):
        if not isinstance(arg, torch.fx.Node) or arg is mutated:
            return arg
        if arg is mask and runtime_dtype(arg, casts.cache) == torch.float32:
            return arg  # attention takes an fp32 mask as it is (see _attention_mask)
        value = arg.meta.get(META_VALUE)
        if not (isinstance(value, TensorSpec) and value.is_convertible):
            return arg
        have = runtime_dtype(arg, casts.cache)
        if have is None or have == want or not have.is_floating_point or have == torch.float64:
            return arg
        return casts.get(arg, want, node, decision.rule, reason)

    map_castable_args(node, info.op, convert)


_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


def _attention_mask(node: torch.fx.Node, info: NodeInfo) -> Optional[torch.fx.Node]:
    """The float mask of a half attention call, which stays fp32: ``scaled_dot_product_attention`` takes an fp32 mask
    with half q/k/v (it adds it to fp32 scores), and a cast would lose what the original computes. Hugging Face fills
    masked positions with ``finfo(float32).min``, which rounds to -inf in bf16 and fp16: a fully masked row (a
    left-padded TimesFM patch) then gives zeros, where the original's ``s + min`` is one constant and its softmax is
    uniform."""
    if info.op != "scaled_dot_product_attention":
        return None
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    return mask if isinstance(mask, torch.fx.Node) and not _reads_parameters(mask) else None


def _reads_parameters(node: torch.fx.Node, limit: int = 64) -> bool:
    """Whether ``node`` is computed from a parameter (a learned bias, T5's relative position bias): such a mask is a
    trained input of attention, cast with q/k/v as autocast casts it (kept fp32, T5's gradients lose 5 dB), unlike a
    padding mask, whose ``finfo.min`` fills the fp32 keeps (looked at up to ``limit`` nodes back)."""
    owner = node.graph.owning_module
    seen: set[torch.fx.Node] = set()
    todo = [node]
    while todo and len(seen) < limit:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "get_attr" and owner is not None:
            try:
                if isinstance(owner.get_parameter(str(current.target)), torch.nn.Parameter):
                    return True
            except AttributeError:
                pass
        todo.extend(current.all_input_nodes)
    return len(seen) >= limit  # not known within the limit: treated as learned (cast, as before)


def _retarget_metadata_assert(node: torch.fx.Node, cache: dict) -> None:
    """export's ``_assert_tensor_metadata(x, dtype=fp32)`` must expect the dtype ``x`` now has."""
    src = node.args[0] if node.args else None
    if not isinstance(src, torch.fx.Node) or node.kwargs.get("dtype") is None:
        return
    have = runtime_dtype(src, cache)
    if have is not None and have != node.kwargs["dtype"]:
        node.kwargs = {**node.kwargs, "dtype": have}


def _share_casts_with_promotes(native: list, casts: dict, cache: dict) -> None:
    """A natively promoting node reads the shared cast of a narrower input when one exists anyway.

    The cast is there for other consumers (one per (producer, dtype)); reading it costs nothing and
    keeps one conversion per (producer, dtype), as the placement cost model counts it (an exporter
    would otherwise write a second, identical Cast for the promotion). The cast moves up to just
    before the promoting node when its first consumer came later.
    """
    if not native:
        return
    position: dict[torch.fx.Node, float] = {n: i for i, n in enumerate(native[0][0].graph.nodes)}
    for node, want in native:
        for arg in list(node.all_input_nodes):
            cast = casts.get((arg, want, node.meta.get(META_REGION, ()), node.meta.get(META_CHECKPOINT)))  # own region only
            have = runtime_dtype(arg, cache)
            if cast is None or have is None or have == want:
                continue
            if position[cast] > position[node]:
                node.prepend(cast)  # its other consumers all come later still
                position[cast] = position[node] - 0.5
            node.replace_input_with(arg, cast)
            rec: CastRecord = cast.meta[META_CAST]
            cast.meta[META_CAST] = dataclasses.replace(rec, consumers=rec.consumers + (node.name,))


def _promotes_natively(node: torch.fx.Node, info: NodeInfo, want: torch.dtype, cache: dict) -> bool:
    """True when the op's own type promotion already yields ``want``: no cast is needed.

    That holds for TensorIterator pointwise ops when a non-scalar input already has ``want`` and no
    input is wider (0-dim tensors do not take part in promotion against dimensioned ones).
    """
    if info.op not in NATIVE_PROMOTE_OPS:
        return False
    found = False
    for arg in node.all_input_nodes:
        value = arg.meta.get(META_VALUE)
        if not (isinstance(value, TensorSpec) and value.is_convertible):
            continue
        have = runtime_dtype(arg, cache)
        if have is None:
            continue
        if have == want and len(value.shape) > 0:
            found = True
        elif torch.promote_types(have, want) != want:
            return False
    return found


def _fold_dynamic_dtype(node: torch.fx.Node, info: NodeInfo) -> None:
    """``x.to(y.dtype)``: replace the run-time dtype by the one observed in the fp32 model."""
    if info.fixed_dtype is None:
        return

    def fold(arg):
        if isinstance(arg, torch.fx.Node) and isinstance(arg.meta.get(META_VALUE), torch.dtype):
            return info.fixed_dtype
        return arg

    node.args = tuple(fold(a) for a in node.args)
    node.kwargs = {k: fold(v) for k, v in node.kwargs.items()}


def _record_user_cast(node: torch.fx.Node, info: NodeInfo, cache: dict) -> None:
    """A cast the model performs itself that now changes dtype is reported (not inserted) too."""
    if info.kind != "fixed" or info.op not in CAST_OPS or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return
    src = node.args[0]
    value = src.meta.get(META_VALUE)
    have = runtime_dtype(src, cache)
    if not (isinstance(value, TensorSpec) and value.is_convertible) or have is None or have == info.fixed_dtype:
        return
    node.meta[META_CAST] = CastRecord(
        src=src.name,
        dtype=_name(info.fixed_dtype),
        src_dtype=_name(have),
        numel=value.numel,
        consumers=tuple(u.name for u in node.users),
        rule=RuleRef(BUILTIN, "builtin", "model-cast"),
        reason=f"the model's own cast {node.name!r} now converts {_name(have)} to {_name(info.fixed_dtype)}",
        on_weight=src.op == "get_attr",
        inserted=False,
    )


def _record_param_dtypes(gm: torch.fx.GraphModule) -> None:
    """The dtype each parameter may be stored in for O2, and why a parameter the graph casts stays fp32.

    Half storage only when every use of the parameter is a cast to that one dtype, and every consumer
    of those casts is a matmul/convolution (or recurrent op) reading it directly: a weight. Tokens,
    positional tables, scales and norms that the graph casts for a pointwise op keep fp32 storage:
    their gradients are sums over the whole batch (a ``cls_token``'s over every image), which
    overflow fp16 once scaled by the loss scale, and their fp32 copy costs little. So does a weight
    that calibration found read by several nodes with a summed gradient fp16 cannot hold
    (``gm.meta["mp_read_casts"]``, see :func:`converter.numerics.calibrate.shared_reads_in_fp32`)."""
    wanted: dict[str, set] = {}
    indirect: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        target = str(node.target)
        for user in node.users:
            info = user.meta.get(META_INFO)
            if info is not None and info.kind == "passive":
                continue
            rec = user.meta.get(META_CAST)
            dtype = DTYPES[rec.dtype] if rec is not None and rec.inserted else None
            wanted.setdefault(target, set()).add(dtype)
            if dtype is None or target in indirect:
                continue
            other = non_weight_use(user)
            if other is not None:
                indirect[target] = (f"cast to {rec.dtype} for {other[0]} ({other[1]}), not read by a matmul or convolution as a "
                                    "weight: kept in fp32 storage under O2 (its gradient sums over the batch)")
    for name, why in (gm.meta.get(GM_READ_CASTS) or {}).items():
        indirect.setdefault(name, why)
    dtypes: dict[str, torch.dtype] = {}
    kept: dict[str, str] = {}
    for name, param in gm.named_parameters():
        if param.is_floating_point():
            uses = wanted.get(name, {None})
            only = next(iter(uses))
            half = len(uses) == 1 and only is not None
            if half and name in indirect:
                kept[name] = indirect[name]
                half = False
            dtypes[name] = only if half else param.dtype
    gm.meta[GM_PARAM_DTYPES] = dtypes
    gm.meta[GM_PARAM_STORAGE] = kept


def inserted_casts(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Every node carrying a CastRecord (inserted casts and the model's own converting casts)."""
    return [n for n in gm.graph.nodes if META_CAST in n.meta]
