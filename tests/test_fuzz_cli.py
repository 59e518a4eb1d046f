"""Issue 19.7: hypothesis over whole command lines and rule files.

Properties, for every generated command line (convert, audit, explain, rules check) on the tiny
samples/mlp.py, a broken model file, a missing path, a directory or a file in the way:

* the exit status is 0, 1 or 2 (3 would be an internal error: a bug);
* no traceback on stdout or stderr, and a failure is one ``mpconvert: error:`` line;
* ``--json`` output is one JSON object;
* nothing exists at the output location unless the exit status is 0.

CI runs it derandomized (the "ci" profile of tests/conftest.py).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from converter.cli.main import main
from tests.helpers import SAMPLES

MLP = SAMPLES / "mlp.py"
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
_models = st.sampled_from(["mlp"] * 6 + ["missing", "dir", "broken", "nomodel"])  # mostly the real model
_GOOD_RULES = ['[op]\nlinear = "fp32"\n', '[module]\n"fc[12]" = "half"\n', '[settings]\noverflow_margin = 3.0\n',
               '\ufeff[op]\nsoftmax = "fp32"\n']
_rule_bodies = st.one_of(
    st.sampled_from(_GOOD_RULES),
    st.sampled_from(_GOOD_RULES),
    st.sampled_from([
        '[op]\nlinear = "fp32"\n',
        '[module]\n"fc[12]" = "half"\n',
        '[module]\n"fc[1" = "half"\n',
        '[settings]\noverflow_margin = nan\n',
        '[settings]\noverflow_margin = 3.0\n',
        '\ufeff[op]\nsoftmax = "fp32"\n',
        "a = " + "[" * 2000 + "]" * 2000 + "\n",
        '[op]\nlinaer = "half"\n',
        '[node]\nfc1 = "banned"\n',
        '[op]\nlinear = { precision = "banned", message = "no" }\n',
    ]),
    _text.map(lambda t: f"[op]\n{json.dumps(t)} = \"fp32\"\n"),
)
_valid_options = st.lists(st.sampled_from([
    ("--precision", "bf16"), ("--precision", "16-mixed"), ("--tracer", "fx"), ("--tracer", "export"), ("--device", "cpu"),
    ("--opt-level", "O2"), ("--rules", "llm"), ("--rules", "user.toml"), ("-q",), ("--json",), ("--force",), ("--batch", "3"),
]), max_size=3)
_any_options = st.lists(st.one_of(
    st.tuples(st.just("--precision"), st.sampled_from(["bf16", "fp16", "16-mixed", "bf16-mixed", "fp8", ""])),
    st.tuples(st.just("--tracer"), st.sampled_from(["auto", "fx", "export", "jit"])),
    st.tuples(st.just("--device"), st.sampled_from(["cpu", "cuda", "tpu"])),
    st.tuples(st.just("--tune-for"), st.sampled_from(["cpu", "gpu"])),
    st.tuples(st.just("--opt-level"), st.sampled_from(["O1", "O2", "O3"])),
    st.tuples(st.just("--tolerance"), st.one_of(st.sampled_from(["10", "nan", "sqnr=5", "rtol=1,atol=1", "x=1"]), _text)),
    st.tuples(st.just("--batch"), st.one_of(st.integers(-2, 5).map(str), _text)),
    st.tuples(st.just("--seq-len"), st.integers(-1, 9).map(str)),
    st.tuples(st.just("--entry"), st.sampled_from(["build_model", "model", "nothing", "MLP"])),
    st.tuples(st.just("--rules"), st.sampled_from(["llm", "user.toml", "missing.toml", "."])),
    st.tuples(st.sampled_from(["-q", "--json", "--force", "--no-measure", "--calibrate", "--onnx-precision"])),
), max_size=4)
_options = st.one_of(_valid_options, _valid_options, _any_options)
_outs = st.sampled_from([None, None, "out", "out", "afile/sub", "afile", "deep/er/out", "exists"])


def _setup(scratch: Path, model: str, rules: str) -> str:
    (scratch / "user.toml").write_text(rules, encoding="utf-8")
    (scratch / "afile").write_text("mine")
    (scratch / "exists").mkdir()
    (scratch / "exists" / "keep.txt").write_text("keep")
    if model == "mlp":
        shutil.copy(MLP, scratch / "mlp.py")
        return "mlp.py"
    if model == "broken":
        (scratch / "broken.py").write_text("def build_model(:\n")
        return "broken.py"
    if model == "nomodel":
        (scratch / "nomodel.py").write_text("x = 1\n")
        return "nomodel.py"
    if model == "dir":
        (scratch / "adir").mkdir()
        return "adir"
    return "missing.py"


def _outputs(scratch: Path) -> set[str]:
    return {p.name for p in scratch.iterdir()} - {"user.toml", "afile", "exists", "mlp.py", "broken.py", "nomodel.py", "adir"}


@pytest.fixture
def scratch(monkeypatch):
    with tempfile.TemporaryDirectory() as directory:
        monkeypatch.chdir(directory)
        yield Path(directory)


@FUZZ
@given(command=st.sampled_from(["convert", "audit", "explain", "rules check"]), model=_models, rules=_rule_bodies,
       options=_options, out=_outs, node=st.one_of(st.sampled_from(["fc1", "head", "fc_1", "norm", "x_to_bf16"]), _text))
def test_any_command_line_exits_0_1_or_2_cleanly(scratch, capfd, command, model, rules, options, out, node):
    for entry in list(scratch.iterdir()):
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    target = _setup(scratch, model, rules)
    flat = [part for option in options for part in option]
    if command == "rules check":
        argv = ["rules", "check", "user.toml", *flat[:1]]
    elif command == "explain":
        argv = ["explain", target, node or "fc1", *flat]
    else:
        argv = ([] if command == "convert" else ["audit"]) + [target, *flat] + (["--out", out] if out else [])
    if command == "convert" and "--no-measure" not in argv:
        argv.append("--no-measure")  # keep each example fast; measuring is covered elsewhere (audit never measures)
    code = main(argv)
    stdout, stderr = capfd.readouterr()
    event(f"{command}: exit {code}")
    assert code in (0, 1, 2), (argv, code, stderr)
    assert "Traceback" not in stderr and "Traceback" not in stdout, (argv, stderr)
    errors = [line for line in stderr.splitlines() if line.startswith("mpconvert: error:")]
    if code == 2:
        assert len(errors) == 1, (argv, stderr)
    if "--json" in argv and command != "rules check" and code == 0:
        json.loads(stdout)
    written = _outputs(scratch)
    if code != 0:
        assert not written, (argv, code, written, stderr)
        assert (scratch / "exists" / "keep.txt").read_text() == "keep" and (scratch / "afile").read_text() == "mine"
