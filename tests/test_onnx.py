"""ONNX export (issue 8): casts verified against the FX graph and onnxruntime.

Module-scoped fixtures convert and export each sample once; the tests then read the written files.
The expected Cast count is recomputed here independently of the exporter: ``conv.module`` is run
once through an Interpreter and every dtype change between a node's activation inputs and its
output is counted (explicit casts, the model's own casts and native type promotions alike).
"""
from __future__ import annotations

import copy
import importlib.util
import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.fx
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import converter
from converter.export.onnx import (
    BF16_CPU_REASON,
    DEFAULT_OPSET,
    TOLERANCE_ULPS,
    cast_pairs,
    tolerance_for,
)
from converter.export.onnx_graph import fold_initializer_casts
from converter.numerics.common import output_tensors

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ["mlp", "cnn", "tiny_transformer", "hf_gpt2", "hf_bert"]
HALF_TYPES = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"sample_{name}", ROOT / "samples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy(module):
    with warnings.catch_warnings():  # torch.export's pytree specs warn on deepcopy
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(module)


def _outputs(module, args, kwargs) -> list[torch.Tensor]:
    ref = _copy(module).eval()
    with torch.no_grad():
        return output_tensors(ref(*args, **kwargs))


def _runtime_casts(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> int:
    """Dtype changes on activations observed when ``gm`` runs (independent of the exporter's count).

    A cast node whose input dtype differs from its output counts once; any other node counts one
    per distinct floating activation input whose dtype differs from its floating output (a native
    type promotion, which ONNX spells as a Cast). Parameters/buffers are excluded: they are stored
    in the dtype their consumers want.
    """
    dtypes: dict[torch.fx.Node, torch.dtype] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            if isinstance(result, torch.Tensor):
                dtypes[n] = result.dtype
            return result

    gm = _copy(gm).eval()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    positional = list(args)
    values = []
    for p in placeholders:
        name = str(p.target)
        if name in kwargs:
            values.append(kwargs[name])
        elif positional:
            values.append(positional.pop(0))
        else:
            values.append(p.args[0] if p.args else None)
    with torch.no_grad():
        Recorder(gm).run(*values)

    count = 0
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or node not in dtypes:
            continue
        out = dtypes[node]
        inputs = [a for a in node.all_input_nodes if a in dtypes and a.op != "get_attr"]
        name = str(node.target)
        is_cast = (node.op == "call_method" and name in ("to", "float", "half", "bfloat16", "double", "type")) or (
            node.op == "call_function" and ("_to_copy" in name or name.startswith("aten.to."))
        )
        if is_cast:
            if inputs and dtypes[inputs[0]] != out:
                count += 1
            continue
        if not out.is_floating_point:
            continue
        count += sum(1 for a in dict.fromkeys(inputs) if dtypes[a].is_floating_point and dtypes[a] != out)
    return count


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """sample -> (conv, OnnxResult) for the fp16 conversion of every sample."""
    out_dir = tmp_path_factory.mktemp("onnx")
    results = {}
    for name in SAMPLES:
        sample = _load(name)
        conv = converter.convert(sample.build_model(), sample.example_inputs(), precision="fp16")
        # the size comparison (a second, fp32 export) is measured on the model whose weights dominate
        result = conv.export_onnx(out_dir / f"{name}.onnx", compare_size=(name == "tiny_transformer"))
        print(f"\n{name}: {result.summary}")
        results[name] = (conv, result)
    return results


@pytest.mark.parametrize("name", SAMPLES)
def test_fp16_export_verified(exported, name):
    conv, result = exported[name]
    assert result.exporter == "dynamo"
    assert result.opset == DEFAULT_OPSET
    assert result.precision == "fp16" and result.verified
    assert result.ok, (result.checks, result.notes)
    model = onnx.load(str(result.path))
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain: o.version for o in model.opset_import}.get("", None) == DEFAULT_OPSET

    # onnxruntime on the written file against conv.module, within a few fp16 ulps
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    args, kwargs = conv.example_inputs
    positional = list(args)
    feeds = {}
    for inp in session.get_inputs():
        tensor = kwargs[inp.name] if inp.name in kwargs else positional.pop(0)
        feeds[inp.name] = tensor.numpy()
    got = session.run(None, feeds)
    ref = _outputs(conv.module, args, kwargs)
    assert len(got) == len(ref)
    err = max(float(np.max(np.abs(g.astype(np.float64) - r.double().numpy()))) for g, r in zip(got, ref))
    scale = max(float(r.abs().max()) for r in ref)
    tol = tolerance_for("fp16", scale)
    print(f"{name}: max abs error ORT vs conv.module {err:.3g} (tolerance {tol:.3g}, max|ref| {scale:.3g})")
    assert err <= tol, f"{name}: max abs error {err:.3g} > {tol:.3g}"
    assert result.max_abs_error == pytest.approx(err, abs=1e-12)


@pytest.mark.parametrize("name", SAMPLES)
def test_cast_count_exact(exported, name):
    conv, result = exported[name]
    model = onnx.load(str(result.path))
    casts = [n for n in model.graph.node if n.op_type in ("Cast", "CastLike")]
    args, kwargs = conv.example_inputs
    observed = _runtime_casts(conv.module, args, kwargs)
    b = result.cast_breakdown
    recorded = sum(1 for n in conv.module.graph.nodes if "mp_cast" in n.meta and not n.meta["mp_cast"].on_weight)
    weight = sum(1 for n in conv.module.graph.nodes if "mp_cast" in n.meta and n.meta["mp_cast"].on_weight)
    print(f"{name}: {len(casts)} ONNX Casts; expected {result.expected_casts} = {recorded} activation CastRecords "
          f"+ {b['implicit']} native promotions + {b['model-nonfloat']} non-float model casts; "
          f"{weight} weight casts folded; runtime dtype changes {observed}")
    assert len(casts) == result.cast_count == result.expected_casts
    assert result.expected_casts == recorded + b["implicit"] + b["model-nonfloat"]
    assert result.expected_casts == observed
    assert b["weight"] == weight and weight > 0
    assert all(c.op_type == "Cast" for c in casts)
    # each Cast is named after the FX cast it implements, so the audit and the ONNX line up
    fx_names = {n.name for n in conv.module.graph.nodes if "mp_cast" in n.meta}
    for c in casts:
        assert c.name.split("/", 1)[0] in ("mp", "mp_promote", "model"), c.name
        if c.name.startswith("mp/"):
            assert c.name[3:] in fx_names
    assert result.checks["cast_dtypes_match_fx"]


@pytest.mark.parametrize("name", SAMPLES)
def test_no_cast_pairs_unique_names_fp32_io(exported, name):
    conv, result = exported[name]
    model = onnx.load(str(result.path))
    assert cast_pairs(model) == [] and result.cast_pairs == []
    producer = {o: n for n in model.graph.node for o in n.output}
    for n in model.graph.node:
        if n.op_type == "Cast":
            assert producer.get(n.input[0]) is None or producer[n.input[0]].op_type != "Cast"
    names = [n.name for n in model.graph.node]
    assert all(names) and len(names) == len(set(names))
    for value in list(model.graph.input) + list(model.graph.output):
        assert value.type.tensor_type.elem_type not in HALF_TYPES, value.name
    assert any(v.type.tensor_type.elem_type == TensorProto.FLOAT for v in model.graph.output)


@pytest.mark.parametrize("name", SAMPLES)
def test_weights_stored_in_half(exported, name):
    conv, result = exported[name]
    model = onnx.load(str(result.path))
    consumers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    # no Cast reads an initializer: weight casts are folded
    inits = {t.name: t for t in model.graph.initializer}
    assert not [n.name for n in model.graph.node if n.op_type == "Cast" and n.input[0] in inits]
    # every parameter the rewrite wants in half is stored as an fp16 initializer (possibly transposed
    # for Gemm/MatMul, and shared with an identical one: the exporter deduplicates initializers;
    # an all-zero bias may be optimised away as x + 0)
    halves = [numpy_helper.to_array(t).reshape(-1) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT16]
    half_params = {k for k, v in conv.module.meta["mp_param_dtypes"].items() if v == torch.float16}
    assert half_params
    for key, param in conv.module.named_parameters():
        if key not in half_params or not bool(param.detach().any()):
            continue
        a = param.detach().half().numpy()
        candidates = [a.reshape(-1)] + ([a.T.reshape(-1)] if a.ndim == 2 else [])
        assert any(h.size == a.size and any(np.array_equal(h, c) for c in candidates) for h in halves), key


def test_size_at_most_055_of_fp32(exported):
    conv, result = exported["tiny_transformer"]
    assert result.size == result.path.stat().st_size
    print(f"tiny_transformer: {result.size} B vs fp32 export {result.fp32_size} B -> {result.size_ratio:.3f}x")
    assert result.fp32_size and result.size_ratio == pytest.approx(result.size / result.fp32_size)
    assert result.size_ratio <= 0.55


def test_to_dict_and_summary(exported):
    _, result = exported["hf_gpt2"]
    data = json.loads(json.dumps(result.to_dict()))
    for key in ("path", "precision", "opset", "exporter", "cast_count", "expected_casts", "cast_pairs",
                "max_abs_error", "fp32_size", "size", "size_ratio", "ok", "notes", "verified"):
        assert key in data
    assert data["ok"] is True and data["exporter"] == "dynamo"
    assert "OK" in result.summary and f"{result.cast_count} Casts (expected {result.expected_casts})" in result.summary
    assert any("implicit promotion" in n for n in result.notes)  # the count is explained


# --- bf16 ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_bf16():
    sample = _load("mlp")
    return converter.convert(sample.build_model(), sample.example_inputs(), precision="bf16")


def test_bf16_default_exports_verified_fp16_variant(mlp_bf16, exported, tmp_path):
    result = mlp_bf16.export_onnx(tmp_path / "mlp.onnx", compare_size=False)
    print(result.summary)
    assert result.precision == "fp16" and result.conversion_precision == "bf16"
    assert result.ok and result.verified and result.max_abs_error <= result.tolerance
    assert "fp16 variant of the bf16 conversion" in result.summary
    assert any("no bf16 compute kernels" in n and "fp16 variant" in n for n in result.notes)
    assert any("same decisions" in n for n in result.notes)
    # same decisions: the same Casts as the fp16 conversion of the same model
    _, fp16 = exported["mlp"]
    assert result.cast_count == fp16.cast_count == result.expected_casts
    model = onnx.load(str(result.path))
    assert not any(t.data_type == TensorProto.BFLOAT16 for t in model.graph.initializer)


def test_bf16_explicit_exports_bf16_unverified(mlp_bf16, tmp_path):
    result = mlp_bf16.export_onnx(tmp_path / "mlp_bf16.onnx", precision="bf16", compare_size=False)
    print(result.summary)
    assert result.precision == "bf16" and result.ok and not result.verified
    assert result.max_abs_error is None
    assert "CPU verification skipped" in result.summary and "bf16" in result.summary
    skip = [n for n in result.notes if n.startswith("CPU verification skipped")]
    assert skip and BF16_CPU_REASON in skip[0] and "NOT_IMPLEMENTED" in skip[0]
    model = onnx.load(str(result.path))
    assert any(t.data_type == TensorProto.BFLOAT16 for t in model.graph.initializer)
    assert any(n.op_type == "Cast" and n.attribute[0].i == TensorProto.BFLOAT16 for n in model.graph.node)
    assert result.cast_count == result.expected_casts and result.cast_pairs == []
    for value in list(model.graph.input) + list(model.graph.output):
        assert value.type.tensor_type.elem_type not in HALF_TYPES
    # the reason is real: the CPU provider cannot even build a session for it
    with pytest.raises(Exception, match="NOT_IMPLEMENTED"):
        ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])


def test_tolerance_catches_a_wrong_half_dtype(mlp_bf16, exported):
    """The same decisions run in bf16 instead of fp16 miss the fp16 tolerance."""
    conv16, _ = exported["mlp"]
    args, kwargs = conv16.example_inputs
    ref = _outputs(conv16.module, args, kwargs)[0]
    wrong = _outputs(mlp_bf16.module, args, kwargs)[0].float()
    err = float((wrong - ref).abs().max())
    tol = tolerance_for("fp16", float(ref.abs().max()))
    print(f"bf16 instead of fp16: max abs error {err:.3g} vs tolerance {tol:.3g} ({TOLERANCE_ULPS} fp16 ulps)")
    assert err > tol


def test_unknown_precision_is_rejected(exported, tmp_path):
    conv, _ = exported["mlp"]
    with pytest.raises(ValueError, match="unknown precision"):
        conv.export_onnx(tmp_path / "x.onnx", precision="int8")
    with pytest.raises(ValueError, match="exporter"):
        conv.export_onnx(tmp_path / "x.onnx", exporter="tflite")


def test_verify_false_runs_only_the_static_checks(exported, tmp_path):
    conv, fp16 = exported["mlp"]
    result = conv.export_onnx(tmp_path / "static.onnx", verify=False, compare_size=False)
    assert result.ok and not result.verified and result.max_abs_error is None and result.size_ratio is None
    assert "ort_match" not in result.checks and result.checks["cast_count"] and result.checks["checker"]
    assert "not verified with onnxruntime" in result.summary
    assert any("verify=False" in n for n in result.notes)
    meta = {p.key: p.value for p in onnx.load(str(result.path)).metadata_props}
    assert meta["mpconvert.precision"] == "fp16" and meta["mpconvert.expected_casts"] == str(fp16.expected_casts)


# --- the TorchScript fallback ------------------------------------------------------------------


def test_falls_back_to_torchscript_with_a_notice(exported, tmp_path, monkeypatch):
    conv, fp16 = exported["mlp"]
    real_export = torch.onnx.export

    def dynamo_broken(*args, **kwargs):
        if kwargs.get("dynamo", True):
            raise RuntimeError("simulated dynamo exporter failure")
        return real_export(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", dynamo_broken)
    with pytest.warns(UserWarning, match="fell back to the TorchScript exporter"):
        result = conv.export_onnx(tmp_path / "ts.onnx", compare_size=False)
    print(result.summary)
    assert result.exporter == "torchscript"
    assert any("simulated dynamo exporter failure" in n and "TorchScript" in n for n in result.notes)
    assert result.ok, (result.checks, result.notes)
    assert result.cast_count == result.expected_casts == fp16.cast_count


# --- graph post-processing, on hand-made models --------------------------------------------------


def _tiny_model(nodes, inits, out_type=TensorProto.FLOAT):
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", out_type, [2, 3])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", DEFAULT_OPSET)], ir_version=10)


def test_cast_of_an_initializer_is_folded_into_a_half_initializer():
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 7, name="w")
    model = _tiny_model([
        helper.make_node("Cast", ["x"], ["xh"], to=TensorProto.FLOAT16, name="cx"),
        helper.make_node("Cast", ["w"], ["wh"], to=TensorProto.FLOAT16, name="cw"),
        helper.make_node("MatMul", ["xh", "wh"], ["yh"], name="mm"),
        helper.make_node("Cast", ["yh"], ["y"], to=TensorProto.FLOAT, name="cy"),
    ], [w])
    assert fold_initializer_casts(model) == 1
    onnx.checker.check_model(model, full_check=True)
    assert [n.name for n in model.graph.node if n.op_type == "Cast"] == ["cx", "cy"]
    (init,) = model.graph.initializer
    assert init.data_type == TensorProto.FLOAT16 and init.name == "wh"
    np.testing.assert_array_equal(numpy_helper.to_array(init), (np.arange(12, dtype=np.float32).reshape(4, 3) / 7).astype(np.float16))
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    (y,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert y.dtype == np.float32


def test_cast_pairs_are_detected():
    w = numpy_helper.from_array(np.ones((4, 3), dtype=np.float32), name="w")
    model = _tiny_model([
        helper.make_node("Cast", ["x"], ["xh"], to=TensorProto.FLOAT16, name="down"),
        helper.make_node("Cast", ["xh"], ["xf"], to=TensorProto.FLOAT, name="up"),
        helper.make_node("MatMul", ["xf", "w"], ["y"], name="mm"),
    ], [w])
    assert cast_pairs(model) == [("down", "up")]


# --- the verdict is numeric (issue 14 item 6) ----------------------------------------------------

_CONSTANT_BRANCH = '''
import torch
from torch import nn


class ConstantBranch(nn.Module):
    """A half Linear fed from a table computed from constants only (like a rotary embedding's)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        table = torch.arange(8, dtype=torch.float32).mul(0.25).cos()
        return self.lin(x) * self.proj(table)


def build_model():
    torch.manual_seed(0)
    return ConstantBranch().eval()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(4, 8),)
'''


@pytest.fixture(scope="module")
def constant_branch(tmp_path_factory):
    """(model file, conversion): under torch.export the table is a graph node, and its fp16 cast
    is one the ONNX exporter's optimizer folds, so the Cast count differs while the numbers match."""
    path = tmp_path_factory.mktemp("constant_branch") / "constant_branch.py"
    path.write_text(_CONSTANT_BRANCH)
    spec = importlib.util.spec_from_file_location("constant_branch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    conv = converter.convert(module.build_model(), module.example_inputs(), precision="fp16", tracer="export")
    return path, conv


def test_cast_count_difference_is_information_with_its_cause(constant_branch, tmp_path):
    _, conv = constant_branch
    result = conv.export_onnx(tmp_path / "cb.onnx", compare_size=False)
    print(result.summary)
    assert result.cast_count == 2 and result.expected_casts == 3, result.summary
    assert not result.checks["cast_count"] and result.checks["ort_match"] and result.checks["checker"]
    assert result.ok and result.verified and result.max_abs_error <= result.tolerance
    (difference,) = result.differences
    assert "folded 1 fp32→fp16 Cast(s) of values computed from constants only (cos_to_fp16)" in difference
    assert result.summary.startswith("ONNX OK") and "information, not a failure" in result.summary
    assert any(n.startswith("information (not a failure): Cast count 2") for n in result.notes)


def test_planted_numeric_mismatch_fails(exported, tmp_path, monkeypatch):
    from converter.export import onnx_verify as onnx_mod

    conv, _ = exported["mlp"]
    real = onnx_mod.run_ort

    def off_by_a_little(*args, **kwargs):
        return [o + np.float32(0.05) * np.abs(o).max() for o in real(*args, **kwargs)]

    monkeypatch.setattr(onnx_mod, "run_ort", off_by_a_little)
    result = conv.export_onnx(tmp_path / "bad.onnx", compare_size=False)
    print(result.summary)
    assert not result.ok and not result.verified and result.checks["ort_match"] is False
    assert result.max_abs_error > result.tolerance
    assert result.checks["cast_count"]  # the structure is fine: only the numbers fail
    assert result.summary.startswith("ONNX FAILED")
    assert any("MISMATCH" in n for n in result.notes)


def _cli(capfd, *args):
    from converter.cli.main import main

    code = main([str(a) for a in args])
    out, err = capfd.readouterr()
    return code, out, err


def test_cli_onnx_exits_0_when_only_the_cast_count_differs(constant_branch, tmp_path, capfd):
    path, _ = constant_branch
    code, out, err = _cli(capfd, path, "--tracer", "export", "--onnx", "--no-measure", "--out", tmp_path / "cb")
    assert code == 0, (out, err)
    assert "ONNX OK" in out and "information, not a failure" in out and "constants only" in out
    assert (tmp_path / "cb" / "model.onnx").is_file()


def test_cli_onnx_exits_1_on_a_numeric_mismatch(constant_branch, tmp_path, capfd, monkeypatch):
    from converter.export import onnx_verify as onnx_mod

    path, _ = constant_branch
    real = onnx_mod.run_ort
    monkeypatch.setattr(onnx_mod, "run_ort", lambda *a, **k: [o * np.float32(1.1) for o in real(*a, **k)])
    code, out, err = _cli(capfd, path, "--tracer", "export", "--onnx", "--no-measure", "--out", tmp_path / "cb")
    assert code == 1, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "ONNX verification failed" in lines[0] and "Traceback" not in err, err


def test_hf_llama_export_is_judged_by_its_numbers(tmp_path):
    """A rotary-embedding decoder: its casts may differ from the FX graph's, its outputs must match."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 100, (2, 8))
    conv = converter.convert(model, ((ids,), {}), precision="fp16")
    result = conv.export_onnx(tmp_path / "llama.onnx", compare_size=False)
    print(result.summary)
    assert result.ok and result.verified and result.max_abs_error <= result.tolerance, result.notes
    if result.cast_count != result.expected_casts:
        assert result.differences and "information, not a failure" in result.summary


def test_bf16_variant_is_made_by_api_and_keeps_calibration(tmp_path):
    """The exporter never re-converts: api makes the fp16 variant, calibrated on the same batches."""

    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x * 40000.0) * 1e-4  # 40000 × margin 2 overflows fp16: calibration moves it

    torch.manual_seed(0)
    x = torch.randn(3, 4)
    # fallback fp32: the variant must still run on onnxruntime's CPU provider (no bf16 kernels)
    conv = converter.convert(Big(), (x,), precision="bf16", calibration=[(x,)],
                             calibration_options={"progress": False, "fallback": "fp32"})
    variant = conv.variant("fp16")
    assert variant.precision == "fp16" and variant.calibration == conv.calibration
    risky = variant.module.meta["mp_calibration"]["risky_nodes"]
    assert risky and all(r["precision"] == "fp32" for r in risky), "the fp16 variant was not calibrated"
    result = conv.export_onnx(tmp_path / "big.onnx", compare_size=False)
    assert result.precision == "fp16" and result.conversion_precision == "bf16"
    assert any("calibration ran again on the same batches" in n for n in result.notes), result.notes
    assert result.ok, result.notes
