"""Pass time (decide + place + rewrite, capture excluded) from 1k to 50k graph nodes.

benchmarks/README.md: the time per node at 50k nodes must stay within 1.5× of the time per node at
1k, and the pass must take no longer than ``torch.fx.symbolic_trace`` of the same model.

The model is a stack of transformer-like MLP blocks (Linear → LayerNorm → GELU → Linear, with a
residual add), ~12 graph nodes per block. Each size is measured ``--repeat`` times; the median is
reported. ``time.process_time`` is used by default because the 2-core machine is often shared.

FX code generation for the rewritten graph is timed on its own (``codegen_s``): capture builds a
lazy GraphModule, so the conversion generates code once, for the final graph, after the pass
(``convert`` reports it as ``timings.codegen_s``). ``symbolic_trace`` includes the code generation
of its own (smaller: Linear and LayerNorm stay leaf modules there) graph.

    python benchmarks/pass_scaling.py                 # 1k, 5k, 10k, 25k, 50k nodes
    python benchmarks/pass_scaling.py --sizes 1000 5000 --repeat 3
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import converter  # noqa: E402
from converter.ir.graphmodule import materialize  # noqa: E402
from converter.passes.capture import capture  # noqa: E402
from converter.passes.decide import decide  # noqa: E402
from converter.passes.place.stage import place  # noqa: E402
from converter.passes.rewrite import rewrite  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.fc2 = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.norm(self.fc1(x))))


def measure(blocks: int, repeat: int, clock) -> dict:
    model = nn.Sequential(*[Block() for _ in range(blocks)])
    x = torch.randn(2, 16)
    rules = converter.load_rules()
    passes, traces, codegens, nodes = [], [], [], 0
    for _ in range(repeat):
        gc.collect()
        t0 = clock()
        torch.fx.symbolic_trace(model)
        traces.append(clock() - t0)
        gm = capture(model, (x,), tracer="fx").gm
        nodes = len(gm.graph.nodes)
        gc.collect()
        t0 = clock()
        decide(gm, rules, precision="bf16")
        place(gm, target="bf16")
        rewrite(gm)
        passes.append(clock() - t0)
        t0 = clock()
        gm = materialize(gm)  # FX code generation for the final graph, deferred by the lazy GraphModule
        codegens.append(clock() - t0)
    pass_s, trace_s, codegen_s = statistics.median(passes), statistics.median(traces), statistics.median(codegens)
    return {"blocks": blocks, "nodes": nodes, "pass_s": pass_s, "us_per_node": 1e6 * pass_s / nodes,
            "codegen_s": codegen_s, "pass_with_codegen_s": pass_s + codegen_s, "symbolic_trace_s": trace_s,
            "pass_over_trace": pass_s / trace_s, "pass_with_codegen_over_trace": (pass_s + codegen_s) / trace_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 10000, 25000, 50000], help="target node counts")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ns = ap.parse_args(argv)
    clock = time.process_time if ns.clock == "cpu" else time.perf_counter
    rows = []
    for size in ns.sizes:
        row = measure(max(1, size // 12), ns.repeat, clock)
        rows.append(row)
        print(f"{row['nodes']:>6} nodes: pass {row['pass_s']:.3f}s ({row['us_per_node']:.1f} us/node), then FX codegen "
              f"{row['codegen_s']:.3f}s; symbolic_trace {row['symbolic_trace_s']:.3f}s; pass/trace {row['pass_over_trace']:.2f} "
              f"(with codegen {row['pass_with_codegen_over_trace']:.2f})", flush=True)
    first, last = rows[0], rows[-1]
    print(f"per-node time {last['nodes']} vs {first['nodes']} nodes: {last['us_per_node'] / first['us_per_node']:.2f}x (target <= 1.5x); "
          f"pass/trace at {last['nodes']}: {last['pass_over_trace']:.2f} (target <= 1.0)")
    if ns.out:
        ns.out.write_text(json.dumps({"clock": ns.clock, "torch": torch.__version__, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
