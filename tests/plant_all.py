"""Every numeric test under the planted fp32 conversion: which tests measure an SQNR, and how each ends planted.

``numeric_tests()`` scans ``tests/`` for the test functions whose body measures an SQNR (the word ``sqnr``, any
case). ``python tests/plant_all.py`` runs all of them with ``--plant-fp32`` (tests/plant.py: every half decision
rewritten to fp32) and writes each test item's outcome to ``tests/planted_fp32.json``;
``tests/test_suite_can_fail.py`` checks that file against a fresh scan (a numeric test added since must be run
planted too), and that the tests that passed planted are exactly ``EXEMPT`` (each with its reason: it measures no
conversion's half precision) and ``OPEN`` (checks that cannot fail yet, to be fixed).

The zoo runs on one decoder (``MPCONVERT_ZOO_MODELS=llama``): each zoo check is one function over 47 models, and
one model shows whether the function can fail.

Run: ``python tests/plant_all.py [-n 2]`` (about 30 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
RESULTS = TESTS / "planted_fp32.json"

#: files not run planted: what they measure is not a conversion
EXEMPT_FILES = {
    "tests/test_numerics_common.py": "unit tests of the SQNR function itself, on hand-made tensors",
    "tests/test_suite_can_fail.py": "the plant's own tests",
}

_KERNEL = "a kernel on tensors the test gives it: no decide stage for the plant to rewrite"
_UNIT = "a unit of the report, schema, search or benchmark code: the SQNR is a value it handles, not one it measures"
_SAME = "two of our own artefacts compared with each other (model.py, ONNX, a copy), not half against fp32"

#: the numeric tests that pass under the plant, and why: EXEMPT ones measure no conversion's half precision
EXEMPT = {
    "tests/test_benchmarks_smoke.py::test_sqnr_db_exact_values": _UNIT,
    "tests/test_benchmarks_smoke.py::test_run_quick_tiniest_model_writes_valid_json": _UNIT,
    "tests/test_fp8_benchmark_smoke.py::test_tiny_run_without_torchao_writes_strict_json": _UNIT,
    "tests/test_cpu_gemm.py::test_upcast_linear_is_the_fp32_gemm_rounded_once_and_saves_half": _KERNEL,
    "tests/test_cpu_gemm.py::test_upcast_matmul_broadcasts_and_sums_the_gradients_back": _KERNEL,
    "tests/test_grouped_gemm.py::test_the_kernel_keeps_the_exact_products_in_fp32_and_saves_half": _KERNEL,
    "tests/test_dispatch.py::test_the_upcast_attention_is_at_least_as_close_to_fp32_as_the_fused_half_kernel": _KERNEL,
    "tests/test_fp8_kernels.py::test_blockwise_tiles_isolate_an_outlier": _KERNEL,
    "tests/test_fp8_kernels.py::test_sqnr_against_an_fp32_linear": _KERNEL,
    "tests/test_fp8_kernels.py::test_sqnr_negative_control_e5m2_forward_fails_the_floor": _KERNEL,
    "tests/test_fp8_reference.py::test_a_wrong_format_misses_the_reference": _KERNEL,
    "tests/test_fp8_reference.py::test_kernels_match_the_float64_reference": _KERNEL,
    "tests/test_trainer.py::test_dynamic_scaling_recovers_underflowing_fp16_grads":
        "the loss scaler on a hand-made fp16 model, not a conversion",
    "tests/test_report_schema.py::test_an_sqnr_that_is_no_number_is_refused_by_name": _UNIT,
    "tests/test_report_schema.py::test_non_finite_sqnr_is_the_documented_string_and_a_module_named_inf_stays_a_string":
        _UNIT,
    "tests/test_search.py::test_emulator_counts_runs_and_memoises": _UNIT,
    "tests/test_search.py::test_tolerance_parsing": _UNIT,
    "tests/test_options.py::test_calibration_options_are_stored_as_one_record": _UNIT,
    "tests/test_html.py::test_html_is_one_self_contained_file": _UNIT,
    "tests/test_cli.py::test_tolerance_not_met_exits_1_and_writes_nothing":
        "an unreachable tolerance: exit 1 whatever the precision",
    "tests/test_emit_patterns.py::test_complex_model_py_is_bit_exact_without_converter": _SAME,
    "tests/test_flows.py::test_conv_module_keeps_the_optional_arguments_with_their_defaults": _SAME,
    "tests/test_flows.py::test_convert_onnx_runs_in_onnxruntime": _SAME,
    "tests/test_flows.py::test_folder_model_py_takes_the_originals_optional_arguments": _SAME,
    "tests/test_vocabulary.py::test_random_at_trace_time_and_the_search_carry_their_reasons": _UNIT,
    "tests/test_shapes.py::test_rnn_given_initial_state_is_dynamic":
        "an fp32 graph by design (no rule matches the GRU): it asserts no half FLOP and exact equality",
    "tests/test_shapes.py::test_swin_captures_dynamic_batch_in_seconds": "capture only: no decide stage",
    "tests/test_served_sizes.py::test_past_the_bound_the_original_code_runs_under_autocast_on_the_module_tensors":
        "the fallback runs the original's code under torch.autocast: no conversion's decisions",
    "tests/test_fp8_numerics.py::test_without_calibration_the_report_has_the_flops_share_and_no_numerics":
        "a model the fp8 gates leave in bf16 by design: it checks the report's fp8 section",
    "tests/test_fp8_search.py::test_the_set_found_is_minimal":
        "the fp8 search's own evaluator on keep sets: the plant rewrites the decide stage only",
}

#: numeric tests of a conversion that still pass under the plant: each is a check that cannot fail yet, to be made
#: to prove that half precision ran (and then removed from here: the suite's check holds this list exact)
OPEN: set[str] = set()


def numeric_tests() -> list[str]:
    """``path::function`` of every test function under tests/ whose body mentions an SQNR, sorted."""
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                if re.search("sqnr", "\n".join(lines[node.lineno - 1:node.end_lineno]), re.I):
                    found.append(f"{path.relative_to(ROOT).as_posix()}::{node.name}")
    return sorted(found)


def planted_tests() -> list[str]:
    """The numeric tests the record holds: the scan less the files of EXEMPT_FILES."""
    return [t for t in numeric_tests() if t.split("::")[0] not in EXEMPT_FILES]


def passed_planted(record: dict) -> set[str]:
    """The tests of a record (``tests/planted_fp32.json``'s ``tests``) with an item that passed under the plant."""
    return {t for t, items in record.items() if any(r["outcome"] == "passed" for r in items.values())}


def _outcomes(junit: Path) -> dict[str, dict]:
    """test item id -> {"outcome": passed|failed|skipped, "message": the first line of why}."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        item = f"{path}.py::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                message = next(iter((child.get("message") or "").strip().splitlines()), "")[:300]
                break
        found[item] = {"outcome": outcome, "message": message}
    return found


def problems(record: dict, scanned: set[str]) -> list[str]:
    """What is wrong with a record against a scan of the suite: tests not run planted, tests that pass planted
    without being named in EXEMPT or OPEN, named ones that no longer pass, and non-CUDA tests that only skipped."""
    found = []
    if set(record) != scanned:
        found.append(f"not run planted (python tests/plant_all.py --only ...): {sorted(scanned - set(record))}; "
                     f"no longer numeric tests: {sorted(set(record) - scanned)}")
    ran = {t for t, items in record.items() if items}
    if len(ran) < 0.9 * len(record):
        found.append(f"only {len(ran)} of {len(record)} numeric tests ran an item planted")
    passed, named = passed_planted(record), set(EXEMPT) | OPEN
    if passed - named:
        found.append(f"pass under a conversion left in fp32 (they cannot fail): {sorted(passed - named)}")
    if named - passed:
        found.append(f"named as passing planted, but they fail there (remove them): {sorted(named - passed)}")
    skipped = {t for t in ran - passed if all(r["outcome"] == "skipped" for r in record[t].values())}
    if any(not t.startswith("tests/test_cuda") for t in skipped):  # CUDA-only tests skip where no GPU is
        found.append(f"only skipped under the plant: {sorted(t for t in skipped if not t.startswith('tests/test_cuda'))}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", default="2", help="pytest-xdist workers")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", nargs="*", default=None,
                        help="run these tests only and merge their outcomes into the existing record")
    ns = parser.parse_args()
    tests = planted_tests()
    if ns.only:
        tests = [t for t in tests if t in ns.only]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "CI")}
    env.update(MPCONVERT_ZOO_MODELS="llama", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--plant-fp32", "-n", ns.n,
                        "--tb=no", f"--junitxml={junit}", "-o", "junit_family=xunit1", *tests],
                       cwd=ROOT, env=env, check=False)
        items = _outcomes(junit)
    by_test: dict[str, dict] = {t: {} for t in tests}
    if ns.only:
        by_test = {**json.loads(ns.out.read_text())["tests"], **by_test}
    for item, result in sorted(items.items()):
        function = re.sub(r"\[.*$", "", item)
        if function in by_test:
            by_test[function][item] = result
    ns.out.write_text(json.dumps({"command": "python tests/plant_all.py", "tests": dict(sorted(by_test.items()))},
                                 indent=1) + "\n")
    passed = passed_planted(by_test)
    print(f"{len(tests)} numeric tests, {len(items)} items run planted; passed planted: {len(passed)}")
    for t in sorted(passed):
        print("  PASSED PLANTED", t, "(exempt)" if t in EXEMPT else "(open)" if t in OPEN else "(NEW: fix it)")


if __name__ == "__main__":
    main()
