"""The user's own precision intent, read from the model code: it outranks every rule file.

A model's author sometimes says which precision a part of the model must run in, and means it:

* **``torch.autocast(..., enabled=False)``** around a region (an STFT/mel front end whose squared
  magnitudes reach 1e10, a loss, Hugging Face's rotary embeddings): every op in the region is
  decided fp32.
* **``torch.autocast(..., dtype=torch.bfloat16 / torch.float16)``** (enabled) around a region: the
  ops autocast runs in lower precision there — the matmul class, convolutions and attention
  (:data:`AUTOCAST_LOWER_OPS`) — are decided in the region's dtype, whatever the conversion's
  target; the other ops are decided by the rules, and a rule's ``half`` means the region's dtype.
* **transformers' ``_keep_in_fp32_modules``** (T5's ``wo``): the ops of those modules are decided
  fp32 when converting to fp16, as transformers keeps their weights in fp32 when it loads the
  model in fp16 (and only then: ``PreTrainedModel._get_dtype_plan``); ``_keep_in_fp32_modules_strict``
  applies to fp16 and bf16. A module is named as transformers 5 matches it: each entry is a
  regular expression (``*`` read as ``.*``) *searched* in the parameter names; the modules owning
  a matching parameter are kept, with everything they call.

Each becomes a :class:`UserIntent` in ``node.meta["mp_intent"]`` (a tuple, highest first: the
innermost autocast region, then ``_keep_in_fp32_modules``). *decide* gives a node the precision of
the first intent that applies to it, with the rule ``[user] autocast region at file.py:LINE`` or
``[user] _keep_in_fp32_modules of T5ForConditionalGeneration: wo`` and a reason, ranked above
every rule file (:mod:`converter.rules.precedence`). Only compute nodes are decided so: a cast the
model writes (``x.float()``) keeps its dtype, an in-place op its tensor's. Placement and rewrite
then cast into and out of a region like around any other decision: a half tensor entering an fp32
region is cast up inside it, and nothing in it reads a half tensor.

How the regions are found:

* **torch.export** records an autocast block as a ``wrap_with_autocast`` region, which
  :mod:`converter.passes.regions` inlines; it tags the region's nodes from the region's own
  arguments (device, dtype, enabled). The ``with`` line comes from :class:`AutocastMarks`
  (``annotate=True``), which records it through ``torch.fx.traceback.annotate`` while exporting.
* **torch.fx.symbolic_trace** records no autocast at all: the block runs eagerly at trace time.
  While tracing, :class:`AutocastMarks` stands in for ``torch.autocast.__enter__``/``__exit__``
  (the class's own methods run unchanged inside), keeps a stack of the open regions and records
  the same ``_enter_autocast``/``_exit_autocast`` calls the inlined export regions have, so both
  graphs compute what the model computes (capture's eval-mode check compares them); the FX tracer
  tags each node it makes with the innermost region (:func:`tag_traced`).

Once decided, an *enabled* region's autocast calls are removed from the graph
(:func:`drop_enabled_autocast`): every op in it has its dtype decided explicitly, and a live
autocast would re-decide some of them at run time behind the report's back (under a bf16 autocast
an fp16 ``cat`` even fails: ``Unexpected floating ScalarType in at::autocast::prioritize``). An
``enabled=False`` region keeps its calls: they change nothing the decisions say, and keep the
region fp32 when the converted module runs under an outer autocast, as the model's own block did.

Only autocast blocks entered from model code count: the frames of torch itself (and of this
package) are skipped to find the ``with`` line, and a block torch enters internally is ignored.
Regions count whatever their ``device_type``: ``autocast("cuda", enabled=False)`` in a model
converted on the CPU still says "fp32 here".
"""
from __future__ import annotations

import contextlib
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.fx

from converter.ir.meta import HALF_NAMES, META_INFO, META_INTENT, META_REGION, RuleRef, name_of
from converter.ir.ops import MATMUL_CONV_OPS
from converter.vocab import HALF_PRECISIONS

__all__ = ["AUTOCAST_LOWER_OPS", "USER_FILE", "UserIntent", "AutocastMarks", "autocast_intent", "add_intent", "tag_traced",
           "region_location", "mark_kept_modules", "kept_modules", "applicable_intent", "half_in", "drop_enabled_autocast"]

#: the ops an enabled autocast region runs in its lower-precision dtype (torch.autocast's CUDA and
#: CPU lower-precision lists: the matmul class, convolutions, attention, prelu)
AUTOCAST_LOWER_OPS = MATMUL_CONV_OPS | {"prelu"}
#: ``RuleRef.file`` of the user's intent
USER_FILE = "<user>"
_ENTER, _EXIT = torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast
#: the ``torch.fx.traceback.annotate`` key export records the ``with`` line of an autocast block under
_ANNOTATION = "mpconvert_autocast"
_SKIP = (str(Path(torch.__file__).resolve().parent), str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class UserIntent:
    """One precision the model's code asks for, over a set of nodes.

    ``label`` names it for ``[user] {label}``; ``precision`` is what it decides (fp32, fp16, bf16);
    ``ops``: the canonical ops it decides (None: every compute node); ``targets``: the conversion
    targets it applies to; ``half``: what a rule's ``half`` means under it (an enabled autocast
    region's dtype); ``autocast``: it comes from an autocast region (the innermost one wins)."""

    label: str
    precision: str
    reason: str
    ops: Optional[frozenset] = None
    targets: tuple[str, ...] = HALF_NAMES
    half: Optional[str] = None
    autocast: bool = False

    @property
    def rule(self) -> RuleRef:
        return RuleRef(USER_FILE, "user", self.label)

    def applies(self, op: str, target: str) -> bool:
        return target in self.targets and (self.ops is None or op in self.ops)


def autocast_intent(device_type: str, dtype: Optional[torch.dtype], enabled: bool, where: str) -> UserIntent:
    """The intent of a ``torch.autocast(device_type, dtype=dtype, enabled=enabled)`` block at ``where``."""
    label = f"autocast region at {where or 'an unknown line'}"
    half = name_of(dtype) if dtype is not None else None
    if not enabled or half not in HALF_NAMES:
        return UserIntent(label=label, precision="fp32", autocast=True, reason=(
            f"the model runs this code under torch.autocast({device_type!r}, enabled=False): it asks for fp32 here, "
            "so every op of the region is fp32 whatever the rule files say"))
    return UserIntent(label=label, precision=half, ops=frozenset(AUTOCAST_LOWER_OPS), half=half, autocast=True, reason=(
        f"the model runs this code under torch.autocast({device_type!r}, dtype=torch.{str(dtype).split('.')[-1]}): "
        f"autocast runs its matmul-class ops in {half}, so they are {half} whatever the conversion's target"))


def add_intent(node: torch.fx.Node, intent: UserIntent) -> None:
    """Append ``intent`` to ``node``'s; an autocast region only where no inner one is recorded already."""
    have = node.meta.get(META_INTENT, ())
    if intent.autocast and any(i.autocast for i in have):
        return
    node.meta[META_INTENT] = (*have, intent)


def applicable_intent(node: torch.fx.Node, op: str, target: str) -> Optional[UserIntent]:
    """The first of ``node``'s intents that decides ``op`` when converting to ``target`` (None: the rules decide)."""
    return next((i for i in node.meta.get(META_INTENT, ()) if i.applies(op, target)), None)


def half_in(node: torch.fx.Node) -> Optional[UserIntent]:
    """The enabled autocast region ``node`` is in (its innermost), whose dtype a rule's ``half`` means
    there; None: the conversion's target."""
    region = next((i for i in node.meta.get(META_INTENT, ()) if i.autocast), None)
    return region if region is not None and region.half is not None else None


# ---------------------------------------------------------------------------------------------
# capture: autocast blocks

#: the autocast blocks open while tracing, innermost last: (region tag, intent)
_STACK: list[tuple[str, UserIntent]] = []


def _where(frame) -> Optional[str]:
    """``file:line`` of the ``with``/decorator that entered an autocast block, or None when torch
    itself entered it. ``frame`` is the caller of ``__enter__``."""
    inside_torch = frame is not None and frame.f_code.co_filename.startswith(_SKIP[0])
    if inside_torch and not frame.f_code.co_filename.replace("\\", "/").endswith(("amp/autocast_mode.py", "utils/_contextlib.py")):
        return None  # an autocast torch enters for its own purposes
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}" if frame is not None else None


class AutocastMarks:
    """Context manager: while tracing, every ``torch.autocast`` block the model enters is recorded
    (see the module docstring). ``annotate``: record the ``with`` line for torch.export's graph
    through ``torch.fx.traceback.annotate``. ``tracer``: the FX tracer, which gets the block's
    ``_enter_autocast``/``_exit_autocast`` calls and reads :func:`tag_traced`."""

    def __init__(self, *, annotate: bool = False, tracer: Optional[torch.fx.Tracer] = None):
        self.annotate = annotate
        self.tracer = tracer
        self.count = 0

    def __enter__(self) -> "AutocastMarks":
        cls = torch.amp.autocast_mode.autocast
        self._saved = (cls.__enter__, cls.__exit__)
        original_enter, original_exit = self._saved
        marks = self
        exits: list[contextlib.ExitStack] = []

        def __enter__(ctx):
            out = original_enter(ctx)
            exits.append(marks._open(ctx, sys._getframe(1)))
            return out

        def __exit__(ctx, *exc):
            try:
                return original_exit(ctx, *exc)
            finally:
                if exits:
                    exits.pop().close()

        setattr(cls, "__enter__", __enter__)  # noqa: B010 (torch's methods are replaced on purpose)
        setattr(cls, "__exit__", __exit__)  # noqa: B010
        return self

    def _open(self, ctx: Any, frame) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        where = _where(frame)
        if where is None:
            return stack
        intent = autocast_intent(str(ctx.device), ctx.fast_dtype, bool(ctx._enabled), where)
        entry = (f"autocast{self.count}", intent)
        self.count += 1
        _STACK.append(entry)
        stack.callback(lambda: _STACK.remove(entry) if entry in _STACK else None)
        tracer = self.tracer
        if tracer is not None:  # FX: the calls the inlined export regions have (converter.passes.regions)
            args = (str(ctx.device), ctx.fast_dtype, bool(ctx._enabled), bool(ctx._cache_enabled))
            enter = tracer.create_proxy("call_function", _ENTER, args, {})
            stack.callback(lambda: tracer.create_proxy("call_function", _EXIT, (enter,), {}))
        if self.annotate:
            import torch.fx.traceback as fx_traceback

            stack.enter_context(fx_traceback.preserve_node_meta())
            stack.enter_context(fx_traceback.annotate({_ANNOTATION: where}))
        return stack

    def __exit__(self, *exc) -> None:
        cls = torch.amp.autocast_mode.autocast
        enter, leave = self._saved
        setattr(cls, "__enter__", enter)  # noqa: B010
        setattr(cls, "__exit__", leave)  # noqa: B010
        _STACK.clear()


def tag_traced(node: torch.fx.Node) -> None:
    """FX tracer: tag a node made inside an autocast block with the innermost block's intent and region."""
    if _STACK and node.op in ("call_function", "call_method", "call_module") and node.target not in (_ENTER, _EXIT):
        tag, intent = _STACK[-1]
        add_intent(node, intent)
        node.meta[META_REGION] = (tag,)


def region_location(nodes: Iterable[torch.fx.Node]) -> str:
    """torch.export: the ``with`` line of the autocast region whose body is ``nodes``, as
    :class:`AutocastMarks` annotated it (the first op's line when it did not). The line most of the
    region's own nodes carry: export copies a node's meta onto checks it inserts before it (an
    ``_assert_tensor_metadata`` of an input made outside the region carries the outer line)."""
    nodes = list(nodes)
    lines = []
    for node in nodes:
        custom = node.meta.get("custom") or {}
        if isinstance(custom, dict) and custom.get(_ANNOTATION) and not any(i.autocast for i in node.meta.get(META_INTENT, ())):
            lines.append(str(custom[_ANNOTATION]))
    if lines:
        return Counter(lines).most_common(1)[0][0]  # ties: the first seen
    for node in nodes:
        frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
        frames = [(p, n) for p, n in frames if not p.startswith(_SKIP)]
        if frames:
            return f"{frames[-1][0].rsplit('/', 1)[-1]}:{frames[-1][1]} (its first op)"
    return ""


def drop_enabled_autocast(gm: torch.fx.GraphModule) -> int:
    """Remove the ``_enter_autocast``/``_exit_autocast`` calls of every enabled autocast region of a
    decided graph (see the module docstring); returns how many regions."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _ENTER or len(node.args) < 3 or node.args[2] is not True:
            continue
        leaves = [u for u in node.users if u.op == "call_function" and u.target is _EXIT]
        if len(leaves) != len(node.users):
            continue  # the context is used some other way: keep it
        for leave in leaves:
            gm.graph.erase_node(leave)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count


# ---------------------------------------------------------------------------------------------
# capture: transformers' _keep_in_fp32_modules


def kept_modules(model: torch.nn.Module, target: str) -> dict[str, tuple[str, str]]:
    """Module path -> (attribute, entry) for every module transformers would keep in fp32 when
    loading ``model`` in ``target`` (``_keep_in_fp32_modules`` for fp16, ``_strict`` for both)."""
    entries: list[tuple[str, str]] = []
    for attr, targets in (("_keep_in_fp32_modules_strict", HALF_PRECISIONS), ("_keep_in_fp32_modules", ("fp16",))):
        value = getattr(model, attr, None)
        if target in targets and isinstance(value, (list, tuple, set, frozenset)):
            entries += [(attr, str(e)) for e in sorted(value, key=str)]
    if not entries:
        return {}
    patterns = [(attr, entry, re.compile(entry.replace("*", ".*"))) for attr, entry in entries]
    kept: dict[str, tuple[str, str]] = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        hit = next(((attr, entry) for attr, entry, rx in patterns if rx.search(name)), None)
        if hit is not None and "." in name:  # a parameter of the root module itself would pin every op: not a module
            kept.setdefault(name.rsplit(".", 1)[0], hit)
    return kept


def mark_kept_modules(gm: torch.fx.GraphModule, model: torch.nn.Module) -> int:
    """Tag the nodes that run in a module ``model``'s ``_keep_in_fp32_modules`` names; returns how many."""
    kept = {t: kept_modules(model, t) for t in HALF_NAMES}
    if not any(kept.values()):
        return 0
    owner = type(model).__name__
    count = 0
    for node in gm.graph.nodes:
        info = node.meta.get(META_INFO)
        if info is None or node.op not in ("call_function", "call_method", "call_module"):
            continue
        hits: dict[tuple[str, str, str], list[str]] = {}
        for target in HALF_NAMES:  # the innermost kept module the node runs in, per target
            path = next((p for p, _ in reversed(info.module_stack) if p in kept[target]), None)
            if path is not None:
                hits.setdefault((path, *kept[target][path]), []).append(target)
        for (path, attr, entry), targets in hits.items():
            add_intent(node, UserIntent(
                label=f"{attr} of {owner}: {entry}", precision="fp32", targets=tuple(targets),
                reason=(f"transformers keeps the weights of module {path!r} in fp32 when it loads {owner} in "
                        f"{' or '.join(targets)} ({attr} names {entry!r}): its ops stay fp32 whatever the rule files say")))
        count += bool(hits)
    return count
