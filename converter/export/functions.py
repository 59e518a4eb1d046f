"""The custom autograd Functions a graph calls, carried into model.py with their backward.

A graph keeps a user's ``torch.autograd.Function`` as one call (:mod:`converter.passes.autograd_fns`);
model.py must run the same ``forward`` *and* ``backward``, so it carries the class:

1. **Its source**, when the class is self-contained: every name its code reads is a builtin, a module
   (``torch``, ``torch.nn.functional as F``, ``math``) or a torch object, each imported by name. The
   class is parsed and written back with ``ast.unparse`` (its code, not its file's other text).
2. **An import of its module**, when the class reads other names of its module (a helper function, a
   constant) and the module is importable by name: ``from mymodels.layers import GradReverse``,
   which fails with one line naming the Function and the module; model.py is then not standalone
   PyTorch and a warning says so.
3. Otherwise (a class of ``__main__`` or of a model file that reads other names of its file, or one
   defined inside a function): :class:`~converter.export.errors.EmitError` naming the Function.
   model.py is never written with the Function's forward alone.
"""
from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import inspect
import re
import symtable
import sys
import textwrap
import types
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from converter.export.errors import EmitError
from converter.fp8 import kernels as fp8_kernels
from converter.kernels import upcast as upcast_kernels

__all__ = ["function_lines", "fp8_kernel_lines", "upcast_kernel_lines", "kernel_lines"]

#: names model.py's template imports itself (``import math``, ``import torch``, ``from torch import nn``...)
_TEMPLATE_MODULES = {"json": "json", "math": "math", "os": "os", "torch": "torch", "nn": "torch.nn"}


def function_lines(classes: list[type], warnings: list[str]) -> list[str]:
    """Source lines that define (or import) each Function class in ``classes`` under its own name."""
    by_name: dict[str, type] = {}
    for cls in classes:
        other = by_name.setdefault(cls.__name__, cls)
        if other is not cls:
            raise EmitError(f"cannot emit model.py: two custom autograd Functions are named {cls.__name__!r} "
                            f"({_qualified(other)} and {_qualified(cls)}); rename one")
    carried = _Carried()
    lines: list[str] = []
    for cls in classes:
        plan = _Carried()
        why = _carry(cls, plan, ())
        if why is None:
            carried.merge(plan)
            continue
        lines += _import_or_refuse(cls, why, warnings)
    taken = sorted(name for name, _, _ in carried.blocks if name in _template_names())
    if taken:
        raise EmitError(f"cannot emit model.py: the custom autograd Functions' code defines {taken[0]!r}, a name model.py "
                        "itself defines; rename it in the model's code")
    head = ["", "", "# custom autograd Functions the graph calls: forward and backward are the model's own"]
    return head + carried.imports + [""] + [block for _, _, code in carried.blocks for block in ("", code)] + lines + [""]


def fp8_kernel_lines() -> list[str]:
    """converter/fp8/kernels.py for model.py (:func:`kernel_lines`): the fp8_linear calls."""
    return kernel_lines(fp8_kernels, "mpconvert's FP8 GEMMs, torch only): the fp8_linear calls below")


def upcast_kernel_lines() -> list[str]:
    """converter/kernels/upcast.py for model.py (:func:`kernel_lines`): the CPU lowering's upcast GEMM calls."""
    return kernel_lines(upcast_kernels, "half GEMMs and attention in fp32 arithmetic, torch only): the upcast_/dispatch_ calls below")


def kernel_lines(module, what: str) -> list[str]:
    """A torch-only kernels module's source for model.py, verbatim but for two statements: its ``from __future__``
    import (legal only at the top of a file; the code runs the same without it) and its ``__all__`` (model.py's
    names are its own). Such a module imports only torch and the standard library (its tests check)."""
    text = Path(module.__file__).read_text(encoding="utf-8")
    drop: set[int] = set()
    for stmt in ast.parse(text).body:
        future = isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__"
        exported = isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets)
        if future or exported:
            drop.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    kept = [line for number, line in enumerate(text.splitlines(), 1) if number not in drop]
    taken = sorted(_template_names() & _top_level_names("\n".join(kept)))
    path = "converter/" + "/".join(module.__name__.split(".")[1:]) + ".py"
    if taken:
        raise EmitError(f"internal error: {path} defines {taken[0]!r}, a name model.py itself defines; please report it")
    return ["", "", f"# ---- {path} ({what} ----", *kept, f"# ---- end of {path} ----", ""]


def _top_level_names(source: str) -> set[str]:
    names: set[str] = set()
    for stmt in ast.parse(source).body:
        if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
    return names


@functools.lru_cache(maxsize=1)
def _template_names() -> frozenset[str]:
    """The top-level names model.py's template defines (a carried definition must not replace one)."""
    text = resources.files("converter.export").joinpath("templates").joinpath("model.py.tmpl").read_text(encoding="utf-8")
    found = re.findall(r"^(?:def|class)\s+(\w+)|^(\w+)\s*=", text, flags=re.M)
    return frozenset(name for pair in found for name in pair if name) | frozenset(_TEMPLATE_MODULES)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class _Carried:
    """What model.py defines for the Functions: import lines and (name, object, code) blocks in order."""

    def __init__(self) -> None:
        self.imports: list[str] = []
        self.blocks: list[tuple[str, Any, str]] = []  # (name, a Function class or a function, its code)

    def has(self, obj: object) -> bool:
        return any(o is obj for _, o, _ in self.blocks)

    def merge(self, other: "_Carried") -> None:
        self.imports += [line for line in other.imports if line not in self.imports]
        for name, obj, code in other.blocks:
            clash = next((o for n, o, _ in self.blocks if n == name and o is not obj), None)
            if clash is not None:
                raise EmitError(f"cannot emit model.py: two definitions named {name!r} ({_qualified(clash)} and "
                                f"{_qualified(obj)}) would both go into model.py for custom autograd Functions; rename one")
            if not self.has(obj):
                self.blocks.append((name, obj, code))


def _carry(obj: Any, plan: _Carried, stack: tuple) -> Optional[str]:
    """Add ``obj``'s code (a Function class, or a function of its module that it calls) and what it
    reads to ``plan``, dependencies first; None when it can be carried, else why not."""
    source, why = _own_source(obj)
    if source is None:
        return why
    namespace = _module_namespace(obj)
    for name in sorted(_global_names(source) - {obj.__name__}):
        if name not in namespace and hasattr(builtins, name):
            continue
        value = namespace.get(name, _MISSING)
        line = _import_of(name, value)
        if line is not None:
            if line and line not in plan.imports:
                plan.imports.append(line)
            continue
        if _is_own_helper(value, obj, name) and value not in stack:
            if plan.has(value):
                continue
            inner = _carry(value, plan, stack + (obj,))
            if inner is None:
                continue
            return f"its code calls {name}, which cannot be carried ({inner})"
        if value in stack:
            continue  # mutual reference: defined by the time it is called
        return f"its code reads {name} from its module"
    plan.blocks.append((obj.__name__, obj, source))
    return None


def _is_own_helper(value: object, owner: object, name: str) -> bool:
    """A top-level function or autograd Function class of ``owner``'s own module, bound under its own name."""
    from torch.autograd import Function

    if not (isinstance(value, types.FunctionType) or (isinstance(value, type) and issubclass(value, Function))):
        return False
    return getattr(value, "__module__", None) == getattr(owner, "__module__", None) and value.__qualname__ == name


def _import_or_refuse(cls: type, why: str, warnings: list[str]) -> list[str]:
    module = cls.__module__
    if _importable(cls):
        warnings.append(f"model.py imports the custom autograd Function {cls.__qualname__} from {module} ({why}): "
                        "model.py needs that module (it is not standalone PyTorch)")
        message = (f"model.py calls the custom autograd Function {cls.__qualname__} (forward and backward), "
                   f"which the module {module!r} defines: make it importable")
        return ["", "try:", f"    from {module} import {cls.__qualname__}",
                "except ImportError as exc:", f"    raise ImportError({message!r}) from exc"]
    raise EmitError(
        f"cannot emit model.py: the graph calls the custom autograd Function {_qualified(cls)}, whose backward "
        f"model.py must carry, but {why} and {module!r} cannot be imported by name; define the Function at the top "
        "level of an importable module, or make its code use only torch")


def _own_source(obj: Any) -> tuple[Optional[str], str]:
    """(the code of class or function ``obj``, parsed and written back without annotations on
    function arguments; None if there is none to take, and why)."""
    if "<locals>" in obj.__qualname__:
        return None, "it is defined inside a function"
    try:
        text = textwrap.dedent(inspect.getsource(obj))
        tree = ast.parse(text)
    except (OSError, TypeError, SyntaxError):
        return None, "its source is not available"
    kind = ast.ClassDef if isinstance(obj, type) else (ast.FunctionDef, ast.AsyncFunctionDef)
    if len(tree.body) != 1 or not isinstance(tree.body[0], kind) or tree.body[0].name != obj.__name__:
        return None, "its source is not one definition"
    functions = list(vars(obj).values()) if isinstance(obj, type) else [obj]
    for method in functions:
        code = getattr(getattr(method, "__func__", method), "__code__", None)
        if code is not None and set(code.co_freevars) - {"__class__"}:
            return None, "its code reads variables of an enclosing function"
    for node in ast.walk(tree):  # annotations are not run (and may name typing helpers model.py lacks)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg):
                if arg is not None:
                    arg.annotation = None
    return ast.unparse(tree), ""


def _global_names(source: str) -> set[str]:
    """The names ``source`` reads that it does not define (its module's globals or builtins)."""
    names: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            if not sym.is_referenced():
                continue
            if table.get_type() == "module" and not sym.is_assigned() and not sym.is_imported():
                names.add(sym.get_name())
            elif table.get_type() != "module" and (sym.is_global() or sym.is_declared_global()):
                names.add(sym.get_name())
        for child in table.get_children():
            walk(child)

    walk(symtable.symtable(source, "<function>", "exec"))
    return names


_MISSING = object()


def _module_namespace(obj: object) -> dict:
    """The globals ``obj``'s code reads (its module's)."""
    if isinstance(obj, types.FunctionType):
        return obj.__globals__
    for method in vars(obj).values():
        func = getattr(method, "__func__", method)
        if isinstance(func, types.FunctionType):
            return func.__globals__
    module = sys.modules.get(obj.__module__)
    return vars(module) if module is not None else {}


def _is_torch_or_stdlib(module: str) -> bool:
    top = module.split(".")[0]
    return top == "torch" or top in sys.stdlib_module_names


def _import_of(name: str, value: object) -> Optional[str]:
    """The line that binds ``name`` to ``value`` in model.py ("" when the template does), or None."""
    if isinstance(value, types.ModuleType):
        if _TEMPLATE_MODULES.get(name) == value.__name__:
            return ""
        if not _is_torch_or_stdlib(value.__name__):
            return None
        return f"import {value.__name__}" if name == value.__name__ else f"import {value.__name__} as {name}"
    module = getattr(value, "__module__", None)
    qual = getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qual, str) or not qual.isidentifier() or not _is_torch_or_stdlib(module):
        return None
    module = {"_operator": "operator", "_functools": "functools"}.get(module, module)
    try:
        found = _resolve(importlib.import_module(module), qual)
    except (ImportError, AttributeError):
        return None
    if found is not value:
        return None
    return f"from {module} import {qual}" + (f" as {name}" if name != qual else "")


def _resolve(module: types.ModuleType, qual: str) -> object:
    value: object = module
    for part in qual.split("."):
        value = getattr(value, part)
    return value


def _importable(cls: type) -> bool:
    module = cls.__module__
    if module == "__main__" or module.startswith("_mpconvert_model_") or not cls.__qualname__.isidentifier():
        return False
    if not all(part.isidentifier() for part in module.split(".")):
        return False
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return False
    except (ImportError, ValueError):
        return False
    imported = sys.modules.get(module)
    return imported is not None and getattr(imported, cls.__qualname__, None) is cls
