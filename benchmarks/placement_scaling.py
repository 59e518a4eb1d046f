"""Scaling of converter.passes.place.solver.solve_mincut on synthetic transformer-like problems.

Each layer is a pre-LN block (27 nodes): layer_norm/softmax fixed fp32,
projections and matmuls fixed half, view/transpose/scale/dropout/gelu free,
the mask add and the two residual adds promote.  Costs are cast bytes
(numel x (4 + 2)).  Two variants:

* ``split``: the residual adds are fixed fp32 (``--fp32-residual-connection``
  style), so every region has 1-2 nodes;
* ``stream``: the residual adds are promote nodes fed by an fp32 embedding: the
  fp32 input forces the whole stream to fp32 (folded before solving), so
  regions stay small;
* ``stream-follow``: the residual adds are ``follow`` (free) nodes, as the
  default rules make ``add``: one long region of 4 nodes per layer;
* ``stream-half``: promote adds with a half embedding, so nothing forces the
  stream and it links every layer into one long region (4 nodes per layer)
  next to many 1-2 node regions — the worst case for the min-cut.

Run: ``PYTHONPATH=. python benchmarks/placement_scaling.py [--sizes 1000 10000 50000]``
Prints the CPU time per node (median of ``--repeat`` runs) with and without
alternative costs, how many free/promote nodes got an alternative cost, and the
greedy TF painting cost for comparison.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import networkx as nx

from converter.passes.place.baselines import solve_greedy_tf
from converter.passes.place.solver import (
    FP32,
    HALF,
    PlacementProblem,
    Tensor,
    _compile,  # diagnostics only: region sizes
    solve_mincut,
)

NODES_PER_LAYER = 27


def build(n_nodes: int, *, variant: str, seed: int = 0) -> PlacementProblem:
    """A transformer-like placement problem with about ``n_nodes`` nodes."""
    rng = random.Random(seed)
    layers = max(1, n_nodes // NODES_PER_LAYER)
    fixed: dict[str, str] = {"embed": HALF if variant == "stream-half" else FP32, "head": FP32}
    free: list[str] = []
    promote: list[str] = []
    tensors: list[Tensor] = []

    def t(producer: str, numel: int, *consumers: str) -> None:
        tensors.append(Tensor(producer, numel * 6, consumers))

    stream = "embed"
    for i in range(layers):
        b, s, d = 8, rng.choice((128, 256)), rng.choice((512, 768))
        act, heads_act, scores = b * s * d, b * s * d, b * 8 * s * s
        n = lambda name, i=i: f"{name}{i}"  # noqa: E731
        fixed.update(
            {
                n("ln1_"): FP32, n("q"): HALF, n("k"): HALF, n("v"): HALF, n("qk"): HALF,
                n("softmax"): FP32, n("pv"): HALF, n("o"): HALF, n("ln2_"): FP32,
                n("fc1_"): HALF, n("fc2_"): HALF,
            }
        )
        free += [
            n("qview"), n("qtr"), n("kview"), n("ktr"), n("vview"), n("vtr"), n("scale"),
            n("attn_drop"), n("ctx_tr"), n("ctx_view"), n("drop1_"), n("gelu"), n("drop2_"),
        ]
        promote += [n("mask_add"), n("res1_"), n("res2_")]
        if variant == "stream-follow":
            promote.remove(n("res1_"))
            promote.remove(n("res2_"))
            free += [n("res1_"), n("res2_")]
        if variant == "split":
            fixed[n("res1_")] = FP32
            fixed[n("res2_")] = FP32
            promote.remove(n("res1_"))
            promote.remove(n("res2_"))
        t(stream, act, n("ln1_"), n("res1_"))
        t(n("ln1_"), act, n("q"), n("k"), n("v"))
        for x in "qkv":
            t(n(x), act, n(f"{x}view"))
            t(n(f"{x}view"), heads_act, n(f"{x}tr"))
        t(n("qtr"), heads_act, n("qk"))
        t(n("ktr"), heads_act, n("qk"))
        t(n("qk"), scores, n("scale"))
        t(n("scale"), scores, n("mask_add"))
        t(n("mask_add"), scores, n("softmax"))
        t(n("softmax"), scores, n("attn_drop"))
        t(n("attn_drop"), scores, n("pv"))
        t(n("vtr"), heads_act, n("pv"))
        t(n("pv"), heads_act, n("ctx_tr"))
        t(n("ctx_tr"), heads_act, n("ctx_view"))
        t(n("ctx_view"), act, n("o"))
        t(n("o"), act, n("drop1_"))
        t(n("drop1_"), act, n("res1_"))
        t(n("res1_"), act, n("ln2_"), n("res2_"))
        t(n("ln2_"), act, n("fc1_"))
        t(n("fc1_"), 4 * act, n("gelu"))
        t(n("gelu"), 4 * act, n("fc2_"))
        t(n("fc2_"), act, n("drop2_"))
        t(n("drop2_"), act, n("res2_"))
        stream = n("res2_")
    t(stream, 8 * 128 * 512, "head")
    return PlacementProblem(fixed=fixed, free=free, promote=promote, tensors=tensors)


def _time(fn, repeat: int) -> float:
    """Median CPU time of ``repeat`` calls (process time: robust on a shared machine)."""
    samples = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        samples.append(time.process_time() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1000, 2000, 5000, 10000, 20000, 50000]
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--flow", default="preflow_push", help="networkx flow function name")
    parser.add_argument(
        "--variants", nargs="+", default=["split", "stream", "stream-follow", "stream-half"]
    )
    args = parser.parse_args()
    print(f"{'variant':13} {'nodes':>7} {'regions':>8} {'max reg':>8} {'solve':>9} "
          f"{'us/node':>8} {'no-alt':>9} {'us/node':>8} {'alt':>11} "
          f"{'min-cut MB':>11} {'greedy MB':>10}")
    for variant in args.variants:
        for size in args.sizes:
            problem = build(size, variant=variant)
            n_nodes = len(problem.fixed) + len(problem.free) + len(problem.promote)
            flow = getattr(nx.algorithms.flow, args.flow)
            with_alt = _time(lambda p=problem, f=flow: solve_mincut(p, flow_func=f), args.repeat)
            no_alt = _time(
                lambda p=problem, f=flow: solve_mincut(p, alternatives=False, flow_func=f), args.repeat
            )
            result = solve_mincut(problem, flow_func=flow)
            greedy = solve_greedy_tf(problem)
            regions = _compile(problem, invariant=True).regions
            biggest = max((len(r.nodes) for r in regions), default=0)
            print(
                f"{variant:13} {n_nodes:7d} {result.regions:8d} {biggest:8d} "
                f"{with_alt * 1e3:7.1f}ms {with_alt / n_nodes * 1e6:8.2f} "
                f"{no_alt * 1e3:7.1f}ms {no_alt / n_nodes * 1e6:8.2f} "
                f"{len(result.alternative_cost):5d}/{len(result.labels):<5d} "
                f"{result.cost / 2**20:11.1f} {greedy.cost / 2**20:10.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
