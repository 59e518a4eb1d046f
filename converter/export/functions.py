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
import importlib.util
import inspect
import symtable
import sys
import textwrap
import types
from typing import Optional

from converter.export.errors import EmitError

__all__ = ["function_lines"]

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
    lines = ["", "", "# custom autograd Functions the graph calls: forward and backward are the model's own"]
    for cls in classes:
        lines += _class_lines(cls, warnings)
    return lines + [""]


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _class_lines(cls: type, warnings: list[str]) -> list[str]:
    source, why = _own_source(cls)
    if source is not None:
        imports, missing = _imports_for(source, cls)
        if not missing:
            return ["", *imports, "", source]
        why = f"its code reads {', '.join(sorted(missing))} from its module"
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


def _own_source(cls: type) -> tuple[Optional[str], str]:
    """(the class's code, parsed and written back; None if there is none to take, and why)."""
    if "<locals>" in cls.__qualname__:
        return None, "it is defined inside a function"
    try:
        text = textwrap.dedent(inspect.getsource(cls))
        tree = ast.parse(text)
    except (OSError, TypeError, SyntaxError):
        return None, "its source is not available"
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.ClassDef) or tree.body[0].name != cls.__name__:
        return None, "its source is not one class definition"
    for method in vars(cls).values():
        code = getattr(getattr(method, "__func__", method), "__code__", None)
        if code is not None and set(code.co_freevars) - {"__class__"}:
            return None, "its methods read variables of an enclosing function"
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


def _imports_for(source: str, cls: type) -> tuple[list[str], set[str]]:
    """(import lines for the names the class reads, the names that cannot be imported by name)."""
    namespace = _module_namespace(cls)
    lines: list[str] = []
    missing: set[str] = set()
    for name in sorted(_global_names(source) - {cls.__name__}):
        if name not in namespace and hasattr(builtins, name):
            continue
        value = namespace.get(name, _MISSING)
        line = _import_of(name, value)
        if line is None:
            missing.add(name)
        elif line:
            lines.append(line)
    return lines, missing


_MISSING = object()


def _module_namespace(cls: type) -> dict:
    for method in vars(cls).values():
        func = getattr(method, "__func__", method)
        if isinstance(func, types.FunctionType):
            return func.__globals__
    module = sys.modules.get(cls.__module__)
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
