"""simplify: fold the nodes that compute nothing, so the converted module makes fewer Python-level calls.

Runs after *rewrite*, on the final graph. On a small model every node costs a Python call and an
aten dispatch whatever its size (a few µs), so no-op nodes are a measurable part of a step. A node is folded — its uses re-pointed to its input and the node erased — only
when the graph's own facts prove it is the identity for every input the graph accepts:

* ``dropout``: probability 0, or ``train=False`` (aten/functional dropout and ``nn.Dropout``
  modules with ``p == 0``): dropout returns its input unchanged then;
* ``view``/``reshape``/``expand`` to the shape the input already has: the target shape is all
  literal ints (no symbolic sizes, no ``-1``) equal to the input's recorded shape, so on any other
  input the original would have failed rather than computed something else;
* ``contiguous`` of a tensor torch recorded (``node.meta["val"]``, static shape) as contiguous;
* ``.to(dtype)`` / ``aten.to.dtype`` (not ``_to_copy``, which copies) of a tensor the graph itself
  fixes to that dtype (a rewrite cast's output, or a node whose code fixes its dtype; never an
  input or a parameter, whose dtype the caller or the O2 trainer may change); rewrite's inserted
  casts (their :class:`~converter.ir.meta.CastRecord` says ``inserted``) are never touched.

The module call path is made leaner too: a torch.export graph that calls its own ``_guards_fn``
(the shape guards) gets ``validate_inputs = False``, which turns off the forward pre-hook that
flattened the inputs with key paths on every call only to re-check their structure (about 0.1 ms
a call on the small encoder, ~3 % of its training step); recorded as a ``hook`` fold. Then the
forward hooks torch.export registered are removed when all of them are idle (the input check once
off, and the enter/exit pair for ``nn.Module``-typed inputs when the graph has none), so the call
takes ``nn.Module``'s hook-free path; one ``hook`` fold each.

Last, :func:`lean_calls` makes the module's generated Python call the aten ops of :data:`LEAN_CALLS`
through their torch bindings (``torch.transpose(x, 1, 0)``, not ``torch.ops.aten.transpose.int(x, 1,
0)``, which adds a Python frame per call); the graph itself is not changed.

Provenance: :func:`simplify` returns one :class:`Fold` per erased node (what it was, why it was
the identity); ``convert`` keeps them in the graph meta's ``simplified`` field and the report's
``extra`` counts them by kind. Folded nodes are not compute nodes a rule decided on
(dropout/view/... are precision-neutral), so no decision is lost.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx

from converter.ir.meta import META_CAST, META_INFO, META_VALUE, TensorSpec, dtype_of

__all__ = ["Fold", "LEAN_CALLS", "simplify", "fold_counts", "lean_calls"]

_aten = torch.ops.aten


@dataclass(frozen=True)
class Fold:
    """One erased node: its name, op, what kind of no-op it was and the fact that proved it."""

    node: str
    op: str
    kind: str  # dropout | view | contiguous | cast | hook
    why: str


_DROPOUT_ATEN = {_aten.dropout.default, _aten.alpha_dropout.default, _aten.feature_dropout.default,
                 _aten.feature_alpha_dropout.default}
_DROPOUT_FN = {torch.nn.functional.dropout, torch.nn.functional.alpha_dropout, torch.nn.functional.dropout1d,
               torch.nn.functional.dropout2d, torch.nn.functional.dropout3d, torch.dropout}
_DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout)
_VIEW_ATEN = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.expand.default}
_VIEW_FN = {torch.reshape}
_VIEW_METHODS = {"view", "reshape", "expand"}


def _shape_of(node: Any) -> Optional[tuple]:
    """The static shape recorded for ``node`` (a single tensor), else None."""
    if not isinstance(node, torch.fx.Node):
        return None
    spec = node.meta.get(META_VALUE)
    if isinstance(spec, TensorSpec) and all(type(s) is int for s in spec.shape):
        return tuple(spec.shape)
    return None


def _dtype_of(node: Any) -> Optional[torch.dtype]:
    """The dtype ``node`` produces on every call, when the graph itself fixes it: a rewrite cast's
    target, or a node whose own code fixes its dtype (kind ``fixed``). Inputs, parameters (O2
    stores them in half) and compute nodes (placement picks their dtype) give None."""
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method", "call_module"):
        return None
    record = node.meta.get(META_CAST)
    if record is not None:
        return dtype_of(record.dtype)
    info = node.meta.get(META_INFO)
    return info.fixed_dtype if info is not None and info.kind == "fixed" else None


def _dropout_identity(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[str]:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, _DROPOUT_MODULES) and module.p == 0:
            return f"{type(module).__name__} with p=0"
        return None
    if node.op != "call_function":
        return None
    if node.target in _DROPOUT_ATEN:
        p, train = (list(node.args[1:3]) + [None, None])[:2]
    elif node.target in _DROPOUT_FN:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", node.kwargs.get("train", True))
        if (len(node.args) > 3 and node.args[3]) or node.kwargs.get("inplace"):
            return None
    else:
        return None
    if isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0:
        return "dropout with p=0"
    if train is False:
        return "dropout with train=False"
    return None


def _target_shape(node: torch.fx.Node) -> Optional[tuple]:
    rest = node.args[1:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = tuple(rest[0])
    if node.kwargs or not all(type(s) is int and s >= 0 for s in rest):
        return None
    return tuple(rest)


def _view_identity(node: torch.fx.Node) -> Optional[str]:
    is_view = ((node.op == "call_function" and (node.target in _VIEW_ATEN or node.target in _VIEW_FN))
               or (node.op == "call_method" and node.target in _VIEW_METHODS))
    if not is_view or not node.args:
        return None
    src = _shape_of(node.args[0])
    target = _target_shape(node)
    if src is not None and target == src and _shape_of(node) == src:
        return f"{node.target if isinstance(node.target, str) else getattr(node.target, '__name__', node.target)} " \
               f"to its input's shape {list(src)}"
    return None


def _contiguous_identity(node: torch.fx.Node) -> Optional[str]:
    is_contig = ((node.op == "call_function" and node.target is _aten.contiguous.default and len(node.args) == 1)
                 or (node.op == "call_method" and node.target == "contiguous" and len(node.args) == 1))
    if not is_contig or node.kwargs or not isinstance(node.args[0], torch.fx.Node):
        return None
    val = node.args[0].meta.get("val")
    if isinstance(val, torch.Tensor) and all(type(s) is int for s in val.shape) and val.is_contiguous():
        return "contiguous of a contiguous tensor"
    return None


def _cast_identity(node: torch.fx.Node) -> Optional[str]:
    record = node.meta.get(META_CAST)
    if (record is not None and record.inserted) or node.kwargs or len(node.args) != 2 \
            or not isinstance(node.args[1], torch.dtype):
        return None
    if not ((node.op == "call_method" and node.target == "to")
            or (node.op == "call_function" and node.target is _aten.to.dtype)):
        return None
    if _dtype_of(node.args[0]) == node.args[1]:
        return f"cast to {node.args[1]} of a tensor already in it"
    return None


def _why(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[tuple[str, str]]:
    for kind, check in (("dropout", lambda n: _dropout_identity(gm, n)), ("view", _view_identity),
                        ("contiguous", _contiguous_identity), ("cast", _cast_identity)):
        why = check(node)
        if why is not None:
            return kind, why
    return None


#: aten overload (as FX prints it) -> the torch binding that dispatches exactly that overload for the
#: arguments FX passes it (``tests/test_simplify.py`` checks each: same aten calls below autograd, same
#: outputs and gradients). Only C bindings: no Python frame, argument parsing in C++.
LEAN_CALLS: dict[str, str] = {
    "torch.ops.aten.add.Tensor": "torch.add",
    "torch.ops.aten.addmm.default": "torch.addmm",
    "torch.ops.aten.bmm.default": "torch.bmm",
    "torch.ops.aten.cat.default": "torch.cat",
    "torch.ops.aten.clone.default": "torch.clone",
    "torch.ops.aten.contiguous.default": "torch.Tensor.contiguous",
    "torch.ops.aten.div.Tensor": "torch.div",
    "torch.ops.aten.dropout.default": "torch.dropout",
    "torch.ops.aten.embedding.default": "torch.embedding",
    "torch.ops.aten.exp.default": "torch.exp",
    "torch.ops.aten.expand.default": "torch.Tensor.expand",
    "torch.ops.aten.flatten.using_ints": "torch.flatten",
    "torch.ops.aten.gelu.default": "torch._C._nn.gelu",
    "torch.ops.aten.layer_norm.default": "torch.layer_norm",
    "torch.ops.aten.linear.default": "torch._C._nn.linear",
    "torch.ops.aten.matmul.default": "torch.matmul",
    "torch.ops.aten.mean.dim": "torch.mean",
    "torch.ops.aten.mm.default": "torch.mm",
    "torch.ops.aten.mul.Tensor": "torch.mul",
    "torch.ops.aten.neg.default": "torch.neg",
    "torch.ops.aten.permute.default": "torch.permute",
    "torch.ops.aten.pow.Tensor_Scalar": "torch.pow",
    "torch.ops.aten.relu.default": "torch.relu",
    "torch.ops.aten.reshape.default": "torch.reshape",
    "torch.ops.aten.rsqrt.default": "torch.rsqrt",
    "torch.ops.aten.scaled_dot_product_attention.default": "torch._C._nn.scaled_dot_product_attention",
    "torch.ops.aten.select.int": "torch.select",
    "torch.ops.aten.sigmoid.default": "torch.sigmoid",
    "torch.ops.aten.silu.default": "torch._C._nn.silu",
    "torch.ops.aten.softmax.int": "torch.softmax",
    "torch.ops.aten.squeeze.dim": "torch.squeeze",
    "torch.ops.aten.sub.Tensor": "torch.sub",
    "torch.ops.aten.t.default": "torch.t",
    "torch.ops.aten.tanh.default": "torch.tanh",
    "torch.ops.aten.transpose.int": "torch.transpose",
    "torch.ops.aten.unflatten.int": "torch.unflatten",
    "torch.ops.aten.unsqueeze.default": "torch.unsqueeze",
    "torch.ops.aten.view.default": "torch.Tensor.view",
}
_ATEN_CALL = re.compile(r"\btorch\.ops\.aten\.\w+\.\w+(?=\()")


_ASSIGN = re.compile(r"^(\s*)(\w+) = ((?:self\b|getattr\()[^;\n]*?)((?:;.*)?\n?)$", re.S)
_ALIAS = "_mp_mod_"


def _attr_path(expr: str) -> Optional[list[str]]:
    """The attribute path FX's ``_format_target("self", path)`` printed as ``expr``, else None."""
    path: list[str] = []
    while expr != "self":
        dotted = re.fullmatch(r"(.+)\.([A-Za-z_]\w*)", expr)
        quoted = re.fullmatch(r'getattr\((.+), "([^"]+)"\)', expr)
        if quoted is not None and (dotted is None or len(quoted.group(1)) < len(dotted.group(1))):
            dotted = quoted
        if dotted is None:
            return None
        expr, atom = dotted.group(1), dotted.group(2)
        path.insert(0, atom)
    return path


def _attr_expr(base: str, atom: str) -> str:
    return f"{base}.{atom}" if atom.isidentifier() else f'getattr({base}, "{atom}")'


def _share_module_lookups(body: list[str]) -> list[str]:
    """Each submodule a parameter read walks to is looked up once per call, not once per parameter.

    FX prints a ``get_attr`` of ``layers.0.self_attn.in_proj_weight`` as
    ``getattr(self.layers, "0").self_attn.in_proj_weight``: three ``nn.Module.__getattr__`` calls
    before the parameter's, repeated for every parameter of the module. A submodule path used by
    two or more reads gets one local (``_mp_mod_<k>``), bound where it is first needed.
    """
    if any(_ALIAS in line for line in body):
        return body
    parsed = []
    uses: dict[tuple, int] = {}
    for line in body:
        match = _ASSIGN.match(line)
        path = _attr_path(match.group(3)) if match else None
        parsed.append((match, path))
        for depth in range(1, len(path or ())):
            assert path is not None
            uses[tuple(path[:depth])] = uses.get(tuple(path[:depth]), 0) + 1
    aliases: dict[tuple, str] = {}
    out: list[str] = []
    for line, (match, path) in zip(body, parsed):
        if not path or len(path) < 2 or uses.get(tuple(path[:1]), 0) < 2:
            out.append(line)
            continue
        assert match is not None  # a line with an attribute path matched
        indent, base = match.group(1), "self"
        for depth in range(1, len(path)):
            prefix = tuple(path[:depth])
            if uses[prefix] < 2:
                base = _attr_expr(base, path[depth - 1])
                continue
            if prefix not in aliases:
                aliases[prefix] = f"{_ALIAS}{len(aliases)}"
                out.append(f"{indent}{aliases[prefix]} = {_attr_expr(base, path[depth - 1])}\n")
            base = aliases[prefix]
        out.append(f"{indent}{match.group(2)} = {_attr_expr(base, path[-1])}{match.group(4)}")
    return out


def _lean_body(body: list[str]) -> list[str]:
    body = [_ATEN_CALL.sub(lambda m: LEAN_CALLS.get(m.group(0), m.group(0)), line) for line in body]
    return _share_module_lookups(body)


def lean_calls(gm: torch.fx.GraphModule) -> int:
    """Make ``gm``'s generated forward call aten ops through their torch bindings; returns how many call sites.

    FX prints an aten node as ``torch.ops.aten.transpose.int(x, 1, 0)``: four attribute lookups and
    ``OpOverload.__call__``, a Python frame that re-packs the arguments, before the op dispatches
    (~0.8 µs more than ``torch.transpose(x, 1, 0)``; ~60 such calls in a 2-layer encoder's forward).
    The code generator's body hook rewrites each call of :data:`LEAN_CALLS` into its binding. The
    graph is untouched (its nodes, metadata, the emitted ``model.py`` and ONNX export keep the aten
    targets); only the module's own Python source changes, and it keeps the rewrite on every
    recompile and deep copy (the hook lives on the graph's code generator). The same hook binds each
    submodule on the parameters' paths to a local once per call (:func:`_share_module_lookups`).
    """
    count = _install_lean_calls(gm)
    if count:
        gm.recompile()
    return count


def _install_lean_calls(gm: torch.fx.GraphModule) -> int:
    """:func:`lean_calls` without the recompile (simplify recompiles once for its folds and this)."""
    if not isinstance(gm, torch.fx.GraphModule):
        return 0
    # counted on the graph: reading gm.code would generate a lazy module's code once more
    count = sum(1 for n in gm.graph.nodes
                if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                and f"torch.ops.{n.target}" in LEAN_CALLS)
    if count == 0 or getattr(gm.graph._codegen, "_mp_lean_calls", False):
        return 0

    def make_transformer(previous: Optional[Callable[[list[str]], list[str]]]) -> Callable[[list[str]], list[str]]:
        return (lambda body: _lean_body(previous(body))) if previous is not None else _lean_body

    gm.graph.on_generate_code(make_transformer)
    setattr(gm.graph._codegen, "_mp_lean_calls", True)  # noqa: B010 (a mark of ours on torch's object)
    return count


def simplify(gm: torch.fx.GraphModule) -> tuple[Fold, ...]:
    """Fold the identity nodes of ``gm`` in place (see the module doc); returns what was folded.

    The graph is linted and the module recompiled when anything changed; the parameter-free
    modules only folded ``call_module`` nodes called (dropout) are deleted.
    """
    folds: list[Fold] = []
    dropped_modules: set[str] = set()
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        found = _why(gm, node)
        if found is None:
            continue
        kind, why = found
        node.replace_all_uses_with(node.args[0])
        if node.op == "call_module":
            dropped_modules.add(node.target)
        op = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        folds.append(Fold(node=node.name, op=str(op), kind=kind, why=why))
        gm.graph.erase_node(node)
    if getattr(gm, "validate_inputs", False) and hasattr(gm, "_guards_fn"):
        # torch.export's pre-hook re-flattens the inputs with key paths on every call only to
        # compare their structure with the exported one; with a _guards_fn in the graph it checks
        # nothing else (the guards check the shapes), and forward's own signature and pytree
        # flatten still reject a wrong call
        setattr(gm, "validate_inputs", False)  # noqa: B010 (torch.export's attribute, not GraphModule's)
        folds.append(Fold(node="<forward>", op="_check_input_constraints_pre_hook", kind="hook",
                          why="torch.export's per-call input-structure check (the graph's _guards_fn still checks shapes)"))
    folds.extend(_drop_idle_export_hooks(gm))
    folded = any(f.kind != "hook" for f in folds)
    if folded:
        still_called = {n.target for n in gm.graph.nodes if n.op == "call_module"}
        for target in sorted(dropped_modules - still_called):  # parameter-free dropout modules
            gm.delete_submodule(target)
        gm.graph.lint()
    if _install_lean_calls(gm) or folded:  # one code generation for both
        gm.recompile()
    return tuple(folds)


_EXPORT_HOOK_QUALNAME = "_create_stateful_graph_module.<locals>.<lambda>"


def _idle_module_type_hook(hook: Any) -> bool:
    """torch.export's enter/exit hook that registers the graph's ``nn.Module`` input types as pytree
    nodes for the call, when there are none (its closure's ``module_types`` is empty): it does nothing."""
    code = getattr(hook, "__code__", None)
    if getattr(hook, "__qualname__", "") != _EXPORT_HOOK_QUALNAME or code is None \
            or code.co_freevars != ("module_types",):
        return False
    types = hook.__closure__[0].cell_contents
    return isinstance(types, (set, frozenset, list, tuple)) and not types


def _drop_idle_export_hooks(gm: torch.fx.GraphModule) -> list[Fold]:
    """Remove the forward hooks of a torch.export module that do nothing on this graph.

    Any forward hook sends ``nn.Module.__call__`` down its slow path (a Python closure per hook and
    the hook bookkeeping: ~10 µs a call on the small encoder). torch.export registers three: the
    input-structure check (idle once ``validate_inputs`` is off, see :func:`simplify`) and an
    enter/exit pair that registers the graph's ``nn.Module``-typed inputs as pytree nodes (idle
    when there are none). They go only when all three are idle, each recorded as a ``hook`` fold.
    """
    from torch.export._unlift import _check_input_constraints_pre_hook

    if getattr(gm, "validate_inputs", True):
        return []
    pre = {k: h for k, h in gm._forward_pre_hooks.items()
           if h is _check_input_constraints_pre_hook or _idle_module_type_hook(h)}
    post = {k: h for k, h in gm._forward_hooks.items() if _idle_module_type_hook(h)}
    if len(pre) != 2 or len(post) != 1:
        return []
    for key in pre:
        gm._forward_pre_hooks.pop(key)
        gm._forward_pre_hooks_with_kwargs.pop(key, None)
    for key in post:
        gm._forward_hooks.pop(key)
        gm._forward_hooks_with_kwargs.pop(key, None)
        gm._forward_hooks_always_called.pop(key, None)
    why = "torch.export hook with nothing to do on this graph (no nn.Module inputs; input check off)"
    return [Fold(node="<forward>", op=getattr(h, "__name__", "export_hook"), kind="hook", why=why)
            for h in [*pre.values(), *post.values()]]


def fold_counts(folds: tuple[Fold, ...]) -> dict[str, int]:
    """kind -> number of folded nodes, for the report."""
    counts: dict[str, int] = {}
    for fold in folds:
        counts[fold.kind] = counts.get(fold.kind, 0) + 1
    return counts

