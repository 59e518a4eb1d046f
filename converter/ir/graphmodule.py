"""GraphModule plumbing shared by the stages: lazy code generation and a GC pause for graph passes.

* FX generates (and ``compile``s) Python source for a GraphModule each time it is built or
  recompiled. The captured graph is rewritten before it ever runs, so generating its code at
  capture time is wasted work, and on a 9k-node graph code generation costs more than the whole
  pass. :func:`new_graph_module` builds torch's ``_LazyGraphModule`` (the one inductor uses), whose
  ``recompile()`` only marks the code stale; the code is generated once, for the final graph, by
  :func:`materialize`, which hands back a plain GraphModule (``convert`` calls it and reports the
  time as ``codegen_s``).
  Where torch lacks that class, a plain GraphModule is built and nothing changes but the timing.
* :func:`gc_paused`: a pass allocates tens of thousands of small, acyclic records; CPython's
  cyclic collector runs repeatedly over the whole heap meanwhile (~10 % of the pass on a 9k-node
  graph) and finds nothing to free.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import inspect
from collections.abc import Iterator
from typing import Any, Callable, Optional, TypeVar, cast

import torch
import torch.fx
from torch.fx.graph_module import _forward_from_src  # private; GraphModule.recompile's own helper

from converter.ir.fx_names import install as _quote_fx_names

_quote_fx_names()  # a module name holding quotes or a newline is data in generated code (converter/ir/fx_names.py)

_LazyGraphModule: Optional[type[torch.fx.GraphModule]]
try:  # private, but stable since torch 2.3 and used by inductor on every compile
    from torch.fx._lazy_graph_module import _LazyGraphModule as _Lazy
    _LazyGraphModule = _Lazy
except ImportError:  # pragma: no cover - a torch without it gets eager code generation
    _LazyGraphModule = None

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = ["new_graph_module", "materialize", "gc_paused", "pauses_gc", "TwoModeGraphModule", "with_eval_graph", "EVAL_PREFIX",
           "resolve_attr"]


def new_graph_module(root: torch.nn.Module, graph: torch.fx.Graph, class_name: str) -> torch.fx.GraphModule:
    """A GraphModule whose Python code is generated on first use instead of now."""
    cls = _LazyGraphModule if _LazyGraphModule is not None else torch.fx.GraphModule
    gm = cls(root, graph, class_name)
    _keep_non_persistent(root, gm)
    return gm


def retarget_calls(gm: torch.fx.GraphModule, targets: dict[Any, Any]) -> int:
    """Point every ``call_function`` node whose target is a key of ``targets`` at its value (same arguments);
    recompiles when any changed; returns how many nodes changed."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            node.target = targets[node.target]
            count += 1
    if count:
        gm.recompile()
    return count


def materialize(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` as a plain GraphModule with its code generated (an eager one is returned as is).

    A lazy GraphModule is rebuilt as ``torch.fx.GraphModule`` over the same graph, parameters and
    submodules (nothing is copied), which generates the code once. The plain class matters:
    TorchScript cannot compile ``_LazyGraphModule``'s methods, and ``torch.jit.script`` worked on
    converted models before capture became lazy.
    """
    if _LazyGraphModule is None or not isinstance(gm, _LazyGraphModule):
        return gm
    plain = torch.fx.GraphModule(gm, gm.graph, type(gm).__name__)
    plain.meta.update(gm.meta)
    _keep_non_persistent(gm, plain)
    return plain


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the duration (reference counting still frees)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def pauses_gc(fn: _F) -> _F:
    """Decorator form of :func:`gc_paused`, for the graph passes."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return cast(_F, wrapper)


#: the prefix of the attributes only the eval graph reads (its own constants, export's guard function)
EVAL_PREFIX = "_eval_"


class TwoModeGraphModule(torch.fx.GraphModule):
    """A GraphModule that runs one graph in train mode and another in eval mode.

    For models whose Python code branches on ``self.training`` in a way a graph cannot record
    (stochastic depth: ``if not training: return x``), capture traces the model once in each mode
    (:mod:`converter.passes.capture`). ``graph``, ``code`` and every stage that reads a graph see
    the *train* graph (what the report describes and the trainer edits); ``eval_graph`` is the one
    ``forward`` runs when ``self.training`` is False. Both read the same parameters, buffers and
    submodules (``state_dict`` has the original model's keys, once); tensors only the eval graph
    reads are non-persistent attributes named ``_eval_*``.

    ``copy.deepcopy`` keeps both graphs. Pickling the module object is refused (it would rebuild a
    one-graph module): save ``state_dict()`` or the emitted model.py instead. Tools that interpret
    ``graph`` rather than call ``forward`` (``torch.export`` of a GraphModule runs it through
    ``torch.fx.Interpreter``) see the train graph: :meth:`for_mode` gives a one-graph module.
    """

    # set on the class by recompile(): the generated forward of each graph
    _forward_train: Callable[..., Any]
    _forward_eval: Callable[..., Any]

    def __init__(self, root: Any, graph: torch.fx.Graph, class_name: str = "GraphModule", *,
                 eval_graph: Optional[torch.fx.Graph] = None, eval_root: Optional[torch.nn.Module] = None) -> None:
        if eval_graph is None:  # copy.deepcopy: root is a module holding a copy of our __dict__
            eval_graph = root.__dict__.get("_eval_graph")
        if not isinstance(eval_graph, torch.fx.Graph):
            raise TypeError("TwoModeGraphModule needs an eval_graph")
        self.__dict__["_eval_graph"] = eval_graph
        super().__init__(root, graph, class_name)
        for node in eval_graph.nodes:
            if node.op in ("get_attr", "call_module") and not _has_path(self, str(node.target)):
                _copy_eval_attr(root if eval_root is None else eval_root, self, str(node.target))
        _keep_non_persistent(root, self)

    @property
    def eval_graph(self) -> torch.fx.Graph:
        """The graph ``forward`` runs in eval mode."""
        graph: torch.fx.Graph = self.__dict__["_eval_graph"]
        return graph

    @property
    def eval_code(self) -> str:
        """The Python source of the eval-mode forward."""
        code: str = self.__dict__["_eval_code"]
        return code

    def for_mode(self, training: bool) -> torch.fx.GraphModule:
        """A plain GraphModule of one mode's graph over the same tensors (nothing is copied).

        Tools that interpret ``graph`` instead of calling ``forward`` (``torch.export`` of a
        GraphModule, ``torch.fx.Interpreter``) see the train graph; give them this for eval."""
        graph = self.graph if training else self.eval_graph
        module = torch.fx.GraphModule(self, graph, type(self).__name__)
        module.meta.update(self.meta)
        _keep_non_persistent(self, module)
        module.train(training)
        return module

    def recompile(self) -> Any:  # noqa: D102 - GraphModule.recompile, then the eval forward and the dispatch
        python_code = super().recompile()
        cls = type(self)
        cls._forward_train = cls.forward
        eval_graph = self.__dict__.get("_eval_graph")
        if eval_graph is not None:
            eval_code = eval_graph.python_code(root_module="self")
            self.__dict__["_eval_code"] = eval_code.src
            cls._forward_eval = _forward_from_src(eval_code.src, eval_code.globals)
        setattr(cls, "forward", _dispatching_forward(cls._forward_train))  # noqa: B010 (mypy: a method is replaced)
        return python_code

    def _deepcopy_init(self) -> Callable[..., None]:
        return TwoModeGraphModule.__init__

    def __reduce__(self) -> Any:
        raise TypeError("a converted module with separate train and eval graphs cannot be pickled; save its "
                        "state_dict() (the original model's keys) or the emitted model.py (Conversion.save)")


def _dispatching_forward(train_forward: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: TwoModeGraphModule, *args: Any, **kwargs: Any) -> Any:
        if self.training:
            return self._forward_train(*args, **kwargs)
        return self._forward_eval(*args, **kwargs)

    setattr(forward, "__signature__", inspect.signature(train_forward))  # noqa: B010 (not an attribute of a function's type)
    forward.__doc__ = "train(): the train-mode graph; eval(): the eval-mode graph (see TwoModeGraphModule)."
    return forward


def _keep_non_persistent(root: torch.nn.Module, module: torch.nn.Module) -> None:
    """GraphModule registers every copied buffer as persistent; keep the ones ``root`` did not save
    (HF Swin's ``relative_position_index``, a model's ``register_buffer(..., persistent=False)``) out
    of ``state_dict`` as they were. Every GraphModule built here from another module goes through it,
    and through :func:`_keep_tied_names`."""
    for path, sub in module.named_modules():
        try:
            original = root.get_submodule(path) if path else root
        except AttributeError:
            continue
        sub._non_persistent_buffers_set |= set(getattr(original, "_non_persistent_buffers_set", ())) & set(sub._buffers)
    _keep_tied_names(root, module)


def _keep_tied_names(root: torch.nn.Module, module: torch.nn.Module) -> None:
    """Every name ``root`` gives a tied tensor (``head.weight is emb.weight``) stays a name of it.

    A GraphModule copies only the attributes its graph reads, under the one name the tracer used, so
    ``emb.weight`` vanished from ``state_dict`` and the converted module no longer loaded strictly
    into the original class. Each missing alias is registered again on the same Parameter or buffer
    (in an empty container module where the path does not exist)."""
    have: dict[int, torch.Tensor] = {id(t): t for _n, t in module.named_parameters(remove_duplicate=False)}
    have.update({id(t): t for _n, t in module.named_buffers(remove_duplicate=False)})
    for kind, members in (("parameter", root.named_parameters(remove_duplicate=False)),
                          ("buffer", root.named_buffers(remove_duplicate=False))):
        for name, tensor in members:
            if id(tensor) not in have or _has_path(module, name):
                continue
            *path, leaf = name.split(".")
            owner = module
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            if kind == "parameter":
                owner.register_parameter(leaf, cast(torch.nn.Parameter, tensor))
            else:
                original = root.get_submodule(".".join(path)) if path else root
                owner.register_buffer(leaf, tensor, persistent=leaf not in original._non_persistent_buffers_set)


def _has_path(module: torch.nn.Module, target: str) -> bool:
    try:
        resolve_attr(module, target)
    except AttributeError:
        return False
    return True


def _copy_eval_attr(root: Any, to: torch.nn.Module, target: str) -> None:
    """Install ``root``'s ``target`` on ``to``: a plain tensor as a non-persistent buffer, so that
    ``.to()`` moves it and ``state_dict`` stays the original model's."""
    *path, leaf = target.split(".")
    source: Any = root
    for part in path:
        source = getattr(source, part)
        if not hasattr(to, part):
            to.add_module(part, torch.nn.Module())
        to = getattr(to, part)
    value = getattr(source, leaf)
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        to.register_buffer(leaf, value, persistent=False)
    else:
        setattr(to, leaf, value)


def with_eval_graph(train: torch.fx.GraphModule, eval_gm: torch.fx.GraphModule, *,
                    shared: Callable[[str], bool]) -> TwoModeGraphModule:
    """Combine ``train`` and ``eval_gm`` (the same model traced in each mode) into one module.

    ``shared(target)``: whether an attribute path names the same tensor or module in both (the
    original model's parameters, buffers and modules); the eval graph then reads ``train``'s. Every
    other attribute the eval graph reads is its own, renamed ``_eval_*``. ``train``'s meta is kept.
    Both graphs must take and return the same structure.
    """
    graph = eval_gm.graph
    train_codegen, eval_codegen = train.graph._codegen, graph._codegen
    train_info, eval_info = getattr(train_codegen, "pytree_info", None), getattr(eval_codegen, "pytree_info", None)
    if (train_info is None) != (eval_info is None) or (
            train_info is not None and eval_info is not None and (train_info.in_spec != eval_info.in_spec or train_info.out_spec != eval_info.out_spec)):
        raise ValueError("the train-mode and eval-mode graphs take or return different structures")
    own: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        if shared(target) and _has_path(train, target):
            continue
        renamed = EVAL_PREFIX + target.replace(".", "_")
        own[renamed] = eval_gm.get_submodule(target) if node.op == "call_module" else resolve_attr(eval_gm, target)
        node.target = renamed
    holder = torch.nn.Module()
    for name, value in own.items():
        if isinstance(value, torch.nn.Module):
            holder.add_module(name, value)
        else:
            setattr(holder, name, value)
    module = TwoModeGraphModule(train, train.graph, type(train).__name__, eval_graph=graph, eval_root=holder)
    module.meta.update(train.meta)
    module.train(train.training)
    for path, sub in module.named_modules():
        if path and _has_path(train, path):
            sub.training = train.get_submodule(path).training
    return module


def resolve_attr(module: torch.nn.Module, target: str) -> Any:
    """The attribute at dotted path ``target`` (a get_attr or call_module target) of ``module``."""
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value

