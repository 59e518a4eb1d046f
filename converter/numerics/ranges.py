"""Range statistics of tensors, computed a whole batch at a time over fp32 bit patterns.

:class:`TensorStats` describes the values of a set of tensors (range, zeros, how many flush or
overflow in fp16, inf, NaN); :class:`RangeAccumulator` keeps one running :class:`TensorStats` per
segment and adds a whole batch of tensors with a handful of vectorised ops (two ``_foreach_max``
and one ``bincount``), not per tensor. Calibration (:mod:`converter.numerics.stats`) records every
node's forward values and gradients with it; :func:`tensor_stats` is the same code path for one set
of tensors, :func:`merge_stats` the statistics of a union.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
from torch._utils import _flatten_dense_tensors

from converter.numerics.common import json_float

__all__ = [
    "FP16_MAX",
    "FP16_MIN_NORMAL",
    "FP16_MIN_SUBNORMAL",
    "LOG2_MIN",
    "TensorStats",
    "RangeAccumulator",
    "tensor_stats",
    "merge_stats",
]

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14  # 6.1e-5
FP16_MIN_SUBNORMAL = 2.0**-24  # 6.0e-8


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


# ---------------------------------------------------------------------------------------------
# the record


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
            "absmax": json_float(self.absmax),
            "absmax_finite": json_float(self.absmax_finite),
            "min_nonzero": json_float(self.min_nonzero),
            "frac_over_fp16": self.frac_over_fp16,
            "frac_below_fp16_normal": self.frac_below_fp16_normal,
            "frac_below_fp16_subnormal": self.frac_below_fp16_subnormal,
            "zeros": self.n_zero,
            "inf": self.n_inf,
            "nan": self.n_nan,
        }

# ---------------------------------------------------------------------------------------------
# vectorised statistics


class RangeAccumulator:
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
    acc = RangeAccumulator(1)
    acc.add(ts, [0] * len(ts))
    return acc.result(0) or TensorStats()



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
