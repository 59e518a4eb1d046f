"""Train/eval modes of a captured graph (part of *capture*).

A graph records the mode it was traced in as literal arguments: ``aten.dropout(x, 0.1, True)``,
``aten.batch_norm(..., training=True, ...)``, ``scaled_dot_product_attention(..., dropout_p=0.1)``
and BatchNorm's ``num_batches_tracked.add_(1)``. Capture therefore traces the model in **train
mode**, where every mode-dependent op is present with its train-mode arguments, and
:func:`make_mode_aware` replaces those literals by the graph module's own ``self.training``
(a ``get_attr`` of ``training``; FX writes it as ``self.training`` in the generated code):

=======================================  =====================================================
train-mode literal                       becomes
=======================================  =====================================================
dropout / feature / alpha dropout        ``train=self.training``
``F.dropout(..., training=True)`` (FX)   ``training=self.training``
``batch_norm(..., training=True, ...)``  ``training=self.training`` (running stats update and
                                         are used exactly as in ``nn.BatchNorm``)
RNN ``train=True`` (LSTM/GRU dropout)    ``train=self.training``
``sdpa(..., dropout_p=p)``, p > 0        ``dropout_p=p * self.training`` (``0.0`` in eval)
``num_batches_tracked.add_(1)``          ``add_(self.training)`` (adds 0 in eval)
=======================================  =====================================================

Only ``True`` flags (and non-zero probabilities) are rewritten: a submodule that was in eval mode
inside a model in train mode (a frozen BatchNorm) stays in eval mode. A batch norm without running
statistics (``F.batch_norm(w, None, None, training=True)``: weight standardisation) uses its batch's
statistics in both modes and keeps ``training=True``. When the eval check below fails, the eval-mode
trace tells mode flags from constants: :func:`constant_flags` gives back the literal of a flag the
model passes in eval mode too (``F.dropout(x, p, training=True)``: MC dropout, random in both modes). ``.train()``/``.eval()`` on
the converted module then behave as on the original. Capture checks the mode it did not trace
(eval) against the original model on the example inputs; a model whose Python code branches on
``self.training`` in some other way fails that check and is captured in its own mode instead,
with its mode frozen and the reason in the report (``report.records.capture.modes``).
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx
import torch.nn.functional as F

from converter.ir.meta import META_MODE_FLAG

__all__ = ["make_mode_aware", "constant_flags", "random_ops", "is_random", "MODE_ATTR"]

#: the GraphModule attribute the rewritten arguments read
MODE_ATTR = "training"

_aten = torch.ops.aten
_FLAG_ARGS: dict[Any, tuple[int, str]] = {}
for _name in ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"):
    if hasattr(_aten, _name):
        _FLAG_ARGS[getattr(_aten, _name).default] = (2, "train")
_FLAG_ARGS[_aten.batch_norm.default] = (5, "training")
for _name in ("lstm", "gru", "rnn_tanh", "rnn_relu"):
    _FLAG_ARGS[getattr(_aten, _name).input] = (6, "train")
for _fn in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout):
    _FLAG_ARGS[_fn] = (2, "training")
_FLAG_ARGS[F.batch_norm] = (5, "training")
_SDPA = (_aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention)


def make_mode_aware(gm: torch.fx.GraphModule) -> list[str]:
    """Rewrite the train-mode literals of ``gm`` (traced in train mode) to read ``self.training``.

    Returns the names of the nodes changed. ``gm.training`` is left as it is.
    """
    graph = gm.graph
    mode: Optional[torch.fx.Node] = None
    changed: list[str] = []

    def mode_node() -> torch.fx.Node:
        nonlocal mode
        if mode is None:
            first = next(n for n in graph.nodes if n.op != "placeholder")
            with graph.inserting_before(first):
                # create_node, not graph.get_attr: the target is a bool attribute, not a tensor or module
                mode = graph.create_node("get_attr", MODE_ATTR, name="training")
            mode.meta[META_MODE_FLAG] = True
        return mode

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _FLAG_ARGS:
            index, name = _FLAG_ARGS[node.target]
            if _get(node, index, name) is True and not _batch_statistics_only(node):
                _set(node, index, name, mode_node())
                changed.append(node.name)
        elif node.target in _SDPA:
            p = _get(node, 4, "dropout_p")
            if isinstance(p, float) and p > 0:
                with graph.inserting_before(node):
                    scaled = graph.call_function(operator.mul, (p, mode_node()))
                scaled.meta[META_MODE_FLAG] = True
                _set(node, 4, "dropout_p", scaled)
                changed.append(node.name)
        elif _is_batch_counter(gm, node):
            node.args = (node.args[0], mode_node())
            changed.append(node.name)
    if changed:
        gm.recompile()
    return changed


#: where each batch norm takes its running statistics: aten's schema puts weight and bias first
_RUNNING_STATS = {_aten.batch_norm.default: (3, 4), F.batch_norm: (1, 2)}


def _batch_statistics_only(node: torch.fx.Node) -> bool:
    """A batch norm with no running statistics (``F.batch_norm(w, None, None, training=True)``: weight
    standardisation, ``track_running_stats=False``) normalises by its batch's statistics in both modes:
    its ``training=True`` is a constant, not the mode (with ``training=False`` it would fail)."""
    if node.target not in _RUNNING_STATS:
        return False
    mean, var = _RUNNING_STATS[node.target]
    return _get(node, mean, "running_mean") is None and _get(node, var, "running_var") is None


def constant_flags(train_gm: torch.fx.GraphModule, eval_gm: torch.fx.GraphModule) -> list[str]:
    """Undo :func:`make_mode_aware` on the nodes of ``train_gm`` whose literal the model passes in eval
    mode too: ``F.dropout(x, p, training=True)`` (MC dropout) is random in both modes, not a mode flag.

    ``eval_gm`` is the model traced in eval mode (not made mode-aware). The flag nodes of both graphs
    (dropout, batch norm, RNN, attention dropout) are matched in graph order; when both graphs have the
    same ones, a rewritten node whose eval-mode counterpart still says ``True`` (or ``dropout_p > 0``)
    gets its literal back. Returns the names of the nodes restored (none when the graphs do not match).
    """
    def flags(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
        return [n for n in gm.graph.nodes if n.op == "call_function" and (n.target in _FLAG_ARGS or n.target in _SDPA)]

    ours, theirs = flags(train_gm), flags(eval_gm)
    if len(ours) != len(theirs) or any(a.target is not b.target for a, b in zip(ours, theirs)):
        return []
    restored: list[str] = []
    for node, other in zip(ours, theirs):
        if node.target in _FLAG_ARGS:
            index, name = _FLAG_ARGS[node.target]
            flag = _get(node, index, name)
            if _reads_mode(flag) and _get(other, index, name) is True:
                _set(node, index, name, True)
                restored.append(node.name)
        else:
            p = _get(node, 4, "dropout_p")
            kept = _get(other, 4, "dropout_p")
            if isinstance(p, torch.fx.Node) and p.target is operator.mul and _reads_mode(p.args[1]) \
                    and isinstance(kept, float) and kept > 0:
                _set(node, 4, "dropout_p", p.args[0])
                if not p.users:
                    train_gm.graph.erase_node(p)
                restored.append(node.name)
    if restored:
        for node in list(train_gm.graph.nodes):  # the mode attribute read by nothing any more
            if node.op == "get_attr" and node.target == MODE_ATTR and node.meta.get(META_MODE_FLAG) and not node.users:
                train_gm.graph.erase_node(node)
        train_gm.recompile()
    return restored


def _reads_mode(value: Any) -> bool:
    return isinstance(value, torch.fx.Node) and value.op == "get_attr" and value.target == MODE_ATTR


def _get(node: torch.fx.Node, index: int, name: str) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else None


def _set(node: torch.fx.Node, index: int, name: str, value: Any) -> None:
    if name in node.kwargs:
        node.update_kwarg(name, value)
    else:
        node.update_arg(index, value)


def _is_batch_counter(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """BatchNorm's ``num_batches_tracked.add_(1)`` (export only; FX keeps BatchNorm a module)."""
    if node.target is not _aten.add_.Tensor or len(node.args) != 2 or node.args[1] != 1:
        return False
    target = node.args[0]
    return (
        isinstance(target, torch.fx.Node)
        and target.op == "get_attr"
        and str(target.target).rsplit(".", 1)[-1] == "num_batches_tracked"
    )


#: ops that draw random numbers (aten overload packets, torch functions and Tensor methods by name)
_RANDOM = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli", "bernoulli_",
    "normal", "normal_", "uniform_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_", "poisson",
    "multinomial", "native_dropout",
})


def is_random(name: str) -> bool:
    """Whether an op, torch function or Tensor method of this name draws random numbers."""
    return name in _RANDOM


def random_ops(gm: torch.fx.GraphModule) -> list[str]:
    """The nodes that draw random numbers whatever the mode: dropout, which reads ``self.training``
    after :func:`make_mode_aware`, is not one of them; stochastic depth's ``rand``/``bernoulli_`` is."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_method":
            name = str(node.target)
        elif node.op == "call_function":
            packet = getattr(node.target, "_overloadpacket", None)
            name = getattr(packet if packet is not None else node.target, "__name__", "")
        else:
            continue
        if name in _RANDOM:
            found.append(node.name)
    return found
