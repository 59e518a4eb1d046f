"""Overhead of scoping the fp32 math mode: the ``fp32_math`` pass's enter/exit calls.

The converted graph brackets each run of fp32 matmul/conv nodes with two calls that save, set and
restore the per-backend fp32 precision (``converter.passes.fp32_math``). This script measures what
those calls cost on the benchmarks/README.md encoders (``nn.TransformerEncoder``, 2 layers, bf16, one
forward + backward step):

* small: d128 h4 ff256, B2×T16;   large: d512 h8 ff2048, B8×T128.

Default rules put every matmul in half, so the encoders have no fp32 matmul and nothing to scope.
Two rule sets make the scoping work:

* ``sdpa_fp32`` — ``rules/attention_fp32.toml``: attention in fp32 (one run per layer, merged into
  one region because nothing between them wants other math);
* ``alternating`` — linears ``fp32`` and attention ``tf32``: every layer alternates IEEE and reduced
  math, the worst case for the number of regions.

For each rule set, the variant ``scoped`` (``fp32_math = "ieee"``) is compared with ``unscoped``
(``fp32_math = "inherit"``: the same graph without the calls; tf32 nodes stay scoped in both, so
the difference is the IEEE scoping only), under the global mode ``highest`` (fast path: the calls
find the mode already right) and ``medium`` (the calls switch oneDNN to IEEE and back; the unscoped
variant then computes its fp32 matmuls in bf16, so that ratio includes the cost of IEEE math
itself). Steps run interleaved (A B A B …) and the medians are reported. By default on one torch
thread with the thread-CPU-time clock: the 2-core machine is shared, and wall time there measures
the neighbours. The cost of one enter+exit pair is also timed on its own.

    python benchmarks/fp32_math_overhead.py                   # both encoders
    python benchmarks/fp32_math_overhead.py --quick           # small encoder only, fewer rounds
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import converter  # noqa: E402
from benchmarks.common import encoder, interleaved, machine_info, summarize  # noqa: E402
from converter.passes.fp32_math import mp_fp32_math_enter, mp_fp32_math_exit  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ENCODERS = {
    "small": dict(d_model=128, nhead=4, ff=256, batch=2, seq=16, rounds=40, inner=10),
    "large": dict(d_model=512, nhead=8, ff=2048, batch=8, seq=128, rounds=8, inner=1),
}
RULES = {
    "sdpa_fp32": "[op]\nscaled_dot_product_attention = \"fp32\"\n",
    "alternating": "[op]\nlinear = \"fp32\"\nscaled_dot_product_attention = \"tf32\"\n",
}


def _convert(model: nn.Module, x: torch.Tensor, rules: str, setting: str, tmp: Path) -> torch.fx.GraphModule:
    path = tmp / f"fp32_math_{abs(hash((rules, setting)))}.toml"
    path.write_text(rules + f"[settings]\nfp32_math = \"{setting}\"\n")
    conv = converter.convert(model, (x,), precision="bf16", rules=str(path))
    return conv.module, conv.report.fp32_math["regions"]


def _step(module: torch.nn.Module, x: torch.Tensor):
    params = list(module.parameters())

    def step(clock) -> None:
        out = module(x)
        clock.mark("fwd")
        out.float().pow(2).mean().backward()
        clock.mark("bwd")
        for p in params:
            p.grad = None

    return step


def _pair_cost_us(mode: str, n: int = 20000) -> float:
    settings = (("cuda", "matmul", "ieee"), ("mkldnn", "matmul", "ieee"))
    torch.set_float32_matmul_precision(mode)
    t0 = time.perf_counter()
    for _ in range(n):
        mp_fp32_math_exit(mp_fp32_math_enter(settings))
    return (time.perf_counter() - t0) / n * 1e6


def run(names: list[str], *, quick: bool, tmp: Path, clock: str) -> dict:
    results: dict = {"machine": machine_info("cpu"), "clock": clock, "encoders": {}, "pair_cost_us": {}}
    for mode in ("highest", "medium"):
        results["pair_cost_us"][mode] = round(_pair_cost_us(mode), 3)
    torch.set_float32_matmul_precision("highest")
    for name in names:
        cfg = dict(ENCODERS[name])
        rounds, inner = cfg.pop("rounds"), cfg.pop("inner")
        if quick:
            rounds = max(5, rounds // 4)
        model, x = encoder(**cfg)
        entry: dict = {"config": {**cfg, "rounds": rounds, "inner": inner}, "rules": {}}
        for rules_name, rules in RULES.items():
            modules, regions = {}, {}
            for setting, label in (("ieee", "scoped"), ("inherit", "unscoped")):
                modules[label], regions[label] = _convert(model, x, rules, setting, tmp)
            per_mode = {}
            for mode in ("highest", "medium"):
                torch.set_float32_matmul_precision(mode)
                samples = interleaved({k: _step(m, x) for k, m in modules.items()}, rounds=rounds, warmup=2, inner=inner,
                                      clock=clock)
                stats = {k: summarize(v) for k, v in samples.items()}
                per_mode[mode] = {
                    **{f"{k}_ms": round(s["total_ms"], 4) for k, s in stats.items()},
                    "ratio": round(stats["scoped"]["total_ms"] / stats["unscoped"]["total_ms"], 4),
                }
            torch.set_float32_matmul_precision("highest")
            entry["rules"][rules_name] = {"regions": regions, **per_mode}
            print(f"{name} {rules_name}: regions {regions} {json.dumps(per_mode)}", flush=True)
        results["encoders"][name] = entry
    return results


def to_markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# fp32 math scoping overhead",
        "",
        f"Machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('torch_threads')} torch threads, torch {m.get('torch')}, "
        f"{m.get('date')}. bf16 conversion, one forward + backward step, interleaved medians of the "
        f"{results['clock']} clock (`benchmarks/fp32_math_overhead.py`).",
        "",
        f"One enter+exit pair on its own: {results['pair_cost_us']['highest']} µs when the mode is already right "
        f"(global `highest`), {results['pair_cost_us']['medium']} µs when it must switch (global `medium`).",
        "",
        "| encoder | rules | regions (scoped / unscoped) | global | scoped ms | unscoped ms | scoped / unscoped |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, entry in results["encoders"].items():
        for rules_name, r in entry["rules"].items():
            for mode in ("highest", "medium"):
                lines.append(f"| {name} | {rules_name} | {r['regions']['scoped']} / {r['regions']['unscoped']} | {mode} | "
                             f"{r[mode]['scoped_ms']:.3f} | {r[mode]['unscoped_ms']:.3f} | {r[mode]['ratio']:.3f} |")
    lines += [
        "",
        "`unscoped` is `fp32_math = \"inherit\"`: under `highest` the two variants compute the same numbers and the ratio",
        "is the cost of the calls; under `medium` the unscoped variant's fp32 matmuls run in bf16 (oneDNN), so the ratio",
        "also contains the price of IEEE math that the scoped variant pays on purpose.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small encoder only, fewer rounds")
    parser.add_argument("--models", nargs="*", default=None, choices=sorted(ENCODERS))
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: see --clock)")
    parser.add_argument("--clock", default="cpu", choices=("cpu", "wall"),
                        help="cpu (default): the calling thread's CPU time, robust on a shared machine with 1 thread")
    parser.add_argument("--out", default=str(RESULTS / "fp32_math_overhead"), help="output path without suffix")
    args = parser.parse_args(argv)
    names = args.models or (["small"] if args.quick else ["small", "large"])
    import tempfile

    before = torch.get_float32_matmul_precision()
    torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = run(names, quick=args.quick, tmp=Path(tmp), clock=args.clock)
    finally:
        torch.set_float32_matmul_precision(before)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(to_markdown(results))
    print(to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
