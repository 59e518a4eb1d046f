"""Leaf modules of model.py: the ``torch.nn`` modules the graph still calls, re-created from their repr.

A leaf (``BatchNorm2d``, ``ReLU``, ``MaxPool2d``, ``Dropout`` …) is written into model.py's
``__init__`` as one ``nn.Name(literal, key=literal, ...)`` call, checked before it is written: the
call is parsed (nothing but literals can run), evaluated, and the module it builds must have the
same plain attributes and the same parameters and buffers as the model's. A leaf that cannot be
re-created exactly is an :class:`~converter.export.errors.EmitError` naming it.
"""
from __future__ import annotations

import ast
import math
from typing import Any

import torch
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from converter.export.errors import EmitError

__all__ = ["leaf_constructor"]



_LEAF_NAMESPACE = {"nn": nn, "torch": torch, "inf": math.inf, "nan": math.nan}
_LEAF_HINT = "capture with --tracer export (it traces into every module), or make the module traceable"


def leaf_constructor(path: str, module: nn.Module) -> str:
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
