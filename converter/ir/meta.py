"""Records that the stages leave on ``node.meta``; the only way stages talk to each other.

Keys (all values are frozen dataclasses):

* ``node.meta["mp_info"]`` — :class:`NodeInfo`, written by *capture*: canonical op name, module
  path and class, source location, the node's kind and the tensors it produces.
* ``node.meta["mp"]`` — :class:`Decision`, written by *decide* and refined by *place* (and by
  *calibrate*): the precision the node runs in, the rule that decided it and why.
* ``node.meta["mp_cast"]`` — :class:`CastRecord`, on every cast node that *rewrite* inserted.

The report, the emitted artifacts and the ONNX check read these records and nothing else.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "HALF_NAMES",
    "NodeInfo",
    "TensorSpec",
    "RuleRef",
    "Match",
    "Decision",
    "CastRecord",
    "GraphMeta",
    "BUILTIN",
    "dtype_of",
    "name_of",
    "itemsize",
]

#: precision name -> torch dtype, for the floating dtypes this tool converts between
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: torch dtype -> precision name (fp64 is listed so that reports can name it; it is never converted)
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
HALF_NAMES = ("fp16", "bf16")


def dtype_of(name: str) -> torch.dtype:
    return DTYPES[name]


def name_of(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor a node produces (from shape propagation)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @property
    def is_convertible(self) -> bool:
        """fp32/fp16/bf16 tensors may be cast; fp64, integer and bool tensors never are."""
        return self.dtype in DTYPE_NAMES and self.dtype != torch.float64


@dataclass(frozen=True)
class NodeInfo:
    """What capture learned about a node, independent of which tracer produced it.

    ``kind`` is one of:

    * ``"compute"`` — produces convertible floating tensors and runs in a precision we choose;
    * ``"fixed"`` — produces floating tensors whose dtype the model's own code fixes (an explicit
      cast, an op with a ``dtype=`` argument, a factory op with no floating input): respected as is;
    * ``"alias"`` — ``getitem`` out of a tuple-producing node; it has its producer's precision;
    * ``"passive"`` — produces no convertible tensor (shapes, ints, bools, fp64, asserts): untouched.
    """

    op: str
    module: str = ""
    module_type: str = ""
    module_stack: tuple[tuple[str, str], ...] = ()  # (path, class name), outermost first
    source: str = ""
    kind: str = "passive"
    outputs: tuple[TensorSpec, ...] = ()
    fixed_dtype: Optional[torch.dtype] = None  # for kind == "fixed"
    inplace: bool = False
    why: str = ""  # why the kind was chosen when it is not "compute"

    @property
    def out_numel(self) -> int:
        return sum(t.numel for t in self.outputs)

    @property
    def out_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)


@dataclass(frozen=True)
class RuleRef:
    """Where a decision came from: a rule file, its table and the pattern that matched."""

    file: str
    table: str  # "node" | "module" | "module_type" | "op" | "default" | "builtin" | "placement" | "calibration"
    pattern: str = ""

    def __str__(self) -> str:
        if self.table in ("default", "builtin", "placement", "calibration") and not self.pattern:
            return f"{self.file}:[{self.table}]"
        return f"{self.file}:[{self.table}].{self.pattern}"


BUILTIN = "<builtin>"


@dataclass(frozen=True)
class Match:
    """One rule that matched a node, kept for ``explain``; ``level`` is its precedence rank."""

    rule: RuleRef
    precision: str
    level: int
    level_name: str
    scope: str = ""  # the module path the rule matched through, for module rules
    reason: str = ""


@dataclass(frozen=True)
class Decision:
    """The precision of one node and its provenance.

    ``precision`` is a concrete dtype name (``fp32``/``fp16``/``bf16``) once placement ran; before,
    it may still be ``follow`` or ``promote``. ``requested`` is what the winning rule said
    (e.g. ``half``). ``matches`` lists every rule that matched, winner first.
    """

    precision: str
    requested: str
    rule: RuleRef
    reason: str
    matches: tuple[Match, ...] = ()
    unmatched: bool = False

    def replace(self, **changes) -> "Decision":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class CastRecord:
    """An inserted cast: which producer it converts, to what, and which rule made it necessary."""

    src: str
    dtype: str
    src_dtype: str
    numel: int
    consumers: tuple[str, ...]
    rule: RuleRef
    reason: str
    on_weight: bool = False  # the producer is a parameter/buffer (O1 weight cast), not an activation
    inserted: bool = True  # False for a cast the model's own code performs

    @property
    def bytes(self) -> int:
        """Bytes read plus bytes written per forward."""
        return self.numel * (itemsize(DTYPES[self.dtype]) + itemsize(DTYPES[self.src_dtype]))


@dataclass(frozen=True)
class GraphMeta:
    """Graph-level facts written by capture and rewrite (``gm.meta["mp_graph"]``)."""

    tracer: str
    precision: str
    capture_errors: tuple[str, ...] = ()
    rule_files: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)
