"""Cast bytes of one training step (fwd + bwd) per placement strategy, against torch.autocast.

The cost of the no-extra-rounding invariant: ``mincut-bytes`` is the byte-only optimum
(before), ``mincut`` keeps the invariant (after), ``simple`` casts per consumer. O1 and O2
conversions (O2 run by MixedPrecisionTrainer with master weights, as in run.py), portable graphs (no device lowering), the benchmark models of ``benchmarks/run.py``.

Run: ``PYTHONPATH=. python benchmarks/placement_cost.py [--models encoder_large hf_bert] [--precision bf16]``
"""
from __future__ import annotations

import argparse
import copy
import json

import torch

from benchmarks.run import MODELS, build_variants, measure_casts

__all__ = ["measure_model", "main"]

PLACEMENTS = ("mincut-bytes", "mincut", "simple")


def measure_model(name: str, *, precision: str = "bf16") -> dict:
    """Cast bytes (fwd+bwd, one step) of autocast and of every placement (O1 and O2) for ``MODELS[name]``."""
    import converter

    model, args, kwargs = MODELS[name].build()
    half = torch.float16 if precision == "fp16" else torch.bfloat16
    row: dict = {}
    for placement in PLACEMENTS:
        convs = {level: converter.convert(copy.deepcopy(model), (args, kwargs), precision=precision,
                                          placement=placement, opt_level=level) for level in ("O1", "O2")}
        variants = build_variants(model, convs["O1"], args, kwargs, half=half, device=torch.device("cpu"),
                                  optimizer="sgd", conv_o2=convs["O2"])
        if "autocast" not in row:
            row["autocast"] = measure_casts(variants["autocast"])["cast_bytes"]
        for level in ("O1", "O2"):
            row[f"{placement} {level}"] = measure_casts(variants[level])["cast_bytes"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    p.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
    a = p.parse_args(argv)
    rows = {name: measure_model(name, precision=a.precision) for name in a.models}
    print("| model | level | autocast | mincut-bytes (before) | mincut (after) | simple | after / autocast |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        for level in ("O1", "O2"):
            after = r[f"mincut {level}"]
            ratio = after / r["autocast"] if r["autocast"] else float("nan")
            print(f"| {name} | {level} | {r['autocast']:,} | {r[f'mincut-bytes {level}']:,} | {after:,} | "
                  f"{r[f'simple {level}']:,} | {ratio:.3f} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
