"""MoE expert GEMMs whose results are read in fp32 keep fp32 results (converter/passes/grouped_gemm.py).

The GPT-OSS-style decoder of ``test_zoo_seams_numerics`` (experts with biases added in place, a clamped SwiGLU and
the routing-weight sum in fp32): its 4 half ``grouped_mm_fallback`` calls become ``upcast_grouped_mm`` calls, their
in-place bias adds run in fp32 and the 4 casts back to fp32 go. Mixtral's gate/up result feeds half ops: its calls
keep the library op (``test_library_ops``)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from helpers import sqnr
from test_zoo_seams_numerics import FAMILIES

import converter
from converter.ir.meta import META_CAST, META_DECISION, META_INFO
from converter.kernels.upcast import upcast_grouped_mm

transformers = pytest.importorskip("transformers")


def _library_op():
    import transformers.integrations.moe  # noqa: F401 (registers torch.ops.transformers.grouped_mm_fallback)

    return torch.ops.transformers.grouped_mm_fallback


def _operands():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, generator=g).bfloat16()
    w = torch.randn(3, 16, 8, generator=g).bfloat16()
    return x, w, torch.tensor([3, 3, 8])  # expert 1 empty, rows 8: past the last group


def test_the_kernel_keeps_the_exact_products_in_fp32_and_saves_half():
    x, w, offs = _operands()
    exact = _library_op()(x.double(), w.double(), offs)
    saved: list[torch.Tensor] = []
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = upcast_grouped_mm(xg, wg, offs)
    assert out.dtype == torch.float32
    # 16 products of two bf16 numbers, each exact in fp32: the fp32 sum is within 16 fp32 roundings of the exact one
    err = (out.double() - exact).abs().max().item()
    assert err <= 16 * 2 ** -24 * exact.abs().max().item(), err
    assert torch.equal(out[8:], torch.zeros(2, 8)), "rows past the last group are zero"
    half = _library_op()(x, w, offs).double()
    assert sqnr(exact, out) > sqnr(exact, half) + 10, (sqnr(exact, out), sqnr(exact, half))  # no rounding to bf16
    assert [t.dtype for t in saved] == [torch.bfloat16, torch.bfloat16], [(t.dtype, tuple(t.shape)) for t in saved]
    # gradients: fp32 GEMMs on the upcast operands, rounded once to bf16, against the fp32 op on the same operands
    gy = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
    out.backward(gy)
    x32, w32 = x.float().requires_grad_(), w.float().requires_grad_()
    _library_op()(x32, w32, offs).backward(gy)
    assert xg.grad.dtype == wg.grad.dtype == torch.bfloat16
    assert torch.equal(xg.grad, x32.grad.bfloat16()) and torch.equal(wg.grad, w32.grad.bfloat16())
    assert torch.equal(wg.grad[1], torch.zeros(16, 8, dtype=torch.bfloat16)), "the empty expert gets no gradient"


def test_fp32_operands_and_torchscript_run_the_library_ops_math():
    x, w, offs = _operands()
    x, w = x.float(), w.float()
    assert torch.equal(upcast_grouped_mm(x, w, offs), _library_op()(x, w, offs))
    scripted = torch.jit.script(upcast_grouped_mm)  # TorchScript compiles only the plain branch
    assert torch.equal(scripted(x, w, offs), _library_op()(x, w, offs))


@pytest.fixture(scope="module")
def gpt_oss():
    model, kwargs, _ = FAMILIES["gpt_oss"]()
    return model, kwargs, converter.convert(model, ((), kwargs), precision="bf16")


def test_gpt_oss_expert_results_stay_fp32_with_their_bias_adds(gpt_oss):
    _, _, conv = gpt_oss
    nodes = list(conv.module.graph.nodes)
    experts = [n for n in nodes if n.meta.get(META_INFO) is not None and n.meta[META_INFO].op == "grouped_mm"]
    assert [n.target for n in experts] == [upcast_grouped_mm] * 4, [str(n.target) for n in experts]
    for node in experts:
        decision = node.meta[META_DECISION]
        assert decision.precision == "bf16" and str(decision.rule) == "default.toml:[op].grouped_mm", decision
        assert "upcast_grouped_mm" in decision.full_reason, decision.full_reason
        bias_add = next(iter(node.users))
        assert str(bias_add.target) == "aten.add_.Tensor" and bias_add.meta[META_DECISION].precision == "fp32", bias_add
        assert not any(META_CAST in u.meta for u in bias_add.users), [u.name for u in bias_add.users]
    widened = [c for c in conv.report.records.lowering.lowering if c["lowering"] == "widen_grouped_gemm"]
    assert [c["node"] for c in widened] == [n.name for n in experts], widened
    assert all(c["why"].endswith("1 cast(s) to fp32 removed") for c in widened), widened
    assert not conv.report.records.lowering.library_ops, "no library op is left in the graph"
    rows = {r["name"]: r for r in conv.report.nodes}
    assert all(rows[n.name]["precision"] == "bf16" for n in experts)
    assert conv.report.summary["half_flop_fraction"] == 1.0


def test_gpt_oss_model_py_needs_no_transformers(gpt_oss, tmp_path):
    """The graph calls no library op now: model.py carries the kernel and runs where transformers is not installed,
    bit-identical to conv.module."""
    _, kwargs, conv = gpt_oss
    from converter.export.emit import emit

    emit(conv, tmp_path / "out")
    source = (tmp_path / "out" / "model.py").read_text()
    assert "def upcast_grouped_mm" in source and "torch.ops.transformers" not in source
    spec = importlib.util.spec_from_file_location("gpt_oss_emitted", tmp_path / "out" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.no_grad():
        assert torch.equal(module.load()(**kwargs)["logits"], conv.module(**kwargs)["logits"])
    torch.save(kwargs, tmp_path / "inputs.pt")
    blocker = ("import sys\nclass _Block:\n    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('transformers', 'converter'):\n            raise ImportError('blocked')\n"
               "sys.meta_path.insert(0, _Block())\n")
    script = (blocker + "import importlib.util, torch\n"
              f"spec = importlib.util.spec_from_file_location('m', {str(tmp_path / 'out' / 'model.py')!r})\n"
              "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
              f"kw = torch.load({str(tmp_path / 'inputs.pt')!r}, weights_only=True)\n"
              "out = m.load()(**kw)['logits']; out.float().sum().backward(); print('OK', out.dtype)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK torch.float32"), run.stderr[-1500:]
