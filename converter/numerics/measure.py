"""Measurements for the audit report: casts, saved activations and numerics on the example inputs.

The report's static numbers come from ``node.meta``; this module checks them by running the model
(benchmarks/README.md, "how to measure"):

* **casts** — :class:`CastCounter`, a ``TorchDispatchMode`` that counts the ``aten._to_copy`` calls
  that change one floating dtype into another, with their bytes (numel · (src + dst itemsize)).
  A cast whose input is a parameter or buffer of the module is a *weight* cast; the others are
  *activation* casts. It runs during the saved-activation forward below (grad on), on the
  converted module and on ``torch.autocast`` over the original.
* **saved activations** — ``torch.autograd.graph.saved_tensors_hooks`` records every tensor
  autograd saves for backward during one forward (grad enabled, the module's own train/eval
  mode). Bytes are counted once per storage (views share it). Storages of parameters and buffers
  are not activations and are excluded; half copies of parameters (O1 weight casts, autocast's
  weight casts) are reported apart as ``weight_copy`` bytes: under O2 they are the stored
  parameters themselves.
* **numerics** — the output of the converted module, and of ``torch.autocast`` on the original,
  against the fp32 original: SQNR = 20·log10(‖ref‖/‖ref−out‖) in dB over all floating outputs,
  and the maximum absolute error. Run in eval mode when the module supports it (dropout off).
* **per-node error attribution** — one pass over the converted graph that evaluates every node on
  the converted values (*mixed*) and on fp32 reference values (the same graph with the inserted
  casts made identities, which is the fp32 model), and once more, only where an input's dtype
  differs between the two, on the reference inputs rounded to the converted dtypes (*local*).
  For each node it reports the
  *cumulative* SQNR (mixed vs reference output) and the *local* SQNR: the node run on the
  reference inputs rounded to the dtypes they have in the converted graph, against the reference
  output, i.e. the error this node adds by itself. The nodes with the lowest local SQNR are the
  ones to pin to fp32 first.
* **below autocast** — an output SQNR more than 3 dB under autocast's is a
  :class:`~converter.numerics.gap.BelowAutocastWarning` naming the node with the lowest local SQNR and the
  ``[node]`` rule that pins it to fp32 (:mod:`converter.numerics.gap`).

Measuring streams: it holds nothing it measures, so it adds no second copy of the weights
(``numerics.method`` in report.json says so). The pack hook counts a saved tensor and keeps
nothing (no backward runs; the unpack hook raises), so each half weight copy is freed after its
op, as in a no-grad forward. A storage is told apart from a later one at the same address by a
weak reference to it (a storage keeps its Python object while it lives): the numbers are those
of holding every saved tensor and every weight copy. The module before this returned the tensor
itself from the pack hook and kept a list of them: a saved *output* → its ``grad_fn`` → the
packed tensor is a reference cycle that kept each such forward's graph, and its 2 GiB of bf16
weight copies at 1.1B parameters, alive after the list was cleared, so the default ``mpconvert``
run peaked at 2.28× the build's memory (``benchmarks/scale.py``, 10.20 GiB); and an activation
allocated where an unsaved weight copy had been freed was counted as a weight copy.
``torch.autocast`` runs with ``cache_enabled=False``: its cache holds a half copy of every weight
until the context exits (2 GiB at 1.1B), and casting again gives the same values. The counts are
autocast's with its cache, which casts a leaf parameter once per forward: :class:`CastCounter`
counts a repeated cast of the same parameter to the autocast dtype as the cache hit it would have
been, and the saved bytes count its copy once. (A model that itself calls ``w.to(half)`` twice on
one parameter under autocast is the one case counted differently: the cache does not serve
explicit casts.) :func:`node_errors` frees each value after its last user and evaluates the
graph's autocast enter/exit brackets once for both passes (twice, they restored the global
autocast state in the wrong order and left autocast's cache switched off for the process).

SQNRs are :func:`converter.numerics.common.sqnr_db` over the positions finite in both (non-finite
mismatches are counted apart): ``+inf`` means identical (``"inf"`` in report.json), ``None``
that nothing was compared (a local SQNR: no input dtype differs). Measuring never changes the
models: buffers (BatchNorm statistics), train/eval mode and the RNG state are restored.
"""
from __future__ import annotations

import contextlib
import itertools
import time
import warnings
import weakref
from typing import Any, Optional

import torch
import torch.fx
from torch.fx.node import map_arg
from torch.utils._python_dispatch import TorchDispatchMode

from converter.ir.meta import DTYPES, META_CAST, META_DECISION, META_INFO
from converter.numerics.common import output_tensors, preserved_state, sqnr_db
from converter.numerics.gap import BelowAutocastWarning, below_autocast

__all__ = [
    "measure",
    "METHOD",
    "CastCounter",
    "count_casts",
    "saved_activations",
    "compare_outputs",
    "node_errors",
]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ---------------------------------------------------------------------------------------------
# state handling


def _storage_ptrs(module: torch.nn.Module) -> set[int]:
    tensors = list(module.parameters()) + list(module.buffers())
    return {t.untyped_storage().data_ptr() for t in tensors if t.device.type != "meta"}


def _try_eval(*modules: torch.nn.Module) -> bool:
    """Put every module in eval mode, or none (export's ``.module()`` refuses ``eval()``)."""
    try:
        for module in modules:
            module.eval()
    except NotImplementedError:
        return False
    return True


def _run(module: torch.nn.Module, args: tuple, kwargs: dict, *, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return module(*args, **kwargs)


def _device_type(module: torch.nn.Module) -> str:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device.type
    return "cpu"


def _autocast(dtype_name: str, module: torch.nn.Module):
    """``torch.autocast`` on the module's device with the target half dtype, without its weight-cast
    cache: the cache would hold a half copy of every weight until the context exits (2 GiB at 1.1B
    parameters in bf16); casting again gives the same values, and :class:`CastCounter` counts as
    the cache would (see the module docstring)."""
    return torch.autocast(_device_type(module), dtype=DTYPES[dtype_name], cache_enabled=False)


class _Live:
    """Storages told apart while they live: a storage at an address that a dead one had is new.

    Storages keep their Python object while they live (PyTorch preserves it), so a weak
    reference to it is alive exactly as long as the storage; keys are addresses. Address 0
    (zero-size storages) is one storage, as the address bookkeeping before this class had it.
    """

    def __init__(self) -> None:
        self._refs: dict[int, tuple[Any, Any]] = {}

    def get(self, storage: torch.UntypedStorage) -> Any:
        """The value put for this very storage, or None."""
        entry = self._refs.get(storage.data_ptr())
        if entry is None:
            return None
        ref, value = entry
        return value if (storage.data_ptr() == 0 or ref() is storage) else None

    def put(self, storage: torch.UntypedStorage, value: Any) -> None:
        self._refs[storage.data_ptr()] = (weakref.ref(storage), value)


# ---------------------------------------------------------------------------------------------
# casts


class CastCounter(TorchDispatchMode):
    """Counts dtype-changing ``aten._to_copy`` calls between floating dtypes, with their bytes.

    ``weight_ptrs`` are the storages of the module's parameters and buffers: a cast reading one
    of them is a weight cast; :meth:`copy_key` names the copy it made while that copy lives.
    ``autocast_dtype``: the forward runs under ``torch.autocast`` to this dtype without its cache
    (:func:`_autocast`); a cast that autocast's cache would have served (a leaf fp32 tensor that
    requires grad, cast to that dtype before in this forward) is not counted again, and its copy
    gets the first copy's key, so the saved bytes count it once as the cache's one copy.
    """

    def __init__(self, weight_ptrs: set[int], *, autocast_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.weight_ptrs = weight_ptrs
        self.autocast_dtype = autocast_dtype
        self.casts: list[dict] = []
        self._copies = _Live()  # output storage of a weight cast -> its key
        self._cached: dict[tuple[int, torch.dtype], tuple[Any, tuple]] = {}  # (id(src), dtype) -> (weakref(src), key)
        self._serial = itertools.count()

    def copy_key(self, storage: torch.UntypedStorage) -> Optional[tuple]:
        """The key of the weight copy ``storage`` is (None: no weight cast made it); copies that
        autocast's cache would have shared have one key."""
        return self._copies.get(storage)

    def _cacheable(self, src: torch.Tensor, dtype: torch.dtype) -> bool:
        """Autocast's own condition for caching a cast (``cached_cast`` in autocast_mode.cpp)."""
        return (self.autocast_dtype is not None and dtype == self.autocast_dtype and src.dtype == torch.float32
                and src.requires_grad and src.is_leaf and not src._is_view())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
            src = args[0]
            if src.dtype != out.dtype and src.dtype in _FLOATS and out.dtype in _FLOATS:
                on_weight = src.untyped_storage().data_ptr() in self.weight_ptrs
                if on_weight:
                    key: tuple = ("copy", next(self._serial))
                    if self._cacheable(src, out.dtype):
                        hit = self._cached.get((id(src), out.dtype))
                        if hit is not None and hit[0]() is src:  # autocast's cache would have served it
                            self._copies.put(out.untyped_storage(), hit[1])
                            return out
                        key = ("cached", id(src), out.dtype)
                        self._cached[(id(src), out.dtype)] = (weakref.ref(src), key)
                    self._copies.put(out.untyped_storage(), key)
                self.casts.append({
                    "shape": list(src.shape),
                    "src": str(src.dtype).replace("torch.", ""),
                    "dtype": str(out.dtype).replace("torch.", ""),
                    "bytes": src.numel() * (src.element_size() + out.element_size()),
                    "on_weight": on_weight,
                })
        return out

    def summary(self) -> dict:
        act = [c for c in self.casts if not c["on_weight"]]
        weight = [c for c in self.casts if c["on_weight"]]
        return {
            "casts": len(act),
            "cast_bytes": sum(c["bytes"] for c in act),
            "weight_casts": len(weight),
            "weight_cast_bytes": sum(c["bytes"] for c in weight),
        }


def count_casts(module: torch.nn.Module, args: tuple, kwargs: Optional[dict] = None, *, autocast: Optional[str] = None) -> dict:
    """Run one forward (no grad) and count its casts; ``autocast="bf16"`` runs under torch.autocast."""
    counter = CastCounter(_storage_ptrs(module), autocast_dtype=DTYPES[autocast] if autocast else None)
    ctx = _autocast(autocast, module) if autocast else contextlib.nullcontext()
    with preserved_state(module), torch.no_grad(), ctx, counter:
        _run(module, args, kwargs or {})
    return counter.summary()


# ---------------------------------------------------------------------------------------------
# saved activations


def saved_activations(
    module: torch.nn.Module,
    args: tuple,
    kwargs: Optional[dict] = None,
    *,
    autocast: Optional[str] = None,
    count_casts: bool = True,
) -> dict:
    """Bytes autograd saves for backward in one forward, per unique storage (see module docstring).

    With ``count_casts`` the same forward runs under a :class:`CastCounter`: it tells the half
    copies of parameters apart (``weight_copy_bytes``) and its summary is returned as ``casts``.
    Without it (faster: no Python dispatch), every non-parameter storage counts as an activation.
    Nothing saved is kept: the forward holds what a no-grad forward holds (module docstring).
    """
    params = _storage_ptrs(module)
    counted = _Live()  # storages counted, while they live
    copy_keys: set = set()
    totals = {"bytes": 0, "copy_bytes": 0, "tensors": 0}
    counter = CastCounter(params, autocast_dtype=DTYPES[autocast] if autocast else None) if count_casts else None

    def pack(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in params or counted.get(storage) is not None:
            return None
        counted.put(storage, True)
        key = counter.copy_key(storage) if counter is not None else None
        if key is not None:
            if key in copy_keys:  # a copy autocast's cache would have shared: counted once
                return None
            copy_keys.add(key)
            totals["copy_bytes"] += storage.nbytes()
        totals["bytes"] += storage.nbytes()
        totals["tensors"] += 1
        return None  # counted, not kept: the tensor is freed when its op is done with it

    ctx = _autocast(autocast, module) if autocast else contextlib.nullcontext()
    with preserved_state(module), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _unpack), \
            (counter if counter is not None else contextlib.nullcontext()), ctx:
        _run(module, args, kwargs or {})
    result: dict[str, Any] = {"activation_bytes": totals["bytes"] - totals["copy_bytes"], "weight_copy_bytes": totals["copy_bytes"],
              "tensors": totals["tensors"]}
    if counter is not None:
        result["casts"] = counter.summary()
    return result


def _unpack(_: None) -> torch.Tensor:
    raise RuntimeError("saved_activations() counts what autograd saves and keeps none of it: "
                       "its forward cannot be differentiated; please report this bug")


# ---------------------------------------------------------------------------------------------
# numerics


def _float_tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in output_tensors(value) if t.dtype in _FLOATS]


def compare_outputs(ref: Any, out: Any) -> dict:
    """SQNR and max |error| of ``out`` against ``ref`` over all floating output tensors."""
    refs, outs = _float_tensors(ref), _float_tensors(out)
    pairs = [(r, o) for r, o in zip(refs, outs) if r.shape == o.shape]
    if not pairs:
        return {"sqnr_db": None, "max_abs_err": 0.0, "numel": 0, "nonfinite_mismatch": 0, "compared": 0}
    if len(pairs) == 1:
        r, o = pairs[0][0].detach().double().flatten(), pairs[0][1].detach().double().flatten()
    else:
        r = torch.cat([p[0].detach().double().flatten() for p in pairs])
        o = torch.cat([p[1].detach().double().flatten() for p in pairs])
    finite = torch.isfinite(r) & torch.isfinite(o)
    mismatch = 0
    if not bool(finite.all()):
        same_nonfinite = (~torch.isfinite(r) & (r == o)) | (torch.isnan(r) & torch.isnan(o))
        mismatch = int((~finite & ~same_nonfinite).sum())
        r, o = r[finite], o[finite]
    diff = r - o
    sqnr = sqnr_db(r, o)
    return {
        "sqnr_db": _round(sqnr),
        "max_abs_err": float(diff.abs().max()) if diff.numel() else 0.0,
        "numel": int(finite.numel()),
        "nonfinite_mismatch": mismatch,
        "compared": len(pairs),
    }


def _round(value: Optional[float], digits: int = 2) -> Optional[float]:
    return None if value is None else round(value, digits)


# ---------------------------------------------------------------------------------------------
# per-node error attribution


def _flat_inputs(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """The values of ``gm``'s placeholders for a call ``gm(*args, **kwargs)``."""
    from converter.passes.capture.values import placeholder_values

    return placeholder_values(gm, args, kwargs)


def _like(ref: Any, mixed: Any) -> Any:
    """``ref`` with the dtypes that ``mixed`` has (a fresh copy, safe for in-place ops)."""
    if isinstance(ref, torch.Tensor) and isinstance(mixed, torch.Tensor):
        if ref.dtype != mixed.dtype and ref.dtype in _FLOATS and mixed.dtype in _FLOATS:
            return ref.to(mixed.dtype)
        return ref.clone()
    if isinstance(ref, (tuple, list)) and isinstance(mixed, (tuple, list)) and len(ref) == len(mixed):
        return tuple(_like(r, m) for r, m in zip(ref, mixed))
    if isinstance(ref, dict) and isinstance(mixed, dict):
        return {k: _like(v, mixed.get(k)) for k, v in ref.items()}
    return ref


def _dtypes_differ(ref: Any, mixed: Any) -> bool:
    if isinstance(ref, torch.Tensor) and isinstance(mixed, torch.Tensor):
        return ref.dtype != mixed.dtype
    if isinstance(ref, (tuple, list)) and isinstance(mixed, (tuple, list)):
        return any(_dtypes_differ(r, m) for r, m in zip(ref, mixed))
    return False


def _reported(node: torch.fx.Node) -> bool:
    info = node.meta.get(META_INFO)
    return info is not None and META_DECISION in node.meta and info.kind not in ("cast", "passive")


#: global-state brackets in captured graphs (regions.py): evaluated once, their value shared by both passes
_BRACKETS = (torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast)


def _free_inputs(node: torch.fx.Node, i: int, last_use: dict, *envs: dict) -> None:
    """Drop the values whose last user is ``node`` (the ``i``-th node) from every environment."""
    for inp in node.all_input_nodes:
        if last_use.get(inp) == i:
            for env in envs:
                env.pop(inp, None)


def node_errors(gm: torch.fx.GraphModule, args: tuple, kwargs: Optional[dict] = None, *, worst: int = 10) -> dict:
    """Per-node cumulative and local SQNR of the converted graph (see the module docstring)."""
    kwargs = kwargs or {}
    interp = torch.fx.Interpreter(gm)
    flat = iter(_flat_inputs(gm, args, kwargs))
    nodes = list(gm.graph.nodes)
    last_use: dict[torch.fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for inp in node.all_input_nodes:
            last_use[inp] = i
    mixed: dict[torch.fx.Node, Any] = {}
    ref: dict[torch.fx.Node, Any] = {}
    per_node: dict[str, dict] = {}

    def call(node: torch.fx.Node, env_args, env_kwargs):
        return getattr(interp, node.op)(node.target, env_args, env_kwargs)

    with torch.no_grad():
        for i, node in enumerate(nodes):
            if node.op == "placeholder":
                value = next(flat, None)
                mixed[node] = value
                ref[node] = value.clone() if isinstance(value, torch.Tensor) else value
            elif node.op == "get_attr":
                mixed[node] = ref[node] = interp.fetch_attr(str(node.target))
            elif node.op == "output":
                break
            else:
                rec = node.meta.get(META_CAST)
                if node.op == "call_function" and node.target in _BRACKETS:
                    # enter/exit of the graph's autocast regions: once, not once per pass (two contexts
                    # left in the wrong order restore the wrong global autocast state, cache flag included)
                    mixed[node] = ref[node] = call(node, *map_arg((node.args, node.kwargs), lambda n: mixed[n]))
                    _free_inputs(node, i, last_use, mixed, ref)
                    continue
                in_ref = map_arg((node.args, node.kwargs), lambda n: ref[n])
                in_mixed = map_arg((node.args, node.kwargs), lambda n: mixed[n])
                local = None
                if _reported(node) and any(_dtypes_differ(ref[n], mixed[n]) for n in node.all_input_nodes):
                    local = call(node, *_like(in_ref, in_mixed))
                mixed[node] = call(node, *in_mixed)
                if rec is not None and rec.inserted:
                    ref[node] = ref[node.args[0]]  # the fp32 model has no such cast
                else:
                    ref[node] = call(node, *in_ref)
                if _reported(node) and _float_tensors(ref[node]):
                    cumulative = compare_outputs(ref[node], mixed[node])
                    row = {"sqnr_db": cumulative["sqnr_db"], "max_abs_err": cumulative["max_abs_err"], "local_sqnr_db": None}
                    if local is not None:
                        row["local_sqnr_db"] = compare_outputs(ref[node], local)["sqnr_db"]
                    per_node[node.name] = row
            _free_inputs(node, i, last_use, mixed, ref)
    ranked = sorted(
        (name for name, row in per_node.items() if row["local_sqnr_db"] is not None),
        key=lambda name: per_node[name]["local_sqnr_db"],
    )
    by_name = {n.name: n for n in nodes}
    worst_rows = []
    for name in ranked[:worst]:
        info, decision = by_name[name].meta[META_INFO], by_name[name].meta[META_DECISION]
        worst_rows.append({"name": name, "op": info.op, "module": info.module, "precision": decision.precision, **per_node[name]})
    return {"per_node": per_node, "worst": worst_rows}


# ---------------------------------------------------------------------------------------------
# everything

#: ``numerics.method`` in report.json: what was compared (``scope``) and how memory was kept bounded.
#: ``scope`` is ``"full"``: every output and every node on the whole example inputs, no slice or subset.
METHOD = {
    "scope": "full",
    "memory": "streamed",
    "note": "every output and every node on the full example inputs (no slice, no subset); streamed: saved tensors "
            "are counted and dropped, torch.autocast runs without its weight-cast cache (same values), each node's "
            "values are freed after its last user, so measuring holds no second copy of the weights",
}


def measure(conv, *, autocast: bool = True, per_node: bool = True, worst: int = 10) -> dict:
    """All measurements for ``conv`` (a :class:`converter.Conversion`) on its example inputs.

    Returns ``{"memory": ..., "numerics": ..., "measured_casts": ...}``; attach it to the report
    with ``conv.report.add_measurements(result)``. The original model and the converted module are
    left exactly as they were.
    """
    t0 = time.perf_counter()
    gm: torch.fx.GraphModule = conv.module
    original: torch.nn.Module = conv.original
    args, kwargs = conv.example_inputs
    precision = conv.precision
    out: dict = {}

    # one forward with grad in the modules' own train/eval mode: saved activations and casts
    saved = {"converted": saved_activations(gm, args, kwargs),
             "fp32": saved_activations(original, args, kwargs, count_casts=False)}
    if autocast:
        saved["autocast"] = saved_activations(original, args, kwargs, autocast=precision)
    out["measured_casts"] = {k: v["casts"] for k, v in saved.items() if "casts" in v}
    fp32_bytes = saved["fp32"]["activation_bytes"]
    memory = {
        "saved_activation_bytes": {k: v["activation_bytes"] for k, v in saved.items()},
        "saved_weight_copy_bytes": {k: v["weight_copy_bytes"] for k, v in saved.items()},
        "saved_ratio": (saved["converted"]["activation_bytes"] / fp32_bytes) if fp32_bytes else None,
        "saved_ratio_autocast": (saved["autocast"]["activation_bytes"] / fp32_bytes) if (autocast and fp32_bytes) else None,
        "saved_method": "saved_tensors_hooks, one forward with grad, unique storages, parameters and buffers excluded; "
                        "half copies of parameters counted apart (weight_copy); each saved tensor counted, none kept",
    }
    out["memory"] = memory

    # numerics (eval mode when possible)
    with preserved_state(gm, original), torch.no_grad():
        mode = "eval" if _try_eval(gm, original) else "as-is"
        ref = _run(original, args, kwargs)
        converted = _run(gm, args, kwargs)
        numerics: dict = {"mode": mode, "precision": precision, "method": dict(METHOD),
                          "vs_fp32": compare_outputs(ref, converted)}
        if autocast:
            with _autocast(precision, original):
                auto = _run(original, args, kwargs)
            numerics["autocast_vs_fp32"] = compare_outputs(ref, auto)
            numerics["vs_autocast"] = compare_outputs(auto, converted)
        if per_node and isinstance(gm, torch.fx.GraphModule):  # a partial conversion's regions are measured end to end
            errors = node_errors(gm, args, kwargs, worst=worst)
            numerics["per_node"] = errors["per_node"]
            numerics["worst"] = errors["worst"]
    out["numerics"] = numerics
    out["measure_s"] = round(time.perf_counter() - t0, 3)
    gap = below_autocast(numerics)  # never silent: well under autocast names the node and the rule (numerics.gap)
    if gap is not None:
        warnings.warn(gap, BelowAutocastWarning, stacklevel=2)
    return out
