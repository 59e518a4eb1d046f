"""FP8 ONNX export on non-finite values (issue 44 item 8): inf in the example input or NaN in a weight is bad
input, one line naming it, exit 2, nothing written. On the old code both were exit 1, "please report this bug"
(model.py's bit-exact check compared NaN with NaN), and the API wrote on until verification failed.
"""
from __future__ import annotations

import pytest
import torch
from test_cli import assert_bad_input, run

import converter
from converter.export.onnx_fp8 import Fp8OnnxRefused, fp8_nodes

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

#: every linear in fp8 (no size, first or last gate): the export writes float8 Q/DQ for both
ALL_FP8 = "[settings]\nfp8_min_flops_per_token = 0\nfp8_keep_first = false\nfp8_keep_last = false\n"

_MODEL = '''
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    if POISON == "weight":
        with torch.no_grad():
            model[2].weight[3, 7] = float("nan")
    return model


def example_inputs():
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(1))
    if POISON == "input":
        x[5, 9] = float("inf")
    return (x,)
'''


@pytest.mark.parametrize("poison, needles", [
    ("input", ("the example input args[0]", "inf first, at [5, 9]", "finite values")),
    ("weight", ("the parameter '2.weight'", "nan first, at [3, 7]", "repair the weights")),
])
def test_the_cli_refuses_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capfd, poison, needles):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text(f"POISON = {poison!r}\n" + _MODEL)
    (tmp_path / "fp8.toml").write_text(ALL_FP8)
    code, out, err = run(capfd, "m.py", "--precision", "fp8", "--rules", "fp8.toml", "--onnx", "--no-measure",
                         "--out", tmp_path / "out")
    assert_bad_input(code, out, err, *needles)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("__")) == ["fp8.toml", "m.py"]


def test_the_api_refuses_before_writing_the_file(tmp_path):
    rules = tmp_path / "fp8.toml"
    rules.write_text(ALL_FP8)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    x = torch.randn(32, 256)
    conv = converter.convert(model, (x,), precision="fp8", rules=[rules])
    assert len(fp8_nodes(conv.module)) == 2  # both linears fp8: the refusal is the fp8 export's
    conv.example_inputs[0][0][0, 0] = float("nan")  # the conversion's example input, poisoned after converting
    with pytest.raises(Fp8OnnxRefused, match=r"args\[0\] holds 1 non-finite value\(s\) \(nan first, at \[0, 0\]\)") as info:
        conv.export_onnx(tmp_path / "model.onnx")
    assert info.value.exit_code == 2
    assert not (tmp_path / "model.onnx").exists()


def test_an_inf_mask_fill_in_a_buffer_is_not_refused(tmp_path):
    """Buffers may hold -inf on purpose (an additive attention mask): only NaN is refused there."""
    from converter.export.onnx_fp8 import check_fp8_finite

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)
            self.register_buffer("mask", torch.triu(torch.full((16, 16), float("-inf")), 1))

    module = Masked()
    check_fp8_finite(module, ((torch.randn(2, 16),), {}))
    module.mask[0, 0] = float("nan")
    with pytest.raises(Fp8OnnxRefused, match="the buffer 'mask' holds 1 non-finite"):
        check_fp8_finite(module, ((torch.randn(2, 16),), {}))
