"""Lower: device-specific rewrites of half ops into faster equivalents (``convert(device="cpu")``).

Runs after *decide* and before *place*, and only when the conversion names the device the model
will train on; a conversion without a device stays portable and is not touched.

**CPU: bf16 scaled-dot-product attention → matmul · softmax · matmul.** PyTorch's CPU
flash-attention kernel is slow in bf16, above all its backward. Measured with torch 2.13 on an
AVX512-BF16/AMX Xeon, one thread, forward + backward of one attention call:

=====================  =========  =========  ==================================
shape (B, H, T, E)     flash bf16 flash fp32 lowered bf16 (this module)
=====================  =========  =========  ==================================
8, 8, 128, 64          25.1 ms    13.0 ms    5.8 ms
2, 4, 16, 32           0.68 ms    0.08 ms    0.28 ms
=====================  =========  =========  ==================================

**Recompute or keep: a cost model.** Unfused, autograd would keep each call's (B, H, L, S)
probability matrix. Recomputing it in backward (the lowered ops in a checkpoint region of their
own) saves what the fused kernel saves, at the price of a second attention forward and a
checkpoint call, whose fixed cost dominates small shapes (small encoder, B2×T16: 1.10× autocast's
step recomputed, 0.87× kept). :func:`recompute_plan` keeps the probabilities when they fit a
budget that keeps saved activations at or under autocast's: under O2 the weights are stored in
half, so autograd keeps no half copy of them where autocast keeps one per weight; half of those
bytes may go to kept probabilities, smallest first. Under O1 the budget is 0. Each call's choice,
with the sizes it compared, is in its nodes' reasons and in ``report.json["lowering"]``. A call whose
scores and probabilities would exceed :data:`MAX_UNFUSED_SCORES_BYTES` (256 MiB: B8 H8 at 2k tokens)
is not lowered at all: the fused kernel streams them in blocks
(``benchmarks/run.py --ablate`` times the choices flipped).

The lowered ops run in the precision *decide* gave the attention node, so the step needs no
cast (fp32 attention would cast q, k, v and the output). With a mask, the softmax is ``torch._safe_softmax``:
a row the mask hides entirely (a left-padded causal batch has them) gives zeros, as the fused kernel gives,
not NaN. Numerics: the fused bf16 kernel keeps
q·kᵀ in fp32 and rounds the probabilities to bf16 before P·V; the lowered graph rounds q·kᵀ to
bf16 too, and its softmax reads bf16 and accumulates in fp32 inside the kernel, then rounds once.
On the benchmark encoder the output SQNR against fp32 moves from 56.99 to 56.98 dB. An explicit
softmax in the model stays fp32 by the rules; only the softmax *inside* an attention op that the
rules already run in half is half here, as it was inside the fused kernel.

Only bf16 is lowered: fp16 scores could overflow where the fused kernel's fp32 scores do not
(bf16 has fp32's range). Attention dropout that capture made mode-aware (``dropout_p=p * self.training``,
:mod:`converter.passes.modes`) becomes ``torch.dropout(probs, p, self.training)`` after the softmax, as the
fused op applies it. Calls with another non-zero ``dropout_p``, ``enable_gqa=True``, both a mask
and ``is_causal``, or non-literal flags keep the fused op. The lowered nodes record the
attention's rule and say why they exist (``explain`` shows it).

**CPU: batch norm on bf16 activations.** A ``batch_norm`` the rules keep in fp32 whose input a
bf16 op produces is given that bf16 input directly: PyTorch's CPU kernel takes bf16 activations
with fp32 weight, bias and running statistics and computes in fp32, so its output is
bit-identical to upcasting the input (exact), normalising in fp32 and rounding to bf16, and its
backward likewise. The statistics and parameters stay fp32 (Apex's ``keep_batchnorm_fp32``
means the same); what changes is that the input autograd saves is bf16, not an fp32 copy, and the
two casts around the norm disappear. The node's decision keeps its rule, its precision becomes
bf16 (its activations' dtype) and its reason says why.

**CUDA: batch norm on half activations.** The same for ``device="cuda"``, fp16 and bf16: the CUDA
and cuDNN batch norm kernels take half activations with fp32 weight, bias and running statistics and
compute in fp32 (what torch.autocast runs, and Apex's ``keep_batchnorm_fp32``), so autograd saves
the half input instead of an fp32 copy and the two casts around the norm go. Only this lowering
applies on CUDA: its fused attention kernels are fast in both half dtypes.
"""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, cast

import torch
import torch.fx

from converter.ir.graphmodule import pauses_gc
from converter.ir.meta import (
    META_CHECKPOINT,
    META_DECISION,
    META_INFO,
    META_LOWERED,
    META_MODE_FLAG,
    META_VALUE,
    CheckpointTag,
    Decision,
    NodeInfo,
    TensorSpec,
    set_graph_facts,
)
from converter.ir.ops import canonical_op
from converter.passes.capture.annotation import classify
from converter.passes.capture.values import flat_specs, spec_of
from converter.vocab import DEVICES, HALF_PRECISIONS

__all__ = ["lower", "DEVICES", "MAX_UNFUSED_SCORES_BYTES", "LoweringChoice", "recompute_plan"]

_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_LOWERED_PRECISIONS = ("bf16",)
_HALF_IO_NORMS = ("batch_norm",)
#: the half dtypes whose activations each device's batch norm kernels take with fp32 statistics
_HALF_IO_PRECISIONS = {"cpu": ("bf16",), "cuda": HALF_PRECISIONS}
_HALF_BYTES = 2
#: a call whose lowered scores + probabilities (bf16) would exceed this many bytes keeps the fused kernel
MAX_UNFUSED_SCORES_BYTES = 256 * 2 ** 20
#: the ops that read a parameter as a weight: autocast saves a half copy of it for backward, O2 storage does not
_WEIGHT_OPS = frozenset({"linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                         "conv_transpose3d", "matmul", "mm", "addmm", "bmm", "baddbmm"})


@dataclass(frozen=True)
class LoweringChoice:
    """One decision of the lowering cost model, for the report (``report.json["lowering"]``)."""

    node: str  #: the node the choice is about (the attention, before it was lowered)
    lowering: str  #: what was decided: ``"recompute_attention"``, or ``"lower_attention"`` (chosen False: kept fused)
    chosen: bool  #: True: applied
    why: str  #: the sizes compared and the conclusion, in words

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "lowering": self.lowering, "chosen": self.chosen, "why": self.why}


def _mib(nbytes: float) -> str:
    """Bytes in MiB, or KiB below 0.1 MiB (the small models' matrices are a few KiB)."""
    return f"{nbytes / 2 ** 20:.2f} MiB" if nbytes >= 0.1 * 2 ** 20 else f"{nbytes / 1024:.1f} KiB"


def _numel(spec: TensorSpec) -> int:
    return math.prod(int(d) for d in spec.shape)


def _score_numel(call: dict[str, Any]) -> int:
    """Elements of one (…, L, S) score (or probability) matrix of the call: batch and heads broadcast."""
    q, k = call["query"].meta[META_VALUE], call["key"].meta[META_VALUE]
    lead = torch.broadcast_shapes(tuple(q.shape[:-2]), tuple(k.shape[:-2]))
    return math.prod(int(d) for d in lead) * int(q.shape[-2]) * int(k.shape[-2])


def _kept_bytes(call: dict[str, Any]) -> int:
    """What keeping a lowered attention's autograd state costs beyond the fused kernel's: the (…, L, S)
    probabilities (the softmax output, which P·V also saves) and the boolean mask masked_fill saves;
    q·scale replaces the fused kernel's saved output, of the same size."""
    extra = _score_numel(call) * _HALF_BYTES
    mask = call["attn_mask"]
    if mask is not None and mask.meta[META_VALUE].dtype == torch.bool:
        extra += _numel(mask.meta[META_VALUE])
    if call["is_causal"]:  # the (L, S) triangle
        extra += int(call["query"].meta[META_VALUE].shape[-2]) * int(call["key"].meta[META_VALUE].shape[-2])
    return extra


def _weight_copy_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes of the half weight copies autocast saves for backward that O2's half storage does not make:
    one per parameter that every reader reads as the weight of a half matmul or convolution."""
    total = 0
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.users:
            continue
        value = node.meta.get(META_VALUE)
        if not isinstance(value, TensorSpec) or not value.dtype.is_floating_point:
            continue
        readers = [u for u in node.users if (u.meta.get(META_INFO) is None or u.meta[META_INFO].kind != "passive")]
        if readers and all(_reads_as_half_weight(u, node) for u in readers):
            total += _numel(value) * _HALF_BYTES
    return total


def _reads_as_half_weight(user: torch.fx.Node, param: torch.fx.Node) -> bool:
    """Does ``user``, a half matmul or convolution, read ``param`` as its weight (which autograd saves; a
    bias is not saved)? A linear's or convolution's weight is its second argument."""
    info, decision = user.meta.get(META_INFO), user.meta.get(META_DECISION)
    if info is None or info.op not in _WEIGHT_OPS or decision is None or decision.precision not in HALF_PRECISIONS:
        return False
    if info.op.startswith(("linear", "conv")):
        return (len(user.args) > 1 and user.args[1] is param) or user.kwargs.get("weight") is param
    return True


def recompute_plan(gm: torch.fx.GraphModule, calls: list[tuple[torch.fx.Node, dict[str, Any]]], *,
                   opt_level: str, forced: Optional[bool] = None) -> dict[torch.fx.Node, LoweringChoice]:
    """The cost model for the lowered attentions: which recompute their probabilities in backward.

    Keeping a lowered attention's probabilities costs memory (:func:`_kept_bytes` per call) and no
    time; recomputing costs a second attention forward and a checkpoint call per step (~0.3 ms of
    fixed overhead per call on a 2-core Xeon: on the small encoder, B2×T16, that is 1.14× vs 0.85×
    autocast's step) and no memory. The promise is that the converted model saves no more
    activations than autocast. Under O2 the weights are stored in half, so autograd saves no half
    copy of them, where autocast saves one per weight: that difference (:func:`_weight_copy_bytes`)
    is the budget. Calls are kept, smallest first, while their probabilities fit in half of it (the
    other half is margin for what the static sizes do not see); the rest are recomputed. Under O1
    the graph saves the weight copies autocast saves, so the budget is 0 and every call recomputes.
    """
    if forced is not None:  # ConvertOptions.recompute_attention
        how = "recomputed" if forced else "kept"
        return {node: LoweringChoice(node.name, "recompute_attention", forced,
                                     f"{how}: forced by ConvertOptions.recompute_attention={forced}")
                for node, _ in calls}
    plan: dict[torch.fx.Node, LoweringChoice] = {}
    for node, _ in calls:
        if META_CHECKPOINT in node.meta:
            plan[node] = LoweringChoice(node.name, "recompute_attention", True,
                                        "recomputed in backward with the model's own checkpoint region")
    calls = [(node, call) for node, call in calls if node not in plan]
    budget = _weight_copy_bytes(gm) // 2 if opt_level == "O2" and calls else 0
    sizes = {node: _kept_bytes(call) for node, call in calls}
    spent = 0
    for node, _ in sorted(calls, key=lambda item: sizes[item[0]]):
        size = sizes[node]
        if spent + size <= budget:
            spent += size
            plan[node] = LoweringChoice(node.name, "recompute_attention", False, (
                f"kept: its probabilities ({_mib(size)}) fit the budget (kept so far {_mib(spent)} of {_mib(budget)}, "
                f"half the {_mib(2 * budget)} of half weight copies autocast saves and O2 storage does not), so "
                f"backward reads them instead of recomputing the attention"))
        else:
            where = ("under O1 the graph saves the half weight copies autocast saves, so there is no budget"
                     if opt_level != "O2" else f"over the budget (kept {_mib(spent)} of {_mib(budget)})")
            plan[node] = LoweringChoice(node.name, "recompute_attention", True, (
                f"recomputed in backward: keeping its probabilities would save {_mib(size)} more than the fused "
                f"kernel, {where}; saved activations stay at the fused kernel's"))
    return plan


@pauses_gc
def lower(gm: torch.fx.GraphModule, *, device: Optional[str], opt_level: str = "O1", fp32_attention: bool = False,
          recompute_attention: Optional[bool] = None) -> list[str]:
    """Apply the lowerings for ``device`` (None: none); returns the names of the nodes replaced.

    ``fp32_attention`` (a CPU whose half GEMM measured slower than fp32's, :mod:`converter.passes.cpu_gemm`): the
    attention calls are not lowered here; after rewrite they call ``upcast_attention``, which runs them in fp32
    arithmetic (:func:`converter.passes.dispatch.dispatch_attention_calls`). The cost model's choices (:class:`LoweringChoice`) go to the
    graph meta's ``lowering`` field. ``recompute_attention``: None, the cost model decides per call; True/False
    force it (``ConvertOptions.recompute_attention``)."""
    if device is None:
        return []
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES} or None, got {device!r}")
    lowered = []
    nodes = list(gm.graph.nodes)
    attention: list[tuple[torch.fx.Node, dict[str, Any]]] = []
    fused: list[LoweringChoice] = []  # calls the size bound leaves fused
    # checkpoint region ids for the recomputed attentions: after every id the model's own regions use
    regions = itertools.count(1 + max((n.meta[META_CHECKPOINT].region for n in nodes if META_CHECKPOINT in n.meta), default=-1))
    for node in nodes:
        info: Optional[NodeInfo] = node.meta.get(META_INFO)
        decision: Optional[Decision] = node.meta.get(META_DECISION)
        if info is None or decision is None:
            continue
        if info.op in _HALF_IO_NORMS:
            if _half_io_norm(node, decision, device):
                lowered.append(node.name)
            continue
        if info.op != "scaled_dot_product_attention" or device != "cpu" or fp32_attention:
            continue
        if decision.precision not in _LOWERED_PRECISIONS:
            continue
        call = _sdpa_call(node)
        if call is None:
            continue
        refused = _too_large_to_unfuse(node, call)
        if refused is not None:
            fused.append(refused)
            continue
        attention.append((node, call))
    plan = recompute_plan(gm, attention, opt_level=opt_level, forced=recompute_attention)
    choices = fused + [plan[node] for node, _ in attention]
    for node, call in attention:
        name = node.name
        _lower_attention(gm, node, node.meta[META_INFO], node.meta[META_DECISION], call, regions, plan[node])
        lowered.append(name)
    set_graph_facts(gm, lowering=tuple(choice.to_dict() for choice in choices))
    return lowered


def _too_large_to_unfuse(node: torch.fx.Node, call: dict[str, Any]) -> Optional[LoweringChoice]:
    """The fused kernel stays when the lowered graph's score matrix would be too large to materialise.

    The lowered forward holds one call's (…, L, S) scores and probabilities at once (recomputed or
    not), where the fused kernel streams them in blocks: at B8 H8 and 4k tokens that is 2 GiB per call.
    Above :data:`MAX_UNFUSED_SCORES_BYTES` the call keeps the fused kernel (slower here, bounded memory)."""
    scores = _score_numel(call) * 2 * _HALF_BYTES  # scores and probabilities
    if scores <= MAX_UNFUSED_SCORES_BYTES:
        return None
    why = (f"kept fused: lowered, it would hold {_mib(scores)} of scores and probabilities at once, over the "
           f"{_mib(MAX_UNFUSED_SCORES_BYTES)} bound (converter.passes.lower.MAX_UNFUSED_SCORES_BYTES); the fused "
           f"kernel streams them in blocks")
    node.meta[META_DECISION] = node.meta[META_DECISION].noted("lower", why)
    return LoweringChoice(node.name, "lower_attention", False, why)


def _half_io_norm(node: torch.fx.Node, decision: Decision, device: str) -> bool:
    """Give an fp32 batch norm its half-produced input as is (see module docstring)."""
    if decision.precision != "fp32" or node.op not in ("call_function", "call_module") or not node.args:
        return False
    src = node.args[0]
    if not isinstance(src, torch.fx.Node):
        return False
    made_by: Optional[Decision] = src.meta.get(META_DECISION)
    src_info: Optional[NodeInfo] = src.meta.get(META_INFO)
    if (made_by is None or src_info is None or src_info.kind != "compute"
            or made_by.precision not in _HALF_IO_PRECISIONS[device]):
        return False
    if device == "cpu":
        why = (f"on CPU it runs on the {made_by.precision} activations {src.name} produces, with fp32 statistics, weight "
               f"and bias (the mixed-type kernel computes in fp32: bit-identical to an fp32 norm of the exactly "
               f"upcast input, rounded to {made_by.precision}); autograd saves the {made_by.precision} input")
    else:
        why = (f"on CUDA it runs on the {made_by.precision} activations {src.name} produces, with fp32 statistics, "
               f"weight and bias (the CUDA/cuDNN kernels compute in fp32, as under torch.autocast); autograd saves "
               f"the {made_by.precision} input")
    node.meta[META_DECISION] = decision.noted("lower", why, precision=made_by.precision)
    node.meta[META_LOWERED] = why
    return True


def _sdpa_call(node: torch.fx.Node) -> Optional[dict[str, Any]]:
    """The call's arguments by name when it can be lowered exactly, else None."""
    if node.op != "call_function" or len(node.args) > len(_SDPA_PARAMS):
        return None
    call: dict[str, Any] = dict(_SDPA_DEFAULTS)
    call.update(zip(_SDPA_PARAMS, node.args))
    if set(node.kwargs) - set(_SDPA_PARAMS):
        return None
    call.update(node.kwargs)
    q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    if not all(isinstance(t, torch.fx.Node) and isinstance(t.meta.get(META_VALUE), TensorSpec) for t in (q, k, v)):
        return None
    if len(q.meta[META_VALUE].shape) < 2 or len(k.meta[META_VALUE].shape) < 2:
        return None
    call["dropout"] = None
    p = call["dropout_p"]
    if isinstance(p, torch.fx.Node) and p.meta.get(META_MODE_FLAG) and p.target is operator.mul:
        call["dropout"] = p.args  # (probability, self.training): dropout that is active in train mode only
    elif not (isinstance(p, (int, float)) and p == 0):
        return None
    if call["enable_gqa"] is not False or not isinstance(call["is_causal"], bool):
        return None
    if call["scale"] is not None and not isinstance(call["scale"], (int, float)):
        return None
    if mask is not None:
        if call["is_causal"] or not (isinstance(mask, torch.fx.Node) and isinstance(mask.meta.get(META_VALUE), TensorSpec)):
            return None
    return call


def _lower_attention(gm: torch.fx.GraphModule, node: torch.fx.Node, info: NodeInfo, decision: Decision,
                     call: dict[str, Any], regions: Iterator[int], choice: LoweringChoice) -> None:
    graph = gm.graph
    q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    head_dim = q.meta[META_VALUE].shape[-1]
    scale = float(call["scale"]) if call["scale"] is not None else 1.0 / math.sqrt(head_dim)
    why = (f"from {node.name} (scaled_dot_product_attention, {decision.precision}) for CPU: the fused "
           f"bf16 flash-attention kernel is 2-4x slower here (converter/lower.py); the softmax reads "
           f"{decision.precision} and accumulates in fp32 inside its kernel, as it did inside the fused op; "
           f"{choice.why}")
    new: list[torch.fx.Node] = []

    # inside the model's own checkpoint region, the region's tag; else a region of its own when the cost
    # model recomputes the attention in backward (recompute_plan), so that it saves q, k, v as the fused op does
    tag = node.meta.get(META_CHECKPOINT)
    if tag is None and choice.chosen:
        tag = CheckpointTag(region=next(regions), preserve_rng_state=True)

    def emit(op: str, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        with graph.inserting_before(node):
            created = graph.create_node(op, target, args, kwargs, name=f"{node.name}_{getattr(target, '__name__', target)}")
        if tag is not None:  # run (and recomputed) inside a checkpoint region (converter.passes.checkpoint)
            created.meta[META_CHECKPOINT] = tag
        new.append(created)
        return created

    scores = emit("call_function", torch.matmul, emit("call_function", torch.mul, q, scale),
                  emit("call_function", torch.transpose, k, -2, -1))
    if mask is not None:
        if mask.meta[META_VALUE].dtype == torch.bool:
            scores = emit("call_method", "masked_fill", scores, emit("call_function", torch.logical_not, mask), -math.inf)
        else:
            scores = emit("call_function", torch.add, scores, mask)
    if call["is_causal"]:  # an (L, S) mask broadcast over batch and heads: masked_fill saves it for backward
        rows, cols = emit("call_method", "size", scores, -2), emit("call_method", "size", scores, -1)
        ones = emit("call_method", "new_ones", scores, (rows, cols), dtype=torch.bool)
        above = emit("call_function", torch.triu, ones, 1)
        scores = emit("call_method", "masked_fill", scores, above, -math.inf)
    # with a mask, rows it hides entirely give zeros, as the fused kernel gives (softmax would give NaN: a
    # left-padded causal batch has such rows)
    probs = emit("call_function", torch.softmax if mask is None else torch._safe_softmax, scores, -1)
    if call["dropout"] is not None:  # what the fused op does in train mode (converter.passes.modes)
        probs = emit("call_function", torch.dropout, probs, *call["dropout"])
    out = emit("call_function", torch.matmul, probs, v)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    p = call["dropout_p"]
    if isinstance(p, torch.fx.Node) and not p.users:
        graph.erase_node(p)
    _annotate(gm, new, info, decision, why)


def _annotate(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], like: NodeInfo, decision: Decision, why: str) -> None:
    """Shapes (on the meta device), NodeInfo and a Decision for each new node, in graph order."""
    computed: dict[torch.fx.Node, Any] = {}  # the new nodes' values (sizes are plain ints)

    def meta_value(arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node) and arg.meta.get(META_MODE_FLAG):
            return True  # self.training: any bool gives the shapes
        if isinstance(arg, torch.fx.Node) and arg in computed:
            return computed[arg]
        if isinstance(arg, torch.fx.Node):
            spec = arg.meta.get(META_VALUE)
            if isinstance(spec, TensorSpec):
                return torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        return arg

    for node in nodes:
        args = torch.fx.node.map_arg(node.args, meta_value)
        kwargs = torch.fx.node.map_arg(node.kwargs, meta_value)
        if node.op == "call_method":
            value = getattr(args[0], str(node.target))(*args[1:], **kwargs)
        else:
            value = cast(Callable[..., Any], node.target)(*args, **kwargs)
        computed[node] = value
        node.meta[META_VALUE] = spec_of(value)
        outputs = tuple(flat_specs(node.meta[META_VALUE]))
        op = canonical_op(node, gm)
        kind, fixed, kind_why, _ = classify(gm, node, op, outputs)
        node.meta[META_INFO] = NodeInfo(op=op, module=like.module, module_type=like.module_type,
                                        module_stack=like.module_stack, source=like.source, kind=kind,
                                        outputs=outputs, fixed_dtype=fixed, why=kind_why)
        if kind == "compute":
            node.meta[META_DECISION] = decision.noted("lower", why)
        node.meta[META_LOWERED] = why
