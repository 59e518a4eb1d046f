"""Issue 33.2: one frozen ConvertOptions, normalised once, built once by convert, audit, apply, the
Lightning plugin and the CLI; each CLI command accepts only the flags it honours, and no CLI helper
receives the argparse namespace."""
from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import converter
from converter.ir.errors import MpconvertError
from converter.numerics.profile import DeviceProfileError
from converter.options import DEVICES, PLACEMENTS, ConvertOptions, OptionsError
from converter.vocab import PrecisionError
from tests.helpers import ROOT, load_sample
from tests.test_cli import MLP, assert_bad_input, run, snapshot

CLI = ROOT / "converter" / "cli"


@pytest.fixture
def work(tmp_path, monkeypatch):
    """An empty working directory as CWD (default output directories land here)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _mlp():
    sample = load_sample("mlp")
    return sample.build_model(), sample.example_inputs()


# ---------------------------------------------------------------------------------------------
# the record


def test_options_are_frozen():
    options = ConvertOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.precision = "fp16"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.opt_level = "O2"  # type: ignore[misc]
    assert (options.precision, options.tracer, options.placement, options.opt_level) == ("bf16", "auto", "mincut", "O1")


@pytest.mark.parametrize("spelling, want", [
    ("bfloat16", "bf16"), (torch.bfloat16, "bf16"), ("bf16-mixed", "bf16"), ("BF16", "bf16"), ("bf16", "bf16"),
    ("float16", "fp16"), (torch.float16, "fp16"), ("16-mixed", "fp16"), ("half", "fp16"),
])
def test_precision_aliases_are_normalised_once(spelling, want):
    options = ConvertOptions(precision=spelling)
    assert options.precision == want
    # the stored value is canonical: building again (replace re-runs __post_init__) changes nothing
    assert dataclasses.replace(options) == options and dataclasses.replace(options).precision == want
    assert ConvertOptions(precision=spelling) == ConvertOptions(precision=want)


def test_calibration_options_are_stored_as_one_record():
    options = ConvertOptions(calibration_options={"progress": False, "tolerance": 30})
    assert isinstance(options.calibration_options, converter.CalibrationOptions)
    assert options.calibration_options.tolerance.sqnr_db == 30.0 and options.calibration_options.progress is False


@pytest.mark.parametrize("field, value, error, needle", [
    ("precision", "fp4", PrecisionError, "unknown precision 'fp4'"),  # fp8 is a precision since issue 34
    ("precision", torch.float32, PrecisionError, "is not a half precision"),
    ("precision", "fp32", PrecisionError, "is not a half precision"),
    ("opt_level", "O3", OptionsError, "opt_level must be one of 'O1', 'O2', got 'O3'"),
    ("tracer", "jit", OptionsError, "tracer must be one of 'auto', 'fx', 'export', got 'jit'"),
    ("placement", "best", OptionsError, "placement must be one of 'mincut', 'mincut-bytes', 'simple', got 'best'"),
    ("device", "tpu", OptionsError, "device must be one of 'cpu', 'cuda' or None, got 'tpu'"),
    ("keep_io_types", "yes", OptionsError, "keep_io_types must be True or False, got 'yes'"),
    ("dynamic", 1, OptionsError, "dynamic must be True or False, got 1"),
    ("strict_modes", None, OptionsError, "strict_modes must be True or False, got None"),
    ("dispatch_kernels", "no", OptionsError, "dispatch_kernels must be True or False, got 'no'"),
    ("check_graph", None, OptionsError, "check_graph must be True or False, got None"),
    ("upcast_half_gemms", 1, OptionsError, "upcast_half_gemms must be None (decided), True or False (forced), got 1"),
    ("recompute_attention", "yes", OptionsError, "recompute_attention must be None (decided), True or False (forced)"),
    ("device_profile", 3, DeviceProfileError, "device_profile must be 'auto', 'none'/None, a DeviceProfile or a profile "
                                              "file's path, got int"),
])
def test_bad_values_are_one_line_errors(field, value, error, needle):
    with pytest.raises(error) as info:
        ConvertOptions(**{field: value})
    message = str(info.value)
    assert needle in message and "\n" not in message, message
    assert isinstance(info.value, MpconvertError) and isinstance(info.value, ValueError)
    # the keyword form of convert() says the same, before any work
    with pytest.raises(error, match="must be|precision"):
        converter.convert(torch.nn.Linear(2, 2), (torch.randn(1, 2),), **{field: value})


def test_option_tables_agree_with_the_stages():
    from converter.passes.lower import DEVICES as LOWER_DEVICES
    from converter.passes.place.stage import STRATEGIES

    assert PLACEMENTS == STRATEGIES and DEVICES == LOWER_DEVICES


def test_the_options_module_imports_no_torch():
    code = ("import sys; from converter.options import ConvertOptions; o = ConvertOptions(precision='bfloat16', "
            "opt_level='O2', device='cpu'); print(o.precision, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": ""}, cwd=ROOT)
    assert proc.stdout.split() == ["bf16", "False"], proc.stderr


def test_a_saved_device_profile_is_read_without_torch(tmp_path):
    """``device_profile=PATH`` is loaded when the options are built (a bad file fails there), still torch-free."""
    (tmp_path / "p.json").write_text(json.dumps({"format": 1, "cpu": "X", "cores": 2, "torch_version": "2.x",
                                                 "matmul_seconds": {"fp32": 1e-4, "bf16": 4e-4, "fp16": 9e-4}}))
    code = ("import sys; from converter.options import ConvertOptions; o = ConvertOptions(device_profile='p.json'); "
            "print(o.device_profile.slowdown('bf16'), o.device_profile.cuda_capability, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": ""}, cwd=tmp_path)
    assert proc.stdout.split() == ["4.0", "None", "False"], proc.stderr
    defaults = {f.name: f.default for f in dataclasses.fields(ConvertOptions)}  # the product's (conftest changes two)
    assert (defaults["device_profile"], defaults["check_graph"], defaults["dispatch_kernels"]) == ("auto", False, True)


# ---------------------------------------------------------------------------------------------
# the API builds it once


def _same_report(a, b) -> None:
    assert a.precision == b.precision and a.tracer == b.tracer
    assert a.nodes == b.nodes and a.casts == b.casts and a.summary == b.summary
    for key in ("opt_level", "device", "dynamic_dims", "modes", "lowered"):
        assert a.records.to_dict()[key] == b.records.to_dict()[key], key


def test_convert_with_options_equals_the_keyword_form():
    model, example = _mlp()
    options = ConvertOptions(precision="bfloat16", opt_level="O2", placement="simple", keep_io_types=False, device="cpu")
    by_record = converter.convert(model, example, options=options)
    by_keywords = converter.convert(model, example, precision="bf16", opt_level="O2", placement="simple",
                                    keep_io_types=False, device="cpu")
    assert by_record.options is options and by_keywords.options == options
    assert isinstance(by_keywords.options, ConvertOptions) and by_keywords.precision == "bf16"
    _same_report(by_record.report, by_keywords.report)
    assert by_record.report.records.run.opt_level == "O2" and by_record.report.records.run.device == "cpu"


def test_options_and_keywords_together_are_refused():
    model, example = _mlp()
    with pytest.raises(OptionsError, match=r"convert\(\) got options= and precision= too"):
        converter.convert(model, example, options=ConvertOptions(), precision="fp16")
    with pytest.raises(OptionsError, match=r"audit\(\) got options= and opt_level= too"):
        converter.audit(model, example, options=ConvertOptions(), opt_level="O2")
    with pytest.raises(TypeError, match="unexpected keyword argument 'precison'"):
        converter.convert(model, example, precison="fp16")
    with pytest.raises(TypeError, match="must be a ConvertOptions"):
        converter.convert(model, example, options={"precision": "fp16"})
    # audit runs no calibration: it never took calibration_options
    with pytest.raises(TypeError, match="unexpected keyword argument 'calibration_options'"):
        converter.audit(model, example, calibration_options={"progress": False})


def test_audit_with_options_equals_the_keyword_form_and_honours_strict_modes():
    model, example = _mlp()
    options = ConvertOptions(precision="fp16", opt_level="O2")
    _same_report(converter.audit(model, example, options=options), converter.audit(model, example, precision="half", opt_level="O2"))
    from tests.test_capture_workload import _LayerDrop

    frozen = _LayerDrop().eval()
    with pytest.raises(converter.FrozenModeError, match="strict_modes"):
        converter.audit(frozen, (torch.randn(4, 8),), tracer="export", strict_modes=True, partial=False)


def test_variant_keeps_the_other_options():
    model, example = _mlp()
    conv = converter.convert(model, example, precision="bf16", opt_level="O2", placement="simple", keep_io_types=False,
                             dynamic=False, device="cpu")
    fp16 = conv.variant(torch.float16)
    assert fp16.options == dataclasses.replace(conv.options, precision="fp16", tracer=conv.tracer)
    assert fp16.precision == "fp16" and fp16.report.records.run.opt_level == "O2" and fp16.report.records.run.device == "cpu"
    assert conv.variant("bfloat16") is conv


def test_apply_builds_one_record():
    from converter.inplace import conversion_of

    model, example = _mlp()
    options = ConvertOptions(precision="fp16", opt_level="O2")
    assert conversion_of(converter.apply(model, example, options=options)).options is options
    other, _ = _mlp()
    assert conversion_of(converter.apply(other, example, precision="16-mixed", opt_level="O2")).options == options
    with pytest.raises(OptionsError, match=r"apply\(\) got options= and precision= too"):
        converter.apply(other, example, options=options, precision="bf16")


def test_the_lightning_plugin_builds_one_record():
    pytest.importorskip("pytorch_lightning", reason="needs Lightning")
    from converter.lightning import MixedPrecision

    plugin = MixedPrecision("bf16-mixed", opt_level="O2", device="cpu", rules="llm")
    assert plugin.options == ConvertOptions(precision="bf16", opt_level="O2", device="cpu")
    assert (plugin.half, plugin.opt_level, plugin.precision) == ("bf16", "O2", "bf16-mixed")
    with pytest.raises(OptionsError, match="opt_level"):  # checked when the plugin is made, not at setup
        MixedPrecision("16-mixed", opt_level="O3")
    with pytest.raises(OptionsError, match="tracer"):
        MixedPrecision("16-mixed", tracer="jit")


# ---------------------------------------------------------------------------------------------
# the CLI: each command accepts only the flags it honours


#: the flags each command takes (besides -h/--help); a new flag must be honoured by the command that takes it
_SHARED = {"--precision", "--rules", "--tracer", "--entry", "--batch", "--seq-len", "--trust-remote-code",
           "--allow-missing-weights", "--empty-weights", "--load-weights", "--opt-level", "--device", "--tune-for", "--static", "-q", "--quiet",
           "--json", "--debug"}
FLAGS = {
    "convert": _SHARED | {"--max-shard-size", "--no-measure", "--strict-modes", "--no-breaks", "--out", "--calibrate", "--calibration-data",
                          "--tolerance", "--onnx", "--onnx-precision", "--force", "--version", "--device-profile"},
    "audit": _SHARED | {"--strict-modes", "--no-breaks", "--out", "--force", "--device-profile"},
    "explain": _SHARED,
    "rules check": {"-q", "--quiet", "--json", "--debug"},
    "profile": {"-o", "--output", "-q", "--quiet", "--json", "--debug"},
}


def test_each_command_takes_exactly_its_flags():
    from converter.cli.parsers import build_parsers

    for command, parser in build_parsers().items():
        taken = {opt for action in parser._actions for opt in action.option_strings} - {"-h", "--help"}
        assert taken == FLAGS[command], (command, sorted(taken ^ FLAGS[command]))


@pytest.mark.parametrize("argv, flag, owner", [
    (["audit", MLP, "--max-shard-size", "1GB"], "--max-shard-size", "mpconvert MODEL"),
    (["audit", MLP, "--no-measure"], "--no-measure", "mpconvert MODEL"),
    (["audit", MLP, "--calibrate"], "--calibrate", "mpconvert MODEL"),
    (["audit", MLP, "--tolerance", "30"], "--tolerance", "mpconvert MODEL"),
    (["audit", MLP, "--onnx"], "--onnx", "mpconvert MODEL"),
    (["explain", MLP, "fc1", "--strict-modes"], "--strict-modes", "mpconvert"),
    (["explain", MLP, "fc1", "--out", "x"], "--out", "mpconvert"),
    (["explain", MLP, "fc1", "--force"], "--force", "mpconvert"),
    (["rules", "check", "r.toml", "--precision", "fp16"], "--precision", "mpconvert"),
])
def test_a_flag_the_command_does_not_honour_exits_2(work, capfd, argv, flag, owner):
    line = assert_bad_input(*run(capfd, *argv), "unrecognized arguments", flag, f"is an option of `{owner}")
    command = "rules check" if argv[0] == "rules" else argv[0]
    assert f"`mpconvert {command}` does not use" in line, line
    assert snapshot(work) == []


def test_audit_strict_modes_is_honoured(work, capfd):
    from tests.test_capture_workload import _FROZEN_FILE

    (work / "frozen.py").write_text(_FROZEN_FILE)
    # whole (--no-breaks): a train mode that cannot be traced freezes the graph in eval mode, which --strict-modes refuses
    code, out, err = run(capfd, "audit", "frozen.py", "--tracer", "export", "--no-breaks", "-q")
    assert code == 0, err
    assert json.loads((work / "frozen_audit" / "report.json").read_text())["modes"].startswith("frozen in eval mode")
    assert_bad_input(*run(capfd, "audit", "frozen.py", "--tracer", "export", "--no-breaks", "--strict-modes", "--out", "strict"),
                     "frozen in eval mode", "strict_modes")
    assert not (work / "strict").exists()


def _takes_namespace(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    args = fn.args
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, [args.vararg, args.kwarg])]:
        if arg.arg == "ns" or (arg.annotation is not None and "Namespace" in ast.unparse(arg.annotation)):
            return True
    return False


def test_only_the_command_entry_points_take_the_namespace():
    from converter.cli.commands import COMMANDS

    entry_points = {fn.__name__ for fn in COMMANDS.values()}
    takers: dict[str, list[str]] = {}
    for path in sorted(CLI.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _takes_namespace(node):
                takers.setdefault(path.name, []).append(node.name)
    assert set(takers) == {"commands.py"} and set(takers["commands.py"]) == entry_points, takers


def test_cli_modules_import_no_private_name_of_another_module():
    found = []
    for path in sorted(Path(converter.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("converter.cli"):
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not found, found
