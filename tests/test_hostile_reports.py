"""``mpconvert explain OUT NODE`` reads report.json from disk: a damaged or hostile file is bad input
(exit 2, one line), never an internal error (issue 31 items 6 and 7). On the old code each case below
ended in exit 3 (KeyError, TypeError, RecursionError).

A real report is written once; hypothesis then replaces, removes or retypes one field at a time
(node rows, their matched rules and notes, cast rows) and checks the exit status and the one line.
"""
from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli import assert_bad_input, run

from converter.cli.main import main
from tests.helpers import SAMPLES


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile") / "cnn_audit"
    assert main(["audit", str(SAMPLES / "cnn.py"), "--out", str(out), "-q"]) == 0
    data = json.loads((out / "report.json").read_text())
    assert data["casts"] and any(row["matches"] for row in data["nodes"])
    return data


def _node_with_matches(data):
    return next(row for row in data["nodes"] if row["matches"])


def _explain(tmp_path, data, capfd, node):
    folder = tmp_path / "r"
    folder.mkdir(exist_ok=True)
    text = data if isinstance(data, str) else json.dumps(data)
    (folder / "report.json").write_text(text)
    return run(capfd, "explain", folder, node)


@pytest.mark.parametrize("damage, needle", [
    (lambda d: d["nodes"][0].update(name=5), "'name' of row '5' is a int"),
    (lambda d: d["nodes"][0].update(matches="x"), "'matches' of row"),
    (lambda d: d["nodes"][0].pop("op"), "a row has no 'op'"),
    (lambda d: _node_with_matches(d)["matches"].__setitem__(0, "x"), "a row is a str"),
    (lambda d: _node_with_matches(d)["matches"][0].update(level=None), "'level' of row"),
    (lambda d: d["casts"].__setitem__(0, 5), "a row is a int"),
    (lambda d: d["casts"][0].update(consumers=[1, 2]), "are not names"),
    (lambda d: d["nodes"][0].update(notes=[["place"]]), "are not [stage, text] pairs"),
    (lambda d: d["nodes"][0].update(unmatched="no"), "'unmatched' of row"),
], ids=["name-int", "matches-str", "no-op", "match-str", "level-none", "cast-int", "consumers-int", "notes", "unmatched-str"])
def test_damaged_report_rows_are_bad_input(report, tmp_path, capfd, damage, needle):
    data = copy.deepcopy(report)
    damage(data)
    assert_bad_input(*_explain(tmp_path, data, capfd, report["nodes"][0]["name"]), "not a report mpconvert wrote", needle)


def test_json_nested_too_deeply_is_bad_input(tmp_path, capfd):
    assert_bad_input(*_explain(tmp_path, "[" * 100000 + "]" * 100000, capfd, "conv1"), "nested too deeply")


def test_the_real_report_still_explains(report, tmp_path, capfd):
    node = _node_with_matches(report)["name"]
    code, out, err = _explain(tmp_path, report, capfd, node)
    assert code == 0, err
    assert out.startswith(f"{node}: op ")


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=5),
                    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_one_field_retyped_or_removed_is_never_an_internal_error(report, tmp_path, capfd, data):
    damaged = copy.deepcopy(report)
    table = data.draw(st.sampled_from(["nodes", "matches", "casts"]))
    if table == "matches":
        row = data.draw(st.sampled_from(_node_with_matches(damaged)["matches"]))
    else:
        row = data.draw(st.sampled_from(damaged[table]))
    key = data.draw(st.sampled_from(sorted(row)))
    if data.draw(st.booleans()):
        del row[key]
    else:
        row[key] = data.draw(_VALUES)
    code, out, err = _explain(tmp_path, damaged, capfd, report["nodes"][0]["name"])
    assert code in (0, 2), (code, err)
    assert "Traceback" not in err and "internal error" not in err, err
    if code == 2:
        assert len(err.strip().splitlines()) == 1, err
