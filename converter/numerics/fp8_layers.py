"""Per-layer FP8 numerics: each fp8 GEMM against the bf16 conversion of the same layer, on calibration batches.

For every linear node the fp8 stage turned into a ``fp8_linear`` call (:mod:`converter.passes.fp8`),
:func:`measure_fp8_layers` reports, as one frozen :class:`Fp8LayerNumerics`:

* **SQNR** (dB, :func:`~converter.numerics.common.sqnr_db`'s definition) of the layer's output, grad_input and
  grad_weight computed by the fp8 kernels against ``F.linear`` in bf16 on the *same operands* (the layer's
  recorded input, weight, bias and incoming gradient), its gradients by autograd. Over several batches the
  signal and noise energies add before the ratio is taken, so one batch gives exactly ``sqnr_db``;
* **amax** of each tensor the recipe quantises: ``x`` (the input), ``weight`` and ``grad_output``;
* **underflow**: the share of the nonzero elements of each such tensor that its fp8 cast turns into zero,
  and **overflow**: the share of its elements whose scaled magnitude lies beyond the rounding interval of the
  fp8 maximum (``fp8_max`` + half its ulp), so that the saturated cast clips them. Both per the recipe's scaling
  (:func:`converter.fp8.kernels.operand_scale`), pooled over every cast the recipe makes of the tensor (a
  tensorwise recipe casts ``x`` for the output and the grad_weight GEMM with one scale, a rowwise one along
  each GEMM's contraction dimension). Dynamic ("current") scaling maps each amax onto the fp8 maximum, so its
  overflow is 0 by construction; underflow is what it costs: values more than the fp8 dynamic range below
  their slice's amax flush to zero;
* **flops**: the layer's forward FLOPs at the example inputs' shapes, 2·numel(output)·K (the number
  report.json's per-node data gives the node).

How: the converted graph runs forward and one backward on each batch, in a copy whose ``fp8_linear`` calls are
retargeted to a tap that records ``(x, weight, bias)`` and the output (the same node under FX and
torch.export captures: the fp8 stage writes one call target for both). The backward seed is
``loss_fn(output, batch)`` when given (as calibration's gradient statistics use it), else ``⟨v, outputs⟩``
for a fixed-seed random projection ``v`` of the floating outputs: a sum of the outputs would give an
all-ones gradient at the last layer, no test of the e5m2 cast. ``torch.autograd.grad`` gives each tap's
output gradient (the layer's grad_output); nothing is left in ``.grad``, and buffers and the RNG state are
restored. Random ops draw the same numbers per batch (``torch.manual_seed(seed + batch)``).

**Fallback** (:func:`fall_back_to_bf16`, issue 34 item 4): a layer with a GEMM whose SQNR is under its floor
(:func:`converter.passes.fp8.fp8_floors`: rule settings ``fp8_min_sqnr_output`` 18 dB,
``fp8_min_sqnr_grad_input`` 17 dB, ``fp8_min_sqnr_grad_weight`` 17 dB by default, torchao's float8 test floors)
is kept bf16: its call goes back to a bf16 linear on the same (already bf16) operands and its decision names
the setting of the GEMM furthest under its floor, every failing GEMM's dB in the reason. A NaN SQNR fails;
an unmeasured gradient (None) never does. The pipeline runs :func:`measure_and_fall_back` right after the
fp8 stage when the conversion has calibration batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Union, cast

import torch
import torch.fx
import torch.nn.functional as F

from converter.fp8.kernels import Fp8Recipe, cast_to_fp8, fp8_linear, operand_scale, resolve_recipe
from converter.ir.meta import META_DECISION, META_INFO, META_VALUE, RuleRef, TensorSpec
from converter.numerics.common import copy_graph, floating_outputs, json_float, preserved_state, user_loss
from converter.passes.capture.values import normalize_inputs
from converter.passes.fp8 import MIN_SQNR_SETTINGS, fp8_floors, keep_bf16
from converter.rules.loader import Rules

__all__ = ["GEMMS", "TENSORS", "Fp8LayerNumerics", "fp8_nodes", "measure_fp8_layers", "fall_back_to_bf16",
           "measure_and_fall_back"]

#: the three GEMMs of a layer's training step, the keys of :attr:`Fp8LayerNumerics.by_gemm`
GEMMS = ("output", "grad_input", "grad_weight")
#: the tensors an fp8 recipe quantises, the keys of ``amax``, ``underflow`` and ``overflow``
TENSORS = ("x", "weight", "grad_output")


@dataclass(frozen=True)
class Fp8LayerNumerics:
    """One fp8 linear node's numerics on the calibration batches (module docstring).

    ``sqnr_grad_input`` / ``sqnr_grad_weight`` are None when no gradient reached the layer (nothing upstream
    requires grad, or the loss does not depend on it); ``amax``, ``underflow`` and ``overflow`` then have no
    ``grad_output`` entry. ``underflow`` and ``overflow`` are shares in [0, 1]; an SQNR is ``inf`` when the fp8
    result equals the bf16 one exactly.
    """

    node: str
    module: str
    recipe: str
    flops: int
    sqnr_output: float
    sqnr_grad_input: Optional[float]
    sqnr_grad_weight: Optional[float]
    amax: Mapping[str, float] = field(default_factory=dict)
    underflow: Mapping[str, float] = field(default_factory=dict)
    overflow: Mapping[str, float] = field(default_factory=dict)
    batches: int = 0

    @property
    def by_gemm(self) -> dict[str, Optional[float]]:
        """``{"output": dB, "grad_input": dB, "grad_weight": dB}`` (None where no gradient was measured)."""
        return {"output": self.sqnr_output, "grad_input": self.sqnr_grad_input, "grad_weight": self.sqnr_grad_weight}

    def to_dict(self) -> dict:
        """report.json's row: non-finite numbers as ``"inf"``/``"-inf"``/``"nan"``."""
        def floats(values: Mapping[str, Optional[float]]) -> dict:
            return {k: None if v is None else json_float(v) for k, v in values.items()}

        return {"node": self.node, "module": self.module, "recipe": self.recipe, "flops": self.flops,
                "sqnr": floats(self.by_gemm), "amax": floats(self.amax), "underflow": floats(self.underflow),
                "overflow": floats(self.overflow), "batches": self.batches}


# --------------------------------------------------------------------------------------------- the layers


def fp8_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The ``fp8_linear`` calls of ``gm``, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fp8_linear]


def _linear_flops(node: torch.fx.Node) -> int:
    """2·numel(output)·K from shape propagation (0 when a shape is unknown)."""
    out = node.meta.get(META_VALUE)
    weight = node.args[1] if len(node.args) > 1 else None
    spec = weight.meta.get(META_VALUE) if isinstance(weight, torch.fx.Node) else None
    if not isinstance(out, TensorSpec) or not isinstance(spec, TensorSpec) or not spec.shape:
        return 0
    return 2 * out.numel * int(spec.shape[-1])


def _module_of(node: torch.fx.Node) -> str:
    info = node.meta.get(META_INFO)
    return getattr(info, "module", "") or ""


# --------------------------------------------------------------------------------------------- quantisation


def _overflow_limit(dtype: torch.dtype) -> float:
    """The top of the fp8 maximum's rounding interval: ``max + ulp(max) / 2``."""
    info = torch.finfo(dtype)
    return info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2


def _casts(recipe: Fp8Recipe, x2: torch.Tensor, weight: torch.Tensor, g2: Optional[torch.Tensor]) -> list[tuple]:
    """``(tensor, operand, dtype, contract_dim, is_weight)`` for each cast the recipe's scaled GEMMs make."""
    found = []
    if "output" in recipe.scaled_gemms:
        found += [("x", x2, recipe.input_dtype, 1, False), ("weight", weight.t(), recipe.weight_dtype, 0, True)]
    if g2 is not None and "grad_input" in recipe.scaled_gemms:
        found += [("grad_output", g2, recipe.grad_output_dtype, 1, False),
                  ("weight", weight, recipe.weight_dtype, 0, True)]
    if g2 is not None and "grad_weight" in recipe.scaled_gemms:
        found += [("grad_output", g2.t(), recipe.grad_output_dtype, 1, False), ("x", x2, recipe.input_dtype, 0, False)]
    return found


def cast_counts(t: torch.Tensor, dtype: torch.dtype, recipe: Fp8Recipe, contract_dim: int,
                is_weight: bool = False) -> tuple[int, int, int, int]:
    """``(underflowed, nonzero, overflowed, elements)`` of one fp8 cast of the 2-D operand ``t`` (module docstring)."""
    scale = operand_scale(t, dtype, recipe, contract_dim, is_weight)
    nonzero = t != 0
    under = nonzero & (cast_to_fp8(t, scale, dtype).to(torch.float32) == 0)
    over = (t.to(torch.float32) * scale).abs() > _overflow_limit(dtype)
    return int(under.sum()), int(nonzero.sum()), int(over.sum()), t.numel()


# --------------------------------------------------------------------------------------------- accumulation


class _Layer:
    """What the batches add up for one layer: energies per GEMM, amax and cast counts per tensor."""

    def __init__(self) -> None:
        self.signal = dict.fromkeys(GEMMS, 0.0)
        self.noise = dict.fromkeys(GEMMS, 0.0)
        self.measured: set[str] = set()
        self.amax: dict[str, float] = {}
        self.counts: dict[str, list[int]] = {}
        self.batches = 0

    def add_error(self, gemm: str, ref: torch.Tensor, out: torch.Tensor) -> None:
        r, o = ref.detach().double(), out.detach().double()
        finite = torch.isfinite(r) & torch.isfinite(o)
        if not bool(finite.all()) and not bool(((r == o) | finite).all()):
            self.noise[gemm] = math.inf  # a non-finite value where the other is not: sqnr_db's -inf
        self.signal[gemm] += float(r[finite].pow(2).sum())
        self.noise[gemm] += float((r - o)[finite].pow(2).sum())
        self.measured.add(gemm)

    def add_casts(self, recipe: Fp8Recipe, x2: torch.Tensor, weight: torch.Tensor, g2: Optional[torch.Tensor]) -> None:
        for name, t in (("x", x2), ("weight", weight), ("grad_output", g2)):
            if t is not None:
                self.amax[name] = max(self.amax.get(name, 0.0), float(t.detach().abs().max()) if t.numel() else 0.0)
        for name, t, dtype, dim, is_weight in _casts(recipe, x2, weight, g2):
            got = cast_counts(t.detach(), dtype, recipe, dim, is_weight)
            total = self.counts.setdefault(name, [0, 0, 0, 0])
            for i, value in enumerate(got):
                total[i] += value

    def pooled_db(self, gemm: str) -> Optional[float]:
        """The SQNR of ``gemm`` over every batch: summed signal over summed noise energy (one batch: ``sqnr_db``)."""
        if gemm not in self.measured:
            return None
        signal, noise = self.signal[gemm], self.noise[gemm]
        if noise == 0.0:
            return math.inf
        if signal == 0.0 or math.isinf(noise):
            return -math.inf
        return 10.0 * math.log10(signal / noise)

    def result(self, node: torch.fx.Node, recipe: Fp8Recipe) -> Fp8LayerNumerics:
        under = {k: (c[0] / c[1] if c[1] else 0.0) for k, c in self.counts.items()}
        over = {k: (c[2] / c[3] if c[3] else 0.0) for k, c in self.counts.items()}
        return Fp8LayerNumerics(node=node.name, module=_module_of(node), recipe=recipe.name, flops=_linear_flops(node),
                                sqnr_output=cast(float, self.pooled_db("output")), sqnr_grad_input=self.pooled_db("grad_input"),
                                sqnr_grad_weight=self.pooled_db("grad_weight"), amax=dict(self.amax), underflow=under,
                                overflow=over, batches=self.batches)


def _measure_layer(acc: _Layer, recipe: Fp8Recipe, x: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor], grad_output: Optional[torch.Tensor]) -> None:
    """One batch of one layer: the fp8 kernels and bf16 ``F.linear`` on the same operands, forward and backward."""
    backward = grad_output is not None
    with torch.enable_grad():
        x8, w8 = x.detach().requires_grad_(backward), weight.detach().requires_grad_(backward)
        xr = x.detach().to(torch.bfloat16).requires_grad_(backward)
        wr = weight.detach().to(torch.bfloat16).requires_grad_(backward)
        b = None if bias is None else bias.detach()
        y8 = fp8_linear(x8, w8, b, recipe)
        yr = F.linear(xr, wr, None if b is None else b.to(torch.bfloat16))
        acc.add_error("output", yr, y8)
        if grad_output is not None:
            gx8, gw8 = torch.autograd.grad(y8, (x8, w8), grad_output.to(y8.dtype))
            gxr, gwr = torch.autograd.grad(yr, (xr, wr), grad_output.to(yr.dtype))
            acc.add_error("grad_input", gxr, gx8)
            acc.add_error("grad_weight", gwr, gw8)
    g2 = None if grad_output is None else grad_output.detach().reshape(-1, grad_output.shape[-1])
    acc.add_casts(recipe, x.detach().reshape(-1, x.shape[-1]), weight.detach(), g2)
    acc.batches += 1


# --------------------------------------------------------------------------------------------- the run


def _tapped(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], slots: list) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose fp8 calls also store ``(x, weight, bias, output)`` in ``slots[i]``."""
    graph, mapping = copy_graph(gm)

    def _mp_fp8_tap(index, x, weight, bias=None, recipe="tensorwise"):
        y = fp8_linear(x, weight, bias, recipe)
        slots[index] = (x, weight, bias, y)
        return y

    for i, old in enumerate(nodes):
        new = mapping[old]
        new.target, new.args = _mp_fp8_tap, (i, *new.args)
    graph.lint()
    return torch.fx.GraphModule(gm, graph, class_name="Fp8Probe")


def _seed(output: Any, item: Any, loss_fn: Optional[Callable], gen: torch.Generator,
          note: list) -> Optional[torch.Tensor]:
    """The scalar to differentiate: ``loss_fn(output, item)``, else ⟨v, floating outputs⟩ for a random ``v``."""
    loss = user_loss(output, item, loss_fn, note, "fp8 numerics", "a random projection of the outputs")
    if loss is not None:
        return loss
    leaves = [t for t in floating_outputs(output, fp64=False) if t.requires_grad]
    if not leaves:
        return None
    return cast(torch.Tensor, sum((t.float() * torch.randn(t.shape, generator=gen).to(t.device)).sum() for t in leaves))


def measure_fp8_layers(gm: torch.fx.GraphModule, batches: Iterable, recipe: Union[str, Fp8Recipe], *,
                       loss_fn: Optional[Callable] = None, seed: int = 0) -> dict[str, Fp8LayerNumerics]:
    """Node name -> :class:`Fp8LayerNumerics` for each ``fp8_linear`` node of ``gm`` (module docstring).

    ``gm``: a converted graph after the fp8 stage (its fp8 layers are ``fp8_linear`` calls on their bf16
    operands). ``batches``: inputs in the example-input form (a tuple of args, an ``(args, kwargs)`` pair or
    a tensor). ``recipe``: the recipe whose kernels and scaling are measured (a name of
    ``converter.fp8.kernels.RECIPES`` or an ``Fp8Recipe``; normally the graph's own). ``loss_fn(output,
    batch)``: the backward seed (None: a random projection of the floating outputs drawn from ``seed``).
    An empty dict when the graph has no fp8 layer; a ValueError when ``batches`` is empty.
    """
    rec = resolve_recipe(recipe)
    nodes = fp8_nodes(gm)
    if not nodes:
        return {}
    items = list(batches)
    if not items:
        raise ValueError("fp8 numerics: no calibration batch to measure the fp8 layers on")
    slots: list = [None] * len(nodes)
    probe = _tapped(gm, nodes, slots)
    layers = [_Layer() for _ in nodes]
    gen = torch.Generator().manual_seed(seed)
    note: list = []
    with preserved_state(gm):
        for b, item in enumerate(items):
            args, kwargs = normalize_inputs(item)
            torch.manual_seed(seed + b)
            slots[:] = [None] * len(nodes)
            with torch.enable_grad():
                output = probe(*args, **kwargs)
                loss = _seed(output, item, loss_fn, gen, note)
                taken = [i for i, s in enumerate(slots) if s is not None and s[3].requires_grad]
                grads: list = [None] * len(nodes)
                if loss is not None and loss.requires_grad and taken:
                    found = torch.autograd.grad(loss, [slots[i][3] for i in taken], allow_unused=True)
                    for i, g in zip(taken, found):
                        grads[i] = g
                del loss, output
            for i, slot in enumerate(slots):
                if slot is not None:
                    x, weight, bias, _ = slot
                    _measure_layer(layers[i], rec, x, weight, bias, grads[i])
            slots[:] = [None] * len(nodes)
    return {node.name: acc.result(node, rec) for node, acc in zip(nodes, layers) if acc.batches}



# --------------------------------------------------------------------------------------------- fallback


def _shortfall(db: float, floor: float) -> float:
    return math.inf if math.isnan(db) else floor - db


def fall_back_to_bf16(gm: torch.fx.GraphModule, numerics: Mapping[str, Fp8LayerNumerics], rules: Rules, *,
                      aten: bool = False) -> list[dict]:
    """Keep bf16 every measured layer of ``gm`` with a GEMM under its SQNR floor (module docstring); returns one
    row per such layer: node, module, gemm (the furthest under), sqnr_db, min_db, rule, failed (gemm -> dB),
    reason. ``aten``: the graph is a torch.export capture (its linear calls are ``aten.linear``)."""
    floors = fp8_floors(rules)
    by_name = {n.name: n for n in gm.graph.nodes}
    kept: dict[str, tuple[RuleRef, str]] = {}
    rows = []
    for name, layer in numerics.items():
        failed = {g: db for g, db in layer.by_gemm.items() if db is not None and not db >= floors[g][0]}
        if not failed or name not in by_name:
            continue
        gemm = max(failed, key=lambda g: _shortfall(failed[g], floors[g][0]))
        floor, rule = floors[gemm]
        was = by_name[name].meta[META_DECISION].rule
        what = "; ".join(f"{g} SQNR {db:.2f} dB < {MIN_SQNR_SETTINGS[g]} = {floors[g][0]:g} dB" for g, db in failed.items())
        reason = (f"fp8 numerics: {what} (recipe {layer.recipe}, {layer.batches} calibration batch(es), against bf16 "
                  f"F.linear on the same operands): kept bf16 (the fp8 rule was {was})")
        kept[name] = (rule, reason)
        rows.append({"node": name, "module": layer.module, "gemm": gemm, "sqnr_db": json_float(failed[gemm]),
                     "min_db": json_float(floor), "rule": str(rule),
                     "failed": {g: json_float(db) for g, db in failed.items()}, "reason": reason})
    keep_bf16(gm, kept, aten=aten)
    return rows


def measure_and_fall_back(gm: torch.fx.GraphModule, batches: Iterable, recipe: Union[str, Fp8Recipe], rules: Rules, *,
                          loss_fn: Optional[Callable] = None, aten: bool = False) -> dict:
    """The pipeline's step after the fp8 stage with calibration: :func:`measure_fp8_layers`, then
    :func:`fall_back_to_bf16`, again on the layers left after a fallback (to a fixed point), so that the numbers
    of the layers still fp8 describe the final conversion (a broken layer upstream distorts its neighbours'
    gradients); a dropped layer keeps the numbers it was dropped on. Returns the graph facts ``fp8_numerics``
    (every measured layer, in graph order), ``fp8_fallback`` (the dropped layers' rows) and ``fp8_layers``
    (the layers still fp8)."""
    items = list(batches)
    numerics = measure_fp8_layers(gm, items, recipe, loss_fn=loss_fn)
    final, rows = dict(numerics), []
    for _ in range(len(numerics)):
        dropped = fall_back_to_bf16(gm, numerics, rules, aten=aten)
        rows += dropped
        if not dropped or not fp8_nodes(gm):
            break
        # the layers left ran beside the dropped ones in fp8: measure them again in the conversion as it now is
        numerics = measure_fp8_layers(gm, items, recipe, loss_fn=loss_fn)
        final.update(numerics)
    return {"fp8_numerics": tuple(final.values()), "fp8_fallback": tuple(rows),
            "fp8_layers": tuple(n.name for n in fp8_nodes(gm))}
