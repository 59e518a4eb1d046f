"""Activation checkpointing kept: ``torch.utils.checkpoint.checkpoint`` regions survive conversion.

Both tracers inline a checkpointed call (``checkpoint(block, x, use_reentrant=False)``, Hugging
Face's ``gradient_checkpointing_enable``): the graph gets the block's ops and no checkpoint, and the
converted model saves every activation of the block again (~10x the memory on a stack of blocks).

* **capture** traces under :class:`CheckpointMarks`, which stands in for the checkpoint machinery
  (``torch.utils.checkpoint._checkpoint_without_reentrant_generator`` and ``CheckpointFunction``,
  looked up at call time however the model imported ``checkpoint``) and tags every node made
  inside a call with ``node.meta["mp_checkpoint"]``, a :class:`~converter.ir.meta.CheckpointTag`
  (region id, ``preserve_rng_state``). The FX tracer reads :func:`active_tag` when it makes a
  node; torch.export (non-strict) records the region id through ``torch.fx.traceback.annotate``,
  which :func:`tag_export_graph` turns into tags.
* decide, place and rewrite work on the flat graph as usual. The rewrite gives each inserted cast
  the tag of its consumer and never shares a cast across a region's edge, so the casts of a
  region's inputs run (and are recomputed) inside it.
* :func:`checkpoint_regions` (the ``checkpoint`` stage, after fp32_math) finds each region's
  nodes and installs :class:`CheckpointCodeGen` on the graph. The graph stays flat (the report,
  the trainer and the ONNX export read every node); the *generated code* of ``conv.module`` and of
  model.py runs each region as a nested function called through
  ``torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False, preserve_rng_state=...)``::

      def _checkpoint_0(x, blocks_0_ln_weight, ...):
          ...  # the region's converted nodes, casts included
          return (add,)
      checkpoint_0 = torch.utils.checkpoint.checkpoint(_checkpoint_0, x, ..., use_reentrant=False, preserve_rng_state=True)
      add_out = checkpoint_0[0]

  A region is the span of the graph from its first tagged node to its last; untagged nodes in
  the span (made by a later pass) run inside it. The passes that insert nodes before a region's
  first node tag them (rewrite's casts, lower's ops, fp32_math's and the no_grad regions'
  brackets); any other node made before it is computed outside and passed in.
  ``preserve_rng_state`` is the original's (default True), so dropout inside a region draws the
  same mask when recomputed.

Limits: a nested checkpoint runs inside its outer region (one checkpoint); a reentrant
checkpoint (``use_reentrant=True``) is kept as a non-reentrant one; a custom ``context_fn`` is not
kept (the region runs without checkpoint, and the report says so). Pickling ``conv.module``
re-traces its code and loses the regions (``state_dict`` and model.py keep them).
"""
from __future__ import annotations

import contextlib
import operator
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional, cast

import torch
import torch.fx
import torch.utils.checkpoint as _ckpt
from torch.fx.graph import CodeGen, PythonCode, _PyTreeCodeGen

from converter.ir.meta import META_CAST, META_CHECKPOINT, META_INFO, CheckpointTag

__all__ = ["CheckpointMarks", "active_tag", "tag_export_graph", "checkpoint_regions", "CheckpointCodeGen", "CheckpointPyTreeCodeGen",
           "Region", "find_regions", "with_checkpoints", "count_checkpoint_calls", "regions_in"]

#: the ``torch.fx.traceback.annotate`` key export records a region id under
_ANNOTATION = "mpconvert_checkpoint"

# ---------------------------------------------------------------------------------------------
# capture: mark the ops made inside a checkpoint call

_STACK: list[CheckpointTag] = []


def active_tag() -> Optional[CheckpointTag]:
    """The outermost checkpoint region being traced now (None outside any)."""
    return _STACK[0] if _STACK else None


class CheckpointMarks:
    """Context manager: while tracing, checkpoint calls run their function directly (no saved-tensor
    hooks) and the nodes made meanwhile are tagged; ``tags`` lists the regions, in call order."""

    def __init__(self, *, annotate: bool = False):
        self.annotate = annotate
        self.tags: list[CheckpointTag] = []
        self.skipped: list[str] = []

    def _enter(self, preserve: bool, reentrant: bool, context_fn: Any = None) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if context_fn is not None and context_fn is not _ckpt.noop_context_fn:
            self.skipped.append("a checkpoint with a custom context_fn runs without checkpoint (not kept)")
            return stack
        if _STACK:  # nested: part of the outer region
            return stack
        tag = CheckpointTag(region=len(self.tags), preserve_rng_state=bool(preserve), reentrant=reentrant)
        self.tags.append(tag)
        _STACK.append(tag)
        stack.callback(lambda: _STACK.remove(tag) if tag in _STACK else None)
        if self.annotate:
            import torch.fx.traceback as fx_traceback

            # node meta is copied from the tracing context only while preserve_node_meta is on: on
            # here, inside the region, so nothing changes for the rest of the model
            stack.enter_context(fx_traceback.preserve_node_meta())
            stack.enter_context(fx_traceback.annotate({_ANNOTATION: (tag.region, tag.preserve_rng_state, reentrant)}))
        return stack

    def __enter__(self) -> "CheckpointMarks":
        marks = self
        self._saved = (_ckpt._checkpoint_without_reentrant_generator, _ckpt.CheckpointFunction)

        def generator(fn, preserve_rng_state=True, context_fn=_ckpt.noop_context_fn, *args, **kwargs):
            with marks._enter(preserve_rng_state, False, context_fn):
                yield  # checkpoint runs the function here

        class Reentrant:
            @staticmethod
            def apply(function, preserve, *args):
                with marks._enter(preserve, True):
                    return function(*args)

        _ckpt._checkpoint_without_reentrant_generator = generator
        setattr(_ckpt, "CheckpointFunction", Reentrant)  # noqa: B010 (torch's class is replaced on purpose)
        return self

    def __exit__(self, *exc) -> None:
        generator, function = self._saved
        _ckpt._checkpoint_without_reentrant_generator = generator
        setattr(_ckpt, "CheckpointFunction", function)  # noqa: B010
        _STACK.clear()


def tag_export_graph(gm: torch.fx.GraphModule) -> int:
    """Turn export's annotations into :class:`CheckpointTag` s on ``gm`` and its nested graphs."""
    count = 0
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            custom = node.meta.get("custom") or {}
            mark = custom.get(_ANNOTATION) if isinstance(custom, dict) else None
            if isinstance(mark, tuple) and len(mark) == 3:
                node.meta[META_CHECKPOINT] = CheckpointTag(*mark)
                count += 1
    return count


# ---------------------------------------------------------------------------------------------
# the regions of a converted graph


@dataclass
class Region:
    """One checkpoint region: its nodes in graph order, what it reads and what it hands out."""

    tag: CheckpointTag
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node]  # passed to checkpoint (which saves them for backward)
    attrs: list[torch.fx.Node]  # get_attr nodes outside it that it reads: read again inside
    outputs: list[torch.fx.Node]
    hoisted: list[torch.fx.Node]  # get_attr nodes in the span that outside nodes read too: also run before the call
    adopted: int  # untagged nodes (made by later passes) that run inside

    def summary(self) -> dict:
        casts = sum(1 for n in self.nodes if META_CAST in n.meta and n.meta[META_CAST].inserted)
        modules = [n.meta[META_INFO].module for n in self.nodes if META_INFO in n.meta and n.meta[META_INFO].module]
        prefix = _common_prefix(modules)
        return {"region": self.tag.region, "module": prefix, "nodes": len(self.nodes), "casts_inside": casts,
                "inputs": len(self.inputs), "outputs": len(self.outputs),
                "preserve_rng_state": self.tag.preserve_rng_state,
                "originally_reentrant": self.tag.reentrant}


def _common_prefix(paths: list[str]) -> str:
    if not paths:
        return ""
    parts = [p.split(".") for p in paths]
    out = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        out.append(items[0])
    return ".".join(out)


def find_regions(graph: torch.fx.Graph) -> tuple[list[Region], list[str]]:
    """The checkpoint regions of ``graph`` (see the module docstring) and why any tag was dropped."""
    nodes = list(graph.nodes)
    spans: dict[CheckpointTag, list[int]] = {}
    for i, node in enumerate(nodes):
        tag = node.meta.get(META_CHECKPOINT)
        if tag is not None and node.op not in ("placeholder", "output"):
            spans.setdefault(tag, [i, i])[1] = i
    regions: list[Region] = []
    problems: list[str] = []
    taken = -1
    for tag, (first, last) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        if first <= taken:
            problems.append(f"checkpoint region {tag.region} overlaps another after conversion; it runs without checkpoint")
            continue
        members = set(nodes[first:last + 1])
        clash = [n for n in members if n.meta.get(META_CHECKPOINT) not in (None, tag)]
        if clash:
            problems.append(f"checkpoint region {tag.region} interleaves with another ({clash[0].name}); it runs without checkpoint")
            continue
        span = nodes[first:last + 1]
        after = set(nodes[last + 1:])
        hoisted = [n for n in span if n.op == "get_attr" and any(u not in members for u in n.users)]
        inside = [n for n in span if n not in hoisted]
        inside_set = set(inside)
        inputs: list[torch.fx.Node] = []
        attrs: list[torch.fx.Node] = []
        for n in inside:
            for arg in n.all_input_nodes:
                if arg not in inside_set and arg not in inputs and arg not in attrs:
                    (attrs if arg.op == "get_attr" else inputs).append(arg)
        outputs = [n for n in inside if any(u not in inside_set for u in n.users)]
        if any(u not in after for n in outputs for u in n.users if u not in inside_set):
            problems.append(f"checkpoint region {tag.region}: a node before it reads its result; it runs without checkpoint")
            continue
        adopted = sum(1 for n in inside if n.meta.get(META_CHECKPOINT) is None)
        regions.append(Region(tag, inside, inputs, attrs, outputs, hoisted, adopted))
        taken = last
    return regions, problems


def checkpoint_regions(gm: torch.fx.GraphModule, *graphs: torch.fx.Graph) -> dict:
    """The ``checkpoint`` stage: install :class:`CheckpointCodeGen` on ``gm.graph`` (and ``graphs``)
    where they hold checkpoint regions; returns what ``report.records.lowering.checkpoint`` shows."""
    found: list[dict] = []
    notes: list[str] = []
    for graph in (gm.graph, *graphs):
        regions, problems = find_regions(graph)
        notes += problems
        if not regions:
            continue
        found += [r.summary() for r in regions]
        graph._codegen = with_checkpoints(graph._codegen)
    if found or notes:
        gm.recompile()
    return {"regions": found, "count": len(found), "notes": notes}


# ---------------------------------------------------------------------------------------------
# code generation


class _Name:
    """An argument FX writes as a bare name (the region's function)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _split(graph: torch.fx.Graph, regions: list[Region], namespace) -> tuple[torch.fx.Graph, list[tuple[str, str, torch.fx.Graph]]]:
    """(the outer graph with one checkpoint call per region, [(call node name, function name, region graph)])."""
    outer = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    starts = {r.hoisted[0] if r.hoisted else r.nodes[0]: r for r in regions}
    skip: set[torch.fx.Node] = set()
    parts: list[tuple[str, str, torch.fx.Graph]] = []
    for node in graph.nodes:
        region = starts.get(node)
        if region is None and node in skip:
            continue
        if region is None:
            env[node] = outer.node_copy(node, env.__getitem__)
            continue
        for h in region.hoisted:
            env[h] = outer.node_copy(h, env.__getitem__)
        skip.update(region.nodes)
        skip.update(region.hoisted)
        inner = torch.fx.Graph()
        inner_env: dict[torch.fx.Node, torch.fx.Node] = {}
        for arg in region.inputs:
            ph = inner.placeholder(arg.name)
            ph.meta.update(arg.meta)
            inner_env[arg] = ph
        for arg in region.attrs:  # parameters and buffers are read inside (checkpoint would save its inputs)
            inner_env[arg] = inner.node_copy(arg)
        for n in region.nodes:
            inner_env[n] = inner.node_copy(n, inner_env.__getitem__)
        inner.output(tuple(inner_env[o] for o in region.outputs))
        fn_name = namespace.create_name(f"_checkpoint_{region.tag.region}", object())
        call_name = fn_name.lstrip("_")
        call = outer.create_node(
            "call_function", _ckpt.checkpoint, (cast(Any, _Name(fn_name)), *(env[a] for a in region.inputs)),
            {"use_reentrant": False, "preserve_rng_state": region.tag.preserve_rng_state}, name=call_name)
        for k, out in enumerate(region.outputs):
            got = outer.create_node("call_function", operator.getitem, (call, k), name=f"{out.name}_out")
            got.meta.update(out.meta)
            env[out] = got
        parts.append((call.name, fn_name, inner))
    return outer, parts


if TYPE_CHECKING:  # mixed into a CodeGen class (below): its super() is that class
    _RegionsBase = CodeGen
else:
    _RegionsBase = object


class _CheckpointRegions(_RegionsBase):
    """Code generation that runs each checkpoint region as a nested function under checkpoint.

    Mixed into the graph's own code generator class (plain, torch.export's pytree one, or
    model.py's) by :func:`with_checkpoints`, so that everything else, ``isinstance`` checks
    included (GraphModule sets ``_in_spec`` only for a ``_PyTreeCodeGen``), stays the same."""

    def _gen_python_code(self, nodes, root_module: str, namespace, **kwargs) -> PythonCode:
        graph = nodes.graph
        regions, _ = find_regions(graph)
        if not regions:
            return super()._gen_python_code(nodes, root_module, namespace, **kwargs)
        outer, parts = _split(graph, regions, namespace)

        def node_repr(n: torch.fx.Node) -> str:
            return namespace.create_name(n.name, n)

        for g in (outer, *(p[2] for p in parts)):
            for n in g.nodes:
                n._repr_fn = node_repr
        outer._codegen = self
        code = super()._gen_python_code(outer.nodes, root_module, namespace, **kwargs)
        for _, _, inner in parts:  # a region's parameters take their unique names (no `x_1 = x` line)
            for n in inner.nodes:
                if n.op == "placeholder":
                    n.target = repr(n)
        src, globals_ = code.src, dict(code.globals)
        for call_name, fn_name, inner in parts:
            inner._codegen = CodeGen()
            body = inner._codegen._gen_python_code(inner.nodes, root_module, namespace, **kwargs)
            globals_.update(body.globals)
            text = body.src[body.src.index("def forward("):].rstrip()
            text = re.sub(r"^def forward\(self,?\s*", f"def {fn_name}(", text, count=1)
            src = _insert_before(src, call_name, text)
        return PythonCode(src, globals_, None)


def _insert_before(src: str, call_name: str, function: str) -> str:
    """Put ``function`` (a def at column 0) before the line assigning ``call_name`` in ``src``."""
    lines = src.split("\n")
    pattern = re.compile(rf"^(\s+){re.escape(call_name)}(\s*:[^=]*)? = ")
    for i, line in enumerate(lines):
        m = pattern.match(line)
        if m:
            indent = m.group(1)
            block = [indent + row if row else row for row in function.split("\n")]
            return "\n".join(lines[:i] + block + lines[i:])
    raise RuntimeError(f"internal error: checkpoint call {call_name!r} not found in the generated code")


class CheckpointCodeGen(_CheckpointRegions, CodeGen):
    """FX's plain code generator, with checkpoint regions."""


class CheckpointPyTreeCodeGen(_CheckpointRegions, _PyTreeCodeGen):
    """torch.export's pytree code generator, with checkpoint regions."""


_WITH_REGIONS: dict[type, type[_CheckpointRegions]] = {CodeGen: CheckpointCodeGen, _PyTreeCodeGen: CheckpointPyTreeCodeGen}


def with_checkpoints(codegen: CodeGen) -> CodeGen:
    """``codegen`` (its state kept) with checkpoint regions; a graph without regions generates as before."""
    if isinstance(codegen, _CheckpointRegions):
        return codegen
    base = type(codegen)
    cls = _WITH_REGIONS.get(base)
    if cls is None:  # model.py's generator: a class made here (never pickled: it lives on a throwaway graph)
        cls = _WITH_REGIONS[base] = type(f"Checkpoint{base.__name__}", (_CheckpointRegions, base), {})
    new = cls.__new__(cls)
    new.__dict__.update(codegen.__dict__)
    return new


def count_checkpoint_calls(source: str) -> int:
    """How many checkpoint calls a generated source (``conv.module.code``, model.py) makes."""
    return len(re.findall(r"\bcheckpoint\(_checkpoint_\d+", source))


def regions_in(graph: torch.fx.Graph) -> Iterator[Region]:
    """The regions code generation outlines (for tests and tools)."""
    yield from find_regions(graph)[0]
