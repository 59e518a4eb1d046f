"""Grouped GEMMs with fp32 results: mixture-of-experts layers whose expert outputs are read in fp32.

transformers runs the experts of its MoE layers (GPT-OSS, Mixtral, Qwen-MoE, ...) through its own custom op
``torch.ops.transformers.grouped_mm_fallback(x, weight, offs)`` when torch's grouped GEMM cannot be used (fp32
weights, under torch.export): one ``torch.mm(..., out=)`` per expert into an output of ``x``'s dtype. The rules
run it in half, as every GEMM (``[op].grouped_mm``). A half result is rounded to half once; where the model then
adds the expert bias in place (``out += bias``: GPT-OSS) and reads the sum in fp32 (its clamped SwiGLU, the
routing-weight product and the top-k sum all stay fp32 by the rules), the graph rounds twice (the product, then
the biased sum) and casts the half result straight back to fp32.

This stage, run after *rewrite*, points each half ``grouped_mm_fallback`` call whose result is only read in fp32
(every reader is an fp32 cast that *rewrite* inserted, or an in-place op on it whose readers are) at
:func:`converter.kernels.upcast.upcast_grouped_mm`: the same half operands, the products summed in fp32 and
**kept fp32** (on CUDA the native half GEMM, widened), half operands saved. The in-place ops then run on the
fp32 result (their decisions say so), and the casts back to fp32 are removed (the report counts none). A call
with a half reader keeps the library op.

Why: torch.autocast does not cast ``_grouped_mm`` or ``mm(out=)`` on the CPU, so there it runs the experts in
fp32: half the FLOPs of a GPT-OSS-style decoder. The conversion runs them in half (half-FLOP share 1.0 against
autocast's 0.49) and keeps the expert results fp32: measured on the 2-layer GPT-OSS-style decoder of
``tests/test_zoo_seams_numerics.py`` (6 batches), the output SQNR against fp32 moves from 0.6 dB under
autocast's to 0.3 dB under (median).

The graph no longer calls the library op there, so model.py carries the kernel (torch only) instead.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx

from converter.ir.meta import GM_GRAPH, META_CAST, META_DECISION, META_INFO, set_graph_facts
from converter.ir.ops import library_op
from converter.kernels.upcast import upcast_grouped_mm
from converter.passes.lower import LoweringChoice
from converter.vocab import HALF_PRECISIONS

__all__ = ["widen_grouped_gemms", "grouped_gemm_stage", "half_wanted"]

_WHY = ("runs upcast_grouped_mm: the same half operands, the products summed in fp32 and kept fp32 (every reader "
        "reads fp32: no rounding to half and back; on CUDA the native half GEMM, widened); half operands saved")
_INPLACE_WHY = "writes in place the fp32 result of {node} (upcast_grouped_mm): runs in fp32"


def _is_library_grouped_mm(node: torch.fx.Node) -> bool:
    """A call of another library's grouped GEMM (``converter.ir.ops.LIBRARY_OPS``: transformers' fallback) with its
    three positional arguments."""
    info = node.meta.get(META_INFO)
    return (info is not None and info.op == "grouped_mm" and library_op(node) is not None and len(node.args) == 3
            and not node.kwargs)


def _writes_first_argument(node: torch.fx.Node) -> bool:
    """An in-place aten op (``add_``): its first argument is written and returned."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target._schema.arguments:
        return False
    alias = target._schema.arguments[0].alias_info
    return alias is not None and alias.is_write and len(target._schema.returns) == 1


def _is_fp32_cast(node: torch.fx.Node) -> bool:
    record = node.meta.get(META_CAST)
    return record is not None and record.inserted and record.dtype == "fp32"


def _fp32_readers(node: torch.fx.Node) -> Optional[tuple[list[torch.fx.Node], list[torch.fx.Node]]]:
    """(the in-place ops that write ``node``'s value, the fp32 casts that read it) when those are all its
    readers, transitively through the in-place ops; None when anything else reads it."""
    inplace: list[torch.fx.Node] = []
    casts: list[torch.fx.Node] = []
    todo, seen = [node], {node}
    while todo:
        value = todo.pop()
        for user in value.users:
            if user in seen:
                continue
            seen.add(user)
            if _is_fp32_cast(user):
                casts.append(user)
            elif _writes_first_argument(user) and user.args[0] is value:
                inplace.append(user)
                todo.append(user)
            else:
                return None
    return inplace, casts


def widen_grouped_gemms(gm: torch.fx.GraphModule, precision: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Point each half library grouped GEMM whose result is read only in fp32 at ``upcast_grouped_mm`` (module
    docstring). Returns the names of the nodes changed and one ``widen_grouped_gemm`` lowering choice per node."""
    changed: list[str] = []
    choices: list[dict[str, Any]] = []
    if precision not in HALF_PRECISIONS:
        return changed, choices
    for node in list(gm.graph.nodes):
        decision = node.meta.get(META_DECISION)
        if not _is_library_grouped_mm(node) or decision is None or decision.precision != precision:
            continue
        found = _fp32_readers(node)
        if found is None:
            continue
        inplace, casts = found
        node.target = upcast_grouped_mm  # the same arguments
        node.meta[META_DECISION] = decision.noted("lower", _WHY)
        for op in inplace:
            op.meta[META_DECISION] = op.meta[META_DECISION].noted("lower", _INPLACE_WHY.format(node=node.name),
                                                                  precision="fp32")
        for cast in casts:
            source = cast.args[0]
            assert isinstance(source, torch.fx.Node)
            cast.replace_all_uses_with(source)
            gm.graph.erase_node(cast)
        changed.append(node.name)
        choices.append(LoweringChoice(node.name, "widen_grouped_gemm", True,
                                      f"{_WHY}; {len(casts)} cast(s) to fp32 removed").to_dict())
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed, choices


def grouped_gemm_stage(state: Any) -> None:
    """The pipeline's *grouped_gemm* stage (a :class:`converter.stages.State`): :func:`widen_grouped_gemms` on the
    graph, its choices appended to the graph's lowering."""
    gm = state.gm
    _, choices = widen_grouped_gemms(gm, state.options.precision)
    set_graph_facts(gm, lowering=gm.meta[GM_GRAPH].lowering + tuple(choices))


def half_wanted(state: Any) -> bool:
    """Whether the stage applies: a conversion to fp16 or bf16."""
    return state.options.precision in HALF_PRECISIONS
