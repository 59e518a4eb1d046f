"""The helpers every numerics user shares; one copy of each, used across the package.

* :func:`sqnr_db` — the one SQNR: ``20·log10(‖ref‖ / ‖ref − out‖)`` in dB, in float64.
* :func:`output_tensors` / :func:`floating_outputs` — the one output flattener (tuples, lists,
  dicts, HF ``ModelOutput`` and other objects with ``to_tuple()``), in pytree order.
* :func:`preserved_state` — the one guard that runs models without leaving a trace: buffers
  (BatchNorm statistics), train/eval flags and the RNG state are restored.
* :func:`json_float` / :func:`to_json` / :func:`from_json_float` — the one convention for
  non-finite numbers in report.json and the other JSON files, re-exported from the torch-free
  :mod:`converter.ir.json_numbers` (which readers without torch import directly).
* :func:`copy_graph` and :func:`progress_bar`, shared by calibration and the accuracy search.
"""
from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable, Optional

import torch
import torch.fx
from torch.utils import _pytree as pytree

from converter.ir.json_numbers import NONFINITE_JSON, from_json, from_json_float, json_float, to_json
from converter.ir.state import preserved_state

__all__ = [
    "sqnr_db",
    "output_tensors",
    "floating_outputs",
    "preserved_state",
    "NONFINITE_JSON",
    "json_float",
    "to_json",
    "from_json_float",
    "from_json",
    "copy_graph",
    "progress_bar",
]


# ---------------------------------------------------------------------------------------------
# SQNR


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio of ``out`` against ``ref``, in dB.

    ``20·log10(‖ref‖ / ‖ref − out‖)`` over all elements (both flattened, computed in float64 on
    the CPU). The contract:

    * ``+inf`` when ``out`` equals ``ref`` exactly (empty tensors included);
    * ``-inf`` when ``ref`` is all zero and ``out`` is not;
    * non-finite values: a position where both hold the same non-finite value (the same infinity,
      or NaN in both) is equal and adds no error; any other position where either is non-finite
      makes the result ``-inf`` (the output does not represent the reference there);
    * ``ValueError`` when the element counts differ.
    """
    r = ref.detach().to("cpu", torch.float64).reshape(-1)
    o = out.detach().to("cpu", torch.float64).reshape(-1)
    if r.numel() != o.numel():
        raise ValueError(f"sqnr_db: shapes differ in size: {tuple(ref.shape)} vs {tuple(out.shape)}")
    finite = torch.isfinite(r) & torch.isfinite(o)
    if not bool(finite.all()):
        same = (r == o) | (torch.isnan(r) & torch.isnan(o))
        if not bool((finite | same).all()):
            return -math.inf
        r, o = r[finite], o[finite]
    err = float(torch.linalg.vector_norm(r - o))
    if err == 0.0:
        return math.inf
    signal = float(torch.linalg.vector_norm(r))
    if signal == 0.0:
        return -math.inf
    return 20.0 * math.log10(signal / err)


# ---------------------------------------------------------------------------------------------
# model outputs


def output_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor of a model output, in pytree order.

    Tuples, lists and dicts (values in insertion order) are walked by pytree; an object pytree
    does not know that has ``to_tuple()`` (a transformers ``ModelOutput``) is walked through it.
    Anything else (None, numbers, strings) is skipped.
    """
    found: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif callable(getattr(leaf, "to_tuple", None)):
            found.extend(output_tensors(leaf.to_tuple()))
    return found


def floating_outputs(value: Any, *, fp64: bool = True) -> list[torch.Tensor]:
    """The floating tensors of :func:`output_tensors`; ``fp64=False`` also leaves out float64 ones
    (the rewrite never touches fp64 values)."""
    return [t for t in output_tensors(value) if t.is_floating_point() and (fp64 or t.dtype != torch.float64)]


# ---------------------------------------------------------------------------------------------
# running a model without leaving a trace


# ---------------------------------------------------------------------------------------------
# graphs and progress


def copy_graph(gm: torch.fx.GraphModule) -> tuple[torch.fx.Graph, dict]:
    """A deep copy of ``gm.graph`` (same codegen, so the same calling convention) and old→new nodes."""
    old = gm.graph
    mapping: dict = {}
    graph = torch.fx.Graph(tracer_cls=old._tracer_cls)
    copied: Any = graph.graph_copy(old, val_map=mapping, return_output_node=True)  # typed without the output node
    output_val, old_output = copied
    graph._codegen = copy.deepcopy(old._codegen)
    new_output = graph.output(output_val, type_expr=getattr(old_output, "type", None))
    new_output.meta = copy.copy(old_output.meta)
    mapping[old_output] = new_output
    return graph, mapping


def progress_bar(enabled: bool):
    """A rich progress bar on stderr; disabled when ``enabled`` is false or stderr is not a terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    show = bool(enabled) and console.is_terminal
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True, disable=not show,
    )


def user_loss(output: Any, item: Any, loss_fn: Optional[Callable], note: list, who: str,
              instead: str) -> Optional[torch.Tensor]:
    """``loss_fn(output, item)`` as an fp32 scalar, or None when there is no ``loss_fn`` or it does not fit.

    The first misfit is noted in ``note`` (later batches then skip ``loss_fn``) and warned about once as
    ``"{who}: <why>; using {instead} instead"``: a loss_fn written for train_batches() may not fit calibration
    batches, and the caller falls back to a loss of its own (``instead`` says which).
    """
    if loss_fn is None or note:
        return None
    try:
        loss = loss_fn(output, item)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            return loss.float().reshape(())
        note.append(f"loss_fn returned {type(loss).__name__} {getattr(loss, 'shape', '')}, not a scalar tensor")
    except Exception as exc:  # a loss_fn written for train_batches() may not fit calibration batches
        note.append(f"loss_fn(output, batch) failed on a calibration batch: {type(exc).__name__}: {exc}")
    warnings.warn(f"{who}: {note[0]}; using {instead} instead", stacklevel=4)
    return None
