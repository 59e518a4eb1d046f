"""Scaling of converter.placement.solve_mincut on synthetic transformer-like problems.

Each layer is a pre-LN block (27 nodes): layer_norm/softmax fixed fp32,
projections and matmuls fixed half, view/transpose/scale/dropout/gelu free,
the mask add and the two residual adds promote.  Costs are cast bytes
(numel x (4 + 2)).  Two variants:

* ``stream``: the residual adds are promote nodes, so the residual stream links
  every layer into one long region (4 nodes per layer) next to many 1-2 node
  regions — what a plain pre-LN transformer gives;
* ``split``: the residual stream is pinned fp32 (``--fp32-residual-connection``
  style), so every region has 1-4 nodes.

Run: ``PYTHONPATH=. python benchmarks/placement_scaling.py [--sizes 1000 10000 50000]``
Prints the time per node (median of ``--repeat`` runs) with and without
alternative costs, and the greedy TF painting cost for comparison.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from converter.placement import (
    FP32,
    HALF,
    PlacementProblem,
    Tensor,
    solve_greedy_tf,
    solve_mincut,
)

NODES_PER_LAYER = 27


def build(n_nodes: int, *, variant: str, seed: int = 0) -> PlacementProblem:
    """A transformer-like placement problem with about ``n_nodes`` nodes."""
    rng = random.Random(seed)
    layers = max(1, n_nodes // NODES_PER_LAYER)
    fixed: dict[str, str] = {"embed": FP32, "head": FP32}
    free: list[str] = []
    promote: list[str] = []
    tensors: list[Tensor] = []

    def t(producer: str, numel: int, *consumers: str) -> None:
        tensors.append(Tensor(producer, numel * 6, consumers))

    stream = "embed"
    for i in range(layers):
        b, s, d = 8, rng.choice((128, 256)), rng.choice((512, 768))
        act, heads_act, scores = b * s * d, b * s * d, b * 8 * s * s
        n = lambda name: f"{name}{i}"  # noqa: E731
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
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 5000, 10000, 20000, 50000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=["split", "stream"])
    args = parser.parse_args()
    print(f"{'variant':8} {'nodes':>7} {'regions':>8} {'max reg':>8} {'solve':>9} "
          f"{'us/node':>8} {'no-alt':>9} {'us/node':>8} {'min-cut MB':>11} {'greedy MB':>10}")
    for variant in args.variants:
        for size in args.sizes:
            problem = build(size, variant=variant)
            n_nodes = len(problem.fixed) + len(problem.free) + len(problem.promote)
            with_alt = _time(lambda: solve_mincut(problem), args.repeat)
            no_alt = _time(lambda: solve_mincut(problem, alternatives=False), args.repeat)
            result = solve_mincut(problem)
            greedy = solve_greedy_tf(problem)
            from converter.placement import _compile  # diagnostics only

            biggest = max((len(r.nodes) for r in _compile(problem).regions), default=0)
            print(
                f"{variant:8} {n_nodes:7d} {result.regions:8d} {biggest:8d} "
                f"{with_alt * 1e3:7.1f}ms {with_alt / n_nodes * 1e6:8.2f} "
                f"{no_alt * 1e3:7.1f}ms {no_alt / n_nodes * 1e6:8.2f} "
                f"{result.cost / 2**20:11.1f} {greedy.cost / 2**20:10.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
