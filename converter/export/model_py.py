"""Generate the standalone model.py of an output directory from ``conv.module``.

model.py is written by FX's code generator, so every inserted cast is an explicit
``x.to(torch.bfloat16)`` line, each op line ends with the precision it runs in, and a comment names
the original module before each group of lines. Parameters and buffers keep their original dotted
names (``layers.0.attn.qkv.weight``): the generated class rebuilds the nested module structure with
plain ``nn.Module`` containers. Leaf modules that the graph still calls (``BatchNorm2d``, ``ReLU``,
``MaxPool2d``, ``Dropout`` …) are re-created from their constructor arguments; a leaf that cannot be
re-created exactly is an :class:`EmitError` naming it.

Graphs captured by ``torch.export``: the GraphModule's own forward flattens its inputs with pytree
and calls a ``_guards_fn``. The emitted forward instead takes the original forward's argument names
(positional arguments first, then the keyword arguments of the example inputs, in their captured
order) and indexes nested containers explicitly; non-tensor inputs were specialised at capture time
and are accepted but ignored. The result keeps the model's output structure with plain Python
containers: tuples, lists and dicts as they were, and a ``ModelOutput``-like object (Hugging Face)
becomes a ``dict`` with the same keys. Device constants the graph baked in
(``arange(..., device='cpu')``) follow the device the model is loaded on.

The fixed part of the file (``_set``/``_get``, ``__init__``, ``load`` with its weights check) is the
template ``templates/model.py.tmpl``. Outside text (file, class and module names) goes in only as a
``repr`` literal, an escaped one-line comment or escaped docstring text (see
:mod:`converter.export.source_text`).
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
import torch.fx
from torch import nn
from torch.fx.graph import CodeGen, _custom_builtins
from torch.fx.node import map_aggregate
from torch.nn.utils.parametrize import ParametrizationList

from converter.export.errors import EmitError
from converter.export.functions import function_lines
from converter.export.shape_guards import guard_lines
from converter.export.source_text import (
    check_attribute_path,
    comment_text,
    doc_text,
    render_template,
)
from converter.export.weights import WEIGHTS_FILE, WEIGHTS_INDEX
from converter.ir.graphmodule import TwoModeGraphModule
from converter.ir.meta import GM_PARAM_DTYPES, META_CAST, META_DECISION, META_INFO
from converter.ir.ops import library_op
from converter.passes.checkpoint import with_checkpoints
from converter.passes.fp32_math import RUNTIME_HELPERS, runtime_source

__all__ = ["ModelSource", "generate_model_source", "WEIGHTS_FILE"]


@dataclass
class ModelSource:
    """Everything :func:`generate_model_source` produces: the code and the tensors it loads.

    ``tensors`` are the converted model's own tensors (not copies), each once (ties are in the
    code); ``dtypes`` names those stored in another dtype than their own (O2: half parameters).
    """

    code: str
    tensors: dict[str, torch.Tensor]
    class_name: str
    warnings: list[str] = field(default_factory=list)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    #: tensors on the meta device (a model converted without its weights): model.py takes them from
    #: ``load(weights=...)``, a checkpoint of the user's; the others are written next to it
    external: list[str] = field(default_factory=list)

    @property
    def own(self) -> dict[str, torch.Tensor]:
        """The tensors written next to model.py (every one that has values)."""
        return {name: t for name, t in self.tensors.items() if not t.is_meta}


# ---------------------------------------------------------------------------------------------
# leaf modules


_LEAF_NAMESPACE = {"nn": nn, "torch": torch, "inf": math.inf, "nan": math.nan}
_LEAF_HINT = "capture with --tracer export (it traces into every module), or make the module traceable"


def _leaf_constructor(path: str, module: nn.Module) -> str:
    """Source of an expression that re-creates leaf ``module`` (without its weights)."""
    cls = type(module)
    name = cls.__name__
    if isinstance(module, ParametrizationList):
        raise EmitError(
            f"cannot emit model.py: {path!r} is a parametrized weight (torch.nn.utils.parametrize), which the FX "
            "tracer keeps as an opaque module; capture with --tracer export or auto (they compute it in the graph)"
        )
    if not cls.__module__.startswith("torch.nn.") or getattr(nn, name, None) is not cls:
        raise EmitError(
            f"cannot emit model.py: cannot re-create leaf module {path!r} of type {cls.__module__}.{cls.__qualname__} "
            f"(only torch.nn modules are re-created); {_LEAF_HINT}"
        )
    if len(list(module.children())) > 0:
        raise EmitError(f"cannot emit model.py: leaf module {path!r} ({name}) has submodules, so it cannot be re-created; {_LEAF_HINT}")
    expr = "nn." + repr(module)
    if "\n" in expr or not _is_plain_constructor(expr):
        raise EmitError(f"cannot re-create leaf module {path!r} ({name}) from its repr; {_LEAF_HINT}")
    try:
        rebuilt = eval(expr, dict(_LEAF_NAMESPACE))  # noqa: S307 - checked above: one nn.X(...) call of literals
    except Exception as exc:
        raise EmitError(f"cannot re-create leaf module {path!r} ({name}) from {expr!r}: {exc}; {_LEAF_HINT}") from None
    _check_same_module(path, module, rebuilt, expr)
    return expr


def _is_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(_is_literal(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _is_literal(node.operand)
    if isinstance(node, ast.Name):
        return node.id in ("inf", "nan")
    if isinstance(node, ast.Attribute):  # torch.float32
        return isinstance(node.value, ast.Name) and node.value.id == "torch"
    return False


def _is_plain_constructor(expr: str) -> bool:
    """``expr`` is exactly one ``nn.Name(literal, key=literal, ...)`` call: nothing else can run."""
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return False
    if not (isinstance(tree, ast.Call) and isinstance(tree.func, ast.Attribute) and isinstance(tree.func.value, ast.Name)):
        return False
    return tree.func.value.id == "nn" and all(_is_literal(a) for a in tree.args) and all(
        k.arg is not None and _is_literal(k.value) for k in tree.keywords
    )


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _check_same_module(path: str, module: nn.Module, rebuilt: nn.Module, expr: str) -> None:
    if type(rebuilt) is not type(module):
        raise EmitError(f"cannot re-create leaf module {path!r}: {expr} builds {type(rebuilt).__name__}; {_LEAF_HINT}")
    simple = (bool, int, float, str, tuple, type(None))
    for key, value in vars(module).items():
        if key.startswith("_") or key == "training":
            continue
        if isinstance(value, torch.Tensor):
            raise EmitError(f"cannot re-create leaf module {path!r} ({type(module).__name__}): attribute {key!r} is a plain tensor; {_LEAF_HINT}")
        if isinstance(value, simple) and not _same_value(value, getattr(rebuilt, key, object())):
            raise EmitError(
                f"cannot re-create leaf module {path!r}: {expr} gives {key}={getattr(rebuilt, key, None)!r}, "
                f"the model has {value!r}; {_LEAF_HINT}"
            )
    want = {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}
    have = {k: (tuple(v.shape), v.dtype) for k, v in rebuilt.state_dict().items()}
    if want != have:
        raise EmitError(f"cannot re-create leaf module {path!r}: {expr} has different parameters or buffers; {_LEAF_HINT}")


# ---------------------------------------------------------------------------------------------
# inputs and outputs of export graphs


def _spec_children(spec) -> list:
    return list(spec.children()) if hasattr(spec, "children") and callable(spec.children) else list(spec.children_specs)


def _is_namedtuple_type(typ: type) -> bool:
    return isinstance(typ, type) and issubclass(typ, tuple) and hasattr(typ, "_fields")


def _input_paths(spec, expr: str, out: list[str]) -> None:
    """Append, in pytree flatten order, an expression that reaches each leaf of ``spec`` from ``expr``."""
    if spec.is_leaf():
        out.append(expr)
        return
    children = _spec_children(spec)
    typ = spec.type
    if typ is type(None):
        return
    if typ in (tuple, list) or _is_namedtuple_type(typ):
        for i, child in enumerate(children):
            _input_paths(child, f"{expr}[{i}]", out)
        return
    context = spec.context
    if isinstance(context, (list, tuple)) and len(context) == len(children):
        for key, child in zip(context, children):
            _input_paths(child, f"{expr}[{key!r}]", out)
        return
    raise EmitError(f"cannot emit model.py: unsupported input structure {getattr(typ, '__name__', typ)!r}; pass plain tensors, tuples, lists or dicts")


def _output_expr(spec, leaves: list[str]) -> str:
    """Python source that rebuilds the output structure ``spec`` from flat leaf names."""
    if spec.is_leaf():
        return leaves.pop(0)
    children = _spec_children(spec)
    typ = spec.type
    if typ is type(None):
        return "None"
    if typ is tuple or _is_namedtuple_type(typ):
        items = [_output_expr(c, leaves) for c in children]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if typ is list:
        return "[" + ", ".join(_output_expr(c, leaves) for c in children) + "]"
    context = spec.context
    if isinstance(context, (list, tuple)) and len(context) == len(children):
        return "{" + ", ".join(f"{k!r}: {_output_expr(c, leaves)}" for k, c in zip(context, children)) + "}"
    raise EmitError(f"cannot emit model.py: unsupported output structure {getattr(typ, '__name__', typ)!r}")


def _signature_names(original: Optional[nn.Module], count: int) -> list[str]:
    names: list[str] = []
    if original is not None:
        try:
            params = list(inspect.signature(original.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    while len(names) < count:
        names.append(f"arg{len(names)}")
    return names[:count]


def _check_argument_names(names: Iterable[str]) -> None:
    import keyword

    for name in names:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name == "self":
            raise EmitError(
                f"cannot emit model.py: the forward argument {name!r} is not a valid Python parameter name; "
                "pass it under a plain identifier in example_inputs"
            )


# ---------------------------------------------------------------------------------------------
# the forward: FX code generation with our signature, prologue and return statement


class _EmitCodeGen(CodeGen):
    """FX code generation with our own signature, input prologue and return statement."""

    def __init__(self, signature: Optional[str], prologue: list[str], output: Optional[Callable[[Any], str]]):
        super().__init__()
        self._signature = signature
        self._prologue = prologue
        self._output = output

    def gen_fn_def(self, free_vars, maybe_return_annotation, *, expanded_def: bool = False) -> str:  # noqa: D102
        if self._signature is None:
            head = super().gen_fn_def(free_vars, "", expanded_def=expanded_def)
        else:
            head = f"def forward({self._signature}):"
        return "\n    ".join([head] + self._prologue)

    def generate_output(self, output_args, *, descs=None, repr_fn=None) -> str:  # noqa: D102
        if self._output is None:
            # repr_fn only when torch passed one: torch < 2.12's CodeGen.generate_output has no such parameter
            extra = {} if repr_fn is None else {"repr_fn": repr_fn}
            return super().generate_output(output_args, descs=descs, **extra)
        return self._output(output_args)


def _is_guard_module(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op != "call_module":
        return False
    try:
        sub = gm.get_submodule(node.target)
    except AttributeError:
        return False
    return type(sub).__name__ == "GuardsFn"


def _is_guard_path(gm: torch.fx.GraphModule, path: str) -> bool:
    if not path:
        return False
    sub = getattr(gm, path.split(".")[0], None)
    return type(sub).__name__ == "GuardsFn"


@dataclass
class _Graph:
    graph: torch.fx.Graph
    leaf_paths: list[str]
    uses_device: bool


def _prepare_graph(gm: torch.fx.GraphModule, source: Optional[torch.fx.Graph] = None) -> _Graph:
    """A copy of ``source`` (default ``gm.graph``) without export's guard call, with baked-in devices made relative."""
    source = gm.graph if source is None else source
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(source, {}))
    for node in list(graph.nodes):
        if node.op == "call_module" and _is_guard_module(gm, node):
            if node.users:
                raise EmitError("cannot emit model.py: the export guard function's result is used by the graph")
            graph.erase_node(node)
    leaf_paths: list[str] = []
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr"):
            check_attribute_path(str(node.target), "attribute")
        if node.op == "call_module" and node.target not in leaf_paths:
            leaf_paths.append(str(node.target))
    for path, sub in gm.named_modules():
        if isinstance(sub, torch.fx.GraphModule) and path:
            raise EmitError(f"cannot emit model.py: submodule {path!r} is a nested graph (control flow); capture without it")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    capture_device = next((p.device for p in gm.parameters()), torch.device("cpu"))
    device_node: list[torch.fx.Node] = []

    def relocate(value):
        if isinstance(value, torch.device) and value.type == capture_device.type:
            if not device_node:
                anchor = placeholders[-1] if placeholders else None
                ctx = graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(next(iter(graph.nodes)))
                with ctx:
                    device_node.append(graph.create_node("get_attr", "device", name="model_device"))
            return device_node[0]
        return value

    for node in list(graph.nodes):
        if node.op in ("call_function", "call_method", "call_module"):
            node.args = map_aggregate(node.args, relocate)
            node.kwargs = map_aggregate(node.kwargs, relocate)
    return _Graph(graph, leaf_paths, bool(device_node))


def _export_codegen(source: torch.fx.Graph, graph: torch.fx.Graph, original: Optional[nn.Module]) -> tuple[_EmitCodeGen, str]:
    """Code generation for a graph captured by torch.export: the original argument names, explicit
    indexing into nested inputs, and the original output structure. Returns (codegen, io note)."""
    pytree_info = source._codegen.pytree_info
    children = _spec_children(pytree_info.in_spec)
    if pytree_info.in_spec.type is not tuple or len(children) != 2:
        raise EmitError("cannot emit model.py: unexpected input structure of the exported graph")
    args_spec, kwargs_spec = children
    arg_specs = _spec_children(args_spec)
    names = _signature_names(original, len(arg_specs))
    kw_names = list(kwargs_spec.context or [])
    _check_argument_names(names + kw_names)
    paths: list[str] = []
    for name, spec in zip(names, arg_specs):
        _input_paths(spec, name, paths)
    for name, spec in zip(kw_names, _spec_children(kwargs_spec)):
        _input_paths(spec, name, paths)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(paths) != len(placeholders):
        raise EmitError(f"cannot emit model.py: the exported graph has {len(placeholders)} inputs but its input structure has {len(paths)} leaves")
    params = ["self"] + names + [k for k in kw_names if k not in names]
    prologue: list[str] = []
    for node, path in zip(placeholders, paths):
        node.target = node.name  # bound here or in the prologue, never as an argument
        if node.name != path:
            prologue.append(f"{node.name} = {path}")
    prologue += guard_lines(placeholders, paths)  # the sizes the graph serves (converter.export.shape_guards)
    out_spec = pytree_info.out_spec

    def output(output_args) -> str:
        flat = output_args if isinstance(output_args, (tuple, list)) else (output_args,)
        return "return " + _output_expr(out_spec, [repr(a) for a in flat])

    note = (
        "Captured with torch.export: the forward takes the original argument names "
        f"({', '.join(params[1:])}); non-tensor inputs were fixed at capture time and are ignored. "
        "A ModelOutput-like result is returned as a dict with the same keys (out['logits'] works on both). "
        "The forward first checks the input sizes the graph serves (the dims it fixed, the ranges and relations "
        "of its dynamic dims) and raises ValueError naming the input, the dim and both sizes."
    )
    return _EmitCodeGen(", ".join(params), prologue, output), note


def _forward_source(gm: torch.fx.GraphModule, prepared: _Graph, original: Optional[nn.Module], warnings: list[str], *,
                    source: torch.fx.Graph, name: str = "forward",
                    functions: Optional[list] = None) -> tuple[str, list[str], dict[str, Any], str]:
    """(the annotated method ``name`` for graph ``source``, the import lines it needs, the fp32-math
    runtime helpers it calls, the io note for the docstring). The custom autograd Function classes it
    calls are appended to ``functions``."""
    graph = prepared.graph
    pytree_info = getattr(source._codegen, "pytree_info", None)
    if pytree_info is not None and pytree_info.in_spec is not None:
        graph._codegen, io_note = _export_codegen(source, graph, original)
    else:
        graph._codegen = _EmitCodeGen(None, [], None)
        io_note = "The forward takes the same arguments as the original model's forward and returns the same structure."
    graph._codegen = with_checkpoints(graph._codegen)  # checkpoint regions as nested functions (passes.checkpoint)
    python = graph.python_code(root_module="self")
    body = python.src[python.src.index("def forward("):]  # drop FX's `wrap(...)` statements before it
    _check_defaults(body)
    body = _annotate_lines(body, {n.name: n for n in source.nodes}, (original, gm))
    if name != "forward":
        body = body.replace("def forward(", f"def {name}(", 1)
    used = {key: obj for key, obj in python.globals.items() if re.search(rf"\b{re.escape(key)}\b", body)}
    # the fp32 math scope calls: model.py carries their (torch-only) source instead of an import
    runtime = {key: obj for key, obj in used.items() if obj in RUNTIME_HELPERS}
    for key, obj in runtime.items():
        body = re.sub(rf"\b{re.escape(key)}\b", obj.__name__, body)
    # custom autograd Functions (passes.autograd_fns): model.py defines or imports the class, calls Fn.apply
    called = {key: obj.autograd_function for key, obj in used.items() if isinstance(getattr(obj, "autograd_function", None), type)}
    for key, cls in called.items():
        body = re.sub(rf"\b{re.escape(key)}\b", f"{cls.__name__}.apply", body)
        if functions is not None and cls not in functions:
            functions.append(cls)
    imports = [line for line in _import_lines({k: v for k, v in used.items() if k not in runtime and k not in called}, warnings)
               if line != "import torch"]
    forward = "\n".join("    " + line if line else "" for line in body.rstrip().splitlines())
    return forward, imports, runtime, io_note


_DISPATCH = '''    def forward(self, *args, **kwargs):
        """train(): the train-mode graph, eval(): the eval-mode graph (the model branches on self.training)."""
        if self.training:
            return self._forward_train(*args, **kwargs)
        return self._forward_eval(*args, **kwargs)
'''


def _forwards(gm: torch.fx.GraphModule, original: Optional[nn.Module], warnings: list[str]) -> tuple[str, list[str], list[_Graph], str]:
    """The forward method(s) of model.py: one for a one-graph conversion; ``_forward_train``,
    ``_forward_eval`` and a ``forward`` that picks one by ``self.training`` for a two-mode one
    (:class:`~converter.ir.graphmodule.TwoModeGraphModule`). Returns (methods, import lines, prepared graphs, io note)."""
    eval_graph = gm.eval_graph if isinstance(gm, TwoModeGraphModule) else None
    sources = [("forward", gm.graph)] if eval_graph is None else [("_forward_train", gm.graph), ("_forward_eval", eval_graph)]
    methods: list[str] = []
    imports: list[str] = []
    runtime: dict[str, Any] = {}
    prepared_graphs: list[_Graph] = []
    io_note = ""
    functions: list[type] = []
    for name, source in sources:
        prepared = _prepare_graph(gm, source)
        method, lines, helpers, io_note = _forward_source(gm, prepared, original, warnings, source=source, name=name,
                                                          functions=functions)
        methods.append(method)
        imports += [line for line in lines if line not in imports]
        runtime.update(helpers)
        prepared_graphs.append(prepared)
    if eval_graph is not None:
        methods.insert(0, _DISPATCH.rstrip("\n"))
    if runtime:
        imports += ["", "", '# fp32 math scopes around fp32 matmul/conv runs (mpconvert docs/rules.md, "fp32 math")',
                    *runtime_source().splitlines(), ""]
    if functions:  # their classes, backward included (converter.export.functions)
        imports += function_lines(functions, warnings)
    return "\n\n".join(methods), imports, prepared_graphs, io_note


def _is_plain_value(node: ast.AST) -> bool:
    """A literal, or a dotted name such as ``torch.float32``: nothing that calls anything."""
    if isinstance(node, (ast.Constant, ast.Name)):
        return True
    if isinstance(node, ast.Attribute):
        return _is_plain_value(node.value) and isinstance(node.value, (ast.Name, ast.Attribute))
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_is_plain_value(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _is_plain_value(k) for k in node.keys) and all(_is_plain_value(v) for v in node.values)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _is_plain_value(node.operand)
    return False


def _check_defaults(body: str) -> None:
    """FX writes ``repr(default)`` for the forward's default values; only plain values may go into model.py."""
    func = ast.parse(body).body[0]
    for default in [*func.args.defaults, *(d for d in func.args.kw_defaults if d is not None)]:
        if not _is_plain_value(default):
            raise EmitError(
                f"cannot emit model.py: the forward has a default value {ast.unparse(default)[:60]!r} that is not a "
                "plain literal; give that argument a literal default (None, a number, a string) or pass it explicitly"
            )


def _import_line(name: str, obj: Any, warnings: list[str]) -> Optional[str]:
    if name in _custom_builtins and _custom_builtins[name].obj is obj:
        return _custom_builtins[name].import_str
    if isinstance(obj, type(sys)):
        return f"import {obj.__name__} as {name}" if name != obj.__name__ else f"import {name}"
    module = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not isinstance(module, str) or not isinstance(qual, str) or not qual.isidentifier():
        raise EmitError(f"cannot emit model.py: the graph refers to {obj!r}, which has no importable name")
    module = {"_operator": "operator", "_functools": "functools"}.get(module, module)
    if not all(part.isidentifier() for part in module.split(".")):
        raise EmitError(f"cannot emit model.py: the graph refers to {qual} from module {module!r}, which is not importable by name")
    if module == "builtins":
        return f"{name} = {qual}" if name != qual else None
    top = module.split(".")[0]
    if module.startswith("_mpconvert_model_") or module == "__main__" or importlib.util.find_spec(top) is None:
        raise EmitError(
            f"cannot emit a standalone model.py: the graph calls {qual}() from the model file itself "
            "(a torch.fx.wrap'ed function); capture with --tracer export, which traces into it"
        )
    if top != "torch" and top not in sys.stdlib_module_names:
        warnings.append(f"model.py imports {qual} from {module}: the graph calls it, so model.py needs that module (it is not standalone PyTorch)")
    return f"from {module} import {qual}" + (f" as {name}" if name != qual else "")


def _library_imports(graphs: Iterable[torch.fx.Graph], warnings: list[str]) -> tuple[list[str], list[str]]:
    """Import lines for the custom ops of other libraries the graphs call (importing the module that
    defines an op registers it), each failing with one clear line, and the packages they need; a
    warning per package."""
    found: dict[str, list[str]] = {}
    for graph in graphs:
        for node in graph.nodes:
            op = library_op(node)
            if op is not None and op[0] not in found.setdefault(op[1], []):
                found[op[1]].append(op[0])
    lines: list[str] = []
    packages: list[str] = []
    for module, ops in found.items():
        package = module.split(".")[0]
        packages += [package] if package not in packages else []
        names = ", ".join(f"torch.ops.{op.replace('::', '.')}" for op in ops)
        warnings.append(f"model.py needs the package '{package}': the graph calls {names} (defined in {module})")
        lines += ["try:  # registers " + names, f"    import {module}", "except ImportError as exc:",
                  f"    raise ImportError({f'model.py calls {names}, which the package {package!r} defines: pip install {package}'!r}) from exc"]
    return lines, sorted(packages)


def _import_lines(globals_: dict[str, Any], warnings: list[str]) -> list[str]:
    lines = [_import_line(name, obj, warnings) for name, obj in sorted(globals_.items())]
    lines = [line for line in lines if line is not None]
    return sorted(set(lines), key=lines.index)


def _annotate_lines(src: str, gm_nodes: dict[str, torch.fx.Node], roots: Iterable[Optional[nn.Module]] = ()) -> str:
    """Add a module comment before each group of lines and the precision after each op line."""
    out: list[str] = []
    current: Optional[str] = None
    line_re = re.compile(r"^( {4,})(\w+)(?:\s*:[^=]*)? = ")  # deeper: inside a checkpoint region's function
    for line in src.splitlines():
        m = line_re.match(line)
        node = gm_nodes.get(m.group(2)) if m else None
        info = node.meta.get(META_INFO) if node is not None else None
        if node is None or info is None or node.op in ("placeholder", "output") or (node.op == "get_attr" and not info.module):
            out.append(line)
            continue
        decision = node.meta.get(META_DECISION)
        cast = node.meta.get(META_CAST)
        module = getattr(info, "module", "") or ""
        if module != current:
            kind = info.module_type or _class_name(roots, module)
            label = f"{module} ({kind})" if module else f"(top level: {kind})"
            out.append(f"{m.group(1)}# --- {comment_text(label)}")
            current = module
        if cast is not None and cast.inserted:
            line += f"  # cast to {comment_text(cast.dtype)}"
        elif decision is not None and getattr(info, "kind", "") in ("compute", "fixed") and decision.precision in ("fp16", "bf16", "fp32"):
            line += f"  # {decision.precision}"
        out.append(line)
    return "\n".join(out)


def _class_name(roots: Iterable[Optional[nn.Module]], path: str) -> str:
    for root in roots:
        if root is None:
            continue
        try:
            return type(root.get_submodule(path)).__name__
        except AttributeError:
            continue
    return "?"


# ---------------------------------------------------------------------------------------------
# the structure: containers, leaf modules, parameters, buffers, constants


def _owner_of(name: str, leaves: Iterable[str]) -> Optional[str]:
    for leaf in leaves:
        if name.startswith(leaf + "."):
            return leaf
    return None


def _resolve(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


@dataclass
class _Tensors:
    """The tensors model.py declares, and the values the weight files hold (the model's own
    tensors, detached: nothing is copied)."""

    values: dict[str, torch.Tensor] = field(default_factory=dict)
    parameters: list[tuple[str, torch.Tensor, str]] = field(default_factory=list)
    buffers: list[tuple[str, torch.Tensor, str]] = field(default_factory=list)
    constants: list[tuple[str, torch.Tensor, str]] = field(default_factory=list)
    tied: list[tuple[str, str, str]] = field(default_factory=list)  # (alias, name, kind)
    seen: dict[int, str] = field(default_factory=dict)

    def add(self, name: str, tensor: torch.Tensor, kind: str) -> bool:
        """Record ``tensor`` under ``name``; False (and a tie) when it was recorded under another name."""
        if id(tensor) in self.seen:
            self.tied.append((name, self.seen[id(tensor)], kind))
            return False
        self.seen[id(tensor)] = name
        self.values[name] = tensor.detach()
        return True


def _collect_tensors(gm: torch.fx.GraphModule, leaf_paths: list[str], graphs: Iterable[torch.fx.Graph]) -> _Tensors:
    found = _Tensors()
    for name, param in gm.named_parameters(remove_duplicate=False):
        if _is_guard_path(gm, name.rsplit(".", 1)[0]):
            continue
        check_attribute_path(name, "parameter")
        if found.add(name, param, "parameter") and not _owner_of(name, leaf_paths):
            found.parameters.append((name, param, f", {param.requires_grad}"))
    for mod_path, sub in gm.named_modules(remove_duplicate=False):
        for bname, buf in sub.named_buffers(recurse=False):
            if buf is None:
                continue
            name = f"{mod_path}.{bname}" if mod_path else bname
            check_attribute_path(name, "buffer")
            persistent = bname not in sub._non_persistent_buffers_set
            if found.add(name, buf, "buffer" if persistent else "buffer-nonpersistent") and not _owner_of(name, leaf_paths):
                found.buffers.append((name, buf, f", {persistent}"))
    for node in (n for graph in graphs for n in graph.nodes):
        if node.op != "get_attr":
            continue
        target = str(node.target)
        if target in found.values or any(target == alias for alias, _, _ in found.tied):
            continue
        if target == "training":  # the module's train/eval flag (converter.passes.modes): self.training
            continue
        value = _resolve(gm, target)
        if not isinstance(value, torch.Tensor):
            raise EmitError(f"cannot emit model.py: get_attr {target!r} is a {type(value).__name__}, not a tensor")
        if found.add(target, value, "constant"):
            found.constants.append((target, value, ""))
    return found


def _module_lines(gm: torch.fx.GraphModule, leaf_paths: list[str]) -> str:
    lines = []
    for path, sub in gm.named_modules():
        if not path or _is_guard_path(gm, path) or _owner_of(path, leaf_paths):
            continue
        check_attribute_path(path, "module")
        expr = _leaf_constructor(path, sub) if path in leaf_paths else "nn.Module()"
        lines.append(f"        _set(self, {path!r}, {expr})\n")
    return "".join(lines)


def _dtype_source(dtype: Any) -> str:
    if not isinstance(dtype, torch.dtype):
        raise EmitError(f"cannot emit model.py: {dtype!r} is not a torch dtype")
    return str(dtype)


def _table(rows: list[tuple[str, torch.Tensor, str]], stored: Optional[dict[str, torch.dtype]] = None) -> str:
    stored = stored or {}
    return "".join(f"    {name!r}: ({tuple(t.shape)!r}, {_dtype_source(stored.get(name, t.dtype))}{extra}),\n" for name, t, extra in rows)


def _storage_dtypes(conv, gm: torch.fx.GraphModule, found: "_Tensors") -> dict[str, torch.dtype]:
    """O2: name -> the half dtype each parameter is stored in (``gm.meta["mp_param_dtypes"]``);
    O1: nothing (every tensor is stored in its own dtype)."""
    if getattr(getattr(conv, "options", None), "opt_level", "O1") != "O2":
        return {}
    recorded = gm.meta.get(GM_PARAM_DTYPES) or {}
    params = {name for name, _, _ in found.parameters}
    return {name: dtype for name, dtype in recorded.items()
            if name in found.values and name in params and dtype != found.values[name].dtype
            and dtype in (torch.float16, torch.bfloat16) and found.values[name].dtype == torch.float32}


def _identifier(name: str) -> str:
    import keyword

    name = re.sub(r"[^0-9A-Za-z_]", "_", name)
    if not name or name[0].isdigit() or keyword.iskeyword(name):
        name = "M_" + name
    return name


# ---------------------------------------------------------------------------------------------
# the file


def generate_model_source(conv, *, model_file: Optional[str] = None) -> ModelSource:
    """Generate model.py for ``conv`` (a :class:`~converter.api.Conversion`) without writing anything.

    ``model_file``: the model file it came from; only its base name is recorded (as a literal).
    """
    from converter._version import __version__

    gm: torch.fx.GraphModule = conv.module
    original = getattr(conv, "original", None)
    root_name = type(original).__name__ if original is not None else type(gm).__name__
    class_name = _identifier(f"{root_name}MixedPrecision")
    warnings: list[str] = []
    forward, imports, prepared_graphs, io_note = _forwards(gm, original, warnings)
    leaf_paths = list(dict.fromkeys(path for prepared in prepared_graphs for path in prepared.leaf_paths))
    modules = _module_lines(gm, leaf_paths)
    found = _collect_tensors(gm, leaf_paths, [gm.graph] + ([gm.eval_graph] if isinstance(gm, TwoModeGraphModule) else []))
    training = {path: sub.training for path, sub in gm.named_modules() if not _is_guard_path(gm, path)}
    modes = {p: t for p, t in training.items() if p and t != gm.training and not _owner_of(p, leaf_paths)}
    param_dtypes = dict(gm.meta.get(GM_PARAM_DTYPES) or {})
    stored = _storage_dtypes(conv, gm, found)
    report = getattr(conv, "report", None)
    summary = report.line if report is not None else ""
    graphs = [gm.graph] + ([gm.eval_graph] if isinstance(gm, TwoModeGraphModule) else [])
    library, packages = _library_imports(graphs, warnings)
    imports = library + imports
    external = sorted(name for name, t in found.values.items() if t.is_meta)
    modes_note = getattr(report, "modes", None)  # capture's ModesNote; None: no report, or one without it
    source_note = ((report.extra.get("source") or {}).get("note") or "") if report is not None else ""  # a checkpoint folder
    code = render_template(
        "model.py.tmpl",
        title=doc_text(f"{root_name} converted to mixed precision ({conv.precision}) by mpconvert {__version__}."),
        summary=doc_text(f"{summary}." if summary else ""),
        tracer=doc_text(conv.tracer),
        depends=doc_text(f"on torch and {', '.join(packages)} (custom ops)" if packages else "only on torch"),
        io_note=doc_text(io_note),
        modes_note=doc_text(f"WARNING: this model is {modes_note.text}: a model whose train mode could not be traced "
                            "(the report says why); training it runs the other mode's ops (e.g. no dropout).\n"
                            if modes_note is not None and modes_note.frozen else "") + (f"{doc_text(source_note)}\n" if source_note else ""),
        imports="".join(line + "\n" for line in imports),
        precision=repr(str(conv.precision)),
        source=repr(Path(model_file).name if model_file else root_name),
        weights_file=repr(WEIGHTS_FILE),
        weights_index=repr(WEIGHTS_INDEX),
        opt_level=repr("O2" if stored else "O1"),
        external=repr(external),
        parameters=_table(found.parameters, stored),
        buffers=_table(found.buffers),
        constants=_table(found.constants),
        tied="".join(f"    {a!r}: ({b!r}, {k!r}),\n" for a, b, k in found.tied),
        param_dtypes="".join(f"    {k!r}: {_dtype_source(v)},\n" for k, v in param_dtypes.items()),
        training=repr(bool(gm.training)),
        module_training=repr(modes),
        class_name=class_name,
        modules=modules,
        device_property=render_template("device_property.py.tmpl") if any(p.uses_device for p in prepared_graphs) else "",
        forward=forward,
    )
    try:
        compile(code, "model.py", "exec")
    except SyntaxError as exc:  # a bug in this generator; never publish broken code
        raise EmitError(f"internal error: generated model.py does not compile ({exc.msg} at line {exc.lineno}); please report it") from exc
    return ModelSource(code=code, tensors=found.values, class_name=class_name, warnings=warnings, dtypes=stored,
                       external=external)
