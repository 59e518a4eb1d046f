"""The CPU GEMM kernels (issue 32): half GEMMs as fp32 GEMMs on upcast operands where this CPU's half GEMM is
slower (converter/kernels/upcast.py, converter/passes/cpu_gemm.py).

What is checked: the kernels compute exactly "fp32 GEMM of the upcast operands, rounded once" (bit-equal to that
definition), their gradients match the fp32 reference as closely as the native half kernels do, they save only
half tensors for backward, a conversion for the CPU retargets exactly its half linear/matmul calls (FX and
torch.export graphs, an HF model with the library's defaults) with the choice in the report, its outputs and
gradients agree with the native conversion's, and model.py carries the kernels and runs with torch only.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import converter
from converter.export.model_py import generate_model_source
from converter.export.weights import write_weights
from converter.ir.meta import META_DECISION
from converter.kernels.upcast import UpcastLinear, upcast_linear, upcast_matmul
from converter.passes import cpu_gemm
from tests.helpers import sqnr


def _saved_dtypes(fn) -> list:
    """The dtypes autograd saves while ``fn()`` runs its forward."""
    seen: list = []

    def pack(t):
        seen.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_linear_is_the_fp32_gemm_rounded_once_and_saves_half(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 64, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(48, 64, generator=g) / 8).to(dtype).requires_grad_()
    b = torch.randn(48, generator=g).to(dtype).requires_grad_()
    saved = _saved_dtypes(lambda: upcast_linear(x, w, b))
    assert saved == [dtype, dtype], saved  # x and W, in their own dtype: no fp32 copy is kept
    y = upcast_linear(x, w, b)
    want = F.linear(x.detach().float(), w.detach().float(), b.detach().float()).to(dtype)
    assert y.dtype == dtype and torch.equal(y, want), (y.float() - want.float()).abs().max()
    gy = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(gy)
    grads = [t.grad for t in (x, w, b)]
    assert torch.equal(grads[0], (gy.float() @ w.detach().float()).to(dtype))
    assert torch.equal(grads[1], (gy.float().reshape(-1, 48).t() @ x.detach().float().reshape(-1, 64)).to(dtype))
    assert torch.equal(grads[2], gy.float().reshape(-1, 48).sum(0).to(dtype))
    # against fp32 math, the upcast kernel is as close as the native half kernel (both round once from fp32 sums)
    ref = [t.detach().float().requires_grad_() for t in (x, w, b)]
    F.linear(*ref).backward(gy.float())
    native = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    F.linear(*native).backward(gy)
    for name, got, nat, r in zip(("grad_input", "grad_weight", "grad_bias"), grads, (t.grad for t in native), (t.grad for t in ref)):
        mine, theirs = sqnr(r, got.float()), sqnr(r, nat.float())
        assert got.dtype == dtype and mine >= theirs - 0.5 and mine >= 40, (name, mine, theirs)


def test_upcast_matmul_broadcasts_and_sums_the_gradients_back():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 4, 16, 8, generator=g).bfloat16().requires_grad_()
    b = torch.randn(4, 8, 16, generator=g).bfloat16().requires_grad_()  # broadcast over a's first dimension
    out = upcast_matmul(a, b)
    assert torch.equal(out, torch.matmul(a.detach().float(), b.detach().float()).bfloat16())
    gy = torch.randn(out.shape, generator=g).bfloat16()
    out.backward(gy)
    a32, b32 = (t.detach().float().requires_grad_() for t in (a, b))
    torch.matmul(a32, b32).backward(gy.float())
    assert a.grad.shape == a.shape and b.grad.shape == b.shape and a.grad.dtype == b.grad.dtype == torch.bfloat16
    for name, got, want in (("a", a.grad, a32.grad), ("b", b.grad, b32.grad)):
        assert sqnr(want, got.float()) >= 45, (name, sqnr(want, got.float()))
    assert _saved_dtypes(lambda: upcast_matmul(a, b)) == [torch.bfloat16] * 2


def test_anything_but_two_operands_of_one_half_dtype_runs_the_plain_op():
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    assert torch.equal(upcast_linear(x, w), F.linear(x, w))  # fp32: plain, bit for bit
    with pytest.raises(RuntimeError, match="same dtype"):  # mixed dtypes: F.linear's own error, not a silent upcast
        upcast_linear(x.bfloat16(), w)
    v = torch.randn(8).bfloat16()
    assert torch.equal(upcast_matmul(w.bfloat16(), v), torch.matmul(w.bfloat16(), v))  # a 1-D operand: plain
    assert upcast_linear(x.bfloat16(), w.bfloat16().requires_grad_()).grad_fn.name().startswith(UpcastLinear.__name__)


def test_the_choice_follows_the_measurement():
    assert cpu_gemm.upcast_wanted(4.5)[0] is True and "4.5x" in cpu_gemm.upcast_wanted(4.5)[1]
    assert cpu_gemm.upcast_wanted(1.1)[0] is False
    assert cpu_gemm.upcast_wanted(None) == (False, "not measured (device_profile=None): the half GEMMs stay native")
    assert cpu_gemm.upcast_wanted(None, True) == (True, "forced on (ConvertOptions.upcast_half_gemms=True)")
    assert cpu_gemm.upcast_wanted(4.5, False) == (False, "forced off (ConvertOptions.upcast_half_gemms=False)")


def test_device_cpu_reads_the_profile_not_the_machine(monkeypatch):
    """``device="cpu"`` chooses its GEMM kernels and attention from the profile's figures, the same on any machine."""
    from converter.numerics.profile import DeviceProfile

    def profile(bf16: float) -> DeviceProfile:
        return DeviceProfile(cpu="Test CPU", cores=2, torch_version="2.x",
                             matmul_seconds=(("fp32", 1e-4), ("bf16", bf16 * 1e-4), ("fp16", 1e-4)))

    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 16, 64)
    monkeypatch.setattr(cpu_gemm, "MIN_GEMM_FLOPS", 0)  # every GEMM call large enough: the upcast kernels run
    for bf16, upcast in ((4.5, True), (1.0, False)):
        conv = converter.convert(model, (x,), precision="bf16", device="cpu", device_profile=profile(bf16))
        [choice] = [c for c in conv.report.to_dict()["lowering"] if c["lowering"] == "upcast_gemm"]
        assert f"measured {bf16:.1f}x" in choice["why"] or f"measured {bf16:.2f}x" in choice["why"], choice
        assert ("upcast_attention" in _targets(conv.module)) is upcast, _targets(conv.module)
        assert ("upcast_linear" in _targets(conv.module)) is upcast and conv.report.records.advice.text is None
        assert conv.report.to_dict()["device_profile"]["matmul_seconds"]["bf16"] == bf16 * 1e-4


class Block(nn.Module):
    """Pre-norm attention block (SDPA, lowered to matmul · softmax · matmul on the CPU) and an MLP."""

    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.out(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _convert(model, x, upcast: bool, monkeypatch, **options):
    monkeypatch.setattr(cpu_gemm, "MIN_GEMM_FLOPS", 0)  # the test models are small: every GEMM call is upcast
    return converter.convert(model, (x,), precision="bf16", device="cpu", upcast_half_gemms=upcast, **options)


def _targets(gm) -> list:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]


def _grads(module, x) -> dict:
    module.zero_grad()
    module(x).float().pow(2).mean().backward()
    return {name: p.grad.float().clone() for name, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_cpu_conversion_runs_every_half_gemm_upcast_with_the_choice_in_the_report(tracer, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(3, 10, 64)
    conv = _convert(model, x, True, monkeypatch, tracer=tracer)
    native = _convert(model, x, False, monkeypatch, tracer=tracer)
    targets = _targets(conv.module)
    # 4 linears per block, and the attention in fp32 arithmetic (not lowered to bf16 matmuls); nothing else is a GEMM
    assert targets.count("upcast_linear") == 8 and targets.count("upcast_attention") == 2, targets
    assert not {"linear", "linear.default", "matmul", "matmul.default", "upcast_matmul"} & set(targets), targets
    assert _targets(native.module).count("upcast_linear") == 0 and "upcast_attention" not in _targets(native.module)
    assert _targets(native.module).count("matmul") == 4  # native: the bf16 lowering, 2 matmuls per attention
    lowering = conv.report.to_dict()["lowering"]
    [choice] = [c for c in lowering if c["lowering"] == "upcast_gemm"]
    assert choice["chosen"] and choice["node"] == "8 bf16 GEMM call(s)" and "forced on" in choice["why"], choice
    assert [c["lowering"] for c in lowering].count("upcast_attention") == 2, lowering
    assert "2 attention call(s) in fp32 arithmetic" in conv.report.to_markdown()
    [off] = [c for c in native.report.to_dict()["lowering"] if c["lowering"] == "upcast_gemm"]
    assert not off["chosen"], off
    noted = [n for n in conv.module.graph.nodes if n.op == "call_function" and _targets_name(n) in ("upcast_linear", "upcast_matmul")]
    assert all(any(stage == "lower" and "upcast" in text for stage, text in n.meta[META_DECISION].notes) for n in noted)
    assert len(noted) == 8, len(noted)
    with torch.no_grad():
        out, want = conv.module(x), native.module(x)
    assert out.dtype == want.dtype and sqnr(want.float(), out.float()) >= 45, sqnr(want.float(), out.float())
    mine, theirs = _grads(conv.module, x), _grads(native.module, x)
    assert mine.keys() == theirs.keys() and len(mine) == 2 * 12  # 4 linears' weights and biases, 2 norms', per block
    worst = min(sqnr(theirs[k], mine[k]) for k in mine)  # a sign flip or a dropped term is far under this
    assert worst >= 30, {k: round(sqnr(theirs[k], mine[k]), 1) for k in mine}


def _targets_name(node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def test_the_upcast_conversion_saves_no_more_than_the_native_one(monkeypatch):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 16, 64)
    modules = [_convert(model, x, flag, monkeypatch, opt_level="O2").module for flag in (True, False)]
    sizes = []
    for module in modules:
        saved: list = []

        def pack(t, saved=saved):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x)
        sizes.append(sum(saved))
    assert sizes[0] <= sizes[1], sizes


def test_an_hf_model_with_library_defaults_on_a_padded_batch(monkeypatch):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)  # SDPA attention and use_cache: the library's defaults
    ids = torch.randint(0, 128, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    example = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    monkeypatch.setattr(cpu_gemm, "MIN_GEMM_FLOPS", 0)
    conv = converter.convert(model, example, precision="bf16", device="cpu", upcast_half_gemms=True)
    native = converter.convert(model, example, precision="bf16", device="cpu", upcast_half_gemms=False)
    assert _targets(conv.module).count("upcast_linear") >= 2 * 7, _targets(conv.module)
    grads = []
    for module in (conv.module, native.module):
        module.zero_grad()
        out = module(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads.append({n: p.grad.float().clone() for n, p in module.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    worst = min(sqnr(grads[1][k], grads[0][k]) for k in grads[0] if grads[1][k].abs().sum() > 0)
    assert worst >= 25, worst


_STANDALONE = textwrap.dedent(
    """
    import importlib.util, sys
    if importlib.util.find_spec("converter") is not None:
        sys.modules["converter"] = None
    sys.modules["safetensors"] = None
    import torch
    spec = importlib.util.spec_from_file_location("emitted_upcast", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.load()
    x = torch.load(sys.argv[2], weights_only=True)
    out = model(x)
    out.float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    torch.save({"out": out.detach(), "grads": len(grads),
                "modules": sorted(m for m in sys.modules if m.startswith("converter") and sys.modules[m] is not None)},
               sys.argv[3])
    """
)


def run_model_py_alone(conv, x, tmp_path, env_drop: tuple = ()) -> dict:
    """Emit ``conv``'s model.py and weights into ``tmp_path`` and run forward + backward on ``x`` in a child Python
    that cannot import converter or safetensors (``env_drop``: environment variables the child does not get);
    returns what the child saved: ``out``, the number of ``grads``, the converter ``modules`` it imported."""
    source = generate_model_source(conv)
    (tmp_path / "model.py").write_text(source.code, encoding="utf-8")
    write_weights(source.own, tmp_path, dtypes=source.dtypes)
    torch.save(x, tmp_path / "x.pt")
    (tmp_path / "run.py").write_text(_STANDALONE, encoding="utf-8")
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", *env_drop)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    proc = subprocess.run([sys.executable, "-I", str(tmp_path / "run.py"), str(tmp_path / "model.py"), str(tmp_path / "x.pt"),
                           str(tmp_path / "out.pt")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp_path / "out.pt", weights_only=True)


def test_model_py_carries_the_kernels_and_runs_with_only_torch(monkeypatch, tmp_path):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 16, 64)
    conv = _convert(model, x, True, monkeypatch)
    code = generate_model_source(conv).code
    assert "class UpcastLinear(torch.autograd.Function):" in code and "from converter" not in code
    assert code.count("upcast_linear(") >= 4
    got = run_model_py_alone(conv, x, tmp_path)
    assert got["modules"] == [] and got["grads"] == len(list(model.parameters())), got
    with torch.no_grad():
        want = conv.module(x)
    assert torch.equal(got["out"], want), (got["out"] - want).abs().max()


def test_the_benchmark_counts_the_kernels_upcasts_apart_from_the_graphs_casts(monkeypatch):
    from benchmarks.common import CastCounter

    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 16, 64)
    counts = {}
    for flag in (True, False):
        module = _convert(model, x, flag, monkeypatch).module
        with CastCounter() as counter:
            module(x).float().sum().backward()
        counts[flag] = (counter.totals(kernel=False), counter.totals(kernel=True))
    assert counts[True][0] == counts[False][0], counts  # the graph's own casts are the same
    # forward: 4 linears upcast x and W, 2 matmuls both operands, one rounding each; backward: more of the same
    assert counts[False][1] == (0, 0) and counts[True][1][0] >= 6 * 3, counts


def test_the_onnx_export_writes_plain_half_matmuls(monkeypatch, tmp_path):
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 16, 64)
    conv = _convert(model, x, True, monkeypatch)
    result = conv.export_onnx(tmp_path / "m.onnx")
    # the kernels' fp32 upcasts are not traced into the file: the casts are the conversion's own, no round trips
    assert result.ok and result.cast_count == result.expected_casts == 4 and result.cast_pairs == [], result.notes
    assert _targets(conv.module).count("upcast_linear") == 4  # the conversion itself is untouched


def test_gemms_below_the_size_bound_stay_native(monkeypatch):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 16, 64)  # 32 tokens: qkv 2·32·64·192, up 2·32·64·256 FLOPs, ...
    # between the MLP's (2·32·64·256 = 1.05 MFLOP) and the attention projections' (out: 0.26 MFLOP)
    monkeypatch.setattr(cpu_gemm, "MIN_GEMM_FLOPS", 10**6)
    conv = converter.convert(model, (x,), precision="bf16", device="cpu", upcast_half_gemms=True)
    upcast = {n.name for n in conv.module.graph.nodes if n.op == "call_function" and _targets_name(n) in ("upcast_linear", "upcast_matmul")}
    # qkv: 2·32·64·192 = 0.79 MFLOP, out: 0.26, up and down: 1.05 each; the attention matmuls 2·16·16·16 per matrix
    assert upcast == {"up", "down"}, upcast
    [choice] = [c for c in conv.report.to_dict()["lowering"] if c["lowering"] == "upcast_gemm"]
    # qkv and out (the attention runs in fp32 arithmetic, not as bf16 matmuls)
    assert choice["node"] == "2 bf16 GEMM call(s)" and "2 smaller GEMM call(s) (< 1 MFLOP per matrix product) stay native" in choice["why"], choice
    flops = {n.name: f for n in conv.module.graph.nodes if n.name in upcast
             for f in [float(_note(n).split(" MFLOP")[0].split("(")[-1])] }
    assert flops == {"up": 1.05, "down": 1.05}, flops


def _note(node) -> str:
    return next(text for stage, text in node.meta[META_DECISION].notes if stage == "lower" and "upcast" in text)


def _profile_with_crossover(crossover):
    from converter.numerics.profile import DeviceProfile

    return DeviceProfile(cpu="Test CPU", cores=2, torch_version="2.x",
                         matmul_seconds=(("fp32", 1e-4), ("bf16", 4.5e-4), ("fp16", 1e-4)),
                         gemm_crossover_flops=(("bf16", crossover), ("fp16", None)))


@pytest.mark.parametrize("device", ["cpu", None])
def test_the_profiles_measured_crossover_sets_which_gemms_get_the_upcast_kernels(device):
    """The size gate is the profile's measured crossover, not a constant from another CPU: with the crossover at
    1 MFLOP exactly the MLP's two GEMMs (1.05 MFLOP each) get the kernels; without one in the profile, none of this
    small block's GEMMs do (the default gate, 32 MFLOP)."""
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 16, 64)
    kernel = "upcast_linear" if device == "cpu" else "dispatch_linear"
    lowering = "upcast_gemm" if device == "cpu" else "dispatch_gemm"
    for crossover, expected in ((10**6, {"up", "down"}), (None, set())):
        conv = converter.convert(model, (x,), precision="bf16", device=device, device_profile=_profile_with_crossover(crossover))
        gemms = {n.name for n in conv.module.graph.nodes if n.op == "call_function" and _targets_name(n) == kernel}
        assert gemms == expected, (crossover, gemms)
        [choice] = [c for c in conv.report.to_dict()["lowering"] if c["lowering"] == lowering]
        gate = "1" if crossover else "32"
        assert f"(< {gate} MFLOP per matrix product) stay native" in choice["why"], choice
        assert conv.report.to_dict()["device_profile"]["gemm_crossover_flops"] == {"bf16": crossover, "fp16": None}
    torch.testing.assert_close(conv.module(x).float(), model(x), atol=0.1, rtol=0.05)


def test_a_profile_keeps_its_crossover_through_a_file_and_older_files_load(tmp_path):
    from converter.numerics.profile import DeviceProfile, DeviceProfileError

    profile = _profile_with_crossover(524288)
    assert DeviceProfile.load(profile.save(tmp_path / "p.json")) == profile
    assert profile.min_gemm_flops("bf16") == 524288 and profile.min_gemm_flops("fp16") is None
    old = profile.to_dict()
    del old["gemm_crossover_flops"]  # a profile saved before the crossover was measured: the default gate
    loaded = DeviceProfile.from_dict(old)
    assert loaded.gemm_crossover_flops == () and cpu_gemm.profile_gate(loaded, "bf16") is None
    for bad in ({"bf16": -3}, {"bf16": 1.5}, {"fp32": 10}, [1]):
        with pytest.raises(DeviceProfileError, match="gemm_crossover_flops"):
            DeviceProfile.from_dict({**old, "gemm_crossover_flops": bad})


def test_the_crossover_is_measured_where_upcast_first_beats_native_for_good(monkeypatch):
    """gemm_crossover_flops: the smallest rung of the ladder from which the upcast kernel wins at every larger one."""
    from converter.kernels import upcast as kernels

    def fake(wins):
        def seconds(kernel, m, k, n, dtype):
            upcast_wins = wins[kernels.GEMM_LADDER.index((m, k, n))]
            return (1.0 if upcast_wins else 3.0) if kernel == kernels.UpcastLinear.apply else 2.0
        return seconds

    flops = [2 * m * k * n for m, k, n in kernels.GEMM_LADDER]
    for wins, expected in (((False, True, False, True), flops[3]), ((False, False, True, True), flops[2]),
                           ((True,) * 4, flops[0]), ((False,) * 4, None)):
        monkeypatch.setattr(kernels, "_linear_seconds", fake(wins))
        assert kernels.gemm_crossover_flops(torch.bfloat16) == expected, wins
