"""fp32_math: fp32 matmuls and convolutions run with the math their decision says, whatever the global flags.

An "fp32" matmul or convolution is not always computed in IEEE fp32:

* on CUDA (Ampere and newer), cuBLAS/cuDNN use TF32 tensor cores (10-bit mantissa) when
  ``torch.set_float32_matmul_precision("high"|"medium")``, ``torch.backends.cuda.matmul.allow_tf32``
  or ``torch.backends.cudnn.allow_tf32`` (True by default: fp32 convolutions use TF32 out of the
  box) allow it;
* on CPU, oneDNN computes fp32 matmuls in bf16 when ``set_float32_matmul_precision("medium")`` set
  ``torch.backends.mkldnn.matmul.fp32_precision`` to ``"bf16"`` (effective on CPUs with native
  bf16: AVX512-BF16, AMX).

This pass makes the converted graph independent of those global flags. Every fp32 node of the
matmul/conv class (:data:`MATH_OPS`) gets a :class:`~converter.ir.meta.MathRecord` saying which
math it runs with:

* ``ieee`` — nodes decided ``fp32`` when the rules' ``[settings] fp32_math`` is ``"ieee"`` (the
  default): IEEE fp32 math, enforced;
* ``tf32`` — nodes a ``tf32`` rule decided (fp32 storage, reduced math), and ``fp32`` nodes when
  ``fp32_math = "tf32"``: the backends' reduced fp32 math, enforced (:data:`REDUCED`);
* ``inherit`` — ``fp32`` nodes when ``fp32_math = "inherit"``: whatever the global flags say when
  the model runs (the behaviour before this pass existed).

Enforcement brackets each maximal run of nodes that want the same enforced math with two calls,
:func:`mp_fp32_math_enter` (saves the current per-backend precisions, sets the wanted ones) and
:func:`mp_fp32_math_exit` (restores them). Nodes that no math flag affects (half-precision ops,
pointwise ops, norms) may sit inside a run; an ``inherit`` node, an fp32 recurrent layer or
unknown leaf module (reported as ``inherit``: not scoped) or a node wanting the other math ends it. Both helpers depend only on torch: the emitted model.py
carries their source verbatim, so it runs exactly like ``conv.module``. Both are registered with
``torch.fx.node.has_side_effect`` so FX dead-code elimination keeps them.

The helpers use torch's per-backend precision API (``torch._C._get_fp32_precision_getter`` /
``_set_fp32_precision_setter``, behind ``torch.backends.<backend>.<op>.fp32_precision``) and
restore the exact values they found, so the legacy flags (``get_float32_matmul_precision()``,
``allow_tf32``) read the same before and after a forward. When the global state already matches,
``enter`` changes nothing and returns ``None`` (the cost is a few getter calls per region).

**Backward.** The autograd engine runs the backward matmuls later, under whatever global mode is
set at that time; this pass does not scope them. With a reduced global mode, the *gradients* of
fp32-pinned matmuls are computed in reduced precision even though their forward is IEEE. Run
backward under ``torch.set_float32_matmul_precision("highest")`` where that matters
(``docs/rules.md``, "fp32 math").

**Exceptions.** A forward that raises inside a region leaves the region's precision set (a graph
has no ``finally``); the next converted forward restores nothing it did not set.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.fx
from torch.fx.node import has_side_effect

from converter.ir.graphmodule import pauses_gc
from converter.ir.meta import META_CHECKPOINT, META_DECISION, META_INFO, META_MATH, FP32Math, MathRecord
from converter.ir.ops import MATMUL_CONV_OPS, RECURRENT_OPS, known_op_names
from converter.vocab import FP32_MATHS

__all__ = [
    "FP32_MATH_MODES",
    "DEFAULT_FP32_MATH",
    "MATH_OPS",
    "IEEE",
    "REDUCED",
    "is_math_op",
    "fp32_math",
    "mp_fp32_math_enter",
    "mp_fp32_math_exit",
    "RUNTIME_HELPERS",
    "runtime_source",
    "global_math_settings",
    "reduced_globals",
]

#: values of ``[settings] fp32_math``
FP32_MATH_MODES: tuple[FP32Math, ...] = FP32_MATHS
#: ``ieee``: an audit that says fp32 must mean fp32; enforcing it costs a few C calls per region
#: and nothing at all when the global mode is already "highest"
DEFAULT_FP32_MATH: FP32Math = "ieee"
#: ops whose fp32 math the backend precision flags change (matmul class, convolutions, attention)
MATH_OPS = MATMUL_CONV_OPS
#: fp32 ops with matmuls inside that are not scoped: they run with the global math and end a run
_OPAQUE = RECURRENT_OPS
_CONV_OPS = frozenset(op for op in MATH_OPS if op.startswith("conv"))
#: (backend, op) -> precision for IEEE math: cuBLAS, cuDNN conv, oneDNN matmul and conv
IEEE: dict[tuple[str, str], str] = {("cuda", "matmul"): "ieee", ("cuda", "conv"): "ieee",
                                    ("mkldnn", "matmul"): "ieee", ("mkldnn", "conv"): "ieee"}
#: (backend, op) -> precision for reduced fp32 math: TF32 on CUDA, bf16 down-conversion in oneDNN
#: (what ``set_float32_matmul_precision("medium")`` selects on CPU)
REDUCED: dict[tuple[str, str], str] = {("cuda", "matmul"): "tf32", ("cuda", "conv"): "tf32",
                                       ("mkldnn", "matmul"): "bf16", ("mkldnn", "conv"): "bf16"}


def is_math_op(op: str) -> bool:
    """Whether the backend fp32 precision flags change this canonical op's fp32 result."""
    return op in MATH_OPS


# ---------------------------------------------------------------------------------------------
# runtime helpers: called by the converted graph; their source is copied into model.py verbatim,
# so they may use nothing but torch.


@has_side_effect
def mp_fp32_math_enter(settings):
    """Set each ``(backend, op, precision)`` of ``settings``; return what to restore (None: no change)."""
    get = torch._C._get_fp32_precision_getter
    saved = tuple((backend, op, get(backend, op)) for backend, op, _ in settings)
    changed = False
    for (backend, _op, now), (_, _, want) in zip(saved, settings):
        if now == "none":  # inherits: the backend's "all", then the generic setting, then IEEE
            now = get(backend, "all")
            now = get("generic", "all") if now == "none" else now
            now = "ieee" if now == "none" else now
        changed = changed or now != want
    if not changed:
        return None
    put = torch._C._set_fp32_precision_setter
    for backend, op, want in settings:
        put(backend, op, want)
    return saved


@has_side_effect
def mp_fp32_math_exit(saved):
    """Restore what :func:`mp_fp32_math_enter` changed (the exact values it found)."""
    if saved is not None:
        put = torch._C._set_fp32_precision_setter
        for backend, op, value in saved:
            put(backend, op, value)


RUNTIME_HELPERS = (mp_fp32_math_enter, mp_fp32_math_exit)


def _helper_source() -> str:
    import inspect

    blocks = []
    for fn in RUNTIME_HELPERS:
        lines = [line for line in inspect.getsource(fn).splitlines() if not line.startswith("@")]
        blocks.append("\n".join(lines))
    return "\n\n\n".join(blocks) + "\n"


# read once, at import: the file on disk then matches the code that runs (inspect re-reads the file)
_RUNTIME_SOURCE = _helper_source()


def runtime_source() -> str:
    """The helpers' source, without the registration decorator, for the emitted model.py."""
    return _RUNTIME_SOURCE


# ---------------------------------------------------------------------------------------------
# the global settings, as the audit reports them


def _safe(fn):
    try:
        return fn()
    except RuntimeError as exc:  # torch refuses to read a legacy flag after mixed legacy/new use
        return f"unreadable: {str(exc).split(',')[0]}"


def global_math_settings() -> dict:
    """The process-wide fp32 math flags now (report.json ``fp32_math.global``)."""
    get = torch._C._get_fp32_precision_getter
    return {
        "float32_matmul_precision": _safe(torch.get_float32_matmul_precision),
        "cuda.matmul.allow_tf32": _safe(lambda: torch.backends.cuda.matmul.allow_tf32),
        "cudnn.allow_tf32": _safe(lambda: torch.backends.cudnn.allow_tf32),
        "cuda.matmul.fp32_precision": get("cuda", "matmul"),
        "cudnn.conv.fp32_precision": get("cuda", "conv"),
        "mkldnn.matmul.fp32_precision": get("mkldnn", "matmul"),
        "mkldnn.conv.fp32_precision": get("mkldnn", "conv"),
        "generic.fp32_precision": get("generic", "all"),
    }


def _effective(backend: str, op: str) -> str:
    get = torch._C._get_fp32_precision_getter
    for b, o in ((backend, op), (backend, "all"), ("generic", "all")):
        value = get(b, o)
        if value != "none":
            return value
    return "ieee"


def reduced_globals(*, conv: bool) -> list[str]:
    """The global flags that make an fp32 matmul (``conv=False``) or convolution run in reduced math now."""
    pairs = (("cuda", "conv"), ("mkldnn", "conv")) if conv else (("cuda", "matmul"), ("mkldnn", "matmul"))
    names = {"cuda": "cudnn" if conv else "cuda", "mkldnn": "mkldnn"}
    return [f"{names[b]}.{o}.fp32_precision={_effective(b, o)}" for b, o in pairs if _effective(b, o) != "ieee"]


# ---------------------------------------------------------------------------------------------
# the pass


def _want(node: torch.fx.Node, setting: FP32Math) -> tuple[Optional[FP32Math], str]:
    """(the math a node needs, why); None for nodes no fp32 math flag affects."""
    info = node.meta.get(META_INFO)
    decision = node.meta.get(META_DECISION)
    if node.op not in ("call_function", "call_method", "call_module") or info is None or decision is None:
        return None, ""
    if info.kind not in ("compute", "fixed") or decision.precision != "fp32":
        return None, ""
    if is_math_op(info.op):
        if decision.requested == "tf32":
            return "tf32", f"rule {decision.rule} asks for tf32 (fp32 storage, reduced fp32 math)"
        return setting, f"decided fp32 by {decision.rule}; [settings] fp32_math = {setting!r}"
    if info.op in _OPAQUE or (node.op == "call_module" and info.op not in known_op_names()):
        # recurrent layers (their own cudnn/oneDNN rnn knobs) and leaf modules we cannot see into
        return "inherit", f"fp32 {info.op}: its inner matmuls run with the global math (not scoped)"
    return None, ""


def _bracket(graph: torch.fx.Graph, region: int, mode: FP32Math, members: list[torch.fx.Node]) -> None:
    """Insert enter before the run's first node and exit after its last; only the knobs its ops need."""
    kinds = {"conv" if node.meta[META_INFO].op in _CONV_OPS else "matmul" for node in members}
    table = IEEE if mode == "ieee" else REDUCED
    settings = tuple((b, o, v) for (b, o), v in table.items() if o in kinds)
    with graph.inserting_before(members[0]):
        enter = graph.create_node("call_function", mp_fp32_math_enter, (settings,), name=f"fp32_math_enter_{region}")
    with graph.inserting_after(members[-1]):
        leave = graph.create_node("call_function", mp_fp32_math_exit, (enter,), name=f"fp32_math_exit_{region}")
    if META_CHECKPOINT in members[0].meta:  # the scope runs inside the checkpoint region too
        enter.meta[META_CHECKPOINT] = leave.meta[META_CHECKPOINT] = members[0].meta[META_CHECKPOINT]
    scopes: tuple[tuple[torch.fx.Node, Literal["enter", "exit"]], ...] = ((enter, "enter"), (leave, "exit"))
    for node, scope in scopes:
        node.meta[META_MATH] = MathRecord(mode=mode, enforced=True, reason=f"region {region}: {len(members)} nodes",
                                          region=region, scope=scope)


@pauses_gc
def fp32_math(gm: torch.fx.GraphModule, *, setting: FP32Math = DEFAULT_FP32_MATH, check: bool = False) -> int:
    """Record each fp32 matmul/conv node's math and bracket the enforced runs; returns the region count."""
    if setting not in FP32_MATH_MODES:
        raise ValueError(f"fp32_math must be one of {', '.join(FP32_MATH_MODES)}, got {setting!r}")
    graph = gm.graph
    runs: list[tuple[FP32Math, list[torch.fx.Node]]] = []
    current: Optional[tuple[FP32Math, list[torch.fx.Node]]] = None
    for node in list(graph.nodes):
        want, why = _want(node, setting)
        if want is None:
            continue  # no fp32 math flag affects it: it may sit inside a run
        if current is not None and (current[0] != want or
                                    current[1][-1].meta.get(META_CHECKPOINT) != node.meta.get(META_CHECKPOINT)):
            # a run never crosses a checkpoint region's edge: the region is recomputed on its own
            runs.append(current)
            current = None
        region = -1
        if want != "inherit":
            if current is None:
                current = (want, [])
            current[1].append(node)
            region = len(runs)
        node.meta[META_MATH] = MathRecord(mode=want, enforced=want != "inherit", reason=why, region=region)
    if current is not None:
        runs.append(current)
    for region, (mode, members) in enumerate(runs):
        _bracket(graph, region, mode, members)
    if runs and check:  # as rewrite: ConvertOptions.check_graph (the test suite) lints every pass
        graph.lint()
    gm.recompile()
    return len(runs)
