"""Emit: write the artifacts of DESIGN §7 into an output directory, atomically.

::

    OUT/
      model.py      readable PyTorch code of the rewritten graph; depends only on torch
      weights.pt    every parameter, buffer and tensor constant, read with torch.load(weights_only=True)
      train.py      a training loop with converter.MixedPrecisionTrainer
      report.json   (and report.md, report.html when converter.render is available)

**model.py** is generated from ``conv.module.graph`` with FX's code generator, so every inserted
cast is an explicit ``x.to(torch.bfloat16)`` line, each op line ends with the precision it runs in,
and a comment names the original module before each group of lines. Parameters and buffers keep
their original dotted names (``layers.0.attn.qkv.weight``): the generated class rebuilds the nested
module structure with plain ``nn.Module`` containers. Leaf modules that the graph still calls
(``BatchNorm2d``, ``ReLU``, ``MaxPool2d``, ``Dropout`` …) are re-created from their constructor
arguments; a leaf that cannot be re-created exactly is an :class:`EmitError` naming it.

``load(device="cpu")`` returns the model with its weights and gives **bit-identical** outputs to
``conv.module`` on the same inputs; :func:`emit` checks that on the example inputs before it
publishes the directory.

Graphs captured by ``torch.export``: the GraphModule's own forward flattens its inputs with pytree
and calls a ``_guards_fn``. The emitted forward instead takes the original forward's argument names
(positional arguments first, then the keyword arguments of the example inputs, in their captured
order) and indexes nested containers explicitly; non-tensor inputs were specialised at capture time
and are accepted but ignored. The result keeps the model's output structure with plain Python
containers: tuples, lists and dicts as they were, and a ``ModelOutput``-like object (Hugging Face)
becomes a ``dict`` with the same keys, so ``out["logits"]`` works on both. Device constants the
graph baked in (``arange(..., device='cpu')``) follow the device the model is loaded on.

**Weights**: ``weights.pt`` is a flat ``{name: tensor}`` dict written with ``torch.save`` and read
with ``torch.load(..., weights_only=True)`` (never plain pickle). It includes non-persistent buffers
and tensor constants, which ``state_dict()`` would drop but the forward needs for bit-exact outputs.
Tied parameters are stored once and re-tied by ``model.py``. (safetensors is not used: it is not a
dependency, and it refuses tied tensors.)

**Atomic output**: everything is written to a hidden temporary sibling of the output directory and
moved into place with ``os.replace`` at the end. An existing directory is refused unless
``force=True``, in which case the old one is moved aside, the new one renamed into place and the
old one deleted. Any exception, including ``KeyboardInterrupt``, removes the temporary directory.

Test-only: ``MPCONVERT_TEST_EMIT_DELAY=<seconds>`` sleeps that long after writing each file, so a
test can interrupt emit half way. It has no other use.
"""
from __future__ import annotations

import contextlib
import importlib.util
import keyword
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
import torch.fx
from torch import nn
from torch.fx.graph import CodeGen, _custom_builtins
from torch.fx.node import map_aggregate

from converter.ir.meta import GM_PARAM_DTYPES, META_CAST, META_DECISION, META_INFO
from converter.ir.errors import EXIT_CHECK_FAILED, MpconvertError

__all__ = [
    "emit",
    "emit_reports",
    "publish_directory",
    "check_output_dir",
    "verify_emitted",
    "EmitError",
    "OutputExistsError",
    "VerificationError",
    "ModelSource",
    "generate_model_source",
    "render_train_py",
    "WEIGHTS_FILE",
    "DELAY_ENV",
]

WEIGHTS_FILE = "weights.pt"
#: test-only: seconds to sleep after writing each file (lets a test interrupt emit half way)
DELAY_ENV = "MPCONVERT_TEST_EMIT_DELAY"


class EmitError(MpconvertError, ValueError):
    """The artifacts cannot be written; the message names the cause and a fix."""


class OutputExistsError(EmitError):
    """The output directory exists and ``force`` was not given."""


class VerificationError(EmitError):
    """The emitted model.py does not reproduce ``conv.module``."""

    exit_code = EXIT_CHECK_FAILED


# ---------------------------------------------------------------------------------------------
# model.py generation


@dataclass
class ModelSource:
    """Everything :func:`generate_model_source` produces: the code and the tensors it loads."""

    code: str
    tensors: dict[str, torch.Tensor]
    class_name: str
    warnings: list[str] = field(default_factory=list)


_LEAF_NAMESPACE = {"nn": nn, "torch": torch, "inf": math.inf, "nan": math.nan}


def _leaf_constructor(path: str, module: nn.Module) -> str:
    """Source of an expression that re-creates leaf ``module`` (without its weights)."""
    cls = type(module)
    name = cls.__name__
    hint = "capture with --tracer export (it traces into every module), or make the module traceable"
    if not cls.__module__.startswith("torch.nn.") or getattr(nn, name, None) is not cls:
        raise EmitError(
            f"cannot emit model.py: cannot re-create leaf module {path!r} of type {cls.__module__}.{cls.__qualname__} "
            f"(only torch.nn modules are re-created); {hint}"
        )
    if len(list(module.children())) > 0:
        raise EmitError(f"cannot emit model.py: leaf module {path!r} ({name}) has submodules, so it cannot be re-created; {hint}")
    expr = "nn." + repr(module)
    if "\n" in expr:
        raise EmitError(f"cannot re-create leaf module {path!r} ({name}) from its repr; {hint}")
    try:
        rebuilt = eval(expr, dict(_LEAF_NAMESPACE))  # noqa: S307 - our own repr of a torch.nn module
    except Exception as exc:
        raise EmitError(f"cannot re-create leaf module {path!r} ({name}) from {expr!r}: {exc}; {hint}") from None
    _check_same_module(path, module, rebuilt, expr, hint)
    return expr


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _check_same_module(path: str, module: nn.Module, rebuilt: nn.Module, expr: str, hint: str) -> None:
    if type(rebuilt) is not type(module):
        raise EmitError(f"cannot re-create leaf module {path!r}: {expr} builds {type(rebuilt).__name__}; {hint}")
    simple = (bool, int, float, str, tuple, type(None))
    for key, value in vars(module).items():
        if key.startswith("_") or key == "training":
            continue
        if isinstance(value, torch.Tensor):
            raise EmitError(f"cannot re-create leaf module {path!r} ({type(module).__name__}): attribute {key!r} is a plain tensor; {hint}")
        if isinstance(value, simple) and not _same_value(value, getattr(rebuilt, key, object())):
            raise EmitError(
                f"cannot re-create leaf module {path!r}: {expr} gives {key}={getattr(rebuilt, key, None)!r}, "
                f"the model has {value!r}; {hint}"
            )
    want = {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}
    have = {k: (tuple(v.shape), v.dtype) for k, v in rebuilt.state_dict().items()}
    if want != have:
        raise EmitError(f"cannot re-create leaf module {path!r}: {expr} has different parameters or buffers; {hint}")


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
    raise EmitError(f"cannot emit model.py: unsupported input structure {getattr(typ, '__name__', typ)}; pass plain tensors, tuples, lists or dicts")


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
    raise EmitError(f"cannot emit model.py: unsupported output structure {getattr(typ, '__name__', typ)}")


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
            return super().generate_output(output_args, descs=descs, repr_fn=repr_fn)
        return self._output(output_args)


def _is_guard_module(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op != "call_module":
        return False
    try:
        sub = gm.get_submodule(node.target)
    except AttributeError:
        return False
    return type(sub).__name__ == "GuardsFn"


def _identifier(name: str) -> str:
    name = re.sub(r"\W", "_", name)
    if not name or name[0].isdigit() or keyword.iskeyword(name):
        name = "M_" + name
    return name


def _import_lines(globals_: dict[str, Any], warnings: list[str]) -> list[str]:
    lines: list[str] = []
    for name, obj in sorted(globals_.items()):
        if name in _custom_builtins and _custom_builtins[name].obj is obj:
            lines.append(_custom_builtins[name].import_str)
            continue
        if isinstance(obj, type(sys)):
            lines.append(f"import {obj.__name__} as {name}" if name != obj.__name__ else f"import {name}")
            continue
        module = getattr(obj, "__module__", None)
        qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
        if module is None or qual is None or "." in qual or "<" in qual:
            raise EmitError(f"cannot emit model.py: the graph refers to {obj!r}, which has no importable name")
        module = {"_operator": "operator", "_functools": "functools"}.get(module, module)
        if module == "builtins":
            if name != qual:
                lines.append(f"{name} = {qual}")
            continue
        top = module.split(".")[0]
        if module.startswith("_mpconvert_model_") or module == "__main__" or importlib.util.find_spec(top) is None:
            raise EmitError(
                f"cannot emit a standalone model.py: the graph calls {qual}() from the model file itself "
                "(a torch.fx.wrap'ed function); capture with --tracer export, which traces into it"
            )
        if top != "torch" and top not in sys.stdlib_module_names:
            warnings.append(
                f"model.py imports {qual} from {module}: the graph calls it, so model.py needs that module "
                "(it is not standalone PyTorch)"
            )
        lines.append(f"from {module} import {qual}" + (f" as {name}" if name != qual else ""))
    return sorted(set(lines), key=lines.index)


def _annotate_lines(src: str, gm_nodes: dict[str, torch.fx.Node], roots: Iterable[Optional[nn.Module]] = ()) -> str:
    """Add a module comment before each group of lines and the precision after each op line."""
    out: list[str] = []
    current: Optional[str] = None
    line_re = re.compile(r"^    (\w+)(?:\s*:[^=]*)? = ")
    for line in src.splitlines():
        m = line_re.match(line)
        node = gm_nodes.get(m.group(1)) if m else None
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
            out.append(f"    # --- {label}")
            current = module
        if cast is not None and cast.inserted:
            line += f"  # cast to {cast.dtype}"
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


def _owner_of(name: str, leaves: Iterable[str]) -> Optional[str]:
    for leaf in leaves:
        if name.startswith(leaf + "."):
            return leaf
    return None


def _signature_names(original: Optional[nn.Module], count: int) -> list[str]:
    names: list[str] = []
    if original is not None:
        import inspect

        try:
            params = list(inspect.signature(original.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    while len(names) < count:
        names.append(f"arg{len(names)}")
    return names[:count]


def _tensor_table(entries: list[tuple[str, torch.Tensor, str]]) -> list[str]:
    lines = []
    for name, tensor, extra in entries:
        lines.append(f"    {name!r}: ({tuple(tensor.shape)!r}, {tensor.dtype}{extra}),")
    return lines


def generate_model_source(conv, *, model_file: Optional[str] = None) -> ModelSource:
    """Generate model.py for ``conv`` (a :class:`~converter.api.Conversion`) without writing anything."""
    gm: torch.fx.GraphModule = conv.module
    original = getattr(conv, "original", None)
    root_name = type(original).__name__ if original is not None else type(gm).__name__
    class_name = _identifier(f"{root_name}MixedPrecision")
    warnings: list[str] = []

    # --- the graph, without export's guard call and with baked-in devices made relative -------
    graph = torch.fx.Graph()
    value_map: dict = {}
    out_value = graph.graph_copy(gm.graph, value_map)
    graph.output(out_value)
    nodes_by_name = {n.name: n for n in gm.graph.nodes}
    for node in list(graph.nodes):
        if node.op == "call_module" and _is_guard_module(gm, node):
            if node.users:
                raise EmitError("cannot emit model.py: the export guard function's result is used by the graph")
            graph.erase_node(node)
    leaf_paths: list[str] = []
    for node in graph.nodes:
        if node.op == "call_module" and node.target not in leaf_paths:
            leaf_paths.append(str(node.target))
    for path, sub in gm.named_modules():
        if isinstance(sub, torch.fx.GraphModule) and path:
            raise EmitError(f"cannot emit model.py: submodule {path!r} is a nested graph (control flow); capture without it")

    uses_device = False
    device_node = None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    capture_device = torch.device("cpu")
    for p in gm.parameters():
        capture_device = p.device
        break

    def relocate(value):
        nonlocal uses_device, device_node
        if isinstance(value, torch.device) and value.type == capture_device.type:
            uses_device = True
            if device_node is None:
                anchor = placeholders[-1] if placeholders else None
                ctx = graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(next(iter(graph.nodes)))
                with ctx:
                    device_node = graph.create_node("get_attr", "device", name="model_device")
            return device_node
        return value

    for node in list(graph.nodes):
        if node.op in ("call_function", "call_method", "call_module"):
            node.args = map_aggregate(node.args, relocate)
            node.kwargs = map_aggregate(node.kwargs, relocate)

    # --- signature, prologue, return ---------------------------------------------------------
    codegen = gm.graph._codegen
    pytree_info = getattr(codegen, "pytree_info", None)
    signature = None
    prologue: list[str] = []
    output = None  # set below for export graphs: how to return the model's output structure
    io_note = "The forward takes the same arguments as the original model's forward and returns the same structure."
    if pytree_info is not None and pytree_info.in_spec is not None:
        in_spec = pytree_info.in_spec
        children = _spec_children(in_spec)
        if in_spec.type is not tuple or len(children) != 2:
            raise EmitError("cannot emit model.py: unexpected input structure of the exported graph")
        args_spec, kwargs_spec = children
        arg_specs = _spec_children(args_spec)
        names = _signature_names(original, len(arg_specs))
        kw_specs = _spec_children(kwargs_spec)
        kw_names = list(kwargs_spec.context or [])
        paths: list[str] = []
        for name, spec in zip(names, arg_specs):
            _input_paths(spec, name, paths)
        for name, spec in zip(kw_names, kw_specs):
            _input_paths(spec, name, paths)
        if len(paths) != len(placeholders):
            raise EmitError(
                f"cannot emit model.py: the exported graph has {len(placeholders)} inputs but its input structure has {len(paths)} leaves"
            )
        params = ["self"] + names + [k for k in kw_names if k not in names]
        signature = ", ".join(params)
        for node, path in zip(placeholders, paths):
            node.target = node.name  # bound here or in the prologue, never as an argument
            if node.name != path:
                prologue.append(f"{node.name} = {path}")
        out_spec = pytree_info.out_spec

        def output(output_args, _spec=out_spec):
            flat = output_args if isinstance(output_args, (tuple, list)) else (output_args,)
            leaves = [repr(a) for a in flat]
            return "return " + _output_expr(_spec, leaves)

        io_note = (
            "Captured with torch.export: the forward takes the original argument names "
            f"({', '.join(params[1:])}); non-tensor inputs were fixed at capture time and are ignored. "
            "A ModelOutput-like result is returned as a dict with the same keys (out['logits'] works on both)."
        )
    graph._codegen = _EmitCodeGen(signature, prologue, output)
    python = graph.python_code(root_module="self")
    # drop FX's `torch.fx._symbolic_trace.wrap(...)` statements before the function
    body = python.src[python.src.index("def forward("):]
    body = _annotate_lines(body, nodes_by_name, (original, gm))
    used = {name: obj for name, obj in python.globals.items() if re.search(rf"\b{re.escape(name)}\b", body)}
    imports = _import_lines(used, warnings)

    # --- the structure: containers, leaf modules, parameters, buffers, constants -------------
    module_lines: list[str] = []
    for path, sub in gm.named_modules():
        if not path or _is_guard_path(gm, path) or _owner_of(path, leaf_paths):
            continue
        if path in leaf_paths:
            module_lines.append(f"        _set(self, {path!r}, {_leaf_constructor(path, sub)})")
        else:
            module_lines.append(f"        _set(self, {path!r}, nn.Module())")
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    param_rows: list[tuple[str, torch.Tensor, str]] = []
    tied: list[tuple[str, str, str]] = []  # (alias, name, kind)
    for name, param in gm.named_parameters(remove_duplicate=False):
        if _is_guard_path(gm, name.rsplit(".", 1)[0]):
            continue
        if id(param) in seen:
            tied.append((name, seen[id(param)], "parameter"))
            continue
        seen[id(param)] = name
        tensors[name] = param.detach().clone()
        if not _owner_of(name, leaf_paths):
            param_rows.append((name, param, f", {param.requires_grad}"))
    buffer_rows: list[tuple[str, torch.Tensor, str]] = []
    for mod_path, sub in gm.named_modules(remove_duplicate=False):
        for bname, buf in sub.named_buffers(recurse=False):
            name = f"{mod_path}.{bname}" if mod_path else bname
            if buf is None:
                continue
            if id(buf) in seen:
                tied.append((name, seen[id(buf)], "buffer" if bname not in sub._non_persistent_buffers_set else "buffer-nonpersistent"))
                continue
            seen[id(buf)] = name
            tensors[name] = buf.detach().clone()
            persistent = bname not in sub._non_persistent_buffers_set
            if not _owner_of(name, leaf_paths):
                buffer_rows.append((name, buf, f", {persistent}"))
    constant_rows: list[tuple[str, torch.Tensor, str]] = []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        target = str(node.target)
        if target in tensors or any(target == alias for alias, _, _ in tied):
            continue
        value = _resolve(gm, target)
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                tied.append((target, seen[id(value)], "constant"))
                continue
            seen[id(value)] = target
            tensors[target] = value.detach().clone()
            constant_rows.append((target, value, ""))
        else:
            raise EmitError(f"cannot emit model.py: get_attr {target!r} is a {type(value).__name__}, not a tensor")
    training = {path: sub.training for path, sub in gm.named_modules() if not _is_guard_path(gm, path)}
    root_training = gm.training
    modes = {p: t for p, t in training.items() if p and t != root_training and not _owner_of(p, leaf_paths)}
    param_dtypes = {k: v for k, v in (gm.meta.get(GM_PARAM_DTYPES) or {}).items()}

    summary = conv.report.line if getattr(conv, "report", None) is not None else ""
    source_note = f"from {model_file}" if model_file else f"from {root_name}"
    from converter._version import __version__

    lines = [
        f'"""{root_name} converted to mixed precision ({conv.precision}) by mpconvert {__version__}, {source_note}.',
        "",
        f"{summary}.",
        f"Captured with the {conv.tracer} tracer. Depends only on torch; load it with::",
        "",
        "    import model",
        "    m = model.load()               # or model.load(device=\"cuda\")",
        "",
        "Every cast is explicit (``x.to(torch.bfloat16)``); each op line ends with the precision it runs",
        "in, and a comment names the original module before each group of lines. Parameters stay in",
        "their original dtype and are cast in the graph (O1); PARAM_STORAGE_DTYPES (also in",
        "``model.meta['mp_param_dtypes']``) lists the dtype each may be stored in for O2 training.",
        "",
        io_note,
        f"Weights are read from {WEIGHTS_FILE} next to this file with torch.load(weights_only=True).",
        '"""',
        "import os",
        "",
        "import torch",
        "from torch import nn",
    ]
    extra_imports = [line for line in imports if line not in ("import torch",)]
    lines += extra_imports
    lines += [
        "",
        f"PRECISION = {conv.precision!r}",
        f"WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), {WEIGHTS_FILE!r})",
        "",
        "# name: (shape, dtype, requires_grad) — values come from the weights file",
        "PARAMETERS = {",
        *_tensor_table(param_rows),
        "}",
        "# name: (shape, dtype, persistent)",
        "BUFFERS = {",
        *_tensor_table(buffer_rows),
        "}",
        "# plain tensor attributes the graph reads: name: (shape, dtype)",
        "CONSTANTS = {",
        *_tensor_table(constant_rows),
        "}",
        "# tied tensors: alias -> (the name it shares its tensor with, kind)",
        "TIED = {",
        *[f"    {a!r}: ({b!r}, {k!r})," for a, b, k in tied],
        "}",
        "# the dtype each parameter may be stored in under O2 (used by converter.MixedPrecisionTrainer)",
        "PARAM_STORAGE_DTYPES = {",
        *[f"    {k!r}: {v}," for k, v in param_dtypes.items()],
        "}",
        "# train/eval mode of the converted model (modules that differ from the root are listed)",
        f"TRAINING = {root_training!r}",
        f"MODULE_TRAINING = {modes!r}",
        "",
        "",
        "def _set(root: nn.Module, name: str, value) -> None:",
        '    """Attach ``value`` at dotted ``name``, creating plain nn.Module containers on the way."""',
        "    *path, leaf = name.split(\".\")",
        "    owner = root",
        "    for part in path:",
        "        if not hasattr(owner, part):",
        "            owner.add_module(part, nn.Module())",
        "        owner = getattr(owner, part)",
        "    if isinstance(value, nn.Module):",
        "        owner.add_module(leaf, value)",
        "    elif isinstance(value, nn.Parameter):",
        "        owner.register_parameter(leaf, value)",
        "    else:",
        "        setattr(owner, leaf, value)",
        "",
        "",
        "def _get(root: nn.Module, name: str):",
        "    *path, leaf = name.split(\".\")",
        "    owner = root",
        "    for part in path:",
        "        owner = getattr(owner, part)",
        "    return getattr(owner, leaf)",
        "",
        "",
        f"class {class_name}(nn.Module):",
        f'    """The rewritten {root_name}: the graph of the conversion as plain PyTorch code."""',
        "",
        "    def __init__(self):",
        "        super().__init__()",
        *module_lines,
        "        for name, (shape, dtype, requires_grad) in PARAMETERS.items():",
        "            _set(self, name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=requires_grad))",
        "        for name, (shape, dtype, persistent) in BUFFERS.items():",
        "            *path, leaf = name.split(\".\")",
        "            owner = _get(self, \".\".join(path)) if path else self",
        "            owner.register_buffer(leaf, torch.empty(shape, dtype=dtype), persistent=persistent)",
        "        for name, (shape, dtype) in CONSTANTS.items():",
        "            _set(self, name, torch.empty(shape, dtype=dtype))",
        "        for alias, (name, kind) in TIED.items():",
        "            *path, leaf = alias.split(\".\")",
        "            owner = _get(self, \".\".join(path)) if path else self",
        "            value = _get(self, name)",
        "            if kind == \"parameter\":",
        "                owner.register_parameter(leaf, value)",
        "            elif kind.startswith(\"buffer\"):",
        "                owner.register_buffer(leaf, value, persistent=(kind == \"buffer\"))",
        "            else:",
        "                setattr(owner, leaf, value)",
        "        names = {n for n, _ in self.named_parameters()}",
        "        self.meta = {\"mp_param_dtypes\": {k: v for k, v in PARAM_STORAGE_DTYPES.items() if k in names}}",
    ]
    if uses_device:
        lines += [
            "",
            "    @property",
            "    def device(self) -> torch.device:",
            '        """Where the weights are; tensors the graph creates are made here."""',
            "        for tensor in self.parameters():",
            "            return tensor.device",
            "        for tensor in self.buffers():",
            "            return tensor.device",
            "        return torch.device(\"cpu\")",
        ]
    lines += ["", *["    " + l if l else "" for l in body.rstrip().splitlines()]]
    lines += [
        "",
        "",
        f"def load(device=\"cpu\") -> {class_name}:",
        '    """The rewritten model with its weights, in the train/eval mode it was converted in."""',
        f"    model = {class_name}()",
        "    state = torch.load(WEIGHTS, map_location=\"cpu\", weights_only=True)",
        "    expected = set(PARAMETERS) | set(BUFFERS) | set(CONSTANTS)",
        "    leaves = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}",
        "    missing = (expected | leaves) - set(state) - set(TIED)",
        "    if missing:",
        "        raise RuntimeError(f\"{WEIGHTS} lacks {sorted(missing)[:5]}: it does not belong to this model.py\")",
        "    with torch.no_grad():",
        "        for name, tensor in state.items():",
        "            _get(model, name).copy_(tensor)",
        "    model.train(TRAINING)",
        "    for name, mode in MODULE_TRAINING.items():",
        "        model.get_submodule(name).training = mode",
        "    return model.to(device)",
        "",
    ]
    code = "\n".join(lines)
    try:
        compile(code, "model.py", "exec")
    except SyntaxError as exc:  # a bug in this generator; never publish broken code
        raise EmitError(f"internal error: generated model.py does not compile ({exc.msg} at line {exc.lineno}); please report it") from exc
    return ModelSource(code=code, tensors=tensors, class_name=class_name, warnings=warnings)


def _is_guard_path(gm: torch.fx.GraphModule, path: str) -> bool:
    if not path:
        return False
    head = path.split(".")[0]
    sub = getattr(gm, head, None)
    return type(sub).__name__ == "GuardsFn"


def _resolve(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


# ---------------------------------------------------------------------------------------------
# train.py


def _input_spec(value: Any) -> Any:
    """A literal description of one example input, for synthetic data in train.py."""
    if isinstance(value, torch.Tensor):
        entry = {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}
        if value.numel() and not value.is_floating_point() and not value.is_complex():
            entry["low"] = int(value.min())
            entry["high"] = int(value.max())
        return {"tensor": entry}
    if isinstance(value, (tuple, list)):
        return {"list" if isinstance(value, list) else "tuple": [_input_spec(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": {str(k): _input_spec(v) for k, v in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    return {"value": None, "unsupported": type(value).__name__}


def render_train_py(conv, *, model_file: Optional[str] = None) -> str:
    """The source of train.py (see the module docstring)."""
    args, kwargs = conv.example_inputs
    spec = {"args": [_input_spec(a) for a in args], "kwargs": {k: _input_spec(v) for k, v in kwargs.items()}}
    package_root = str(Path(__file__).resolve().parent.parent.parent)
    model_file_abs = str(Path(model_file).resolve()) if model_file else None
    return _TRAIN_TEMPLATE.format(
        precision=conv.precision,
        model_file=repr(model_file_abs),
        spec=repr(spec),
        package_root=repr(package_root),
    )


_TRAIN_TEMPLATE = '''"""Train the mixed-precision model in this directory with converter.MixedPrecisionTrainer.

    python train.py --steps 10          # O1: fp32 parameters, casts in the graph
    python train.py --steps 10 --o2     # O2: half parameters with fp32 master weights

Data: the model file's ``train_batches()`` (each item an ``(inputs, batch)`` pair, ``inputs`` in the
form of ``example_inputs``) and ``loss_fn(output, batch)`` when it defines both; otherwise random
inputs shaped like the example inputs with loss = mean of squares of the outputs (a smoke test,
announced by a NOTICE line). Prints loss, loss scale and skipped steps after every step.
"""
import argparse
import importlib.util
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PRECISION = {precision!r}
#: the model file this directory was converted from (its loss_fn/train_batches are used)
MODEL_FILE = {model_file}
#: shapes and dtypes of the example inputs, for synthetic data
EXAMPLE_INPUTS = {spec}
#: where the mpconvert package was when this was generated (used only if it is not installed)
CONVERTER_FALLBACK = {package_root}


def _import(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    directory = os.path.dirname(path)
    sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(module)
    finally:
        if directory in sys.path:
            sys.path.remove(directory)
    return module


def _trainer_class():
    try:
        import converter
    except ImportError:
        sys.path.append(CONVERTER_FALLBACK)
        try:
            import converter
        except ImportError:
            sys.exit("train.py needs the mpconvert package (converter.MixedPrecisionTrainer): pip install mpconvert")
    return converter.MixedPrecisionTrainer


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {{k: _to(v, device) for k, v in value.items()}}
    return value


def _split(inputs):
    """example_inputs form -> (args, kwargs)."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {{}}
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)) and len(inputs) == 2 and isinstance(inputs[0], (tuple, list)) and isinstance(inputs[1], dict):
        return tuple(inputs[0]), dict(inputs[1])
    return tuple(inputs), {{}}


def _make(entry, gen):
    if "tensor" in entry:
        t = entry["tensor"]
        dtype = getattr(torch, t["dtype"])
        if dtype.is_floating_point:
            return torch.randn(t["shape"], generator=gen).to(dtype)
        if dtype == torch.bool:
            return torch.randint(0, 2, t["shape"], generator=gen).bool()
        return torch.randint(t.get("low", 0), t.get("high", 1) + 1, t["shape"], generator=gen, dtype=dtype)
    if "tuple" in entry:
        return tuple(_make(e, gen) for e in entry["tuple"])
    if "list" in entry:
        return [_make(e, gen) for e in entry["list"]]
    if "dict" in entry:
        return {{k: _make(e, gen) for k, e in entry["dict"].items()}}
    return entry["value"]


def synthetic_batches():
    gen = torch.Generator().manual_seed(0)
    while True:
        args = tuple(_make(e, gen) for e in EXAMPLE_INPUTS["args"])
        kwargs = {{k: _make(e, gen) for k, e in EXAMPLE_INPUTS["kwargs"].items()}}
        yield (args, kwargs), None


def _float_tensors(value):
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _float_tensors(v)]
    return []


def synthetic_loss(output, batch):
    """Mean of squares of every floating output, in fp32: a smoke-test objective."""
    tensors = [t for t in _float_tensors(output) if t.requires_grad]
    if not tensors:
        sys.exit("train.py: the model returns no floating-point tensor that depends on its parameters; nothing to train")
    return sum(t.float().pow(2).mean() for t in tensors)


def data_source():
    """(batches, loss_fn, description)."""
    if MODEL_FILE and os.path.isfile(MODEL_FILE):
        user = _import("_mpconvert_train_model_file", MODEL_FILE)
        missing = [n for n in ("loss_fn", "train_batches") if not callable(getattr(user, n, None))]
        if not missing:
            return iter(user.train_batches()), user.loss_fn, f"train_batches()/loss_fn from {{MODEL_FILE}}"
        why = f"{{os.path.basename(MODEL_FILE)}} defines no {{' or '.join(missing)}}"
    elif MODEL_FILE:
        why = f"the model file {{MODEL_FILE}} no longer exists"
    else:
        why = "no model file was recorded"
    print(
        f"NOTICE: {{why}}; training on SYNTHETIC random inputs shaped like the example inputs, "
        "loss = mean of squares of the outputs. Define loss_fn(output, batch) and train_batches() "
        "in the model file to train on real data.",
        flush=True,
    )
    return synthetic_batches(), synthetic_loss, "synthetic data"


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train the mixed-precision model in " + HERE)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--o2", action="store_true", help="store parameters in half with fp32 master weights (O2)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--max-grad-norm", type=float, default=None, help="clip gradients to this norm")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    Trainer = _trainer_class()
    emitted = _import("_mpconvert_emitted_model", os.path.join(HERE, "model.py"))
    model = emitted.load(device=args.device)
    model.train()
    batches, loss_fn, described = data_source()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    trainer = Trainer(model, optimizer, precision=PRECISION, master_weights=args.o2, max_grad_norm=args.max_grad_norm)
    print(f"training {{type(model).__name__}} in {{PRECISION}} ({{'O2' if args.o2 else 'O1'}}) on {{args.device}} with {{described}}", flush=True)
    for step in range(1, args.steps + 1):
        inputs, batch = next(batches)
        call_args, call_kwargs = _split(_to(inputs, args.device))
        trainer.zero_grad()
        output = model(*call_args, **call_kwargs)
        loss = loss_fn(output, _to(batch, args.device))
        trainer.backward(loss)
        stepped = trainer.step()
        stats = trainer.stats
        note = "" if stepped else "  (step skipped: inf/NaN gradients)"
        print(f"step {{step:4d}}  loss {{stats.loss:.6f}}  scale {{stats.scale:g}}  skipped {{stats.skipped}}{{note}}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


# ---------------------------------------------------------------------------------------------
# verification


def _import_file(path: Path) -> Any:
    name = f"_mpconvert_emitted_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat_tensors(v)]
    if hasattr(value, "to_tuple") and callable(value.to_tuple):  # ModelOutput
        return [t for v in value.to_tuple() for t in _flat_tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat_tensors(v)]
    return []


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _run_restoring(module: nn.Module, args: tuple, kwargs: dict, seed: int) -> Any:
    """Run ``module`` without leaving a trace on its buffers, with a fixed RNG seed."""
    saved = {name: buf.detach().clone() for name, buf in module.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed)
            return module(*args, **kwargs)
    finally:
        with torch.no_grad():
            for name, buf in module.named_buffers():
                if name in saved:
                    buf.copy_(saved[name])


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref = ref.detach().double().cpu()
    err = (ref - out.detach().double().cpu()).norm()
    if err == 0:
        return math.inf
    return float(20 * torch.log10(ref.norm() / err))


def verify_emitted(conv, out_dir: Path, *, device: str = "cpu") -> str:
    """Load ``out_dir/model.py`` in-process and compare it with ``conv.module`` on the example inputs.

    On CPU the outputs must be bit-identical. On CUDA the model is moved there and its outputs must
    be finite, with the CPU model's shapes and dtypes and an SQNR of at least 30 dB against it.
    Returns a one-line description of the check.
    """
    args, kwargs = conv.example_inputs
    emitted = _import_file(out_dir / "model.py")
    ref = _flat_tensors(_run_restoring(conv.module, args, kwargs, seed=0))
    if device == "cpu":
        got = _flat_tensors(_run_restoring(emitted.load(device="cpu"), args, kwargs, seed=0))
        if len(got) != len(ref):
            raise VerificationError(f"emitted model.py returns {len(got)} tensors, the converted model {len(ref)}; please report this bug")
        for i, (a, b) in enumerate(zip(ref, got)):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("nan")
                raise VerificationError(
                    f"emitted model.py differs from the converted model on output {i} (max |diff| {diff:g}); please report this bug"
                )
        return f"model.py reproduces the converted model bit-exactly on CPU ({len(ref)} output tensors)"
    dev = torch.device(device)
    model = emitted.load(device=dev)
    got = _flat_tensors(_run_restoring(model, _to_device(args, dev), _to_device(kwargs, dev), seed=0))
    if len(got) != len(ref):
        raise VerificationError(f"on {device}, model.py returns {len(got)} tensors instead of {len(ref)}")
    worst = math.inf
    for i, (a, b) in enumerate(zip(ref, got)):
        if b.device.type != dev.type or a.shape != b.shape or a.dtype != b.dtype:
            raise VerificationError(f"on {device}, output {i} has {b.device}/{tuple(b.shape)}/{b.dtype}, expected {tuple(a.shape)}/{a.dtype}")
        if b.is_floating_point():
            if not torch.isfinite(b).all():
                raise VerificationError(f"on {device}, output {i} has inf/NaN values")
            worst = min(worst, _sqnr(a, b))
    if worst < 30.0:
        raise VerificationError(f"on {device}, outputs differ from the CPU result: SQNR {worst:.1f} dB < 30 dB")
    return f"model.py runs on {device}; outputs match the CPU result (SQNR {worst:.1f} dB)"


# ---------------------------------------------------------------------------------------------
# writing


def _pause() -> None:
    delay = os.environ.get(DELAY_ENV)
    if delay:
        time.sleep(float(delay))


@contextlib.contextmanager
def _uninterruptible():
    """Hold off SIGINT while cleaning up or swapping directories (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    _pause()


def _write_reports(report, directory: Path) -> list[str]:
    """report.json/.md/.html through converter.render when it exists; report.json at least."""
    try:
        from converter.report.render import write_reports
    except ModuleNotFoundError as exc:
        if exc.name not in ("converter.render", f"{__package__}.render"):
            raise
        write_reports = None
    if write_reports is not None:
        write_reports(report, directory)
        _pause()
        return []
    _write_text(directory / "report.json", report.to_json())
    return ["converter.render is not available: wrote report.json only (no report.md/report.html)"]


def check_output_dir(out_dir: Path, *, force: bool) -> None:
    """Raise :class:`OutputExistsError` when ``out_dir`` exists and ``force`` is false."""
    if out_dir.exists() and not force:
        raise OutputExistsError(f"output directory {out_dir} already exists; pass --force to replace it or choose another --out")
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputExistsError(f"{out_dir} exists and is not a directory; choose another --out")


def emit(
    conv,
    out_dir: Path,
    *,
    force: bool = False,
    model_file: Optional[str] = None,
    device: str = "cpu",
    verify: bool = True,
    extra: Optional[Callable[[Path], Any]] = None,
    messages: Optional[list] = None,
) -> Path:
    """Write model.py, weights.pt, train.py and the reports into ``out_dir`` atomically.

    ``model_file``: the model file the conversion came from (train.py imports its ``loss_fn`` and
    ``train_batches``). ``device``: where the emitted model is checked (``cuda`` needs CUDA).
    ``verify``: check that model.py reproduces ``conv.module`` before publishing. ``extra``: called
    with the temporary directory before it is published (the CLI exports ONNX there), so its files
    are part of the atomic output. ``messages``: a list that receives warnings and check results.
    Returns the output directory.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, force=force)
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise EmitError(f"unknown device {device!r}; use cpu or cuda")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise EmitError("--device cuda was given but CUDA is not available on this machine; use --device cpu")
    notes = messages if messages is not None else []
    source = generate_model_source(conv, model_file=model_file)
    notes.extend(source.warnings)
    train_py = render_train_py(conv, model_file=model_file)


    def fill(tmp: Path) -> None:
        _write_text(tmp / "model.py", source.code)
        torch.save(source.tensors, tmp / WEIGHTS_FILE)
        _pause()
        _write_text(tmp / "train.py", train_py)
        notes.extend(_write_reports(conv.report, tmp))
        if verify:
            notes.append(verify_emitted(conv, tmp, device="cpu"))
            if str(device).startswith("cuda"):
                notes.append(verify_emitted(conv, tmp, device=device))
        if extra is not None:
            extra(tmp)

    return publish_directory(out_dir, fill, force=force)


def emit_reports(report, out_dir: Path, *, force: bool = False, messages: Optional[list] = None) -> Path:
    """Write report.json/.md/.html (the audit) into ``out_dir`` atomically, like :func:`emit`."""
    out_dir = Path(out_dir)
    check_output_dir(out_dir, force=force)
    notes = messages if messages is not None else []
    return publish_directory(out_dir, lambda tmp: notes.extend(_write_reports(report, tmp)), force=force)


def publish_directory(out_dir: Path, fill: Callable[[Path], Any], *, force: bool = False) -> Path:
    """Create a temporary sibling of ``out_dir``, let ``fill`` write into it, then rename it into place.

    Any exception (``KeyboardInterrupt`` included) removes the temporary directory, restores a
    replaced directory, and removes parent directories this call created.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir, force=force)
    parent = out_dir.absolute().parent
    created: list[Path] = []
    probe = parent
    while not probe.exists():
        created.append(probe)
        probe = probe.parent
    tmp = parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    old: Optional[Path] = None
    published = False
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        fill(tmp)
        with _uninterruptible():
            if out_dir.exists():
                old = parent / f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            published = True
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        with _uninterruptible():
            shutil.rmtree(tmp, ignore_errors=True)
            if old is not None and not published and old.exists() and not out_dir.exists():
                os.replace(old, out_dir)
            for directory in created:
                with contextlib.suppress(OSError):
                    directory.rmdir()
        raise
    return out_dir
