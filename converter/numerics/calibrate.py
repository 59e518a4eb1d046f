"""Calibrate: measure per-node value ranges on real inputs and re-decide nodes that would overflow.

Runs after *decide* and *place* and before *rewrite*, on the still-fp32 graph::

    capture ─► decide ─► place ─► calibrate ─► rewrite ─► report
                          ▲          │ re-decides overflowing fp16 nodes,
                          └──────────┘ then re-runs placement for their neighbours

1. **Statistics** (:func:`collect_statistics`). Every calibration batch (the example-input form:
   a tuple of args or an ``(args, kwargs)`` pair) runs through an *instrumented copy* of the
   graph: after every node that produces a floating tensor a tiny recorder node is inserted, so
   the forward pass is the graph's own generated code (no per-node Python dispatch as in
   ``torch.fx.Interpreter``, whose overhead alone exceeds the cost budget on small models). One
   ``torch.autograd.grad`` call then gives the gradient of the loss (``loss_fn(output, batch)``
   or the sum of the floating outputs) with respect to every recorded activation and parameter:
   one backward pass, no ``.grad`` left on the model. The statistics of all nodes of a batch
   (forward values and gradients together) are computed by a handful of vectorised ops over the
   concatenated fp32 bit patterns (two ``_foreach_max`` and one ``bincount``; see
   :class:`_Accumulator`), not per node; layout ops (view, transpose, ...) and tuple producers
   (split) take the statistics of the nodes that hold the same values instead of being recorded.
   They end up as a frozen :class:`NodeStats` on ``node.meta["mp_stats"]``. Cost on the sample
   transformer: 2.6-2.9× twenty fp32 training steps (``benchmarks/calibration_cost.py``).
2. **Overflow fallback** (:func:`redecide_overflow`). For an fp16 conversion, a node that runs in
   fp16 and whose output or a floating input it casts has ``absmax × margin > 65504`` (the
   largest *finite* value: an inf already in fp32, like an attention mask, stays inf) is
   re-decided to the rules setting ``overflow_fallback`` (``bf16`` by default: the range of
   fp32 at half the bytes; ``fp32`` for the most conservative choice). Placement is then re-run
   so that ``follow`` neighbours are consistent; a neighbour whose own values also overflow is
   re-decided in turn (to a fixed point).
3. **Report data** in ``gm.meta["mp_calibration"]`` (a plain dict, for report.json's
   ``"calibration"`` section): the risky nodes with their evidence, the gradient underflow risk
   and a recommended initial loss scale.
4. **Accuracy search** (:mod:`converter.search`) when a ``tolerance`` is given.

Why the margin defaults to 2 (one binade of headroom): calibration sees a finite sample, and a
value only twice the largest one seen already overflows; half rounding of the inputs and a
different summation order in the half kernels move the result slightly; and the activations of
a model in training grow as the weights move. Larger margins fall back more eagerly. Set it per
rule file with ``[settings] overflow_margin``, or per call with ``margin=``.
"""
from __future__ import annotations

import copy
import math
import time
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.fx
from torch._utils import _flatten_dense_tensors
from torch.utils import _pytree as pytree

from converter.passes.capture import normalize_inputs
from converter.ir.meta import HALF_NAMES, Decision, Match, RuleRef, TensorSpec
from converter.passes.place.stage import castable_inputs, place
from converter.rules.loader import Rules
from converter.ir.meta import GM_CALIBRATION, META_DECISION, META_INFO, META_STATS, META_VALUE
from converter.ir.errors import EXIT_CHECK_FAILED, MpconvertError
from converter.rules.precedence import OVERRIDE_LEVEL, rank

__all__ = [
    "FP16_MAX",
    "FP16_MIN_NORMAL",
    "FP16_MIN_SUBNORMAL",
    "DEFAULT_MARGIN",
    "DEFAULT_FALLBACK",
    "TensorStats",
    "NodeStats",
    "Calibration",
    "ToleranceNotMet",
    "calibrate_and_redecide",
    "collect_statistics",
    "redecide_overflow",
    "replace_decisions",
    "recommend_loss_scale",
    "tensor_stats",
    "merge_stats",
    "copy_graph",
    "progress_bar",
    "LOG2_MIN",
]

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14  # 6.1e-5
FP16_MIN_SUBNORMAL = 2.0**-24  # 6.0e-8
DEFAULT_MARGIN = 2.0
DEFAULT_FALLBACK = "bf16"
MAX_LOSS_SCALE = 2.0**24  # LossScaler's default max_scale


# fp32 bit patterns of |x| (sign cleared): order as integers == order as values, NaN above inf
def _bits(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.float32).view(torch.int32))


_B_INF = _bits(math.inf)
_B_OVER = _bits(FP16_MAX)  # |x| > 65504  <=>  bits > _B_OVER
#: exponent histogram: bin ``i`` holds |x| whose biased fp32 exponent clamps to ``_E_LO + i``,
#: i.e. |x| in [2**(i + _E_LO - 127), 2**(i + _E_LO - 126)); bin 0 also holds the zeros and
#: everything below 2**-63, the last bin everything from 2**17 up (inf and NaN included).
_E_LO = 127 - 64
_E_HI = 127 + 17
_N_BINS = _E_HI - _E_LO + 1
_B_TINY = (_E_LO + 1) << 23  # values below 2**-63 share bin 0 with the zeros
#: LOG2 bin edges for reports: bin i covers [2**(LOG2_MIN + i), 2**(LOG2_MIN + i + 1))
LOG2_MIN = _E_LO - 127
_INT32_MAX = 2**31 - 1


class ToleranceNotMet(MpconvertError, ValueError):
    """The accuracy search could not meet the tolerance; carries the best result reached.

    A ``ValueError`` so that it reaches the caller of :func:`converter.convert` unwrapped
    (the pipeline wraps other exceptions in ``PassError``). The CLI maps it to exit status 1.
    """

    exit_code = EXIT_CHECK_FAILED

    def __init__(self, best_sqnr: float, best_set: Sequence[str], *, tolerance: Any = None, evaluations: int = 0, why: str = ""):
        self.best_sqnr = float(best_sqnr)
        self.best_set = tuple(best_set)
        self.tolerance = tolerance
        self.evaluations = evaluations
        self.why = why
        detail = f"; {why}" if why else ""
        super().__init__(
            f"tolerance {tolerance} not met{detail}: best SQNR {self.best_sqnr:.2f} dB with {len(self.best_set)} "
            f"node(s) kept in fp32 ({', '.join(self.best_set[:8])}{', ...' if len(self.best_set) > 8 else ''}) "
            f"after {evaluations} evaluations"
        )


# ---------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class TensorStats:
    """Range statistics of every value a node produced over the calibration batches.

    Fractions are over all ``count`` values; zeros are exact in every dtype, so they are never
    counted as under- or overflowing.
    """

    count: int = 0
    absmax: float = 0.0  # NaN is ignored here (counted in n_nan); inf counts
    min_nonzero: float = math.inf  # smallest non-zero |x|; inf when every value is 0
    n_zero: int = 0
    n_below_subnormal: int = 0  # 0 < |x| < 2**-24: flushes to 0 in fp16
    n_below_normal: int = 0  # 0 < |x| < 2**-14: subnormal or zero in fp16 (includes the above)
    n_over_fp16: int = 0  # finite |x| > 65504: finite in fp32, inf once cast to fp16
    n_inf: int = 0  # already inf in fp32 (e.g. an attention mask): no overflow, fp16 has inf too
    n_nan: int = 0
    absmax_finite: float = 0.0  # the largest finite |x|: what can overflow fp16

    def _frac(self, n: int) -> float:
        return n / self.count if self.count else 0.0

    @property
    def frac_over_fp16(self) -> float:
        return self._frac(self.n_over_fp16)

    @property
    def frac_below_fp16_normal(self) -> float:
        return self._frac(self.n_below_normal)

    @property
    def frac_below_fp16_subnormal(self) -> float:
        return self._frac(self.n_below_subnormal)

    def to_dict(self) -> dict:
        return {
            "count": self.count,
            "absmax": _num(self.absmax),
            "absmax_finite": _num(self.absmax_finite),
            "min_nonzero": _num(self.min_nonzero),
            "frac_over_fp16": self.frac_over_fp16,
            "frac_below_fp16_normal": self.frac_below_fp16_normal,
            "frac_below_fp16_subnormal": self.frac_below_fp16_subnormal,
            "zeros": self.n_zero,
            "inf": self.n_inf,
            "nan": self.n_nan,
        }


@dataclass(frozen=True)
class NodeStats:
    """``node.meta["mp_stats"]``: forward statistics and, when a backward pass ran, gradient ones.

    ``grad_log2_hist`` lists ``(e, n)`` for the binades that hold gradient values: ``n`` non-zero
    gradient values have ``|g|`` in ``[2**e, 2**(e + 1))``. The lowest binade (``LOG2_MIN``) also
    holds everything smaller, the highest (2**17 up) everything larger, inf and NaN included.
    Binade edges are powers of two, so the fraction that a loss scale 2**k lifts above the fp16
    subnormal 2**-24 is exact.
    """

    forward: TensorStats
    grad: Optional[TensorStats] = None
    grad_log2_hist: tuple[tuple[int, int], ...] = ()
    batches: int = 0

    def to_dict(self) -> dict:
        out = {"forward": self.forward.to_dict(), "batches": self.batches}
        out["grad"] = self.grad.to_dict() if self.grad is not None else None
        return out


@dataclass
class Calibration:
    """What :func:`collect_statistics` returns: per-node stats and how they were obtained."""

    stats: dict[str, NodeStats]
    batches: int
    loss: str
    backward: bool
    seconds: float
    inputs: list  # the normalised batches, kept for the accuracy search


def _num(x: float):
    """JSON-friendly float (inf/nan as strings)."""
    if math.isfinite(x):
        return float(x)
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


# ---------------------------------------------------------------------------------------------
# vectorised statistics


class _Accumulator:
    """Per-segment running statistics over many tensors, computed a whole batch at a time.

    All tensors of a batch are concatenated once; every statistic is then one vectorised op over
    the fp32 bit patterns of ``|x|`` (whose integer order is the value order):

    * ``absmax``: ``_foreach_max`` of the bits; ``min_nonzero``: ``_foreach_max`` of
      ``(bits - 1) ^ INT32_MAX``, which maps 0 to the smallest int and reverses the order of the rest;
    * the threshold counts come from one ``bincount`` of (segment, clamped exponent): 2**-24 and
      2**-14 are bin edges, so the counts below them are exact;
    * the rare cases the histogram cannot split exactly (zeros mixed with values below 2**-63,
      values above 65504, inf, NaN) are counted per tensor, only for the tensors that have them.
    """

    def __init__(self, n: int):
        self.n = n
        self.count = torch.zeros(n, dtype=torch.int64)
        self.maxbits = torch.full((n,), -1, dtype=torch.int64)
        self.minkey = torch.full((n,), -(2**31), dtype=torch.int64)
        self.hist = torch.zeros(n, _N_BINS, dtype=torch.int64)
        self.seen = torch.zeros(n, dtype=torch.bool)
        # exact counts from the rare path: segment -> [zeros, over (finite), inf, nan], and the
        # NaN-free and finite maxima (as bits)
        self.exact: dict[int, list[int]] = {}
        self.nan_free_max: dict[int, int] = {}
        self.finite_max: dict[int, int] = {}
        self._index_cache: dict = {}

    def _layout(self, segs: tuple, lengths: tuple) -> tuple:
        """(bincount base index, segment ids, lengths) for one batch layout; batches repeat layouts."""
        key = (segs, lengths)
        layout = self._index_cache.get(key)
        if layout is None:
            if len(self._index_cache) > 64:
                self._index_cache.clear()
            local = torch.arange(len(segs), dtype=torch.int32) * 256
            lens = torch.tensor(lengths, dtype=torch.int64)
            layout = (torch.repeat_interleave(local, lens), torch.tensor(segs, dtype=torch.int64), lens)
            self._index_cache[key] = layout
        return layout

    @torch.no_grad()
    def add(self, tensors: Sequence[torch.Tensor], segments: Sequence[int]) -> None:
        flat, lengths, segs = [], [], []
        for t, s in zip(tensors, segments):
            n = t.numel()
            if n == 0:
                self.seen[s] = True
                continue
            flat.append(t if t.dtype == torch.float32 else t.float())
            lengths.append(n)
            segs.append(s)
        if not flat:
            return
        # one contiguous fp32 copy of everything (the C++ loop of DDP's bucket flattening)
        a = _flatten_dense_tensors(flat).abs_() if len(flat) > 1 else flat[0].reshape(-1).abs()
        b = a.view(torch.int32)
        k = len(flat)
        base, idx, lens = self._layout(tuple(segs), tuple(lengths))
        pieces = b.split(lengths)
        maxbits = torch.stack(torch._foreach_max(pieces)).to(torch.int64)
        key = b - 1
        key ^= _INT32_MAX
        minkey = torch.stack(torch._foreach_max(key.split(lengths))).to(torch.int64)
        del key
        # histogram of the biased exponent (all 256 values, no clamping pass), folded to _N_BINS
        exponent = b >> 23
        exponent += base
        full = torch.bincount(exponent, minlength=k * 256).view(k, 256)
        del exponent
        hist = torch.cat([full[:, : _E_LO + 1].sum(1, keepdim=True), full[:, _E_LO + 1 : _E_HI], full[:, _E_HI:].sum(1, keepdim=True)], 1)
        # rare path: tensors with values the histogram cannot split exactly
        min_nonzero_bits = _INT32_MAX - minkey + 1  # meaningless where the tensor is all zero
        rare = (maxbits > _B_OVER) | ((minkey != -(2**31)) & (min_nonzero_bits < _B_TINY))
        rare_js = rare.nonzero().flatten().tolist()
        for j in rare_js:
            s = segs[j]
            if s not in self.exact:  # earlier batches were not rare: bin 0 held exactly their zeros
                self.exact[s] = [int(self.hist[s, 0]), 0, 0, 0]
                self.nan_free_max[s] = int(self.maxbits[s])
                self.finite_max[s] = int(self.maxbits[s])
        if self.exact:
            rare_set = set(rare_js)
            for j, s in enumerate(segs):
                if s not in self.exact:
                    continue
                record = self.exact[s]
                if j in rare_set:
                    piece = pieces[j]
                    n_nan = int((piece > _B_INF).sum())
                    n_inf = int((piece == _B_INF).sum())
                    record[0] += int((piece == 0).sum())
                    record[1] += int((piece > _B_OVER).sum()) - n_nan - n_inf
                    record[2] += n_inf
                    record[3] += n_nan
                    top = top_finite = int(maxbits[j])
                    if n_nan or n_inf:
                        finite = piece[piece < _B_INF]
                        top_finite = int(finite.max()) if finite.numel() else -1
                        top = _B_INF if n_inf else top_finite
                else:
                    record[0] += int(hist[j, 0])
                    top = top_finite = int(maxbits[j])
                self.nan_free_max[s] = max(self.nan_free_max[s], top)
                self.finite_max[s] = max(self.finite_max[s], top_finite)
        self.hist.index_add_(0, idx, hist)
        self.count.index_add_(0, idx, lens)
        self.maxbits.scatter_reduce_(0, idx, maxbits, "amax")
        self.minkey.scatter_reduce_(0, idx, minkey, "amax")
        self.seen[idx] = True

    def _finish(self) -> None:
        """Move the accumulators to Python once (reading tensor elements one by one is slow)."""
        if getattr(self, "_done", None) is not None:
            return
        below_sub_bin = (127 - 24) - _E_LO  # bins strictly below 2**-24
        below_norm_bin = (127 - 14) - _E_LO
        absmax = _floats(self.maxbits.clamp(min=0))
        min_nonzero = _floats(_INT32_MAX - self.minkey + 1)
        cum = self.hist.cumsum(1)
        self._done = {
            "seen": self.seen.tolist(),
            "count": self.count.tolist(),
            "maxbits": self.maxbits.tolist(),
            "absmax": absmax,
            "minkey": self.minkey.tolist(),
            "min_nonzero": min_nonzero,
            "zero_bin": self.hist[:, 0].tolist(),
            "below_sub": cum[:, below_sub_bin - 1].tolist(),
            "below_norm": cum[:, below_norm_bin - 1].tolist(),
        }

    def result(self, i: int) -> Optional[TensorStats]:
        self._finish()
        d = self._done
        if not d["seen"][i]:
            return None
        count = d["count"][i]
        if count == 0:
            return TensorStats()
        exact = self.exact.get(i)
        if exact is None:
            zeros, over, n_inf, n_nan = d["zero_bin"][i], 0, 0, 0
            absmax = absmax_finite = d["absmax"][i] if d["maxbits"][i] >= 0 else 0.0
        else:
            zeros, over, n_inf, n_nan = exact
            maxbits = self.nan_free_max.get(i, d["maxbits"][i])
            absmax = _float(maxbits) if maxbits >= 0 else 0.0
            finite_bits = self.finite_max.get(i, d["maxbits"][i])
            absmax_finite = _float(finite_bits) if finite_bits >= 0 else 0.0
        # no non-zero value, or only NaN ones (NaN bit patterns sort above inf)
        nonzero_bits = _INT32_MAX - d["minkey"][i] + 1
        min_nonzero = math.inf if d["minkey"][i] == -(2**31) or nonzero_bits > _B_INF else d["min_nonzero"][i]
        return TensorStats(
            count=count,
            absmax=absmax,
            min_nonzero=min_nonzero,
            n_zero=zeros,
            n_below_subnormal=d["below_sub"][i] - zeros,
            n_below_normal=d["below_norm"][i] - zeros,
            n_over_fp16=over,
            n_inf=n_inf,
            n_nan=n_nan,
            absmax_finite=absmax_finite,
        )

    def log2_hist(self, i: int) -> tuple[tuple[int, int], ...]:
        """``(e, count)`` per non-empty binade ``[2**e, 2**(e+1))``, zeros removed (see NodeStats)."""
        hist = self.hist[i].tolist()
        exact = self.exact.get(i)
        hist[0] -= exact[0] if exact is not None else hist[0]
        return tuple((LOG2_MIN + j, c) for j, c in enumerate(hist) if c)


def _float(bits: int) -> float:
    return float(torch.tensor(bits, dtype=torch.int32).view(torch.float32))


def _floats(bits: torch.Tensor) -> list[float]:
    return bits.to(torch.int32).view(torch.float32).tolist()


def tensor_stats(tensors: Iterable[torch.Tensor]) -> TensorStats:
    """The statistics of a set of tensors (the same code path as calibration, one segment)."""
    ts = list(tensors)
    acc = _Accumulator(1)
    acc.add(ts, [0] * len(ts))
    return acc.result(0) or TensorStats()


# ---------------------------------------------------------------------------------------------
# the instrumented graph


def copy_graph(gm: torch.fx.GraphModule) -> tuple[torch.fx.Graph, dict]:
    """A deep copy of ``gm.graph`` (same codegen, so the same calling convention) and old→new nodes."""
    old = gm.graph
    mapping: dict = {}
    graph = torch.fx.Graph(tracer_cls=old._tracer_cls)
    output_val, old_output = graph.graph_copy(old, val_map=mapping, return_output_node=True)
    graph._codegen = copy.deepcopy(old._codegen)
    new_output = graph.output(output_val, type_expr=getattr(old_output, "type", None))
    new_output.meta = copy.copy(old_output.meta)
    mapping[old_output] = new_output
    return graph, mapping


def _float_leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64]


def _has_float_output(node: torch.fx.Node) -> bool:
    spec = node.meta.get(META_VALUE)
    specs = [spec] if isinstance(spec, TensorSpec) else [s for s in pytree.tree_leaves(spec) if isinstance(s, TensorSpec)] if isinstance(spec, tuple) else []
    return any(s.is_convertible and s.dtype.is_floating_point for s in specs)


def _mutated_later(gm: torch.fx.GraphModule) -> set:
    """Nodes whose tensor an in-place op modifies afterwards (recorded as a clone)."""
    out = set()
    for node in gm.graph.nodes:
        info = node.meta.get(META_INFO)
        if info is not None and info.inplace and node.args and isinstance(node.args[0], torch.fx.Node):
            out.add(node.args[0])
    return out


class _Probe:
    """An instrumented copy of ``gm`` that stores every floating node output of a forward pass."""

    def __init__(self, gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node]):
        graph, mapping = copy_graph(gm)
        self.slots: list = [None] * len(nodes)
        slots = self.slots

        def _mp_record(index, value):
            slots[index] = value
            return value

        def _mp_record_clone(index, value):
            slots[index] = pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)
            return value

        mutated = _mutated_later(gm)
        last_placeholder = None
        for n in graph.nodes:
            if n.op == "placeholder":
                last_placeholder = n
        for i, old in enumerate(nodes):
            new = mapping[old]
            where = last_placeholder if new.op == "placeholder" else new
            fn = _mp_record_clone if old in mutated else _mp_record
            with graph.inserting_after(where):
                graph.call_function(fn, (i, new))
        self.module = torch.fx.GraphModule(gm, graph, class_name="CalibrationProbe")

    def __call__(self, args: tuple, kwargs: dict):
        return self.module(*args, **kwargs)

    def clear(self) -> None:
        """Drop the recorded values (the caller keeps what it needs)."""
        self.slots[:] = [None] * len(self.slots)


# ---------------------------------------------------------------------------------------------
# statistics


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


class _BufferGuard:
    """Restores buffers and the RNG: calibration leaves no trace on the model or the global RNG."""

    def __init__(self, gm: torch.nn.Module):
        self.gm = gm

    def __enter__(self):
        self.saved = {name: buf.detach().clone() for name, buf in self.gm.named_buffers()}
        self.rng = torch.random.get_rng_state()
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for name, buf in self.gm.named_buffers():
                if name in self.saved:
                    buf.copy_(self.saved[name])
        torch.random.set_rng_state(self.rng)
        return False


def _loss(output: Any, item: Any, loss_fn: Optional[Callable], note: list) -> Optional[torch.Tensor]:
    if loss_fn is not None and not note:
        try:
            loss = loss_fn(output, item)
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                return loss.float().reshape(())
            note.append(f"loss_fn returned {type(loss).__name__} {getattr(loss, 'shape', '')}, not a scalar tensor")
        except Exception as exc:  # a loss_fn written for train_batches() may not fit calibration batches
            note.append(f"loss_fn(output, batch) failed on a calibration batch: {type(exc).__name__}: {exc}")
        warnings.warn(f"calibration: {note[0]}; using the sum of the floating outputs instead", stacklevel=3)
    leaves = [t for t in _float_leaves(output) if t.requires_grad]
    if not leaves:
        return None
    return sum(t.float().sum() for t in leaves)


#: ops whose output holds exactly the values of their input, rearranged
_LAYOUT_OPS = frozenset({"view", "reshape", "transpose", "permute", "t", "contiguous", "flatten", "unflatten",
                         "squeeze", "unsqueeze", "clone"})


def _single_spec(node: torch.fx.Node) -> Optional[TensorSpec]:
    spec = node.meta.get(META_VALUE)
    return spec if isinstance(spec, TensorSpec) else None


def _plan_taps(gm: torch.fx.GraphModule, candidates: Sequence[torch.fx.Node]) -> tuple[list, dict]:
    """Which nodes to record, and which to derive from others without recording them.

    * a layout op (view, transpose, ...) whose single-use input is recorded has that input's
      statistics: the same values forward, and (the input having no other user) the same gradient
      values backward;
    * a tuple producer (split, chunk, ...) whose every element is taken by a ``getitem`` has the
      merged statistics of those ``getitem`` nodes (the very same tensors).
    Deriving instead of recording saves a quarter of the work on a transformer.
    """
    mutated = _mutated_later(gm)
    chosen = set(candidates)
    derived: dict = {}
    for node in candidates:
        info = node.meta.get(META_INFO)
        if info is None or node in mutated:
            continue
        if info.op in _LAYOUT_OPS and node.args and isinstance(node.args[0], torch.fx.Node):
            src = node.args[0]
            spec, sspec = _single_spec(node), _single_spec(src)
            if (src in chosen and src not in mutated and len(src.users) == 1 and spec is not None and sspec is not None
                    and spec.numel == sspec.numel and spec.dtype == sspec.dtype):
                derived[node] = ("copy", src)
        elif isinstance(node.meta.get(META_VALUE), tuple):
            n_out = len(node.meta[META_VALUE])
            users = list(node.users)
            picks = {}
            ok = n_out > 0
            for u in users:
                uinfo = u.meta.get(META_INFO)
                if (u.op == "call_function" and uinfo is not None and uinfo.op == "getitem" and len(u.args) > 1
                        and isinstance(u.args[1], int) and u in chosen and u not in mutated):
                    picks.setdefault(u.args[1] % n_out, u)
                else:
                    ok = False
            if ok and len(picks) == n_out and all(_single_spec(u) is not None for u in picks.values()):
                derived[node] = ("merge", tuple(picks.values()))
    taps = [n for n in candidates if n not in derived]
    return taps, derived


def merge_stats(parts: Sequence[TensorStats]) -> TensorStats:
    """The statistics of the union of the values behind ``parts``."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return TensorStats()
    return TensorStats(
        count=sum(p.count for p in parts),
        absmax=max(p.absmax for p in parts),
        min_nonzero=min(p.min_nonzero for p in parts),
        n_zero=sum(p.n_zero for p in parts),
        n_below_subnormal=sum(p.n_below_subnormal for p in parts),
        n_below_normal=sum(p.n_below_normal for p in parts),
        n_over_fp16=sum(p.n_over_fp16 for p in parts),
        n_inf=sum(p.n_inf for p in parts),
        n_nan=sum(p.n_nan for p in parts),
        absmax_finite=max(p.absmax_finite for p in parts),
    )


def collect_statistics(
    gm: torch.fx.GraphModule,
    calibration: Iterable,
    *,
    loss_fn: Optional[Callable] = None,
    backward: bool = True,
    progress: bool = True,
    max_batches: Optional[int] = None,
) -> Calibration:
    """Run ``calibration`` through ``gm`` and write :class:`NodeStats` on ``node.meta["mp_stats"]``.

    ``gm`` must still be the fp32 graph (before rewrite). Buffers (e.g. BatchNorm running
    statistics) and the global RNG state are restored afterwards, and no ``.grad`` is written.
    """
    t0 = time.perf_counter()
    for n in gm.graph.nodes:
        n.meta.pop(META_STATS, None)
    candidates = [n for n in gm.graph.nodes if n.op not in ("get_attr", "output") and _has_float_output(n)
                  and (n.op == "placeholder" or not (n.meta.get(META_INFO) is not None and n.meta[META_INFO].kind == "passive"))]
    nodes, derived = _plan_taps(gm, candidates)
    params = [n for n in gm.graph.nodes if n.op == "get_attr" and _has_float_output(n)]
    index = {n: i for i, n in enumerate(nodes)}
    p_index = {n: len(nodes) + i for i, n in enumerate(params)}
    total = len(nodes) + len(params)
    # one accumulator: segment i holds the forward values of node i, segment total + i its gradients
    acc = _Accumulator(2 * total)
    param_values = {}
    for n in params:
        value = _fetch_attr(gm, str(n.target))
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            param_values[n] = value
    acc.add(list(param_values.values()), [p_index[n] for n in param_values])
    param_pairs = [(v, p_index[n]) for n, v in param_values.items() if v.requires_grad]

    probe = _Probe(gm, nodes)
    items = list(calibration) if max_batches is None else _take(calibration, max_batches)
    inputs: list = []
    note: list = []
    batches = 0
    grads_seen = False
    bar = progress_bar(progress)
    with _BufferGuard(gm), bar:
        task = bar.add_task("calibrating", total=len(items))
        for item in items:
            args, kwargs = normalize_inputs(item)
            inputs.append((args, kwargs))
            with torch.enable_grad():
                output = probe(args, kwargs)
                f_tensors, f_segs = [], []
                for i, value in enumerate(probe.slots):
                    if type(value) is torch.Tensor:  # the common case, without pytree
                        if value.is_floating_point() and value.dtype != torch.float64:
                            f_tensors.append(value)
                            f_segs.append(i)
                    elif value is not None:
                        for t in _float_leaves(value):
                            f_tensors.append(t)
                            f_segs.append(i)
                probe.clear()
                tensors, segs = f_tensors, f_segs
                if backward:
                    loss = _loss(output, item, loss_fn, note)
                    if loss is not None and loss.requires_grad:
                        pairs = [(t, s) for t, s in zip(f_tensors, f_segs) if t.requires_grad] + param_pairs
                        if pairs:
                            grads = torch.autograd.grad(loss, [t for t, _ in pairs], allow_unused=True)
                            keep = [(g, s) for g, (_, s) in zip(grads, pairs) if g is not None]
                            tensors = f_tensors + [g for g, _ in keep]
                            segs = f_segs + [total + s for _, s in keep]
                            grads_seen = grads_seen or bool(keep)
                    del loss
                acc.add(tensors, segs)
                del output, f_tensors, tensors
            batches += 1
            bar.advance(task)

    results: dict[torch.fx.Node, tuple] = {}
    for n, i in list(index.items()) + list(p_index.items()):
        f = acc.result(i)
        if f is not None:
            g = acc.result(total + i)
            results[n] = (f, g, acc.log2_hist(total + i) if g is not None else ())

    def resolve(node):
        if node in results or node not in derived:
            return results.get(node)
        how, src = derived[node]
        if how == "copy":
            got = resolve(src)
        else:
            parts = [resolve(u) for u in src]
            if any(p is None for p in parts):
                got = None
            else:
                grads = [p[1] for p in parts]
                merged: dict[int, int] = {}
                for p in parts:
                    for e, c in p[2]:
                        merged[e] = merged.get(e, 0) + c
                got = (merge_stats([p[0] for p in parts]),
                       merge_stats(grads) if all(g is not None for g in grads) else None,
                       tuple(sorted(merged.items())))
        if got is not None:
            results[node] = got
        return got

    for n in derived:
        resolve(n)
    stats: dict[str, NodeStats] = {}
    for n in gm.graph.nodes:
        if n not in results:
            continue
        f, g, hist = results[n]
        record = NodeStats(forward=f, grad=g, grad_log2_hist=hist, batches=batches)
        n.meta[META_STATS] = record
        stats[n.name] = record
    if not backward:
        loss_text = "none (backward=False)"
    elif note:
        loss_text = f"sum of the floating outputs ({note[0]})"
    elif loss_fn is not None:
        loss_text = "loss_fn(output, batch)"
    else:
        loss_text = "sum of the floating outputs"
    if backward and not grads_seen:
        loss_text += "; no gradient: nothing in the graph requires grad"
    return Calibration(stats=stats, batches=batches, loss=loss_text, backward=backward and grads_seen,
                       seconds=time.perf_counter() - t0, inputs=inputs)


def _take(iterable: Iterable, n: int) -> list:
    out = []
    for item in iterable:
        if len(out) >= n:
            break
        out.append(item)
    return out


def _fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# ---------------------------------------------------------------------------------------------
# re-deciding


def _setting_source(rules: Rules, key: str) -> Optional[str]:
    """The label of the last rule file whose ``[settings]`` sets ``key`` (None: nobody set it)."""
    from converter.rules.loader import rules_dir

    if key not in rules.settings:
        return None
    found = None
    for label in rules.files:
        path = Path(label)
        if not path.is_file():
            path = rules_dir() / label
        if not path.is_file():
            continue
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if isinstance(data.get("settings"), dict) and key in data["settings"]:
            found = label
    return found


def _fresh_decisions(gm: torch.fx.GraphModule, rules: Rules, target: str) -> dict[str, Decision]:
    """What *decide* says for every node, without placement (used to reset ``follow`` nodes)."""
    from converter.passes.decide import decide

    saved = {n: n.meta.get(META_DECISION) for n in gm.graph.nodes}
    try:
        decide(gm, rules, precision=target)
        return {n.name: n.meta[META_DECISION] for n in gm.graph.nodes if META_DECISION in n.meta}
    finally:
        for n, d in saved.items():
            if d is None:
                n.meta.pop(META_DECISION, None)
            else:
                n.meta[META_DECISION] = d


def replace_decisions(
    gm: torch.fx.GraphModule,
    overrides: Mapping[str, Decision],
    *,
    fresh: Mapping[str, Decision],
    target: str,
    placement: str,
    keep_io_types: bool,
) -> None:
    """Apply ``overrides`` and re-run placement.

    Every node that *decide* left unresolved (``follow``/``promote``/alias) gets its pre-placement
    decision back (from ``fresh``), unless overridden; concrete decisions stay as they are.
    """
    for node in gm.graph.nodes:
        if node.name in overrides:
            node.meta[META_DECISION] = overrides[node.name]
            continue
        before = fresh.get(node.name)
        if before is not None and before.precision in ("follow", "promote", "alias") and META_DECISION in node.meta:
            node.meta[META_DECISION] = before
    place(gm, target=target, strategy=placement, keep_io_types=keep_io_types)


def _overflow_evidence(node: torch.fx.Node, margin: float) -> Optional[tuple[str, float, str]]:
    """(what, absmax, source) for the largest finite value of ``node`` that would overflow fp16, else None.

    Values already infinite in fp32 (an attention mask's -inf) are not an overflow: fp16 has inf too.
    """
    limit = FP16_MAX / margin
    stats: Optional[NodeStats] = node.meta.get(META_STATS)
    worst = None
    if stats is not None and stats.forward.absmax_finite > limit:
        worst = ("output", stats.forward.absmax_finite, node.name)
    for producer in castable_inputs(node):
        ps: Optional[NodeStats] = producer.meta.get(META_STATS)
        if ps is not None and ps.forward.absmax_finite > limit and (worst is None or ps.forward.absmax_finite > worst[1]):
            worst = ("input", ps.forward.absmax_finite, producer.name)
    return worst


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def redecide_overflow(
    gm: torch.fx.GraphModule,
    *,
    rules: Rules,
    target: str,
    placement: str,
    keep_io_types: bool,
    margin: float,
    fallback: str,
    fresh: Optional[Mapping[str, Decision]] = None,
) -> list[dict]:
    """Re-decide every fp16 node that would overflow to ``fallback``; returns the risky-node rows.

    Iterates to a fixed point: after placement re-runs, a ``follow`` neighbour that placement put
    in fp16 and whose own values overflow is re-decided too.
    """
    if target != "fp16":
        return []
    if fallback not in ("bf16", "fp32"):
        raise ValueError(f"overflow_fallback must be 'bf16' or 'fp32', got {fallback!r}")
    ref = None  # the rule reference, made on the first re-decision (finding the file reads TOML)
    fresh = fresh if fresh is not None else _fresh_decisions(gm, rules, target)
    overrides: dict[str, Decision] = {}
    rows: list[dict] = []
    for _ in range(len(gm.graph.nodes) + 1):
        newly = []
        for node in gm.graph.nodes:
            info = node.meta.get(META_INFO)
            decision: Optional[Decision] = node.meta.get(META_DECISION)
            if info is None or decision is None or info.kind != "compute" or decision.precision != "fp16":
                continue
            if node.name in overrides:
                continue
            evidence = _overflow_evidence(node, margin)
            if evidence is None:
                continue
            what, absmax, src = evidence
            if ref is None:
                source = _setting_source(rules, "overflow_fallback") or "<calibration>"
                ref = RuleRef(file=source, table="calibration", pattern="overflow_fallback")
            value = "absmax" if what == "output" else f"input {src!r} absmax"
            reason = (
                f"calibration: {value} {_fmt(absmax)} × margin {margin:g} > fp16 max 65504 → {fallback} "
                f"(was fp16 by {decision.rule}: {decision.full_reason})"
            )
            match = Match(rule=ref, precision=fallback, level=rank(OVERRIDE_LEVEL), level_name=OVERRIDE_LEVEL, reason=reason)
            overrides[node.name] = decision.replace(
                precision=fallback, requested=fallback, rule=ref, reason=reason, matches=(match,) + tuple(decision.matches),
                unmatched=False, notes=(),
            )
            newly.append(node)
            stats: NodeStats = node.meta[META_STATS]
            rows.append({
                "name": node.name,
                "op": info.op,
                "module": info.module,
                "evidence": what,
                "source": src,
                "absmax": _num(absmax),
                "output_absmax": _num(stats.forward.absmax_finite),
                "frac_over_fp16": stats.forward.frac_over_fp16,
                "grad_absmax": _num(stats.grad.absmax) if stats.grad is not None else None,
                "was": decision.precision,
                "precision": fallback,
                "rule": str(ref),
                "reason": reason,
            })
        if not newly:
            break
        replace_decisions(gm, overrides, fresh=fresh, target=target, placement=placement, keep_io_types=keep_io_types)
    return rows


# ---------------------------------------------------------------------------------------------
# loss scale and underflow


def recommend_loss_scale(max_abs_grad: float, margin: float) -> Optional[float]:
    """The largest power of two ``s`` with ``max|grad| × s × margin < 65504``, within [1, 2**24]."""
    if not (max_abs_grad > 0) or not math.isfinite(max_abs_grad):
        return None
    k = math.floor(math.log2(FP16_MAX / (margin * max_abs_grad)))
    if max_abs_grad * 2.0**k * margin >= FP16_MAX:  # exact power-of-two boundary
        k -= 1
    return float(min(max(2.0**k, 1.0), MAX_LOSS_SCALE))


def _gradient_report(gm: torch.fx.GraphModule, margin: float, target: str) -> dict:
    """Underflow risk and the loss scale, over the gradients that fp16 nodes produce in half.

    Those are the gradients of the outputs of fp16 nodes and of the parameters they cast (O1:
    the weight gradient is computed in half before it reaches the fp32 master).
    """
    if target != "fp16":
        return {"recommended_initial_scale": None,
                "why": f"{target} has the range of fp32: no loss scaling is needed"}, {"applies": False, "why": f"{target} has the range of fp32"}
    hist = None
    count = zeros = 0
    max_grad = 0.0
    names = []
    for node in gm.graph.nodes:
        stats: Optional[NodeStats] = node.meta.get(META_STATS)
        if stats is None or stats.grad is None:
            continue
        decision = node.meta.get(META_DECISION)
        half = decision is not None and decision.precision == "fp16"
        if node.op == "get_attr":
            half = any(u.meta.get(META_DECISION) is not None and u.meta[META_DECISION].precision == "fp16" for u in node.users)
        if not half:
            continue
        names.append(node.name)
        g = stats.grad
        hist = {} if hist is None else hist
        for e, c in stats.grad_log2_hist:
            hist[e] = hist.get(e, 0) + c
        count += g.count
        zeros += g.n_zero
        if not math.isnan(g.absmax):
            max_grad = max(max_grad, g.absmax)
    if hist is None:
        scale_info = {"recommended_initial_scale": None, "why": "no gradient reached an fp16 node (backward off, or nothing requires grad)"}
        return scale_info, {"applies": False, "why": scale_info["why"]}
    scale = recommend_loss_scale(max_grad, margin)
    nonzero = sum(hist.values())

    def below(threshold_exp: int) -> int:
        # |g| in [2**e, 2**(e+1)) is below 2**threshold_exp  <=>  e < threshold_exp
        return sum(c for e, c in hist.items() if e < threshold_exp)

    k = int(round(math.log2(scale))) if scale else 0
    under_unscaled = below(-24)
    under_scaled = below(-24 - k)
    scale_info = {
        "recommended_initial_scale": scale,
        "max_abs_grad": _num(max_grad),
        "margin": margin,
        "rule": "largest power of two s with max|grad| × s × margin < 65504 (clamped to [1, 2**24])",
        "nodes": len(names),
    }
    underflow = {
        "applies": True,
        "gradient_values": count,
        "nonzero_values": nonzero,
        "frac_below_fp16_subnormal": under_unscaled / nonzero if nonzero else 0.0,
        "frac_below_fp16_subnormal_at_recommended_scale": under_scaled / nonzero if nonzero else 0.0,
        "frac_below_fp16_normal": below(-14) / nonzero if nonzero else 0.0,
        "note": "fractions of the non-zero gradient values that fp16 nodes produce; below 2**-24 they flush to 0 in fp16",
    }
    return scale_info, underflow


# ---------------------------------------------------------------------------------------------
# the stage


def calibrate_and_redecide(
    gm: torch.fx.GraphModule,
    calibration: Iterable,
    *,
    rules: Rules,
    target: str,
    placement: str = "mincut",
    keep_io_types: bool = True,
    margin: Optional[float] = None,
    fallback: Optional[str] = None,
    loss_fn: Optional[Callable] = None,
    backward: bool = True,
    progress: bool = True,
    max_batches: Optional[int] = None,
    tolerance: Any = None,
    max_evaluations: int = 64,
    max_keep: Optional[int] = None,
    search_options: Optional[Mapping[str, Any]] = None,
) -> dict:
    """The calibrate stage (see the module docstring); returns ``gm.meta["mp_calibration"]``.

    ``calibration``: an iterable of inputs in the example-input form. ``margin``/``fallback``
    override the rules settings ``overflow_margin``/``overflow_fallback``. ``loss_fn(output,
    batch)`` gives the loss for the gradient statistics (the sum of the floating outputs without
    it); ``backward=False`` skips them. ``tolerance`` (an SQNR in dB, ``{"sqnr": dB}``,
    ``{"rtol": r, "atol": a}``, or a string such as ``"30"`` / ``"rtol=1e-2,atol=1e-3"``) runs the
    accuracy search of :mod:`converter.search` with at most ``max_evaluations`` candidate
    evaluations and at most ``max_keep`` nodes kept in fp32; ``search_options`` go to
    :func:`converter.search.accuracy_search` (``projections``, ``prune``, ``max_batches``, ``seed``).
    Raises :class:`ToleranceNotMet` when the tolerance cannot be met.
    """
    t0 = time.perf_counter()
    if margin is not None:
        margin_source = "argument"
    else:
        margin_source = _setting_source(rules, "overflow_margin") or ("rules" if rules.setting("overflow_margin") else "default")
        margin = rules.setting("overflow_margin", DEFAULT_MARGIN)
    margin = float(margin)
    if not margin > 0:
        raise ValueError(f"overflow margin must be > 0, got {margin}")
    fallback = fallback if fallback is not None else rules.setting("overflow_fallback", DEFAULT_FALLBACK)
    if fallback not in ("bf16", "fp32"):
        raise ValueError(f"overflow_fallback must be 'bf16' or 'fp32', got {fallback!r}")
    if target not in HALF_NAMES:
        raise ValueError(f"target must be fp16 or bf16, got {target!r}")
    cal = collect_statistics(gm, calibration, loss_fn=loss_fn, backward=backward, progress=progress, max_batches=max_batches)
    if cal.batches == 0:
        raise ValueError("calibration: the calibration iterable gave no batches")
    fresh = _fresh_decisions(gm, rules, target)
    t1 = time.perf_counter()
    risky = redecide_overflow(gm, rules=rules, target=target, placement=placement, keep_io_types=keep_io_types,
                              margin=margin, fallback=fallback, fresh=fresh)
    nonfinite = [
        {"name": n.name, "inf": n.meta[META_STATS].forward.n_inf, "nan": n.meta[META_STATS].forward.n_nan}
        for n in gm.graph.nodes
        if META_STATS in n.meta and (n.meta[META_STATS].forward.n_inf or n.meta[META_STATS].forward.n_nan)
    ]
    scale_info, underflow = _gradient_report(gm, margin, target)
    result: dict = {
        "target": target,
        "batches": cal.batches,
        "loss": cal.loss,
        "backward": cal.backward,
        "margin": margin,
        "margin_source": margin_source,
        "overflow_fallback": fallback,
        "fp16_max": FP16_MAX,
        "risky_nodes": risky,
        "nonfinite_in_fp32": nonfinite,
        "underflow": underflow,
        "loss_scale": scale_info,
        "nodes": {name: s.to_dict() for name, s in cal.stats.items()},
        "timings": {"statistics_s": cal.seconds, "redecide_s": time.perf_counter() - t1},
    }
    gm.meta[GM_CALIBRATION] = result
    if tolerance is not None:
        from converter.numerics.search import accuracy_search

        t2 = time.perf_counter()
        try:
            result["search"] = accuracy_search(
                gm, cal.inputs, tolerance=tolerance, target=target, rules=rules, placement=placement,
                keep_io_types=keep_io_types, fresh=fresh, progress=progress, max_evaluations=max_evaluations,
                max_keep=max_keep, **dict(search_options or {}))
        except ToleranceNotMet as exc:
            result["search"] = {"tolerance": str(exc.tolerance), "met": False, "best_sqnr_db": _num(exc.best_sqnr),
                                "best_set": list(exc.best_set), "evaluations": exc.evaluations, "why": exc.why}
            raise
        finally:
            result["timings"]["search_s"] = time.perf_counter() - t2
    result["timings"]["total_s"] = time.perf_counter() - t0
    return result
