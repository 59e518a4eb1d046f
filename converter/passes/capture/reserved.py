"""User names that are GraphModule's own: ``graph``, ``code``, ``meta``...

A model whose root has a submodule, parameter, buffer or tensor attribute named like an attribute of
``torch.fx.GraphModule`` (a graph network's ``self.graph``, a clinical model's ``self.code`` embedding, a
``self.meta`` parameter) cannot become one: torch refuses ("cannot assign 'torch.fx.graph.Graph' as child
module 'graph'", "attribute 'meta' already exists"). Only the root's names can collide (a GraphModule
installs ``blocks.0.graph`` under ``blocks``).

:func:`rename_reserved` gives such a name another one on the shell that is traced (``graph`` ->
``graph_``), with a property of the old name on the shell's own class so that the model's code still
reads ``self.graph``. :func:`keep_user_names` makes the captured module's ``state_dict`` and
``load_state_dict`` speak the model's names (``graph.weight``), so checkpoints go both ways;
``USER_NAMES`` on the GraphModule maps each new name to the model's, which
:mod:`converter.inplace` reads to bind an applied model's tensors.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx

__all__ = ["USER_NAMES", "reserved_names", "rename_reserved", "keep_user_names", "user_path"]

#: GraphModule attribute holding {name in the graph: the model's name} for the renamed root names
USER_NAMES = "_mp_user_names"


@functools.cache
def reserved_names() -> frozenset:
    """Names a GraphModule (and our two-mode one) has that a plain ``nn.Module`` does not."""
    from converter.ir.graphmodule import TwoModeGraphModule

    plain = set(dir(torch.nn.Module)) | set(vars(torch.nn.Module()))
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    names = set(dir(torch.fx.GraphModule)) | set(vars(gm)) | set(dir(TwoModeGraphModule))
    names |= {"graph", "code", "meta", "_graph", "_code", "_tracer_cls", "_tracer_extras", "_in_spec", "_out_spec",
              "range_constraints", "_guards_fn", "_forward_train", "_forward_eval", USER_NAMES}
    return frozenset(n for n in names - plain if not n.startswith("__"))


def rename_reserved(shell: torch.nn.Module) -> dict[str, str]:
    """Rename ``shell``'s reserved root names in place (see the module docstring); {new name: old name}."""
    reserved = reserved_names()
    owned = [k for table in (shell._modules, shell._parameters, shell._buffers) for k in table]
    plain = [k for k, v in vars(shell).items() if isinstance(v, torch.Tensor)]
    clashes = [k for k in dict.fromkeys(owned + plain) if k in reserved]
    if not clashes:
        return {}
    taken = set(owned) | set(vars(shell)) | set(dir(type(shell))) | reserved
    renamed: dict[str, str] = {}
    for old in clashes:
        new = old + "_"
        while new in taken:
            new += "_"
        taken.add(new)
        renamed[new] = old
        tables: tuple[dict[str, Any], ...] = (shell._modules, shell._parameters, shell._buffers, shell.__dict__)
        for table in tables:
            if old in table:
                table[new] = table.pop(old)
        if old in shell._non_persistent_buffers_set:
            shell._non_persistent_buffers_set = (shell._non_persistent_buffers_set - {old}) | {new}
    properties = {old: property(functools.partial(_read, name=new)) for new, old in renamed.items()}
    shell.__class__ = type(type(shell).__name__, (type(shell),), {**properties, "__module__": type(shell).__module__})
    return renamed


def _read(module: torch.nn.Module, *, name: str) -> Any:
    return getattr(module, name)


def user_path(renamed: dict[str, str], path: str) -> str:
    """The model's name of a dotted ``path`` of the graph (its first part renamed back)."""
    head, dot, rest = path.partition(".")
    return renamed.get(head, head) + dot + rest


def keep_user_names(gm: torch.nn.Module, renamed: dict[str, str]) -> None:
    """``gm``'s state_dict and load_state_dict use the model's names for the renamed root names."""
    if not renamed:
        return
    gm.__dict__[USER_NAMES] = dict(renamed)
    back = {old: new for new, old in renamed.items()}

    def rename(state: dict, prefix: str, table: dict) -> None:
        for key in [k for k in state if k.startswith(prefix)]:
            head, dot, rest = key[len(prefix):].partition(".")
            if head in table:
                state[prefix + table[head] + dot + rest] = state.pop(key)

    def saved(module: torch.nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        rename(state, prefix, renamed)

    def loading(module: torch.nn.Module, state: dict, prefix: str, *args: Any) -> None:
        rename(state, prefix, back)

    gm.register_state_dict_post_hook(saved)
    gm.register_load_state_dict_pre_hook(loading)
