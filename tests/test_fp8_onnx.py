"""ONNX export of an fp8 conversion (issue 34, item 7): float8e4m3fn QuantizeLinear/DequantizeLinear in place of
the scaled GEMMs, verified with onnx's reference evaluator (onnxruntime's CPU provider has no bf16 kernels).

Where every linear runs fp8 the file reproduces the conversion bit for bit; in a decoder with attention, norms
and gated linears it matches within the bf16 export's own noise, and it differs measurably from the same
conversion with its fp8 linears in bf16 (so a file without the Q/DQ would fail). The Q/DQ nodes are counted
exactly, and only the fp8 linears have any. What cannot be exported is refused in one line before anything
is written (exit 2).
"""
from __future__ import annotations

import json
import math
import textwrap
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator
from torch import nn

import converter
from converter.export.onnx import REFERENCE_MIN_SQNR_DB, Fp8OnnxRefused
from converter.export.onnx_exporter import export_copy
from converter.export.onnx_fp8 import fp8_nodes
from converter.export.onnx_verify import _feeds
from converter.ir.errors import EXIT_BAD_INPUT
from converter.numerics.common import output_tensors
from tests.helpers import sqnr
from tests.test_fp8_rules import FP8_LAYERS, Decoder, _tokens

E4M3 = TensorProto.FLOAT8E4M3FN
#: rules that put every linear in fp8 (no first/last/size gate): no bf16 op upstream of any quantisation
ALL_FP8 = "[settings]\nfp8_min_flops_per_token = 0\nfp8_keep_first = false\nfp8_keep_last = false\n"
#: fp8 quantisation against bf16 is ~24-40 dB on these models; a file that dropped the Q/DQ would sit there
DROPPED_QDQ_DB = 30.0


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _rules(tmp_path_factory, text: str) -> str:
    path = tmp_path_factory.mktemp("rules") / "fp8.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def _nodes(model, op_type: str) -> list:
    return [n for n in model.graph.node if n.op_type == op_type]


def _run_file(path, conv) -> list[torch.Tensor]:
    args, kwargs = conv.example_inputs
    evaluator = ReferenceEvaluator(str(path))
    return [torch.as_tensor(o) for o in evaluator.run(None, _feeds(evaluator.input_names, args, kwargs))]


def _eval(module, conv) -> list[torch.Tensor]:
    args, kwargs = conv.example_inputs
    with torch.no_grad():
        return output_tensors(module(*args, **kwargs))


def _fp8_dropped(conv) -> torch.nn.Module:
    """The conversion with its fp8 linears as plain bf16 linears: what a file without the Q/DQ computes."""
    gm = export_copy(conv.module, {})
    for node in fp8_nodes(gm):
        node.target, node.args = F.linear, tuple(node.args[:3])
    gm.recompile()
    return gm


@pytest.fixture(scope="module", params=["tensorwise", "rowwise"])
def mlp_export(request, tmp_path_factory):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 16, 64) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = converter.convert(model, (x,), precision="fp8", rules=[_rules(tmp_path_factory, ALL_FP8)],
                                 fp8_recipe=request.param)
        result = conv.export_onnx(tmp_path_factory.mktemp("onnx") / "mlp.onnx", compare_size=False)
    return request.param, conv, result


def test_every_fp8_linear_becomes_float8_qdq(mlp_export):
    recipe, conv, result = mlp_export
    assert conv.report.records.fp8.layers == ["a", "b", "c"]
    assert result.ok and result.checks["fp8_qdq"] and result.checks["reference_match"], result.notes
    assert {k: result.fp8[k] for k in ("recipe", "layers", "inputs", "QuantizeLinear", "DequantizeLinear", "float8e4m3fn")} \
        == {"recipe": recipe, "layers": 3, "inputs": 3, "QuantizeLinear": 3, "DequantizeLinear": 6, "float8e4m3fn": 9}
    model = onnx.load(str(result.path))
    inits = {t.name: t for t in model.graph.initializer}
    quantise = _nodes(model, "QuantizeLinear")
    assert [n.name for n in quantise] == [f"fp8/{layer}/quantize_x" for layer in "abc"]
    for q in quantise:
        attrs = {a.name: a.i for a in q.attribute}
        assert attrs["saturate"] == 1 and inits[q.input[2]].data_type == E4M3, q
        if recipe == "rowwise":  # per-axis: one scale per row of the (rows, K) input
            assert attrs["axis"] == 0
        else:  # the kernel multiplies by 448/amax: Mul first, then QuantizeLinear with scale 1
            assert numpy_helper.to_array(inits[q.input[1]]) == 1.0
    # each weight is a float8e4m3fn initializer (K x N) behind one DequantizeLinear; the fp32/bf16 weights are gone
    weights = {n: t for n, t in inits.items() if n.startswith("mp_fp8_weight__")}
    assert {n: (t.data_type, list(t.dims)) for n, t in weights.items()} == {
        "mp_fp8_weight__a": (E4M3, [64, 128]), "mp_fp8_weight__b": (E4M3, [128, 64]), "mp_fp8_weight__c": (E4M3, [64, 32])}
    zero_points = [t for n, t in inits.items() if t.data_type == E4M3 and n not in weights]
    assert zero_points and all(not numpy_helper.to_array(t).astype(np.float32).any() for t in zero_points)
    assert not [n for n in inits if n.endswith(".weight")], sorted(inits)
    weight_dq = [n for n in _nodes(model, "DequantizeLinear") if n.input[0] in weights]
    assert [n.name for n in weight_dq] == [f"fp8/{layer}/dequantize_w" for layer in "abc"]
    assert any("NOT_IMPLEMENTED" in note and "onnx.reference" in note for note in result.notes), result.notes


def test_where_every_linear_runs_fp8_the_file_is_bit_equal(mlp_export):
    recipe, conv, result = mlp_export
    (got,), (want,) = _run_file(result.path, conv), _eval(conv.module, conv)
    err = float((got - want).abs().max())
    assert err == 0.0, f"{recipe}: onnx.reference vs the fp8 conversion: max abs error {err} (expected bit-equal)"
    (bf16,) = _eval(_fp8_dropped(conv), conv)
    db = sqnr(bf16.float(), got.float())
    assert db < DROPPED_QDQ_DB, f"{recipe}: the file is within {db:.1f} dB of the bf16 linears (< {DROPPED_QDQ_DB} expected)"


@pytest.fixture(scope="module")
def decoder_export(tmp_path_factory):
    torch.manual_seed(0)
    model = Decoder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = converter.convert(model, (_tokens(),), precision="fp8",
                                 rules=[_rules(tmp_path_factory, "[settings]\nfp8_min_flops_per_token = 4096\n")])
        result = conv.export_onnx(tmp_path_factory.mktemp("onnx") / "decoder.onnx", compare_size=False)
    return conv, result


def test_a_decoder_exports_qdq_for_exactly_its_fp8_linears(decoder_export):
    conv, result = decoder_export
    assert set(conv.report.records.fp8.layers) == FP8_LAYERS and len(FP8_LAYERS) == 9
    assert result.ok, result.summary
    # q/k/v (block 1) and k/v (block 0, q is gated) read one tensor: they share its quantisation
    assert (result.fp8["QuantizeLinear"], result.fp8["DequantizeLinear"], result.fp8["inputs"]) == (6, 15, 6), result.fp8
    model = onnx.load(str(result.path))
    producer = {o: n for n in model.graph.node for o in n.output}
    qdq_fed = {n.name.split("/")[1] for n in _nodes(model, "MatMul") if any(
        getattr(producer.get(i), "op_type", "") == "DequantizeLinear" for i in n.input)}
    assert qdq_fed == FP8_LAYERS, sorted(qdq_fed ^ FP8_LAYERS)
    assert all(n.name.startswith("fp8/") for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear"))
    assert result.cast_count == result.expected_casts and not result.cast_pairs, result.summary


def test_a_decoder_file_matches_its_fp8_conversion_not_its_bf16_linears(decoder_export):
    conv, result = decoder_export
    (got,), (want,) = _run_file(result.path, conv), _eval(conv.module, conv)
    (bf16,) = _eval(_fp8_dropped(conv), conv)
    to_fp8, to_bf16 = sqnr(want.float(), got.float()), sqnr(bf16.float(), got.float())
    # measured: 46.3 dB against the fp8 conversion (the bf16 ops' own rounding, amplified by each quantisation),
    # 39.6 dB against its fp8 linears run in bf16
    assert to_fp8 >= REFERENCE_MIN_SQNR_DB and to_fp8 >= to_bf16 + 5.0, (
        f"onnx.reference: {to_fp8:.1f} dB to the fp8 conversion (>= {REFERENCE_MIN_SQNR_DB}), {to_bf16:.1f} dB to its "
        "fp8 linears in bf16 (5 dB lower expected)")
    assert math.isclose(result.sqnr_db, to_fp8, rel_tol=1e-9), (result.sqnr_db, to_fp8)


def test_what_cannot_be_exported_is_refused_in_one_line_before_anything_is_written(decoder_export, tmp_path):
    conv, _ = decoder_export
    path = tmp_path / "out" / "m.onnx"
    cases = {
        "fp16": (dict(precision="fp16"), "exports bf16 with float8 Q/DQ GEMMs, not fp16"),
        "torchscript": (dict(exporter="torchscript"), "the TorchScript exporter cannot write the fp8 GEMMs"),
        "opset": (dict(opset=19), "the fp8 export needs opset >= 20"),
    }
    for name, (kwargs, words) in cases.items():
        with pytest.raises(Fp8OnnxRefused) as info:
            conv.export_onnx(path, compare_size=False, **kwargs)
        assert info.value.exit_code == EXIT_BAD_INPUT and words in str(info.value) and "\n" not in str(info.value), name
    assert not path.parent.exists()


_MODEL_FILE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(128, 64)
        self.up, self.mid, self.down = nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 64)
        self.lm_head = nn.Linear(64, 128)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.lm_head(self.down(torch.relu(self.mid(torch.relu(self.up(h))))))


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randint(0, 128, (2, 16)),)
'''


def test_cli_writes_and_verifies_the_fp8_onnx_and_refuses_blockwise(tmp_path, capfd):
    from converter.cli.main import main

    model_file = tmp_path / "net.py"
    model_file.write_text(_MODEL_FILE, encoding="utf-8")
    gates = tmp_path / "gates.toml"
    gates.write_text("[settings]\nfp8_min_flops_per_token = 4096\n", encoding="utf-8")
    out = tmp_path / "out"
    code = main([str(model_file), "--precision", "fp8", "--rules", str(gates), "--onnx", "--out", str(out), "--json",
                 "--no-measure"])
    stdout, err = capfd.readouterr()
    assert code == 0, err
    payload = json.loads(stdout)["onnx"]
    assert payload["ok"] and payload["checks"]["reference_match"] and payload["checks"]["fp8_qdq"], payload["notes"]
    assert payload["fp8"]["nodes"] == ["mid", "down"] and payload["fp8"]["recipe"] == "tensorwise", payload["fp8"]
    model = onnx.load(str(out / "model.onnx"))
    assert [len(_nodes(model, op)) for op in ("QuantizeLinear", "DequantizeLinear")] == [2, 4]
    assert {p.key: p.value for p in model.metadata_props}["mpconvert.fp8_recipe"] == "tensorwise"

    block = tmp_path / "block.toml"
    block.write_text(textwrap.dedent('''\
        [settings]
        fp8_min_flops_per_token = 4096
        fp8_recipe = "blockwise"
        '''), encoding="utf-8")
    code = main([str(model_file), "--precision", "fp8", "--rules", str(block), "--onnx", "--out", str(tmp_path / "bad"),
                 "-q", "--no-measure"])
    _, err = capfd.readouterr()
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1, (code, err)
    assert "fp8 recipe 'blockwise' cannot be exported to ONNX" in err and 'fp8_recipe = "tensorwise"' in err, err
    assert not (tmp_path / "bad").exists()


def test_the_reference_evaluator_reproduces_the_float8_rounding():
    """The reference evaluator's saturating float8e4m3fn cast rounds as torch's does (ties to even, 448 at most)."""
    values = np.array([17.0, 18.0, 19.0, 136.0, 152.0, 464.0, 1e6, -1e6, 0.0], dtype=np.float32)
    got = numpy_helper.saturate_cast(values, dtype=onnx.helper.tensor_dtype_to_np_dtype(E4M3)).astype(np.float32)
    want = torch.clamp(torch.from_numpy(values), -448, 448).to(torch.float8_e4m3fn).float().numpy()
    assert got.tolist() == want.tolist() == [16.0, 18.0, 20.0, 128.0, 160.0, 448.0, 448.0, -448.0, 0.0], (got, want)
