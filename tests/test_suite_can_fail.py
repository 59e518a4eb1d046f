"""The suite can fail: numeric tests under a planted conversion that leaves every op in fp32, and CI's no-skip guard.

``pytest --plant-fp32`` (tests/plant.py, installed by tests/conftest.py) rewrites every half (and fp8) decision of
the decide stage to fp32: conversions still run, report and emit, but compute everything in fp32, so their SQNR
against fp32 is +inf, which passes any SQNR floor. Each numeric test also proves that half precision ran (a
half-FLOP share, an op-dtype or cast count, a float8 call count, or an SQNR ceiling that fp32 exceeds), so under
the plant it must fail. ``PLANTED`` is a representative subset (the zoo's checks on one decoder, and one or two
numeric tests of each other file), run planted here on every CI run; ``python tests/plant_all.py`` runs every
numeric test planted and records the outcomes in ``tests/planted_fp32.json``, which this file checks is complete
and passes only where ``tests/plant_all.py`` names the test. The normal run of the suite runs the same tests
unplanted, where they pass.

Under ``CI=true``, a test that would skip because a package of ``.[test]`` does not import fails instead.
"""
from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

#: test id -> a fragment the planted failure's message must contain (the check that caught it)
PLANTED = {
    "tests/test_zoo.py::test_numerics_against_fp32_and_autocast[llama]": "in half",
    "tests/test_zoo.py::test_gradients_against_fp32_and_autocast[llama]": "in half",
    "tests/test_zoo.py::test_second_batch_size_and_length[llama]": "in half",
    "tests/test_zoo.py::test_train_and_eval_modes[llama]": "in half",
    "tests/test_zoo.py::test_zoo_table": "in half",
    "tests/test_never_silent.py::test_new_empty_filled_by_copy_and_index_put_converts_to_fp16_every_time": "decided",
    "tests/test_never_silent.py::test_mask_fills_convert_to_fp16[masked_fill_finfo_min]": "in half",
    "tests/test_lower.py::test_causal_sample_with_rmsnorm": "in half",
    "tests/test_two_modes.py::test_eval_is_deterministic_and_matches_the_original[export]": "in half",
    "tests/test_shapes.py::test_rnn_sequence_length_stays_dynamic[gru-2layers]": "in half",
    "tests/test_capture_workload.py::test_broadcast_mask_dim_stays_static_and_batch_one_is_dynamic[2]": "in half",
    "tests/test_ranges.py::test_a_recaptured_graph_follows_train_eval_and_the_device": "as if|< 80|SQNR",
    "tests/test_fp8_rules.py::test_sqnr_against_the_bf16_conversion": "fp8|Counter",
}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


@pytest.mark.slow
def test_numeric_tests_fail_on_a_conversion_left_in_fp32():
    """Runs PLANTED with --plant-fp32 in a subprocess: every one of them fails, and for the reason it should."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--plant-fp32", "-rfE",
         "--tb=line", *PLANTED],
        cwd=ROOT, env=_env(MPCONVERT_ZOO_MODELS="llama", OMP_NUM_THREADS="1", COLUMNS="4000"), capture_output=True, text=True, timeout=1500)
    out = proc.stdout + proc.stderr
    failed = {m.group(1): m.group(2) for m in re.finditer(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", out, re.M)}
    passed = [t for t in PLANTED if t not in failed]
    assert not passed, f"passed under a conversion left in fp32 (they cannot fail): {passed}\n{out[-3000:]}"
    assert proc.returncode == 1, out[-3000:]
    wrong = {t: failed[t] for t, why in PLANTED.items() if not re.search(why, failed[t] or "")}
    assert not wrong, f"failed, but not on a half-precision check: {wrong}"



def test_every_numeric_test_was_run_planted_and_only_the_named_ones_pass():
    """tests/planted_fp32.json (``python tests/plant_all.py``: every test that measures an SQNR, run under the
    plant) covers a fresh scan of the suite, and the tests that passed under the plant are exactly the named ones:
    EXEMPT (each measures no conversion's half precision, with its reason) and OPEN (not yet able to fail)."""
    import json

    import plant_all

    record = json.loads(plant_all.RESULTS.read_text())["tests"]
    scanned = set(plant_all.planted_tests())
    assert plant_all.problems(record, scanned) == []
    planted = copy.deepcopy(record)  # the check can fail: one item of a numeric test passing under the plant
    test = "tests/test_zoo_seams_numerics.py::test_output_sqnr_against_autocast"
    next(iter(planted[test].values()))["outcome"] = "passed"
    assert plant_all.problems(planted, scanned) == [f"pass under a conversion left in fp32 (they cannot fail): {[test]}"]
    unrun = scanned | {"tests/test_new.py::test_sqnr_of_something"}
    assert plant_all.problems(record, unrun)[0].startswith("not run planted"), plant_all.problems(record, unrun)

def test_plant_leaves_every_op_in_fp32(monkeypatch):
    """The plant itself: with it installed a conversion reports no half node and its output equals fp32's."""
    import plant
    import torch

    import converter
    import converter.api
    import converter.numerics.redecide

    monkeypatch.setattr(converter.api, "decide", converter.api.decide)
    monkeypatch.setattr(converter.numerics.redecide, "decide", converter.numerics.redecide.decide)
    plant.install()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    for precision in ("bf16", "fp16"):
        conv = converter.convert(model, (x,), precision=precision)
        summary = conv.report.summary
        assert summary["by_precision"] == {"fp16": 0, "bf16": 0, "fp32": 3} and summary["half_flop_fraction"] == 0, summary
        rules = {n["op"]: n["rule"] for n in conv.report.nodes}
        assert rules["linear"].endswith("planted-fp32"), rules  # the plant records itself as the rule (gelu follows)
        with torch.no_grad():
            assert torch.equal(conv.module(x), model(x))


_SKIPPING = """
import pytest

pytest.importorskip("peft.not_a_module_of_peft")


def test_nothing():
    pass
"""


@pytest.mark.parametrize("ci", ["true", None], ids=["CI", "local"])
def test_a_missing_test_extra_fails_under_ci_and_skips_locally(ci, tmp_path):
    (tmp_path / "test_skipping.py").write_text(_SKIPPING)
    env = _env(PYTHONPATH=os.pathsep.join((str(TESTS), str(ROOT))))
    env.pop("CI", None)
    if ci:
        env["CI"] = ci
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-p", "conftest", str(tmp_path / "test_skipping.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    if ci:
        assert proc.returncode != 0 and "of the .[test] extra does not import" in out, out[-2000:]
    else:
        assert proc.returncode in (0, 5) and "1 skipped" in out and "peft.not_a_module_of_peft" in out, out[-2000:]
