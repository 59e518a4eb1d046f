"""One schema for report.json, shared by the writer and the reader (issue 43, item 2).

On 412bc85 the writer wrote an exact node's SQNR as the string "inf" (its documented convention) and
the strict reader of ``mpconvert explain`` refused it ("'sqnr_db' of row 'embed' is a str"), so
``explain OUT_DIR NODE`` failed on every model with an embedding. Both now go through
:mod:`converter.report.schema`. Hypothesis writes reports (``write_reports``: report.json, .md and
.html, as the CLI does) with every value a row can have: +inf, -inf and NaN SQNRs, unmeasured
(null) ones, empty tables, unicode module names (and a module named "inf"), then reads them back with
the reader ``explain`` uses and compares value for value; ``explain`` itself answers from them.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import converter
from converter.cli.explain import read_report
from converter.report import schema
from converter.report.explain import explain_rows
from converter.report.render import write_reports

#: unicode text without lone surrogates (no Python identifier or file path has them)
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_NAMES = st.one_of(_TEXT, st.sampled_from(["inf", "-inf", "nan", "", "blöcke.0.注意", "x" * 60]))
_DB = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.inf, -math.inf, math.nan]),
                st.integers(-400, 400))
_PRECISIONS = st.sampled_from(["bf16", "fp16", "fp32", "fp64", "int64", "bool"])
_MATCH = st.fixed_dictionaries({"level": st.sampled_from(["op", "module", "module_type", "node", "default", "user"]),
                                "rule": _TEXT, "pattern": _TEXT, "file": _TEXT, "precision": _PRECISIONS,
                                "scope": st.sampled_from(["self", "subtree", ""]), "reason": _TEXT})


@st.composite
def _node(draw, index: int) -> dict:
    row = {"name": draw(_NAMES), "index": index, "op": draw(_TEXT), "module": draw(_NAMES), "module_type": draw(_NAMES),
           "precision": draw(_PRECISIONS), "rule": draw(_TEXT), "rule_level": draw(_TEXT), "reason": draw(_TEXT),
           "notes": draw(st.lists(st.tuples(_TEXT, _TEXT).map(list), max_size=2)),
           "requested": draw(st.sampled_from(["half", "fp32", "follow", "promote", "keep"])), "source": draw(_TEXT),
           "kind": draw(st.sampled_from(["compute", "attention", "reduction"])), "flops": draw(st.integers(0, 2**62)),
           "out_bytes": draw(st.integers(0, 2**40)), "out_shape": draw(st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=2)),
           "unmatched": draw(st.booleans()), "matches": draw(st.lists(_MATCH, max_size=3)),
           "fp32_math": draw(st.sampled_from([None, "ieee", "tf32", "inherit"])), "gemm": draw(st.sampled_from([None, "fp8"]))}
    if draw(st.booleans()):  # measured (numerics ran) or not
        row["sqnr_db"], row["local_sqnr_db"] = draw(_DB), draw(_DB)
    return row


@st.composite
def _cast(draw, index: int) -> dict:
    numel = draw(st.integers(0, 2**30))
    return {"name": draw(_NAMES), "index": index, "src": draw(_NAMES), "dtype": draw(_PRECISIONS),
            "src_dtype": draw(_PRECISIONS), "bytes": 6 * numel, "numel": numel, "consumers": draw(st.lists(_NAMES, max_size=3)),
            "rule": draw(_TEXT), "reason": draw(_TEXT), "on_weight": draw(st.booleans()), "inserted": draw(st.booleans())}


@st.composite
def _tables(draw) -> tuple[list, list]:
    n_nodes, n_casts = draw(st.integers(0, 4)), draw(st.integers(0, 3))
    return [draw(_node(i)) for i in range(n_nodes)], [draw(_cast(i)) for i in range(n_casts)]


def _same(a, b) -> bool:
    """Equal, value for value, NaN equal to NaN, and a float never equal to its string spelling."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def base_report():
    """A real report (its summary, memory and module tables) whose node and cast tables the test replaces."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    return converter.audit(net, (torch.randint(0, 16, (2, 5)),))


@pytest.mark.filterwarnings("ignore:Glyph .* missing from font")  # matplotlib, on unicode module names
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(tables=_tables())
def test_every_report_the_writer_emits_reads_back_exactly(base_report, tmp_path, tables):
    nodes, casts = tables
    report = dataclasses.replace(base_report, nodes=nodes, casts=casts)
    write_reports(report, tmp_path / "r")
    path = tmp_path / "r" / "report.json"
    json.loads(path.read_text(encoding="utf-8"), parse_constant=lambda c: pytest.fail(f"non-strict JSON token {c}"))
    back = read_report(path)
    assert _same(back["nodes"], nodes), (back["nodes"], nodes)
    assert _same(back["casts"], casts), (back["casts"], casts)
    for row in nodes:  # explain answers from what it read, for every node (the first of a repeated name)
        text = explain_rows(back["nodes"], back["casts"], row["name"])
        assert text.startswith(f"{row['name']}: op "), text[:200]


@settings(max_examples=60, deadline=None)
@given(tables=_tables())
def test_the_schema_accepts_what_it_encodes_and_decodes_it_back(tables):
    nodes, casts = tables
    document = schema.encode({"nodes": nodes, "casts": casts, "precision": "bf16", "rules": {"files": ["default.toml"]}})
    parsed = json.loads(json.dumps(document, allow_nan=False))
    assert schema.problem(parsed) is None
    back = schema.decode(parsed)
    assert _same(back["nodes"], nodes) and _same(back["casts"], casts)


def test_non_finite_sqnr_is_the_documented_string_and_a_module_named_inf_stays_a_string():
    row = {"name": "embed", "op": "embedding", "module": "inf", "module_type": "nan", "source": "", "precision": "fp32",
           "requested": "fp32", "unmatched": False, "rule": "r", "reason": "", "matches": [], "sqnr_db": math.inf,
           "local_sqnr_db": -math.inf}
    written = json.loads(json.dumps(schema.encode({"nodes": [row], "casts": []}), allow_nan=False))
    assert written["nodes"][0]["sqnr_db"] == "inf" and written["nodes"][0]["local_sqnr_db"] == "-inf"
    back = schema.decode(written)["nodes"][0]
    assert back["sqnr_db"] == math.inf and back["local_sqnr_db"] == -math.inf
    assert back["module"] == "inf" and back["module_type"] == "nan"


@pytest.mark.parametrize("value", ["infinity", "1.5", True, [1.0], {"db": 1}])
def test_an_sqnr_that_is_no_number_is_refused_by_name(value):
    row = {"name": "n", "op": "linear", "module": "", "module_type": "", "source": "", "precision": "bf16",
           "requested": "half", "unmatched": False, "rule": "r", "reason": "", "matches": [], "sqnr_db": value}
    assert schema.problem({"nodes": [row], "casts": []}) == f"'sqnr_db' of row 'n' is a {type(value).__name__}"
