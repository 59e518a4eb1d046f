"""Records that the stages leave on ``node.meta`` and ``gm.meta``; the only way stages talk to each other.

Every key a stage reads or writes is declared once, here, as a named constant (``META_*`` on
nodes, ``GM_*`` on the GraphModule) and described in :data:`CONTRACT` with its type, the stage
that writes it and the stages that read it; ``tests/test_ir_contract.py`` fails on any other key.
The main ones:

* ``node.meta[META_INFO]`` — :class:`NodeInfo`, written by *capture*: canonical op name, module
  path and class, source location, the node's kind and the tensors it produces.
* ``node.meta[META_DECISION]`` — :class:`Decision`, written by *decide*; *lower* and *place*
  amend it and say why in :attr:`Decision.notes`; *calibrate* (and the accuracy search through
  it) replaces it with a new rule and reason, keeping the old rule in ``matches``.
* ``node.meta[META_CAST]`` — :class:`CastRecord`, on every cast node that *rewrite* inserted.
* ``node.meta[META_MATH]`` — :class:`MathRecord`, written by *fp32_math*: the math an fp32
  matmul/conv node runs with, and on the scope calls that pass inserted.

The report, the emitted artifacts and the ONNX check read these records and nothing else.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Literal, Mapping, Optional, get_args

import torch

from converter.ir.notes import NOTE_LABELS, NoteStage, note_text
from converter.vocab import HALF_PRECISIONS, FloatPrecision, Fp32Math
from converter.vocab import HalfPrecision as _HalfPrecision
from converter.vocab import Precision as _Target

__all__ = [
    "Precision",
    "HalfPrecision",
    "TargetPrecision",
    "DecisionPrecision",
    "RequestedPrecision",
    "FP32Math",
    "NodeKind",
    "RuleTable",
    "NoteStage",
    "NODE_KINDS",
    "NOTE_LABELS",
    "note_text",
    "META_INFO",
    "META_DECISION",
    "META_CAST",
    "META_VALUE",
    "META_STATS",
    "META_LOWERED",
    "META_SOURCE",
    "META_TRAINER",
    "META_MATH",
    "META_REGION",
    "META_MODE_FLAG",
    "META_CHECKPOINT",
    "META_INTENT",
    "GM_GRAPH",
    "GM_PARAM_DTYPES",
    "GM_PARAM_STORAGE",
    "GM_CALIBRATION",
    "GM_READ_CASTS",
    "TORCH_META_KEYS",
    "MetaKey",
    "CONTRACT",
    "DTYPES",
    "DTYPE_NAMES",
    "HALF_NAMES",
    "NodeInfo",
    "ModesKind",
    "MODES_KINDS",
    "ModesNote",
    "TensorSpec",
    "RuleRef",
    "Match",
    "Decision",
    "CastRecord",
    "MathRecord",
    "CheckpointTag",
    "GraphMeta",
    "set_graph_facts",
    "BUILTIN",
    "dtype_of",
    "name_of",
    "itemsize",
]

#: a concrete precision name, the dtypes this tool converts between (:mod:`converter.vocab`)
Precision = FloatPrecision
#: the half precisions a conversion targets
HalfPrecision = _HalfPrecision
#: what a conversion may target: a half precision, or ``fp8`` (GEMMs in float8, the rest bf16; never a dtype)
TargetPrecision = _Target
#: ``Decision.precision``: a concrete name once *place* ran (``fp64`` only for a model's own fp64
#: op); before, ``follow``/``promote`` (placement decides) or ``alias`` (its producer's precision)
DecisionPrecision = Literal["fp32", "fp16", "bf16", "fp64", "follow", "promote", "alias"]
#: ``Decision.requested``: what the winning rule said (``half`` = the target dtype), or
#: ``fixed``/``alias`` for nodes no rule decides
#: ``fp8`` is a compute mode of GEMMs (storage and IO stay bf16: such a node's ``precision`` is ``bf16``)
RequestedPrecision = Literal["fp32", "fp16", "bf16", "fp64", "half", "tf32", "fp8", "follow", "promote", "banned", "fixed",
                             "alias"]
#: the math an fp32 matmul/conv runs with: IEEE fp32, reduced (TF32 on CUDA, bf16 in oneDNN), or
#: whatever the global flags say at run time (``[settings] fp32_math``, the ``tf32`` precision)
FP32Math = Fp32Math
#: ``NodeInfo.kind`` (see :class:`NodeInfo`)
NodeKind = Literal["compute", "fixed", "alias", "passive", "cast"]
NODE_KINDS: tuple[str, ...] = get_args(NodeKind)
#: ``RuleRef.table``: a rule table, or where a non-rule decision came from
#: (``settings``: a threshold of a rule file's ``[settings]``, e.g. a shape gate of :mod:`converter.passes.fp8`)
RuleTable = Literal["node", "module", "module_type", "op", "default", "builtin", "placement", "calibration", "user", "settings"]
# NoteStage, NOTE_LABELS and note_text live in the torch-free converter.ir.notes (imported above)

# ---------------------------------------------------------------------------------------------
# the meta contract: every key, its type, who writes it and who reads it

META_INFO = "mp_info"
META_DECISION = "mp"
META_CAST = "mp_cast"
META_VALUE = "mp_value"
META_STATS = "mp_stats"
META_LOWERED = "mp_lowered"
META_SOURCE = "mp_source"
META_TRAINER = "mp_trainer"
META_MATH = "mp_math"
META_REGION = "mp_region"
META_MODE_FLAG = "mp_mode_flag"
META_CHECKPOINT = "mp_checkpoint"
META_INTENT = "mp_intent"
GM_GRAPH = "mp_graph"
GM_PARAM_DTYPES = "mp_param_dtypes"
GM_PARAM_STORAGE = "mp_param_storage"
GM_CALIBRATION = "mp_calibration"
GM_READ_CASTS = "mp_read_casts"
#: keys torch itself writes, which the stages only read
TORCH_META_KEYS = ("val", "stack_trace", "nn_module_stack", "custom")


@dataclass(frozen=True)
class MetaKey:
    """One entry of the meta contract: where the key lives, what it holds, who writes and reads it.

    ``writers`` and ``readers`` name stages (``capture``, ``decide``, ``lower``, ``place``,
    ``rewrite``, ``fp8``, ``simplify``, ``checkpoint``, ``verify``, ``calibrate``, ``search``, ``measure``, ``report``, ``export``,
    ``train``, ``api``, ``cli``, ``ir``); ``tests/test_ir_contract.py`` checks them against the code.
    """

    key: str
    on: Literal["node", "graph"]  # node.meta or gm.meta
    type: str
    writers: tuple[str, ...]
    readers: tuple[str, ...]
    doc: str


CONTRACT: tuple[MetaKey, ...] = (
    MetaKey(META_INFO, "node", "NodeInfo", ("capture", "lower", "rewrite"),
            ("ir", "decide", "place", "calibrate", "search", "measure", "fp32_math", "report", "export", "train", "api",
             "verify", "simplify", "checkpoint", "intent", "fp8", "overflow"),
            "what capture learned: op, module, kind, outputs, opaque_leaf (a module FX could not trace into, "
            "read by capture instead of the wording of why); lower and rewrite describe the nodes they make"),
    MetaKey(META_DECISION, "node", "Decision", ("decide", "lower", "place", "calibrate", "fp8"),
            ("rewrite", "fp32_math", "search", "measure", "report", "export", "api", "verify"),
            "the node's precision and its provenance; later stages amend it with Decision.noted (fp8 replaces the "
            "rule of a linear one of its gates keeps bf16)"),
    MetaKey(META_CAST, "node", "CastRecord", ("rewrite",),
            ("measure", "report", "export", "train", "overflow", "simplify", "checkpoint", "lower"),
            "on every cast node: what it converts and which rule made it necessary (lower's grouped GEMMs drop the "
            "fp32 casts of the results they keep fp32)"),
    MetaKey(META_VALUE, "node", "TensorSpec | tuple | torch.dtype | str", ("capture", "lower", "rewrite"),
            ("ir", "decide", "place", "calibrate", "report", "export", "simplify", "fp8"),
            "shape propagation: a TensorSpec per tensor (tuples for containers), a dtype, or a type name"),
    MetaKey(META_STATS, "node", "converter.numerics.stats.NodeStats", ("calibrate",), (),
            "forward (and gradient) statistics over the calibration inputs"),
    MetaKey(META_LOWERED, "node", "str", ("lower",), (),
            "marks a node lower made or re-typed, with why (for users and tests; the decision has the note)"),
    MetaKey(META_SOURCE, "node", "str", ("capture",), (),
            "file:line of the model code that made the node (FX tracer; read back by capture)"),
    MetaKey(META_TRAINER, "node", "str", ("train",), (),
            "marks a node the trainer inserted (e.g. embedding_grad_shrink)"),
    MetaKey(META_MATH, "node", "MathRecord", ("fp32_math",), ("report",),
            "the fp32 math a matmul/conv node runs with (ieee/tf32/inherit); on the scope calls fp32_math inserted"),
    MetaKey(META_REGION, "node", "tuple[str, ...]", ("regions", "rewrite", "intent"), ("rewrite",),
            "the no_grad/autocast regions (outermost first) capture inlined (or FX traced) the node from; casts are not "
            "shared across"),
    MetaKey(META_MODE_FLAG, "node", "bool", ("modes",), ("lower",),
            "marks the node reading self.training (or p * self.training) that capture put in a mode-dependent op"),
    MetaKey(META_CHECKPOINT, "node", "CheckpointTag", ("capture", "regions", "rewrite", "lower", "fp32_math", "fp8"),
            ("checkpoint", "rewrite", "fp32_math"),
            "the torch.utils.checkpoint region the node ran in; casts (and the fp8 stage's weight views) take their "
            "consumer's; code generation "
            "runs each region under checkpoint (converter.passes.checkpoint)"),
    MetaKey(META_INTENT, "node", "tuple[UserIntent, ...]", ("intent",), ("intent",),
            "the user's precision intent over the node (its innermost autocast region, _keep_in_fp32_modules), "
            "first applicable wins; capture and regions tag through converter.passes.intent, decide reads through "
            "its applicable_intent; outranks every rule file"),
    MetaKey(GM_GRAPH, "graph", "GraphMeta", ("api", "lower", "ir", "optional_inputs"), ("report", "export"),
            "graph-level facts, declared fields of a frozen record: tracer, precision, capture errors, rule files; "
            "lower's list and its cost model's choices (lower sets lowering), simplify's folds, the fp32_math "
            "setting and region count, the checkpoint summary, the fp8 recipe, layers, SQNR floors, per-layer numerics and "
            "fallback, the optional inputs and their fills (set_graph_facts replaces them)"),
    MetaKey(GM_PARAM_DTYPES, "graph", "dict[str, torch.dtype]", ("rewrite", "api", "partition"), ("report", "export", "train", "api", "lightning"),
            "fqn -> the dtype each parameter may be stored in (O2); the emitted model.py sets it too"),
    MetaKey(GM_PARAM_STORAGE, "graph", "dict[str, str]", ("rewrite",), ("report",),
            "fqn -> why O2 keeps a parameter that the graph casts to half in fp32 storage"),
    MetaKey(GM_CALIBRATION, "graph", "dict", ("calibrate", "fp8"), ("report",),
            "calibration results for report.json (risky nodes, loss scale, underflow; the fp8 accuracy search adds "
            "fp8_search)"),
    MetaKey(GM_READ_CASTS, "graph", "dict[str, str]", ("calibrate",), ("rewrite",),
            "fqn -> why a parameter several nodes read is cast once per read and stored in fp32 under O2"),
)

#: precision name -> torch dtype, for the floating dtypes this tool converts between
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: torch dtype -> precision name (fp64 is listed so that reports can name it; it is never converted)
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
HALF_NAMES = HALF_PRECISIONS


def dtype_of(name: str) -> torch.dtype:
    return DTYPES[name]


def name_of(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CheckpointTag:
    """The ``torch.utils.checkpoint`` call a node ran inside (``node.meta["mp_checkpoint"]``)."""

    region: int
    preserve_rng_state: bool = True
    #: the model called it with use_reentrant=True (kept as a non-reentrant checkpoint)
    reentrant: bool = False


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
    * ``"passive"`` — produces no convertible tensor (shapes, ints, bools, fp64, asserts): untouched;
    * ``"cast"`` — a cast node that *rewrite* inserted (it carries a :class:`CastRecord`).
    """

    op: str
    module: str = ""
    module_type: str = ""
    module_stack: tuple[tuple[str, str], ...] = ()  # (path, class name), outermost first
    source: str = ""
    kind: NodeKind = "passive"
    outputs: tuple[TensorSpec, ...] = ()
    fixed_dtype: Optional[torch.dtype] = None  # for kind == "fixed"
    inplace: bool = False
    why: str = ""  # why the kind was chosen when it is not "compute"
    #: a module FX kept as a leaf (it cannot trace into it) holding floating parameters it cannot convert;
    #: capture reads this flag (never ``why``) to try torch.export instead
    opaque_leaf: bool = False
    #: a second op name rules match besides ``op``: ``weight_matmul`` (:mod:`converter.ir.weight_gemm`) for a
    #: matmul/mm/addmm of an activation and a 2-D weight parameter; ``""`` for every other node
    op_alias: str = ""

    @property
    def out_numel(self) -> int:
        return sum(t.numel for t in self.outputs)

    @property
    def out_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)


#: how the converted module treats train()/eval(): one mode-aware graph, a train and an eval graph, or one
#: graph frozen in the model's own mode (train()/eval() then change nothing)
ModesKind = Literal["follows", "two_graphs", "frozen_train", "frozen_eval"]
MODES_KINDS: tuple[str, ...] = get_args(ModesKind)


@dataclass(frozen=True)
class ModesNote:
    """What capture did with the model's train/eval modes (``Captured.modes``, ``Report.modes``).

    ``kind`` is what code reads (strict_modes, the report's header warning, model.py's docstring, the
    in-place wrapper); ``text`` is the prose for people, ``report.records.capture.modes`` and report.json. Code
    never parses ``text``: a reworded note changes no behaviour.
    """

    kind: ModesKind
    text: str

    def __post_init__(self) -> None:
        if self.kind not in MODES_KINDS:
            raise ValueError(f"ModesNote kind {self.kind!r} is not one of {MODES_KINDS}")

    def __str__(self) -> str:
        return self.text

    @property
    def frozen(self) -> Optional[Literal["train", "eval"]]:
        """The one mode the converted module is frozen in, or None when train()/eval() work."""
        return "train" if self.kind == "frozen_train" else "eval" if self.kind == "frozen_eval" else None

    def extended(self, more: str) -> "ModesNote":
        """The same kind with ``more`` appended to the prose (e.g. why LayerDrop is off)."""
        return ModesNote(self.kind, self.text + more)


@dataclass(frozen=True)
class RuleRef:
    """Where a decision came from: a rule file, its table and the pattern that matched."""

    file: str
    table: RuleTable
    pattern: str = ""

    def __str__(self) -> str:
        if self.table == "user":  # the user's intent in the model code: "[user] autocast region at m.py:12"
            return f"[user] {self.pattern}"
        if self.table in ("default", "builtin", "placement", "calibration") and not self.pattern:
            return f"{self.file}:[{self.table}]"
        return f"{self.file}:[{self.table}].{self.pattern}"


BUILTIN = "<builtin>"


@dataclass(frozen=True)
class Match:
    """One rule that matched a node, kept for ``explain``; ``level`` is its precedence rank."""

    rule: RuleRef
    precision: RequestedPrecision
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

    ``reason`` is what the deciding rule (or stage) said; every later stage that amends the decision
    (*lower*, *place*) appends a ``(stage, text)`` pair to ``notes`` with :meth:`noted` instead of
    editing ``reason``, so ``explain`` and the report read the trail as data.
    """

    precision: DecisionPrecision
    requested: RequestedPrecision
    rule: RuleRef
    reason: str
    matches: tuple[Match, ...] = ()
    unmatched: bool = False
    notes: tuple[tuple[NoteStage, str], ...] = ()

    def replace(self, **changes: Any) -> "Decision":
        return dataclasses.replace(self, **changes)

    def noted(self, stage: NoteStage, text: str, **changes: Any) -> "Decision":
        """A copy with ``changes`` applied and ``(stage, text)`` appended to :attr:`notes`."""
        return dataclasses.replace(self, notes=self.notes + ((stage, text),), **changes)

    @property
    def full_reason(self) -> str:
        """``reason`` followed by every labelled note, ``; ``-separated: the one-line form for tables."""
        return "; ".join((self.reason, *(note_text(stage, text) for stage, text in self.notes)))


@dataclass(frozen=True)
class CastRecord:
    """An inserted cast: which producer it converts, to what, and which rule made it necessary."""

    src: str
    dtype: Precision
    src_dtype: Precision
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
class MathRecord:
    """The fp32 math of one matmul/conv node (or, with ``scope``, a scope call *fp32_math* inserted).

    ``enforced``: the converted graph sets ``mode`` around the node whatever the global flags are;
    ``mode == "inherit"`` is never enforced. ``region`` numbers the bracketed run (-1: none).
    """

    mode: FP32Math
    enforced: bool
    reason: str
    region: int = -1
    scope: Literal["", "enter", "exit"] = ""


@dataclass(frozen=True)
class GraphMeta:
    """Graph-level facts (``gm.meta["mp_graph"]``): the pipeline (converter.api) writes the first four
    when the graph is captured, and each later stage sets its own field through :func:`set_graph_facts`.

    ``device``: the device the graph was lowered for (None: portable); ``lowered``: the nodes lower
    rewrote; ``lowering``: its cost model's choices (``LoweringChoice.to_dict()``, one per attention
    call); ``simplified``: simplify's folds (``converter.passes.simplify.Fold``); ``fp32_math``: the
    rule files' fp32_math setting and ``fp32_math_regions`` how many bracketed regions enforce it;
    ``checkpoint``: what the checkpoint stage kept (``checkpoint_regions``' summary), None before it ran;
    ``fp8_recipe``: the FP8 recipe of a conversion with fp8 GEMMs (None: none), ``fp8_layers`` the linear
    nodes that run their GEMMs in fp8 (after the fallback), ``fp8_thresholds`` the SQNR floors of the fallback
    (GEMM -> ``{"min_db", "rule"}``, from the rules), ``fp8_numerics`` the per-layer measurements with
    calibration (``converter.numerics.fp8_layers.Fp8LayerNumerics``, one per layer the fp8 stage made, fallbacks
    included; None: not measured) and ``fp8_fallback`` the rows of the layers the fallback kept bf16.
    """

    tracer: str
    precision: HalfPrecision
    capture_errors: tuple[str, ...] = ()
    rule_files: tuple[str, ...] = ()
    device: Optional[str] = None
    lowered: tuple[str, ...] = ()
    lowering: tuple[Mapping[str, Any], ...] = ()
    simplified: tuple[Any, ...] = ()
    fp32_math: Optional[str] = None
    fp32_math_regions: int = 0
    checkpoint: Optional[Mapping[str, Any]] = None
    fp8_recipe: Optional[str] = None
    fp8_layers: tuple[str, ...] = ()
    fp8_thresholds: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    fp8_numerics: Optional[tuple[Any, ...]] = None
    fp8_fallback: tuple[Mapping[str, Any], ...] = ()
    #: input (``idx``, ``xs[1]``) -> the dims the graph keeps symbolic that a guard in the model's code pins to the
    #: example's size (capture's ``pinned_dims``: ``idx.size(1) // 8 == 2``): model.py checks them as fixed
    pinned: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    #: the graph inputs a caller may leave out, with the fill the original uses in their place
    #: (``converter.numerics.optional_inputs.OptionalInput``; conv.module's and model.py's forward take them as ``=None``)
    optional_inputs: tuple[Any, ...] = ()


def set_graph_facts(gm: torch.fx.GraphModule, **facts: Any) -> None:
    """Replace fields of ``gm``'s :class:`GraphMeta` (frozen: a stage's facts are set, never edited in
    place); a graph without one (a stage run on its own, as the tests do) is left as it is."""
    graph_meta = gm.meta.get(GM_GRAPH)
    if graph_meta is not None:
        gm.meta[GM_GRAPH] = replace(graph_meta, **facts)
