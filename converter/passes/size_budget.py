"""Stop a dynamic torch.export whose size expressions blow up, so that capture can fall back early.

With every input dim dynamic, torch.export describes each intermediate size as a sympy expression
of the input sizes and reasons about it on every op. For most models these stay tiny (at most 4
operations in every model of the zoo: ``s0``, ``(s1//10) - 1``). Window attention over a dynamic
image size is different: Swin pads the feature map to a multiple of the window
(``(w - s % w) % w``), splits it into windows and merges them back, and its reshapes produce
expressions of 270-400 operations; simplifying them takes the fake-tensor ``view`` 2-13 s each,
and the export 120-250 s on a 2-core CPU (``tests/zoo_models.py`` "swin", 32x32 images). The result
is not even more dynamic: Swin's ``if min(input_resolution) <= window_size`` then fixes the image
size to at most the example's.

:class:`SizeBudget` (a ``TorchFunctionMode``, active only around ``torch.export.export``) looks at
the sizes of every op's tensor outputs and raises :class:`SizesTooComplex` once one takes more than
``max_ops`` sympy operations; Swin reaches that about 4 s into its export. Capture then exports
with only the batch dims dynamic (0.8 s for that Swin) and says so in ``shapes_note``.
"""
from __future__ import annotations

from typing import Any, Optional

import sympy
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from converter.ir.errors import EXIT_INTERNAL, MpconvertError

__all__ = ["SizeBudget", "SizesTooComplex", "MAX_SIZE_OPS"]

#: sympy operations one size expression may take (the zoo's models stay at 4 or less; Swin reaches 271)
MAX_SIZE_OPS = 32


class SizesTooComplex(MpconvertError, RuntimeError):
    """A size expression grew past the budget; ``op`` names the call that produced it. Capture
    catches it (and exports with dynamic batch dims instead): it never reaches the user."""

    exit_code = EXIT_INTERNAL

    def __init__(self, op: str, ops: int, max_ops: int):
        self.op = op
        self.ops = ops
        super().__init__(f"the output size of `{op}` is a {ops}-operation expression of the input sizes "
                         f"(more than {max_ops}): torch.export's reasoning over such sizes takes minutes")


class SizeBudget(TorchFunctionMode):
    """Raise :class:`SizesTooComplex` when an op's output size exceeds ``max_ops`` sympy operations."""

    def __init__(self, max_ops: Optional[int] = None):
        super().__init__()
        self.max_ops = MAX_SIZE_OPS if max_ops is None else max_ops
        self._seen: dict[sympy.Expr, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._check(func, leaf.shape)
        return out

    def _check(self, func: Any, shape: torch.Size) -> None:
        for size in shape:
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            ops = self._seen.get(expr)
            if ops is None:
                ops = self._seen[expr] = int(sympy.count_ops(expr))
            if ops > self.max_ops:
                raise SizesTooComplex(getattr(func, "__name__", str(func)), ops, self.max_ops)
