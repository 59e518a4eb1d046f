"""Typed records between the stages and the report (issue 46, item 1).

``Report.extra`` was an untyped dict every stage wrote keys into and every reader fished strings out
of. Each stage's facts are now a frozen record of :mod:`converter.ir.records` (``Report.records``);
report.json is unchanged (same top-level keys, in the same order), and the strict reader of
``mpconvert explain`` checks those sections with the same records' ``from_dict``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from converter.cli.explain import ReportNotUsable, read_report
from converter.ir.errors import MpconvertError
from converter.ir.records import (
    RECORD_KEYS,
    CaptureFacts,
    DeviceAdvice,
    Fp8Facts,
    LoweringFacts,
    OptionalInputs,
    RecordError,
    RunFacts,
    SourceFacts,
    StageRecords,
)
from converter.report import schema

ROOT = Path(__file__).resolve().parents[1]

#: report.json's top-level keys for ``mpconvert samples/tiny_transformer.py``, in order, main's keys
#: before the records (a53feba) plus the device profile the conversion read (numerics/profile.py)
TINY_KEYS = [
    "schema", "model", "precision", "tracer", "summary_line", "summary", "nodes", "casts", "ops", "modules", "memory",
    "numerics", "measured_casts", "calibration", "fp32_math", "rules", "device_profile", "graph_breaks", "regions", "capture_errors",
    "timings", "opt_level", "device", "lowered", "lowering", "dynamic_dims", "shapes", "narrowed_dims", "dynamic_ranges",
    "tied_dims", "modes", "cache", "library_ops", "checkpoint", "simplified", "fp8", "device_advice", "optional_inputs"]

FP8 = Fp8Facts(recipe="tensorwise", layers=["a", "b"], count=2, flops=12, gemm_flops=20, flops_share=0.6,
               thresholds={"y": {"min_db": 20.0, "rule": "fp8.toml:[settings].fp8_min_sqnr_y"}},
               numerics=[{"node": "a", "sqnr": {"y": 31.5}, "fp8": True, "below": []}],
               fallback=[{"node": "c", "why": "y 12.0 dB < 20.0 dB"}], kept_bf16=[{"rule": "r", "count": 1}])
FULL = StageRecords(
    run=RunFacts(capture_errors={"fx": "opaque leaf"}, timings={"capture_s": 0.5, "stages": {"decide": 0.1}},
                 opt_level="O2", device="cpu"),
    capture=CaptureFacts(dynamic_dims={"x": [0, 1]}, shapes="batch and sequence dynamic",
                         narrowed_dims={"x": {2: "guard at m.py:3"}}, dynamic_ranges={"x": {1: {"min": 2, "max": 16, "why": "g"}}},
                         tied_dims={"labels": {0: ["x", 0]}}, modes="follows train()/eval()", cache="captured without it"),
    lowering=LoweringFacts(lowered=["attn"], lowering=[{"lowering": "upcast_gemm", "chosen": False, "node": "mm"}],
                           library_ops=[{"op": "lib::op", "module": "lib.ops", "package": "lib", "nodes": 1}],
                           checkpoint={"regions": [], "count": 0, "notes": []}, simplified={"dropout": 2}),
    fp8=FP8, advice=DeviceAdvice("fp16 matmuls on this CPU are 15x slower"),
    optional_inputs=OptionalInputs(optional=[{"name": "mask", "default": None}], required={"ids": "no default"}),
    source=SourceFacts({"kind": "save_pretrained folder", "note": "Built from the folder m."}))
#: one of each record with every field set
RECORDS = [FULL.run, FULL.capture, FULL.lowering, FP8, FULL.advice, FULL.optional_inputs, FULL.source]


def _through_json(document: dict) -> dict:
    return json.loads(json.dumps(schema.encode(document), allow_nan=False))


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_and_is_frozen(record):
    assert type(record).from_dict(record.to_dict()) == record
    assert type(record).from_dict(_through_json(record.to_dict())) == record  # JSON's string dims come back as ints
    first = dataclasses.fields(record)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, first, None)


def test_stage_records_round_trip_through_report_json():
    document = _through_json(FULL.to_dict())
    assert list(document) == [k for k in RECORD_KEYS if k in document] and set(document) == set(RECORD_KEYS)
    assert StageRecords.from_dict(document) == FULL
    merged = StageRecords(run=FULL.run, merged=True)  # a partial conversion's report: no fp8 key, its own order
    assert list(merged.to_dict()) == ["timings", "opt_level", "device", "capture_errors"]
    assert StageRecords.from_dict(_through_json(merged.to_dict())) == merged
    assert StageRecords().to_dict() == {"fp8": None}  # a report built from a graph alone (explain)


_JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                                  st.text(max_size=6)),
                        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                        max_leaves=8)
_DIMS = st.dictionaries(st.text(max_size=6), st.dictionaries(st.integers(0, 5), _JSONISH, max_size=3), max_size=3)
_OPT_TEXT = st.one_of(st.none(), st.text(max_size=20))
_TIMINGS = st.dictionaries(st.text(max_size=8), st.one_of(st.floats(0, 1e4), st.dictionaries(st.text(max_size=8), st.floats(0, 1e4))))


@st.composite
def _records(draw) -> StageRecords:
    lists = st.lists(_JSONISH, max_size=3)
    maps = st.dictionaries(st.text(max_size=6), _JSONISH, max_size=3)
    run = RunFacts(draw(st.dictionaries(st.text(max_size=6), st.text(max_size=20))), draw(_TIMINGS),
                   draw(st.sampled_from(["O1", "O2"])), draw(st.sampled_from([None, "cpu", "cuda"])))
    capture = CaptureFacts(draw(st.dictionaries(st.text(max_size=6), st.lists(st.integers(0, 5)))), draw(st.text(max_size=20)),
                           draw(_DIMS), draw(_DIMS), draw(_DIMS), draw(st.text(max_size=20)), draw(_OPT_TEXT))
    fp8 = Fp8Facts(draw(st.text(max_size=8)), draw(st.lists(st.text(max_size=6))), draw(st.integers(0, 99)),
                   draw(st.integers(0, 2**50)), draw(st.integers(0, 2**50)), draw(st.floats(0, 1)), draw(maps),
                   draw(st.one_of(st.none(), lists)), draw(lists), draw(lists))
    merged = draw(st.booleans())
    return StageRecords(
        run=draw(st.one_of(st.none(), st.just(run))), capture=None if merged else capture,
        lowering=None if merged else LoweringFacts(draw(lists), draw(lists), draw(lists), draw(maps), draw(maps)),
        fp8=None if merged else draw(st.one_of(st.none(), st.just(fp8))),
        advice=None if merged else draw(st.one_of(st.none(), st.just(DeviceAdvice(draw(_OPT_TEXT))))),
        optional_inputs=draw(st.one_of(st.none(), st.just(OptionalInputs(draw(lists), draw(maps))))),
        merged=merged)


@settings(max_examples=80, deadline=None)
@given(records=_records())
def test_whatever_the_writer_emits_the_strict_reader_reads_back(records):
    """Written as report.json (non-finite floats as strings, dims as string keys), read back: the same JSON."""
    written = _through_json(records.to_dict())
    read = StageRecords.from_dict(written)
    assert _through_json(read.to_dict()) == written
    assert read.merged == records.merged and (read.run is None) == (records.run is None)
    if records.capture is not None and read.capture is not None:
        assert read.capture.dynamic_ranges == records.capture.dynamic_ranges or _has_nan(records.capture.dynamic_ranges)


def _has_nan(value) -> bool:
    if isinstance(value, float):
        return math.isnan(value) or math.isinf(value)
    if isinstance(value, dict):
        return any(map(_has_nan, value.values()))
    return isinstance(value, list) and any(map(_has_nan, value))


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("timings", [1.0], "its 'timings' is a list, not an object"),
    ("device_advice", 3, "its 'device_advice' is a number, not a string or null"),
    ("dynamic_dims", "x", "its 'dynamic_dims' is a string, not an object"),
    ("fp8", {"layers": []}, "no 'recipe' in 'fp8'"),
    ("fp8", {"recipe": "tensorwise", "count": True}, "its fp8.count is true/false, not a number"),
    ("optional_inputs", [], "its 'optional_inputs' is a list, not an object"),
    ("source", {"note": 1}, "its source.note is a number, not a string"),
])
def test_a_mistyped_section_is_one_line_naming_it(key, value, needle, tmp_path):
    document = {"nodes": [], "casts": [], **_through_json(FULL.to_dict()), key: value}
    with pytest.raises(RecordError) as caught:
        StageRecords.from_dict(document)
    assert caught.value.what == needle and isinstance(caught.value, MpconvertError) and isinstance(caught.value, ValueError)
    assert schema.problem(document) == needle
    path = tmp_path / "report.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(ReportNotUsable) as refused:
        read_report(path)
    assert needle in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    from converter.cli.main import main

    out = tmp_path_factory.mktemp("tiny") / "out"
    code = main([str(ROOT / "samples" / "tiny_transformer.py"), "--out", str(out), "--no-measure", "-q"])
    assert code == 0
    return out / "report.json"


def test_a_conversion_writes_todays_report_keys_and_reads_them_back(tiny_report):
    data = json.loads(tiny_report.read_text(encoding="utf-8"))
    assert list(data) == TINY_KEYS, sorted(set(data) ^ set(TINY_KEYS))
    assert schema.problem(data) is None
    records = schema.records(data)
    assert records.run is not None and records.capture is not None and records.lowering is not None
    assert records.advice is not None and records.optional_inputs is not None and not records.merged
    assert {k: v for k, v in data.items() if k in RECORD_KEYS} == _through_json(records.to_dict())
    assert read_report(tiny_report)["nodes"] == data["nodes"]


def test_report_extra_is_a_deprecated_read_only_view():
    import converter
    from tests.helpers import load_sample

    sample = load_sample("mlp")
    report = converter.convert(sample.build_model(), sample.example_inputs()).report
    with pytest.warns(DeprecationWarning, match="Report.records"):
        extra = report.extra
    assert dict(extra) == report.records.to_dict() and extra["opt_level"] == "O1"
    with pytest.raises(TypeError):
        extra["opt_level"] = "O2"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.records.run.opt_level = "O2"  # type: ignore[misc,union-attr]


#: the test files that may read the deprecated view: its own test, and the prose scan's planted snippets
READS_EXTRA = {"tests/test_records.py", "tests/test_typed_fields.py"}


@pytest.mark.parametrize("tree", ["converter", "tests"])
def test_no_code_reads_report_extra(tree):
    """Neither the package nor the tests read the deprecated ``Report.extra``: they read the typed records."""
    found = []
    for path in sorted((ROOT / tree).rglob("*.py")):
        if path.relative_to(ROOT).as_posix() in READS_EXTRA:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if (tree == "converter" and "extra[" in line) or re.search(r"(?<!self)\.extra\b(?!\s+is deprecated)", line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)
