"""Train/eval mode splitting: one mode-aware graph, or a train graph and an eval graph.

A graph traced in train mode has its mode-dependent ops made to read ``self.training``
(:mod:`converter.passes.modes`); it is then run in eval mode and compared with the model in eval mode.
When the model branches on ``self.training`` some other way (or draws random numbers only in train
mode), :func:`split_modes` traces it again in eval mode (see :mod:`converter.passes.capture`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

from converter.ir.meta import ModesNote
from converter.ir.state import preserved_state
from converter.passes.capture.advice import short_reason
from converter.passes.capture.fx_trace import propagate
from converter.passes.capture.reserved import rename_reserved
from converter.passes.capture.shells import shell
from converter.passes.capture.values import Shapes
from converter.passes.modes import constant_flags, make_mode_aware, random_ops

__all__ = ["trace_in_mode", "split_modes"]


def trace_in_mode(trace, name: str, model: torch.nn.Module, args: tuple, kwargs: dict, shapes: Shapes, *,
                  training: Optional[bool] = None, config: Optional[dict] = None) -> tuple:
    """(graph, mode-dependent nodes made to read self.training) of ``model`` traced in train mode
    (``training=True``: mode-aware), eval mode (False) or its own (None), with the ``config``
    fields set. The trace runs on a :func:`~converter.passes.capture.shells.shell` of ``model``: the
    graph shares its tensors, and the mode and config changes stay on the shell. Root names that are
    GraphModule's own (``graph``, ``code``, ``meta``) are renamed on the shell
    (:func:`~converter.passes.capture.reserved.rename_reserved`)."""
    shelled = shell(model, config=config)
    rename_reserved(shelled)
    if training is not None:
        shelled.train(training)
    gm = trace(shelled, args, kwargs, shapes)
    changed = make_mode_aware(gm) if training else []
    if name == "fx":
        propagate(gm, args, kwargs)
    return gm, changed


def split_modes(trace, name: str, model: torch.nn.Module, gm: torch.fx.GraphModule, changed: list,
                args: tuple, kwargs: dict, shapes: Shapes) -> tuple:
    """(train graph, eval graph or None, note): one mode-aware graph when it computes in eval mode
    what the model does and draws no random numbers eval mode does not; else an eval graph too."""
    differs = _eval_mismatch_or_failure(gm, model, args, kwargs)
    eval_gm = None
    kept = ""
    random = random_ops(gm)
    if differs or random:
        eval_gm, _ = trace_in_mode(trace, name, model, args, kwargs, shapes, training=False)
        restored = constant_flags(gm, eval_gm) if differs and changed else []
        if restored:  # literals the model passes in eval mode too (MC dropout): not the mode
            changed = [c for c in changed if c not in restored]
            kept = f"; {len(restored)} train-mode literal(s) kept, the model passes them in eval mode too (e.g. MC dropout)"
            differs = _eval_mismatch_or_failure(gm, model, args, kwargs)
        dropped = len(random) - len(random_ops(eval_gm))
        if not differs and dropped > 0:
            differs = f"{dropped} random op(s) run in train mode only (e.g. stochastic depth)"
        elif not differs:
            eval_gm = None  # the random ops run in both modes: one graph serves
    _set_modes(gm, model)
    if eval_gm is None:
        if any(t.is_meta for t in model.parameters()):
            kept += "; eval mode was run but not compared by value (the model has no weights)"
        return gm, None, ModesNote("follows", f"follows train()/eval(): traced in train mode, {len(changed)} "
                                              f"mode-dependent ops read self.training{kept}")
    _set_modes(eval_gm, model)
    return gm, eval_gm, ModesNote("two_graphs", f"follows train()/eval() with two graphs: the model branches on self.training "
                                                f"({differs}), so it was traced in each mode and the converted module runs "
                                                "the train graph in train mode and the eval graph in eval mode (the report "
                                                "describes the train graph)")


def _set_modes(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """The converted module starts in the original's mode; leaf modules keep their own."""
    gm.train(model.training)
    originals = dict(model.named_modules())
    for path, sub in gm.named_modules():
        if path in originals:
            sub.training = originals[path].training


def _eval_mismatch_or_failure(gm: torch.fx.GraphModule, model: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[str]:
    """:func:`_eval_mismatch`, or why the train graph cannot run in eval mode (it then needs a graph of its own)."""
    try:
        return _eval_mismatch(gm, model, args, kwargs)
    except Exception as exc:
        return f"running the train graph in eval mode failed ({short_reason(exc)})"


def _buffer_versions(module: torch.nn.Module) -> dict[str, int]:
    """Each buffer's autograd version counter: it moves on every in-place write."""
    return {name: buf._version for name, buf in module.named_buffers(remove_duplicate=False)}


def _updated(module: torch.nn.Module, before: dict[str, int]) -> set[str]:
    """The buffers of ``module`` written in place since ``before`` (:func:`_buffer_versions`)."""
    return {name for name, buf in module.named_buffers(remove_duplicate=False) if before.get(name) != buf._version}


def _eval_mismatch(gm: torch.fx.GraphModule, model: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[str]:
    """Why ``gm`` in eval mode does not compute what ``model`` computes in eval mode (None: it does)."""
    reference = shell(model).eval()  # the model's own modes are left as they are
    without_weights = any(t.is_meta for t in model.parameters())
    with preserved_state(gm, reference), torch.no_grad():
        torch.manual_seed(0)  # the same random numbers for both (noise a model adds in eval mode too)
        before = _buffer_versions(reference)
        try:
            want = pytree.tree_leaves(reference(*args, **kwargs))
        except Exception:
            if not without_weights:
                raise
            want = None  # eager code that reads a value (a mask check's .item()) cannot run on meta weights
        theirs = _updated(reference, before)
        gm.eval()
        torch.manual_seed(0)
        before = _buffer_versions(gm)
        got = pytree.tree_leaves(gm(*args, **kwargs))  # the graph runs in eval mode, at least
        mine = _updated(gm, before)
    # spectral_norm's power iteration: a train-only in-place update the outputs barely show (1e-4)
    updates = (f"in eval mode the graph updates buffer(s) {', '.join(sorted(mine)[:3])}, which the model leaves alone"
               if mine and not theirs else None)
    if want is None:
        return updates
    want = [t for t in want if isinstance(t, torch.Tensor)]
    got = [t for t in got if isinstance(t, torch.Tensor)]
    if len(want) != len(got):
        return f"in eval mode the graph returns {len(got)} tensors, the model {len(want)}"
    for i, (w, g) in enumerate(zip(want, got)):
        if w.shape != g.shape or w.dtype != g.dtype:
            return f"in eval mode output {i} is {tuple(g.shape)} {g.dtype}, the model's {tuple(w.shape)} {w.dtype}"
        if w.is_meta or g.is_meta:  # a model built without weights (empty_weights) has no values to compare
            continue
        if w.is_floating_point() and w.numel():
            scale = max(1.0, float(w.abs().max()))
            diff = float((w - g).abs().max())
            if not diff <= 1e-4 * scale:  # also catches NaN
                return f"in eval mode output {i} differs from the model's by {diff:.3g} (it branches on self.training)"
        elif not torch.equal(w, g):
            return f"in eval mode output {i} differs from the model's"
    return updates
