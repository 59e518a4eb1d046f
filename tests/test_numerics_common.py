"""The shared numerics helpers (issue 13): one SQNR, one output flattener, one state guard, one
non-finite JSON convention, the typed calibration options, and audit doing what it says."""
from __future__ import annotations

import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import converter
from converter.numerics.common import (
    floating_outputs,
    from_json,
    from_json_float,
    json_float,
    output_tensors,
    preserved_state,
    sqnr_db,
    to_json,
)
from converter.numerics.measure import measure
from converter.numerics.options import CalibrationOptions, SearchOptions
from converter.numerics.search import Tolerance

ROOT = Path(__file__).resolve().parents[1]
INF, NAN = math.inf, math.nan


# ---------------------------------------------------------------------------------------------
# SQNR


def test_sqnr_contract():
    ref = torch.tensor([1.0, -2.0, 3.0, 4.0])
    assert sqnr_db(ref, ref.clone()) == INF  # exact
    assert sqnr_db(torch.zeros(0), torch.zeros(0)) == INF  # nothing differs
    noisy = ref * 1.1  # error = 0.1 ‖ref‖: exactly 20 dB
    assert sqnr_db(ref, noisy) == pytest.approx(20.0, abs=1e-5), sqnr_db(ref, noisy)
    assert sqnr_db(torch.zeros(4), ref) == -INF  # no signal, some error
    # the same non-finite value on both sides is equal; any other non-finite position is -inf
    masked = torch.tensor([1.0, -INF, 3.0, NAN])
    assert sqnr_db(masked, masked.clone()) == INF
    assert sqnr_db(masked, torch.tensor([1.1, -INF, 3.0, NAN])) == pytest.approx(
        20 * math.log10(math.sqrt(10.0) / 0.1), abs=1e-4)
    assert sqnr_db(ref, torch.tensor([1.0, -2.0, INF, 4.0])) == -INF  # an fp16 overflow
    assert sqnr_db(masked, torch.tensor([1.0, INF, 3.0, NAN])) == -INF  # the wrong infinity
    # float64 on the CPU whatever the inputs are; shapes may differ, sizes may not
    assert sqnr_db(ref.reshape(2, 2), ref.to(torch.bfloat16)) == INF
    with pytest.raises(ValueError, match="shapes differ"):
        sqnr_db(ref, torch.ones(5))


def test_one_sqnr_everywhere():
    """Every user of an SQNR calls the one in converter.numerics.common (no copies left)."""
    from benchmarks import common as bench
    from converter.export import verify as emit
    from converter.numerics import measure as measure_mod
    from converter.numerics import search
    from tests import helpers

    assert bench.sqnr_db is sqnr_db and helpers.sqnr is sqnr_db
    assert emit.sqnr_db is sqnr_db and measure_mod.sqnr_db is sqnr_db and search.sqnr_db is sqnr_db
    for path in list((ROOT / "converter").rglob("*.py")) + list((ROOT / "benchmarks").glob("*.py")) + [ROOT / "tests" / "helpers.py"]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and "sqnr" in n.name.lower()]
        if path.name != "common.py" or path.parent.name != "numerics":
            assert defined in ([], ["measure_sqnr"]), (path, defined)


# ---------------------------------------------------------------------------------------------
# outputs


def test_output_tensors_walks_every_output_form():
    a, b, c = torch.ones(1), torch.zeros(2, dtype=torch.int64), torch.full((3,), 2.0, dtype=torch.float64)
    assert [t is x for t, x in zip(output_tensors((a, [b, None], {"k": c, "s": "text"}), ), (a, b, c))] == [True] * 3
    assert output_tensors(a)[0] is a and output_tensors(None) == [] and output_tensors(3.0) == []

    class Output:  # a ModelOutput-like object pytree does not know
        def to_tuple(self):
            return (a, (c,))

    assert [t is x for t, x in zip(output_tensors({"out": Output(), "b": b}), (a, c, b))] == [True] * 3
    assert floating_outputs((a, b, c)) == [a, c]
    assert floating_outputs((a, b, c), fp64=False) == [a]


def test_output_tensors_reads_hf_model_outputs():
    transformers = pytest.importorskip("transformers")
    logits, hidden = torch.randn(2, 3), torch.randn(2, 4)
    out = transformers.modeling_outputs.CausalLMOutput(logits=logits, hidden_states=(hidden,))
    got = output_tensors(out)
    assert len(got) == 2 and got[0] is logits and got[1] is hidden


# ---------------------------------------------------------------------------------------------
# the state guard


def test_preserved_state_restores_buffers_modes_and_rng_even_on_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).train()
    model[2].eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    with pytest.raises(RuntimeError, match="stop"):
        with preserved_state(model):
            model(torch.randn(8, 4) * 5)  # moves the BatchNorm statistics and draws random numbers
            model.eval()
            assert not torch.equal(before["1.running_mean"], model[1].running_mean)
            raise RuntimeError("stop")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training and model[1].training and not model[2].training
    assert torch.equal(rng, torch.random.get_rng_state())


# ---------------------------------------------------------------------------------------------
# non-finite numbers in JSON


def test_json_convention_round_trips():
    assert [json_float(x) for x in (1.5, INF, -INF, NAN)] == [1.5, "inf", "-inf", "nan"]
    doc = {"a": (1, INF), 2: {"b": -INF, "c": NAN, "d": None, "e": torch.float16, "f": True}}
    text = json.dumps(to_json(doc), allow_nan=False)  # strict JSON
    back = from_json(json.loads(text))
    assert back["a"] == [1, INF] and back["2"]["b"] == -INF and math.isnan(back["2"]["c"])
    assert back["2"]["d"] is None and back["2"]["e"] == "torch.float16" and back["2"]["f"] is True
    assert [from_json_float(x) for x in ("inf", "-inf", 2, None)] == [INF, -INF, 2.0, None]
    with pytest.raises(ValueError, match="not a JSON number"):
        from_json_float("fast")


def test_report_json_writes_an_exact_sqnr_as_inf():
    """An all-fp32 model reproduces fp32 exactly: report.json says "inf", the renderers "exact"."""
    from converter.report.render import to_markdown

    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Softmax(dim=-1))  # both fp32 by the default rules
    x = torch.randn(2, 8)
    conv = converter.convert(model, (x,), precision="fp16")
    assert {d.precision for d in conv.decisions.values()} == {"fp32"}
    conv.report.add_measurements(measure(conv, per_node=False))
    assert conv.report.numerics["vs_fp32"]["sqnr_db"] == INF
    data = json.loads(conv.report.to_json())  # allow_nan=False inside
    assert data["numerics"]["vs_fp32"]["sqnr_db"] == "inf"
    assert from_json_float(data["numerics"]["vs_fp32"]["sqnr_db"]) == INF
    assert "exact" in to_markdown(conv.report)


def test_calibration_and_report_use_the_same_encoding():
    class Masked(nn.Module):
        def forward(self, x):
            return torch.softmax(x.masked_fill(x < 0, float("-inf")), dim=-1)

    x = torch.randn(2, 6)
    conv = converter.convert(Masked(), (x,), precision="fp16", calibration=[(x,)],
                             calibration_options=CalibrationOptions(progress=False))
    calibration = json.loads(conv.report.to_json())["calibration"]
    fill = calibration["nodes"]["masked_fill"]["forward"]
    assert fill["absmax"] == "inf" and fill["absmax_finite"] == pytest.approx(float(x.clamp(min=0).max()), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# options


def test_calibration_options_are_typed_and_validated():
    options = CalibrationOptions(tolerance="rtol=1e-2,atol=1e-3", margin=3)
    assert options.tolerance == Tolerance(rtol=1e-2, atol=1e-3) and options.margin == 3.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.margin = 4.0
    for bad, match in (({"margin": 0}, "margin"), ({"margin": INF}, "margin"), ({"fallback": "fp16"}, "overflow_fallback"),
                       ({"max_batches": 0}, "max_batches"), ({"tolerance": "fast"}, "tolerance"),
                       ({"progress": "yes"}, "progress"), ({"loss_fn": 3}, "loss_fn")):
        with pytest.raises(ValueError, match=match):
            CalibrationOptions(**bad)
    with pytest.raises(ValueError, match="max_evaluations"):
        SearchOptions(max_evaluations=0)


def test_calibration_options_from_a_mapping():
    options = CalibrationOptions.coerce({"tolerance": 30, "max_keep": 2, "search_options": {"seed": 3, "prune": False}})
    assert options.tolerance == Tolerance(sqnr_db=30.0)
    assert options.search == SearchOptions(max_keep=2, seed=3, prune=False)
    assert CalibrationOptions.coerce(None) == CalibrationOptions()
    assert CalibrationOptions.coerce(options) is options
    with pytest.raises(TypeError, match="unknown calibration option"):
        CalibrationOptions.coerce({"tolerence": 30})
    with pytest.raises(TypeError, match="unknown search option"):
        CalibrationOptions.coerce({"search_options": {"projection": 2}})


def test_convert_keeps_the_calibration_for_variants_and_reads_an_endless_iterator_once():
    def endless():
        while True:
            yield (torch.randn(3, 4),)

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    conv = converter.convert(model, (torch.randn(3, 4),), precision="fp16", calibration=endless(),
                             calibration_options=CalibrationOptions(max_batches=3, progress=False))
    assert len(conv.calibration) == 3 and conv.module.meta["mp_calibration"]["batches"] == 3
    assert conv.calibration_options.max_batches == 3
    assert conv.variant("fp16") is conv
    bf16 = conv.variant("bf16")
    assert bf16.precision == "bf16" and bf16.module.meta["mp_calibration"]["batches"] == 3


# ---------------------------------------------------------------------------------------------
# audit and layering


def test_audit_reports_what_convert_would_do_without_codegen():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = converter.audit(model, (x,), precision="bf16")
    conv = converter.convert(model, (x,), precision="bf16")
    assert report.summary == conv.report.summary
    decided = [(r["name"], r["precision"], r["rule"], r["reason"]) for r in report.nodes]
    assert decided == [(r["name"], r["precision"], r["rule"], r["reason"]) for r in conv.report.nodes]
    assert report.casts == conv.report.casts and report.summary["casts"] > 0
    assert "codegen_s" not in report.records.run.timings and "codegen_s" in conv.report.records.run.timings
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_no_cycle_between_calibrate_and_search_or_api_and_onnx():
    numerics, export = ROOT / "converter" / "numerics", ROOT / "converter" / "export"
    assert "converter.numerics.calibrate" not in _imports(numerics / "search.py")
    assert not {m for m in _imports(export / "onnx.py") if m == "converter.api" or m.startswith("converter.cli")}
    for path in numerics.glob("*.py"):
        upward = {m for m in _imports(path) if m.split(".")[:2] in (["converter", "report"], ["converter", "export"],
                                                                     ["converter", "api"], ["converter", "cli"])}
        assert not upward, (path.name, upward)


def test_judge_checks_a_tolerance_given_only_atol_or_only_rtol():
    """A Tolerance built with one of rtol/atol is an allclose check with the other at numpy's default (as
    Tolerance.parse fills it in): atol alone was not checked at all, rtol alone failed on None + tensor."""
    from converter.numerics.search import judge

    ref = [torch.tensor([1.0, 2.0, 4.0])]
    off = [torch.tensor([1.0, 2.0, 4.5])]  # |error| 0.5
    atol_only = judge(Tolerance(atol=0.1), ref, off)
    assert not atol_only.ok and atol_only.allclose_ratio == pytest.approx(0.5 / (0.1 + 1e-5 * 4.0)), atol_only
    assert judge(Tolerance(atol=1.0), ref, off).ok
    rtol_only = judge(Tolerance(rtol=0.05), ref, off)
    assert not rtol_only.ok and rtol_only.allclose_ratio == pytest.approx(0.5 / (1e-8 + 0.05 * 4.0)), rtol_only
    assert judge(Tolerance(rtol=0.2), ref, off).ok
