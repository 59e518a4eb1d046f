"""Fuzz ``mpconvert rules check`` with hypothesis-generated rule files, valid and broken.

Property: never a traceback. The exit status is 0 or 2, and with 2 stderr is exactly one line
starting with ``mpconvert: error:`` that names the file. Rule files built only from the valid
vocabulary must pass (exit 0). The CLI runs in-process for speed; 500+ examples in all.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from converter.cli.main import main
from converter.ir.ops import known_op_names
from converter.rules.loader import LEVELS, PRECISIONS

KNOWN_OPS = sorted(known_op_names())
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# a tiny TOML writer (tomli_w is not a dependency)


def _toml_string(text: str) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_string(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(type(value))


def to_toml(doc: dict) -> str:
    lines = []
    for table, body in doc.items():
        if isinstance(body, dict):
            lines.append(f"[{_toml_string(table)}]")
            for key, value in body.items():
                lines.append(f"{_toml_string(key)} = {_toml_value(value)}")
        else:
            lines.insert(0, f"{_toml_string(table)} = {_toml_value(body)}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# strategies

names = st.text(min_size=0, max_size=12)
safe_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]{0,10}", fullmatch=True)
scalars = st.one_of(st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True), names)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(names, inner, max_size=3)), max_leaves=6)
precisions = st.one_of(st.sampled_from(PRECISIONS), names)
rule_keys = st.one_of(st.sampled_from(("precision", "reason", "message")), names)
rule_values = st.one_of(
    precisions,
    st.dictionaries(rule_keys, st.one_of(precisions, values), max_size=3),
    values,
)
tables = st.one_of(st.sampled_from(("meta", "settings", "default") + LEVELS), names)
patterns = st.one_of(st.sampled_from(KNOWN_OPS), names, st.sampled_from(("*", "lin*", "conv?d", "[ab]*", "*norm*")))


@st.composite
def broken_docs(draw) -> str:
    doc = {}
    for _ in range(draw(st.integers(0, 4))):
        table = draw(tables)
        body = draw(st.one_of(st.dictionaries(patterns, rule_values, max_size=4), values))
        doc[table] = body
    return to_toml(doc)


@st.composite
def valid_docs(draw) -> str:
    doc: dict = {}
    if draw(st.booleans()):
        doc["meta"] = {"description": draw(names)}
    for level in LEVELS:
        if not draw(st.booleans()):
            continue
        body = {}
        for _ in range(draw(st.integers(1, 4))):
            pattern = draw(st.sampled_from(KNOWN_OPS)) if level == "op" else draw(safe_names)
            precision = draw(st.sampled_from(PRECISIONS))
            if precision == "banned":
                body[pattern] = {"precision": "banned", "message": draw(names.filter(bool))}
            elif draw(st.booleans()):
                body[pattern] = {"precision": precision, "reason": draw(names)}
            else:
                body[pattern] = precision
        doc[level] = body
    if draw(st.booleans()):
        doc["default"] = {"precision": draw(st.sampled_from(("half", "fp16", "bf16", "fp32")))}
    if draw(st.booleans()):
        doc["settings"] = {"overflow_fallback": draw(st.sampled_from(("bf16", "fp32")))}
    if draw(st.booleans()):
        doc.setdefault("settings", {})["overflow_margin"] = draw(st.floats(0.01, 100.0))
    return to_toml(doc)


@st.composite
def mutated_docs(draw) -> bytes:
    """A valid file with random bytes inserted, deleted or replaced (bad TOML, bad UTF-8 ...)."""
    data = bytearray(draw(valid_docs()).encode())
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(("insert", "delete", "replace")))
        chunk = draw(st.binary(min_size=1, max_size=4))
        if action == "insert":
            data[pos:pos] = chunk
        elif action == "delete":
            del data[pos:pos + len(chunk)]
        else:
            data[pos:pos + len(chunk)] = chunk
    return bytes(data)


file_bytes = st.one_of(
    broken_docs().map(str.encode),
    mutated_docs(),
    st.binary(max_size=64),  # garbage bytes
    st.text(max_size=80).map(lambda t: t.encode("utf-8", "surrogatepass")),  # arbitrary text, mostly bad TOML
)


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory(prefix="mpconvert-fuzz-") as d:
        yield Path(d)


def _check(scratch: Path, capfd, data: bytes) -> tuple[int, str]:
    path = scratch / "rules.toml"
    path.write_bytes(data)
    code = main(["rules", "check", str(path)])
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    assert code in (0, 2), (code, err, data)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1, (err, data)
        assert lines[0].startswith("mpconvert: error: ") and "rules.toml" in lines[0], (err, data)
    else:
        assert err == "" and out.startswith("ok: "), (out, err)
    return code, err


@SETTINGS
@given(data=file_bytes)
def test_rules_check_never_crashes(scratch, capfd, data):
    _check(scratch, capfd, data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=valid_docs())
def test_valid_rule_files_pass(scratch, capfd, text):
    code, err = _check(scratch, capfd, text.encode())
    assert code == 0, (err, text)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.lists(file_bytes, min_size=2, max_size=3))
def test_several_files_one_line_per_bad_file(scratch, capfd, data):
    paths = []
    for i, blob in enumerate(data):
        path = scratch / f"r{i}.toml"
        path.write_bytes(blob)
        paths.append(str(path))
    code = main(["rules", "check", *paths])
    out, err = capfd.readouterr()
    assert "Traceback" not in err and code in (0, 2)
    bad = err.strip().splitlines() if err.strip() else []
    assert len(bad) + out.count("ok: ") == len(paths)
    assert (code == 2) == bool(bad)


def test_known_op_names_hold_no_class_names():
    """Hypothesis found ``[op] Tensor = "half"`` drawn as a valid rule (torch.Tensor is callable) and
    refused by the loader, which reads a capitalised op name as a custom autograd Function's class."""
    assert [name for name in KNOWN_OPS if name[:1].isupper()] == []
    assert {"tensor", "linear", "softmax"} <= set(KNOWN_OPS)
