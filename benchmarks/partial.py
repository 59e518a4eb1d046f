"""Partial capture: the bf16 train step of research models converted region by region, against torch.autocast.

Models (from ``tests/research/``, written as papers' repositories write them): ``moe_dispatch`` (a MoE with a
token-dispatch loop, ``if tok.numel() == 0: continue``) and ``pabee`` (a patience-based early-exit encoder,
``torch.equal(pred, last)`` in the layer loop). Variants, each on its own copy of the same weights, each a
train-mode step (forward, the model file's ``loss_fn``, backward, SGD with momentum) on the same batches:

* ``fp32`` — the original model;
* ``autocast`` — the original under ``torch.autocast("cpu", dtype=torch.bfloat16)``: the baseline;
* ``partial`` — ``converter.convert(model, example, precision="bf16")``.module (portable: no device named), whose
  regions run converted graphs and whose glue runs under autocast; ``partial_cpu`` — the same with ``device="cpu"``;
* ``partial_fixed_gate`` — ``partial`` with this machine's device profile less its measured GEMM crossover, so that
  GEMMs under the fixed default (32 MFLOP per matrix product) stay native half GEMMs: what the crossover buys.

Interleaved (A B C … A B C …) after warm-up, median of ``--rounds`` samples, one torch thread, thread CPU clock
(:func:`benchmarks.common.interleaved`). Printed and written (``--json``): median ms per variant, each variant's
ratio to autocast, and the conversion's graph breaks and captured FLOP share.

With ``--table`` (any of the 13 models, ``--models all``) each model's entry also gets its numerics, measured as
``tests/test_partial.py`` checks them (:mod:`tests.research`): the median over five training batches of the output and
parameter-gradient SQNR against fp32, of the conversion and of torch.autocast, in bf16 and fp16.

Run: ``python benchmarks/partial.py [--rounds 40] [--json benchmarks/results/partial_cpu.json]``;
``python benchmarks/partial.py --table --models all --rounds 15 --json benchmarks/results/partial_table_cpu.json``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from research import NAMES, against_autocast, load  # noqa: E402

import converter  # noqa: E402
from benchmarks.common import interleaved, machine_info, summarize  # noqa: E402
from converter.numerics.profile import measured_once  # noqa: E402

MODELS = ("moe_dispatch", "pabee")
VARIANTS = ("fp32", "autocast", "partial", "partial_cpu", "partial_fixed_gate")


def numerics(name: str) -> dict:
    """Output and gradient SQNR (dB, medians over the batches) against fp32: the conversion's and autocast's, each
    on freshly built weights (the timed modules have taken optimizer steps)."""
    mf = load(name)
    found = {}
    for precision in ("bf16", "fp16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            conv = converter.convert(mf.build_model(), mf.example_inputs(), precision=precision)
        found[precision] = {k: round(v, 2) for k, v in against_autocast(mf, conv.module, precision).items()}
    return found


def _step(module: torch.nn.Module, mf, batches: list, *, autocast: bool):
    opt = torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0.9)
    state = {"i": 0}

    def step(clock) -> None:
        inputs, batch = batches[state["i"] % len(batches)]
        state["i"] += 1
        opt.zero_grad(set_to_none=True)
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = mf.loss_fn(module(*inputs), batch)
        else:
            loss = mf.loss_fn(module(*inputs), batch)
        clock.mark("fwd")
        loss.backward()
        clock.mark("bwd")
        opt.step()
        clock.mark("opt")

    return step


def run(name: str, rounds: int, table: bool = False) -> dict:
    mf = load(name)
    example = mf.example_inputs()
    batches = [b for _, b in zip(range(8), mf.train_batches())]
    base = mf.build_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        portable = converter.convert(copy.deepcopy(base), example, precision="bf16")
        tuned = converter.convert(copy.deepcopy(base), example, precision="bf16", device="cpu")
        fixed = converter.convert(copy.deepcopy(base), example, precision="bf16",
                                  device_profile=dataclasses.replace(measured_once(), gemm_crossover_flops=()))
        steps = {
            "fp32": _step(copy.deepcopy(base).train(), mf, batches, autocast=False),
            "autocast": _step(copy.deepcopy(base).train(), mf, batches, autocast=True),
            "partial": _step(portable.module.train(), mf, batches, autocast=False),
            "partial_cpu": _step(tuned.module.train(), mf, batches, autocast=False),
            "partial_fixed_gate": _step(fixed.module.train(), mf, batches, autocast=False),
        }
        samples = interleaved(steps, rounds=rounds, warmup=5, clock="cpu")
    figures = {variant: summarize(s) for variant, s in samples.items()}
    auto = figures["autocast"]["total_ms"]
    summary = portable.report.summary
    extra = {"numerics": numerics(name)} if table else {}
    return {"model": name, "ms": {v: round(f["total_ms"], 3) for v, f in figures.items()},
            "vs_autocast": {v: round(f["total_ms"] / auto, 3) for v, f in figures.items()},
            "break_count": summary["break_count"], "captured_flop_fraction": summary["captured_flop_fraction"],
            "regions": len(portable.partition.regions) if portable.partition is not None else 0, **extra,
            "phases": figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=(*NAMES, "all"))
    parser.add_argument("--table", action="store_true", help="also measure each model's output and gradient SQNR")
    parser.add_argument("--json", type=Path, default=None)
    ns = parser.parse_args()
    names = list(NAMES) if "all" in ns.models else ns.models
    torch.set_num_threads(1)
    results = {"machine": machine_info("cpu"), "torch": torch.__version__, "rounds": ns.rounds, "clock": "cpu",
               "device_profile": measured_once().to_dict(), "models": [run(name, ns.rounds, ns.table) for name in names]}
    print(f"{'model':14s} {'breaks':>6s} {'FLOPs in graphs':>16s} " + " ".join(f"{v:>14s}" for v in
                                                                            VARIANTS))
    for r in results["models"]:
        cells = " ".join(f"{r['ms'][v]:7.2f} ({r['vs_autocast'][v]:.2f}x)" for v in VARIANTS)
        print(f"{r['model']:14s} {r['break_count']:6d} {100 * r['captured_flop_fraction']:15.1f}% {cells}")
        for precision, n in r.get("numerics", {}).items():
            print(f"    {precision}: output {n['output_db']:.1f} dB (autocast {n['autocast_output_db']:.1f}), "
                  f"gradients {n['grad_db']:.1f} dB (autocast {n['autocast_grad_db']:.1f})")
    if ns.json is not None:
        ns.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
