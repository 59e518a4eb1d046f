"""Patterns model.py must emit (issue 30, item 5): parametrized weights, complex tensors, and a strict
``load(weights=)``.

Two conversions for the module (one model with four parametrizations, one FFT filter model with
complex tensors); one torch-only subprocess runs both emitted model.py files (train-mode forward and
backward, eval-mode forward) against ``conv.module``, bit for bit.
"""
from __future__ import annotations

import copy
import json
import os
import struct
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import converter
from converter.export.emit import EmitError, emit, generate_model_source, import_file
from converter.ir.meta import META_CAST, META_DECISION, META_INFO
from converter.passes.verify import ForwardCheckError
from tests.helpers import assert_half_ran, sqnr


class _Symmetric(nn.Module):
    """A user parametrization: the weight is symmetric (its upper triangle, mirrored)."""

    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


class Parametrized(nn.Module):
    """weight_norm on a conv, spectral_norm, orthogonal and a user parametrization on linears."""

    def __init__(self):
        super().__init__()
        self.conv = parametrizations.weight_norm(nn.Conv1d(4, 16, 3, padding=1))
        self.sn = parametrizations.spectral_norm(nn.Linear(16, 16))
        self.orth = parametrizations.orthogonal(nn.Linear(16, 16))
        self.sym = nn.Linear(16, 16)
        parametrize.register_parametrization(self.sym, "weight", _Symmetric())
        self.head = nn.Linear(16, 8)

    def forward(self, x):  # x: (batch, 4, time)
        h = torch.relu(self.conv(x)).transpose(1, 2)
        h = torch.tanh(self.sn(h))
        h = torch.relu(self.orth(h)) + self.sym(h)
        return self.head(h)


class SpectralFilter(nn.Module):
    """A GFNet/FNO-style global filter: rfft over time, times a complex64 weight (a parameter, a
    complex buffer and a real parameter seen through view_as_complex), irfft back."""

    def __init__(self, width: int = 16, length: int = 32):
        super().__init__()
        modes = length // 2 + 1
        self.length = length
        self.inp = nn.Linear(4, width)
        self.filter = nn.Parameter(torch.randn(width, modes, dtype=torch.complex64) * 0.2)
        self.register_buffer("window", torch.polar(torch.ones(modes), torch.linspace(0, 1, modes)))
        self.gain = nn.Parameter(torch.randn(width, modes, 2) * 0.2)
        self.out = nn.Linear(width, 4)

    def forward(self, x):  # x: (batch, time, 4)
        h = self.inp(x).transpose(1, 2)
        spectrum = torch.fft.rfft(h, dim=-1)
        spectrum = spectrum * self.filter * self.window + spectrum * torch.view_as_complex(self.gain)
        h = torch.fft.irfft(spectrum, n=self.length, dim=-1) + torch.view_as_real(spectrum).sum(-1)[..., :1]
        return self.out(torch.relu(h.transpose(1, 2)))


def _build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Parametrized() if name == "param" else SpectralFilter()


def _example(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 4, 24, generator=g) if name == "param" else torch.randn(3, 32, 4, generator=g)


class _Lazy(dict):
    """name -> value, computed on first use (a failing conversion fails only the tests that use it)."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, name):
        self[name] = value = self._make(name)
        return value


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (original fp32 model, conversion, output dir)."""
    base = tmp_path_factory.mktemp("patterns")

    def make(name):
        model = _build(name)
        original = copy.deepcopy(model)
        conv = converter.convert(model, (_example(name),))
        return original, conv, emit(conv, base / name)

    return _Lazy(make)


def _train_step(model: nn.Module, x: torch.Tensor):
    """Train-mode forward and backward: (output, gradients by name, buffers by name after the step)."""
    model.train()
    out = model(x)
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}


_STANDALONE = textwrap.dedent(
    """
    import importlib.util, sys
    if importlib.util.find_spec("converter") is not None:  # installed into the venv: block it outright
        sys.modules["converter"] = None
    sys.modules["safetensors"] = None  # model.py reads its weights with torch alone
    import torch
    try:
        import converter  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("converter imported")
    results = {}
    for name, (model_py, x) in torch.load(sys.argv[1], weights_only=True).items():
        spec = importlib.util.spec_from_file_location("emitted_" + name, model_py)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.load()
        model.train()
        out = model(x)
        out.float().square().mean().backward()
        results[name + ".out"] = out.detach()
        results[name + ".grads"] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results[name + ".buffers"] = dict(model.named_buffers())
        model.eval()
        with torch.no_grad():
            results[name + ".eval"] = model(x)
        results[name + ".modules"] = sorted(n for n in sys.modules if n.split(".")[0] == "converter" and sys.modules[n] is not None)
    torch.save(results, sys.argv[2])
    """
)


@pytest.fixture(scope="module")
def standalone(converted, tmp_path_factory):
    """name -> what the emitted model.py computes in a subprocess where only torch is importable (-I,
    converter blocked): train-mode output, gradients and buffers after one step, then eval output."""
    work = tmp_path_factory.mktemp("standalone")
    (work / "run.py").write_text(_STANDALONE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}

    def make(name):
        torch.save({name: (str(converted[name][2] / "model.py"), _example(name))}, work / f"{name}.pt")
        proc = subprocess.run([sys.executable, "-I", str(work / "run.py"), str(work / f"{name}.pt"), str(work / f"{name}.out.pt")],
                              cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return torch.load(work / f"{name}.out.pt", weights_only=True)

    return _Lazy(make)


# ---------------------------------------------------------------------------------------------
# parametrizations


def test_parametrizations_are_computed_in_the_graph_from_the_original_parameters(converted):
    _original, conv, out = converted["param"]
    gm = conv.module
    names = {n for n, _ in gm.named_parameters()}
    assert {"conv.parametrizations.weight.original0", "conv.parametrizations.weight.original1",
            "sn.parametrizations.weight.original", "orth.parametrizations.weight.original",
            "sym.parametrizations.weight.original"} <= names, sorted(names)
    leaves = [n.target for n in gm.graph.nodes if n.op == "call_module" and n.target != "_guards_fn"]
    assert not leaves, f"parametrizations kept as opaque leaves (fx) instead of traced: {leaves}"
    assert conv.tracer == "export", conv.tracer
    # every op a parametrization runs is fp32 by the ParametrizationList rule (spectral_norm's power
    # iteration writes its u/v buffers with out=: a half copy of them would never be updated)
    inside = [n for n in gm.graph.nodes if META_DECISION in n.meta and n.meta[META_INFO].kind == "compute"
              and any(t == "ParametrizationList" for _p, t in n.meta[META_INFO].module_stack)]
    assert len(inside) >= 10, len(inside)
    wrong = [(n.name, n.meta[META_DECISION].precision) for n in inside if n.meta[META_DECISION].precision != "fp32"]
    assert not wrong, wrong
    assert all("ParametrizationList" in n.meta[META_DECISION].rule.pattern for n in inside
               if n.meta[META_DECISION].requested == "fp32" and n.meta[META_DECISION].rule.pattern != "fixed-dtype")
    code = (out / "model.py").read_text()
    assert "'conv.parametrizations.weight.original0'" in code and "torch._weight_norm" in code.replace("aten._weight_norm", "torch._weight_norm")


def test_parametrized_model_py_is_bit_exact_without_converter(converted, standalone):
    _original, conv, _out = converted["param"]
    x = _example("param")
    reference = copy.deepcopy(conv.module)
    ref_out, ref_grads, ref_buffers = _train_step(reference, x)
    assert standalone["param"]["param.modules"] == []
    assert torch.equal(standalone["param"]["param.out"], ref_out), (standalone["param"]["param.out"] - ref_out).abs().max()
    assert set(standalone["param"]["param.grads"]) == set(ref_grads) and len(ref_grads) == 11, sorted(ref_grads)
    for name, grad in ref_grads.items():
        _same_to_the_last_bits(standalone["param"]["param.grads"][name], grad, name)
    for name, buf in ref_buffers.items():  # spectral_norm's u/v after one train-mode power iteration
        _same_to_the_last_bits(standalone["param"]["param.buffers"][name], buf, name)
    with torch.no_grad():  # eval mode after that step: the updated u/v, no power iteration
        _same_to_the_last_bits(standalone["param"]["param.eval"], reference.eval()(x), "eval output")


def _same_to_the_last_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-equal, or (after a train step) equal but for the last bits. model.py's weights are views of the
    memory-mapped file at the offsets safetensors gives them, not 64-byte aligned: on some CPUs (AMD EPYC, AVX512)
    spectral_norm's mv then sums in another order than on conv.module's aligned tensors, and the gradients, the
    power iteration's u/v and what the next forward reads from them differ in the last bits (measured 150 dB).
    A wrong dtype or a missing cast is 50 dB or less."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(got, want) or sqnr(got.double(), want.double()) > 120, \
        f"{what}: SQNR {sqnr(got.double(), want.double()):.1f} dB against conv.module's"


def test_parametrized_gradients_reach_the_original_parameters_like_fp32(converted):
    original, conv, _out = converted["param"]
    assert_half_ran(conv)
    x = _example("param")
    fp32_out, fp32_grads, fp32_buffers = _train_step(copy.deepcopy(original), x)
    out, grads, buffers = _train_step(copy.deepcopy(conv.module), x)
    assert set(grads) == set(fp32_grads), (sorted(grads), sorted(fp32_grads))
    assert sqnr(out.float(), fp32_out) > 40, f"output SQNR {sqnr(out.float(), fp32_out):.1f} dB"
    for name in ("conv.parametrizations.weight.original0", "conv.parametrizations.weight.original1",
                 "sn.parametrizations.weight.original", "orth.parametrizations.weight.original",
                 "sym.parametrizations.weight.original"):
        value = sqnr(grads[name], fp32_grads[name])
        assert value > 30, f"{name}: gradient SQNR {value:.1f} dB against fp32"
    # spectral_norm's power iteration runs in fp32 on fp32 weights: the same u/v as the original's
    for name in ("sn.parametrizations.weight.0._u", "sn.parametrizations.weight.0._v"):
        assert torch.allclose(buffers[name], fp32_buffers[name], rtol=0, atol=1e-6), name


def test_spectral_norm_eval_matches_fp32_and_train_keeps_iterating(converted):
    original, conv, _out = converted["param"]
    assert_half_ran(conv)
    x = _example("param")
    reference, module = copy.deepcopy(original), copy.deepcopy(conv.module)
    u0 = module.get_buffer("sn.parametrizations.weight.0._u").clone()
    for _ in range(3):  # train mode: three power iterations, as the original does
        with torch.no_grad():
            reference.train()(x)
            module.train()(x)
    u = module.get_buffer("sn.parametrizations.weight.0._u")
    assert not torch.equal(u, u0), "train mode did not update spectral_norm's u"
    assert torch.allclose(u, reference.get_buffer("sn.parametrizations.weight.0._u"), rtol=0, atol=1e-6)
    with torch.no_grad():
        got, want = module.eval()(x), reference.eval()(x)
    assert sqnr(got.float(), want) > 40, f"eval SQNR {sqnr(got.float(), want):.1f} dB"


# ---------------------------------------------------------------------------------------------
# complex tensors


def test_complex_ops_keep_complex64_and_fp32_inputs(converted):
    _original, conv, _out = converted["complex"]
    gm = conv.module
    ffts = [n for n in gm.graph.nodes if n.meta.get(META_INFO) is not None and n.meta[META_INFO].op in ("fft_rfft", "rfft")]
    assert len(ffts) == 1, [n.meta[META_INFO].op for n in gm.graph.nodes if META_INFO in n.meta]
    assert ffts[0].meta[META_DECISION].precision == "fp32", ffts[0].meta[META_DECISION]
    assert "complex op" in ffts[0].meta[META_INFO].why
    casts = [n.meta[META_CAST] for n in gm.graph.nodes if META_CAST in n.meta and n.meta[META_CAST].inserted]
    # the input linear's 3 operands to bf16, its output back to fp32 for the FFT; the output linear's 3
    # operands, its output to fp32 (keep_io_types): nothing complex is ever cast
    assert sorted(c.dtype for c in casts) == ["bf16"] * 6 + ["fp32"] * 2, [(c.src, c.dtype) for c in casts]
    recorder = []

    class Dtypes(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "fft" in func.__name__ or "view_as" in func.__name__ or func.__name__.startswith("mul"):
                recorder.append((func.__name__, [a.dtype for a in args if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Dtypes():
        copy.deepcopy(gm)(_example("complex"))
    assert recorder and all(d in (torch.float32, torch.complex64) for _f, ds in recorder for d in ds), recorder


def test_complex_weights_round_trip_through_safetensors(converted):
    _original, conv, out = converted["complex"]
    raw = (out / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["filter"]["dtype"] == "C64" and header["window"]["dtype"] == "C64", header
    loaded = load_file(str(out / "model.safetensors"))  # the safetensors library reads our file
    assert loaded["filter"].dtype == torch.complex64
    assert torch.equal(loaded["filter"], conv.module.get_parameter("filter").detach())
    assert torch.equal(loaded["window"], conv.module.get_buffer("window"))
    module = import_file(out / "model.py")
    model = module.load()
    assert model.get_parameter("filter").dtype == torch.complex64
    assert torch.equal(model.get_parameter("filter"), loaded["filter"])


def test_complex_model_py_is_bit_exact_without_converter(converted, standalone):
    original, conv, _out = converted["complex"]
    x = _example("complex")
    ref_out, ref_grads, _ = _train_step(copy.deepcopy(conv.module), x)
    assert standalone["complex"]["complex.modules"] == []
    assert torch.equal(standalone["complex"]["complex.out"], ref_out), (standalone["complex"]["complex.out"] - ref_out).abs().max()
    assert set(standalone["complex"]["complex.grads"]) == set(ref_grads) == {n for n, _ in original.named_parameters()}
    for name, grad in ref_grads.items():
        assert grad.dtype == original.get_parameter(name).dtype, name
        assert torch.equal(standalone["complex"]["complex.grads"][name], grad), name
    fp32_out, fp32_grads, _ = _train_step(copy.deepcopy(original), x)
    assert sqnr(ref_out.float(), fp32_out) > 40, f"output SQNR {sqnr(ref_out.float(), fp32_out):.1f} dB"
    for name in ("filter", "gain"):
        value = sqnr(torch.view_as_real(ref_grads[name]) if ref_grads[name].is_complex() else ref_grads[name],
                     torch.view_as_real(fp32_grads[name]) if fp32_grads[name].is_complex() else fp32_grads[name])
        assert value > 30, f"{name}: gradient SQNR {value:.1f} dB"


# ---------------------------------------------------------------------------------------------
# load(weights=) is strict


@pytest.fixture(scope="module")
def emitted_param(converted):
    """The parametrized model's model.py, and another model's weights (seed 1) to load into it."""
    _original, _conv, out = converted["param"]
    other = {k: v.contiguous() for k, v in _build("param", seed=1).state_dict().items()}
    return import_file(out / "model.py"), other


def _out(model):
    with torch.no_grad():
        return model.eval()(_example("param"))


def test_load_weights_takes_every_tensor_of_the_checkpoint(emitted_param, tmp_path):
    module, other = emitted_param
    save_file(other, str(tmp_path / "other.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note: the names match as they are
        loaded = module.load(weights=tmp_path / "other.safetensors")
    for name, tensor in other.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert not torch.equal(_out(loaded), _out(module.load()))


def test_load_weights_strips_a_common_prefix_and_says_so(emitted_param, tmp_path):
    module, other = emitted_param
    save_file(other, str(tmp_path / "plain.safetensors"))
    save_file({"model." + k: v for k, v in other.items()}, str(tmp_path / "prefixed.safetensors"))
    with pytest.warns(UserWarning, match=r"prefixed\.safetensors: every tensor name starts with 'model\.'; stripped"):
        loaded = module.load(weights=tmp_path / "prefixed.safetensors")
    assert torch.equal(_out(loaded), _out(module.load(weights=tmp_path / "plain.safetensors")))
    assert not torch.equal(_out(loaded), _out(module.load()))


def test_load_weights_names_a_missing_tensor_and_the_file(emitted_param, tmp_path):
    module, other = emitted_param
    partial = {k: v for k, v in other.items() if k != "sn.parametrizations.weight.0._u"}
    save_file(partial, str(tmp_path / "partial.safetensors"))
    with pytest.raises(ValueError, match=r"partial\.safetensors does not match this model\.py: it lacks "
                                         r"'sn\.parametrizations\.weight\.0\._u' \(1\)") as info:
        module.load(weights=tmp_path / "partial.safetensors")
    assert "\n" not in str(info.value)


def test_load_weights_names_an_unexpected_tensor(emitted_param, tmp_path):
    module, other = emitted_param
    save_file({**other, "extra.weight": torch.zeros(2), "head.scale": torch.ones(1)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match=r"extra\.safetensors does not match this model\.py: it has 'extra\.weight', "
                                         r"'head\.scale' \(2\), which this model does not"):
        module.load(weights=tmp_path / "extra.safetensors")
    # a prefix that does not make every name match is not stripped: the mismatch is named
    save_file({**{"model." + k: v for k, v in other.items()}, "lm_head.weight": torch.zeros(2)}, str(tmp_path / "wrap.safetensors"))
    with pytest.raises(ValueError, match=r"wrap\.safetensors does not match this model\.py: it lacks 'conv\.bias', .* and 11 more \(14\); "
                                         r"it has 'lm_head\.weight', 'model\.conv\.bias', .* and 12 more \(15\), which this model does not"):
        module.load(weights=tmp_path / "wrap.safetensors")


def test_load_weights_checks_shapes_and_dtype_kinds(emitted_param, tmp_path):
    module, other = emitted_param
    save_file({**other, "head.bias": torch.zeros(9)}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ValueError, match=r"shape\.safetensors: 'head\.bias' is \(9,\), this model's is \(8,\)"):
        module.load(weights=tmp_path / "shape.safetensors")
    save_file({**other, "head.bias": torch.zeros(8, dtype=torch.int64)}, str(tmp_path / "kind.safetensors"))
    with pytest.raises(ValueError, match=r"kind\.safetensors: 'head\.bias' is torch\.int64, this model's is torch\.float32 "
                                         r"\(integer values cannot stand for floating ones\)"):
        module.load(weights=tmp_path / "kind.safetensors")
    # another floating dtype is converted, as for a bf16 checkpoint of an fp32 model
    save_file({**other, "head.bias": other["head.bias"].to(torch.bfloat16)}, str(tmp_path / "bf16.safetensors"))
    loaded = module.load(weights=tmp_path / "bf16.safetensors")
    assert loaded.get_parameter("head.bias").dtype == torch.float32
    assert torch.equal(loaded.get_parameter("head.bias"), other["head.bias"].to(torch.bfloat16).float())


def test_a_half_rule_on_spectral_norm_fails_loudly_instead_of_freezing_its_buffers(tmp_path):
    """The power iteration writes u/v with div(..., out=u): a cast copy of u must never take that write
    (it did: v stayed at its initial value in train mode, silently). In half, the op computes in bf16
    into the fp32 buffer, so the next op's inputs disagree: the conversion check names it."""
    rules = tmp_path / "half.toml"
    rules.write_text('[module_type]\n"ParametrizationList" = { precision = "half", reason = "test" }\n')
    with pytest.raises(ForwardCheckError, match=r"at node 'mv_1' \(op mv, bf16 by .*half\.toml:\[module_type\]\.ParametrizationList"):
        converter.convert(_build("param"), (_example("param"),), rules=[str(rules)])


def test_fx_captured_parametrization_is_refused_with_the_way_out():
    conv = converter.convert(_build("param"), (_example("param"),), tracer="fx")
    with pytest.raises(EmitError, match=r"'conv\.parametrizations\.weight' is a parametrized weight .*--tracer export or auto"):
        generate_model_source(conv)


def test_spectral_norm_buffers_stay_put_in_eval_like_the_original():
    """Found by the zoo (param_conv): the train graph's power iteration changed spectral_norm's ``_u``/``_v``
    in eval mode too, an output difference of only ~1e-4 that the eval check let pass. A graph that writes
    buffers in eval mode the original leaves alone now gets an eval graph of its own."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.spectral_norm(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(3, 8)
    conv = converter.convert(model, (x,), precision="bf16")
    assert "updates buffer(s)" in conv.report.records.capture.modes, conv.report.records.capture.modes
    conv.module.eval()
    before = {n: b.clone() for n, b in conv.module.named_buffers()}
    for _ in range(3):
        conv.module(x)
    changed = [n for n, b in conv.module.named_buffers() if not torch.equal(b, before[n])]
    assert changed == [], changed
    conv.module.train()
    conv.module(x)
    assert any(not torch.equal(b, before[n]) for n, b in conv.module.named_buffers() if n.endswith(("_u", "_v"))), \
        "train mode must keep iterating"
