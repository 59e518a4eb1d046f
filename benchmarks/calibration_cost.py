"""Cost of calibration: 20 calibration batches of samples/tiny_transformer.py vs 20 fp32 fwd+bwd steps.

Target: calibrating costs less than 3x the fp32 training steps on the same batches.

Variants, run interleaved (A B C A B C ...) after a warm-up; the median of each is reported:

* ``fp32``: 20 x (``model(tokens)`` -> ``loss_fn`` -> ``backward``) on the eager model;
* ``statistics``: :func:`converter.numerics.stats.collect_statistics` over the same 20 batches
  (instrumented forward, one backward, per-node forward and gradient statistics);
* ``calibrate``: the whole stage, :func:`converter.numerics.calibrate.calibrate_and_redecide` (statistics,
  overflow re-decision, report data) on an fp16 conversion's decided graph.

The default clock is the CPU time of the benchmark thread with one torch thread: the machine has
2 cores shared with other work, and wall time under contention measures the neighbours. Use
``--clock wall --threads 2`` on an idle machine for wall-clock figures.

``--search`` adds the accuracy-search comparison: model evaluations (forward passes over the
validation batches, the fp32 reference and the ranking pass included) of the ranked search
against onnxconverter-common's graph-order bisection, on the sample transformer at tolerances
3, 6 and 10 dB above its all-half SQNR.

Run: ``PYTHONPATH=. python benchmarks/calibration_cost.py [--batches 20] [--repeat 7] [--search]``
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from converter.numerics.calibrate import calibrate_and_redecide  # noqa: E402
from converter.numerics.options import CalibrationOptions  # noqa: E402
from converter.numerics.redecide import PlaceSettings  # noqa: E402
from converter.numerics.search import HalfEmulator, bisect_graph_order, search_ranked  # noqa: E402
from converter.numerics.sensitivity import rank_sensitivity  # noqa: E402
from converter.numerics.stats import collect_statistics  # noqa: E402
from converter.passes.capture import capture  # noqa: E402
from converter.passes.decide import decide  # noqa: E402
from converter.passes.place.stage import place  # noqa: E402
from converter.rules.loader import load_rules  # noqa: E402


def _load_sample():
    spec = importlib.util.spec_from_file_location("tiny_transformer", ROOT / "samples" / "tiny_transformer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def search_comparison(tt, rules) -> list[dict]:
    """Evaluations of the ranked search vs graph-order bisection on the sample transformer."""
    model = tt.build_model()
    gen = torch.Generator().manual_seed(2)
    batches = [((torch.randint(0, 128, (2, 16), generator=gen),), {}) for _ in range(4)]
    rows = []
    for precision in ("fp16", "bf16"):
        gm = capture(model, batches[0][0]).gm
        decide(gm, rules, precision=precision)
        place(gm, target=precision)
        probe = HalfEmulator(gm, batches, tolerance=0)
        base = probe.evaluate(probe.base).sqnr_db
        for extra in (3.0, 6.0, 10.0):
            tol = base + extra
            ours = HalfEmulator(gm, batches, tolerance=tol)
            assert not ours.evaluate_keep(()).ok  # the all-half check, as accuracy_search does first
            ranked = [s.name for s in rank_sensitivity(gm, batches, base=ours.base)]
            try:
                kept = search_ranked(ours.evaluate_keep, ranked, max_keep=len(ranked) - 1)
            except LookupError:
                kept = None
            theirs = HalfEmulator(gm, batches, tolerance=tol)
            order = [n for n in theirs.order if n in theirs.base]
            blocked, attempts = bisect_graph_order(lambda keep, em=theirs: em.evaluate_keep(keep, memo=False), order)
            rows.append({"precision": precision, "candidates": len(order), "all_half_sqnr_db": base, "tolerance_db": tol,
                         # + the ranking pass: 2 + 2 x 1 projection forward-equivalents
                         "ranked_evaluations": ours.runs + 4, "ranked_kept": None if kept is None else len(kept),
                         "bisection_evaluations": 1 + attempts, "bisection_kept": len(blocked)})
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--search", action="store_true", help="also compare the accuracy search with graph-order bisection")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    tt = _load_sample()
    model = tt.build_model()
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 128, (2, 16), generator=gen),) for _ in range(args.batches)]
    rules = load_rules()
    gm = capture(model, tt.example_inputs()).gm
    decide(gm, rules, precision="fp16")
    place(gm, target="fp16")

    def fp32():
        for batch in batches:
            model.zero_grad(set_to_none=True)
            loss = tt.loss_fn(model(*batch), batch)
            loss.backward()

    def stats():
        collect_statistics(gm, batches, loss_fn=tt.loss_fn, progress=False)

    def stage():
        calibrate_and_redecide(gm, batches, rules=rules, settings=PlaceSettings(target="fp16"),
                               options=CalibrationOptions(loss_fn=tt.loss_fn, progress=False))

    variants = {"fp32": fp32, "statistics": stats, "calibrate": stage}
    for fn in variants.values():  # warm-up
        fn()
    samples = {name: [] for name in variants}
    for _ in range(args.repeat):
        for name, fn in variants.items():
            t0 = clock()
            fn()
            samples[name].append(clock() - t0)
    med = {name: statistics.median(v) for name, v in samples.items()}
    print(f"tiny_transformer, {args.batches} batches of (2, 16) tokens, {args.threads} thread(s), {args.clock} clock, "
          f"median of {args.repeat}")
    for name, value in med.items():
        print(f"  {name:<11} {1e3 * value:8.1f} ms   ({1e3 * value / args.batches:.2f} ms/batch)")
    ratio_stats = med["statistics"] / med["fp32"]
    ratio_stage = med["calibrate"] / med["fp32"]
    print(f"  ratio statistics/fp32 = {ratio_stats:.2f}x   calibrate stage/fp32 = {ratio_stage:.2f}x   (target < 3x)")
    result = {"fp32_s": med["fp32"], "statistics_s": med["statistics"], "calibrate_s": med["calibrate"],
              "ratio_statistics": ratio_stats, "ratio_calibrate": ratio_stage}
    if args.search:
        rows = search_comparison(tt, rules)
        print("accuracy search on tiny_transformer (4 batches): model evaluations, ranked search vs graph-order bisection")
        for r in rows:
            print(f"  {r['precision']} all-half {r['all_half_sqnr_db']:.1f} dB, tolerance {r['tolerance_db']:.1f} dB: "
                  f"ranked {r['ranked_evaluations']} evaluations ({r['ranked_kept']} kept fp32)   "
                  f"bisection {r['bisection_evaluations']} ({r['bisection_kept']} kept fp32)   of {r['candidates']} half nodes")
        result["search"] = rows
    return result


if __name__ == "__main__":
    main()
