"""Accuracy search: emulation fidelity, the ranked search against graph-order bisection, tolerances."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import converter
from converter.numerics.common import sqnr_db
from converter.numerics.options import CalibrationOptions
from converter.numerics.search import (
    HalfEmulator,
    Outcome,
    Tolerance,
    ToleranceNotMet,
    bisect_graph_order,
    search_ranked,
)
from converter.numerics.sensitivity import rank_sensitivity
from converter.passes.capture import capture
from converter.passes.decide import decide
from converter.passes.place.stage import place
from converter.rules.loader import load_rules

PLANTED = (3, 7, 11)


class Planted(nn.Module):
    """14 residual blocks (56 compute nodes). In blocks 3, 7 and 11 the Linear adds ~1000 to a signal
    of ~0.3 and a LayerNorm subtracts it again: rounding that Linear's output to fp16 (spacing 0.5
    near 1000) destroys the signal. Every other node is harmless in fp16."""

    def __init__(self, width: int = 16, blocks: int = 14):
        super().__init__()
        torch.manual_seed(0)
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.norms = nn.ModuleDict({str(i): nn.LayerNorm(width) for i in PLANTED})
        with torch.no_grad():
            for i in PLANTED:
                self.lins[i].weight.mul_(0.3)
                self.lins[i].bias.add_(1000.0)

    def forward(self, x):
        h = x
        for i, lin in enumerate(self.lins):
            y = lin(h)
            y = self.norms[str(i)](y) if i in PLANTED else torch.tanh(y)
            h = h + y * 0.5
        return h


PLANTED_NODES = {f"lins_{i}" for i in PLANTED}


@pytest.fixture(scope="module")
def planted():
    model = Planted()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 16, generator=gen),) for _ in range(4)]
    return model, batches


def _decided(model, example, precision="fp16"):
    gm = capture(model, example).gm
    decide(gm, load_rules(), precision=precision)
    place(gm, target=precision)
    return gm


# ---------------------------------------------------------------------------------------------
# acceptance: the planted model


def test_search_finds_the_planted_nodes_with_fewer_evaluations_than_bisection(planted):
    model, batches = planted
    conv = converter.convert(model, batches[0], precision="fp16", calibration=batches,
                             calibration_options=CalibrationOptions(tolerance=30, progress=False))
    assert conv.report.summary["compute_nodes"] >= 50
    search = conv.module.meta["mp_calibration"]["search"]
    kept = set(search["kept_fp32"])
    assert PLANTED_NODES <= kept and len(kept) <= 6, kept
    assert search["met"] and search["sqnr_db"] >= 30
    # the real converted model (not the emulation) meets the tolerance
    with torch.no_grad():
        ref = torch.cat([model(*b) for b in batches])
        out = torch.cat([conv.module(*b) for b in batches])
    real = sqnr_db(ref, out)
    assert real >= 30, f"real SQNR {real:.1f} dB"
    rows = {r["name"]: r for r in conv.report.nodes}
    assert all("accuracy search" in rows[n]["reason"] and rows[n]["precision"] == "fp32" for n in kept)

    # the baseline on the same decided graph and batches
    gm = _decided(model, batches[0])
    em = HalfEmulator(gm, [(b, {}) for b in batches], tolerance=30)
    order = [n for n in em.order if n in em.base]
    blocked, attempts = bisect_graph_order(lambda keep: em.evaluate_keep(keep, memo=False), order)
    baseline = 1 + attempts  # + the fp32 reference run, as for ours
    assert PLANTED_NODES <= set(blocked)
    ours = search["evaluations"]
    print(f"\naccuracy search: {len(order)} half candidates, kept {sorted(kept)}; SQNR {search['initial_sqnr_db']:.1f} dB "
          f"-> {search['sqnr_db']:.1f} dB (real model {real:.1f} dB)")
    print(f"evaluations: ranked search {ours} (breakdown {search['evaluation_breakdown']}) vs graph-order bisection {baseline}")
    assert ours < baseline


def test_ranking_puts_the_planted_nodes_first(planted):
    model, batches = planted
    gm = _decided(model, batches[0])
    base = {n.name: n.meta["mp"].precision for n in gm.graph.nodes
            if n.meta.get("mp") is not None and n.meta["mp_info"].kind == "compute" and n.meta["mp"].precision == "fp16"}
    ranked = rank_sensitivity(gm, [(b, {}) for b in batches], base=base)
    top = {s.name for s in ranked[:3]}
    assert top == PLANTED_NODES
    # the estimate separates them from the rest by orders of magnitude
    assert ranked[2].score > 1e3 * ranked[3].score


# ---------------------------------------------------------------------------------------------
# emulation fidelity


def test_emulation_matches_the_real_conversion(planted):
    model, batches = planted
    for precision in ("bf16", "fp16"):
        conv = converter.convert(model, batches[0], precision=precision)
        gm = _decided(model, batches[0], precision=precision)
        em = HalfEmulator(gm, [(b, {}) for b in batches], tolerance=0)
        emulated = em.evaluate(em.base).sqnr_db
        with torch.no_grad():
            ref = torch.cat([model(*b) for b in batches])
            real = sqnr_db(ref, torch.cat([conv.module(*b) for b in batches]))
        assert emulated == pytest.approx(real, abs=0.5), (precision, emulated, real)


def test_emulator_counts_runs_and_memoises(planted):
    model, batches = planted
    gm = _decided(model, batches[0])
    em = HalfEmulator(gm, [(b, {}) for b in batches], tolerance=30)
    assert em.runs == 1  # the fp32 reference
    a = em.evaluate_keep(["lins_3"])
    b = em.evaluate_keep(["lins_3"])
    assert a == b and em.runs == 2
    em.evaluate_keep(["lins_3"], memo=False)
    assert em.runs == 3
    assert em.evaluate({}).sqnr_db == math.inf  # nothing in half: exactly the reference


# ---------------------------------------------------------------------------------------------
# tolerance handling


def test_tolerance_not_met_reaches_the_caller_with_the_best_result(planted):
    model, batches = planted
    with pytest.raises(ToleranceNotMet) as info:
        converter.convert(model, batches[0], precision="fp16", calibration=batches,
                          calibration_options={"tolerance": 30, "max_keep": 2, "progress": False})
    exc = info.value
    assert exc.best_sqnr < 30 and 0 < len(exc.best_set) <= 2 and set(exc.best_set) <= PLANTED_NODES
    assert exc.evaluations > 0 and "not met" in str(exc)


def test_rtol_atol_tolerance_and_nothing_to_do(planted):
    model, batches = planted
    loose = converter.convert(model, batches[0], precision="fp16", calibration=batches,
                              calibration_options={"tolerance": "0dB", "progress": False})
    s = loose.module.meta["mp_calibration"]["search"]
    assert s["kept_fp32"] == [] and s["evaluations"] == 2  # reference + the assignment itself
    tight = converter.convert(model, batches[0], precision="fp16", calibration=batches,
                              calibration_options={"tolerance": "rtol=1e-2,atol=1e-2", "progress": False})
    s = tight.module.meta["mp_calibration"]["search"]
    assert s["met"] and s["allclose_ratio"] <= 1.0 and PLANTED_NODES <= set(s["kept_fp32"])
    with torch.no_grad():
        for b in batches:
            torch.testing.assert_close(tight.module(*b), model(*b), rtol=1e-2, atol=1e-2)


def test_tolerance_parsing():
    assert Tolerance.parse(30) == Tolerance(sqnr_db=30.0)
    assert Tolerance.parse("30") == Tolerance.parse("30dB") == Tolerance.parse("sqnr=30") == Tolerance(sqnr_db=30.0)
    assert Tolerance.parse({"rtol": 1e-2, "atol": 1e-3}) == Tolerance(rtol=1e-2, atol=1e-3)
    assert Tolerance.parse("rtol=1e-2, atol=1e-3") == Tolerance(rtol=1e-2, atol=1e-3)
    assert Tolerance.parse({"rtol": 1e-2}) == Tolerance(rtol=1e-2, atol=1e-8)  # numpy's default atol
    assert str(Tolerance(sqnr_db=30)) == "SQNR >= 30 dB"
    for bad in ("fast", {"rel": 1}, True, {"rtol": -1, "atol": 0}):
        with pytest.raises(ValueError):
            Tolerance.parse(bad)


# ---------------------------------------------------------------------------------------------
# the search procedures on a synthetic oracle


def _oracle(bad: set[str]):
    calls = []

    def evaluate_keep(keep):
        calls.append(tuple(keep))
        missing = len(bad - set(keep))
        return Outcome(ok=missing == 0, sqnr_db=60.0 - 20 * missing)

    return evaluate_keep, calls


def test_search_ranked_with_a_perfect_and_an_imperfect_ranking():
    nodes = [f"n{i}" for i in range(64)]
    evaluate, calls = _oracle({"n5", "n40", "n41"})
    ranked = ["n40", "n5", "n41"] + [n for n in nodes if n not in ("n40", "n5", "n41")]
    assert sorted(search_ranked(evaluate, ranked)) == ["n40", "n41", "n5"]
    assert len(set(calls)) <= 7
    # a culprit ranked 6th: the prefix grows to 8, bisection brings it to 6, pruning removes the rest
    evaluate, calls = _oracle({"n5", "n40", "n41"})
    ranked = ["n40", "n5", "n1", "n2", "n3", "n41"] + [n for n in nodes if n not in ("n40", "n5", "n1", "n2", "n3", "n41")]
    assert sorted(search_ranked(evaluate, ranked)) == ["n40", "n41", "n5"]
    with pytest.raises(LookupError):
        search_ranked(_oracle({"n5", "n40", "n41"})[0], ranked, max_keep=2)


def test_bisect_graph_order_is_onnxconverter_commons_algorithm():
    nodes = [f"n{i}" for i in range(64)]
    evaluate, calls = _oracle({"n5", "n40", "n41"})
    blocked, attempts = bisect_graph_order(evaluate, nodes)
    assert sorted(blocked) == ["n40", "n41", "n5"]
    assert attempts == len(calls)
    # the first attempt converts everything; the last validates the result
    assert calls[0] == () and calls[-1] == tuple(blocked)
    evaluate, calls = _oracle(set())
    assert bisect_graph_order(evaluate, nodes) == ([], 2)



def test_a_tolerance_only_all_fp32_meets_is_not_met():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=gen),) for _ in range(2)]
    with pytest.raises(ToleranceNotMet) as info:
        converter.convert(model, batches[0], precision="bf16", calibration=batches,
                          calibration_options={"tolerance": 200, "progress": False})
    exc = info.value
    # keeping every half node in fp32 is no conversion: the best keeps all but one
    assert 20 < exc.best_sqnr < 200 and 1 <= len(exc.best_set) and "not enough" in exc.why
