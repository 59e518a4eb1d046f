"""CUDA checks on real tensor cores (skipped without a GPU; CI has none).

What runs on the GPU, for fp16 and bf16, through ``converter.convert(..., device="cuda")``:

* **dtypes**: a ``TorchDispatchMode`` records the input dtypes of every aten call of a forward and
  a backward. Every matmul-class call (``mm``/``addmm``/``bmm``/``convolution``/
  ``_scaled_dot_product_*``) reads half, the ops the default rules keep in fp32 (softmax,
  log_softmax, layer_norm, the hand-written RMSNorm's pow/mean/rsqrt, GPT-2's gelu_new pow) read
  fp32, and batch_norm (lowered for CUDA) reads the half activations with fp32 statistics, weight
  and bias, with the number of calls that the model's structure gives
  (:data:`EXPECTED`), in train and eval mode, at the example size and another batch/length;
* **numerics**: output and gradient SQNR against the fp32 model (IEEE fp32: TF32 off) on the
  GPU ≥ ``torch.autocast``'s SQNR − 1 dB, autocast measured in the same test;
* **training**: 20 steps of the O2 :class:`~converter.MixedPrecisionTrainer` (fp16 with its loss
  scaler, bf16 without) against ``torch.autocast`` (+ ``torch.amp.GradScaler`` for fp16) on the
  same batches: both losses fall, end close to each other and to fp32, no step skipped after the
  first few;
* **export**: ``emit(..., device="cuda")`` and the CLI's ``--device cuda`` write a model.py that
  loads and runs on the GPU.

``MPCONVERT_TEST_DEVICE=cpu`` runs the same checks on the CPU (a dry run of the test logic without a
GPU; the conversions still target ``device="cuda"``, so nothing is lowered for the CPU).
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
from collections import Counter

import pytest
import torch
from torch import nn

import converter
from converter.cli.main import main as cli_main
from converter.export.emit import emit
from converter.export.verify import import_file
from tests.helpers import SAMPLES, DtypeRecorder, first_tensor, load_sample, split_inputs, sqnr

DEVICE = os.environ.get("MPCONVERT_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
F32 = torch.float32
MODELS = ("tiny_transformer", "cnn", "hf_gpt2")

# forward calls per op class, from the models' structure (default rules; the same in train and eval mode)
#   tiny_transformer: 2 blocks × (qkv, proj, gate, up, down) + lm_head = 11 bias-free linears -> mm; block 1's
#     explicit attention: 2 matmuls -> bmm, 1 softmax; block 0: 1 fused SDPA; 5 RMSNorms -> pow/mean/rsqrt ×5
#   cnn: 3 convolutions, 3 batch norms, 1 linear with bias -> addmm, global average pool -> mean,
#     cross entropy inside the model -> log_softmax
#   hf_gpt2: 2 blocks × 4 Conv1D (addmm), 2 blocks × 2 attention matmuls -> bmm, lm_head -> mm;
#     2 softmaxes, 5 layer norms (ln_1, ln_2 ×2, ln_f), gelu_new's pow(x, 3) ×2
EXPECTED = {
    "tiny_transformer": {"half": {"mm": 11, "bmm": 2, "sdpa": 1},
                         "fp32": {"softmax": 1, "pow": 5, "mean": 5, "rsqrt": 5}},
    "cnn": {"half": {"convolution": 3, "addmm": 1}, "fp32": {"log_softmax": 1, "mean": 1},
            "half_io": {"batch_norm": 3}},
    "hf_gpt2": {"half": {"addmm": 8, "bmm": 4, "mm": 1}, "fp32": {"softmax": 2, "layer_norm": 5, "pow": 2}},
}
HALF_CLASSES = ("mm", "addmm", "bmm", "convolution", "sdpa")
FP32_CLASSES = ("softmax", "log_softmax", "layer_norm", "pow", "mean", "rsqrt")
#: ops lowered for CUDA to read the half activations with fp32 statistics, weight and bias (as under autocast)
HALF_IO_CLASSES = ("batch_norm",)


def op_class(name: str) -> str | None:
    """The class of an aten op (overload packet name) that the dtype checks count; None for the rest."""
    if "backward" in name:
        return "backward_matmul" if name == "convolution_backward" or name.startswith("_scaled_dot_product") else None
    if name.startswith("_scaled_dot_product"):  # flash / efficient / cudnn / math-for-cpu kernels
        return "sdpa"
    if name in ("_softmax", "softmax"):
        return "softmax"
    if name in ("_log_softmax", "log_softmax"):
        return "log_softmax"
    if name in ("native_layer_norm", "layer_norm"):
        return "layer_norm"
    if "batch_norm" in name and "impl_index" not in name:  # native_/cudnn_/_native_..._legit/_with_update
        return "batch_norm"
    if name in ("mm", "addmm", "bmm", "convolution", "pow", "mean", "rsqrt"):
        return name
    return None


# ------------------------------------------------------------------------------------------------ helpers
def to_device(obj):
    if isinstance(obj, torch.Tensor):
        return obj.to(DEVICE)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v) for v in obj)
    if isinstance(obj, dict):
        return {k: to_device(v) for k, v in obj.items()}
    return obj


def build(name: str) -> tuple[nn.Module, tuple, dict]:
    """The sample model on the device with dropout off (train-mode outputs must be comparable), and its inputs."""
    sample = load_sample(name)
    model = sample.build_model()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    args, kwargs = split_inputs(sample.example_inputs())
    return model.to(DEVICE), to_device(args), to_device(kwargs)


def other_inputs(name: str) -> tuple[tuple, dict]:
    """Another batch size and sequence length / image size than the example's."""
    gen = torch.Generator().manual_seed(7)
    if name == "tiny_transformer":
        return (torch.randint(0, 128, (5, 24), generator=gen).to(DEVICE),), {}
    if name == "cnn":
        return (torch.randn(7, 3, 24, 24, generator=gen).to(DEVICE), torch.randint(0, 10, (7,), generator=gen).to(DEVICE)), {}
    if name == "hf_gpt2":
        return (), {"input_ids": torch.randint(0, 128, (3, 24), generator=gen).to(DEVICE)}
    raise KeyError(name)


@contextlib.contextmanager
def ieee_fp32():
    """fp32 matmuls and convolutions in IEEE fp32 (cuDNN allows TF32 for convolutions by default): the reference."""
    legacy, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(legacy)
        torch.backends.cudnn.allow_tf32 = cudnn


def loss_of(output) -> torch.Tensor:
    """The model's loss when it returns one (the CNN), else mean(output²) in fp32 (benchmarks/run.py's loss)."""
    out = first_tensor(output)
    return out.float().reshape(()) if out.numel() == 1 else out.float().pow(2).mean()


def grad_vector(module: nn.Module, names: list[str]) -> torch.Tensor:
    params = dict(module.named_parameters())
    return torch.cat([params[n].grad.detach().float().reshape(-1) for n in names])


_CONVERSIONS: dict = {}


def conversion(name: str, precision: str, opt_level: str = "O1"):
    """One conversion per (model, precision, opt_level), made on the GPU for the GPU; with the model it came from."""
    key = (name, precision, opt_level)
    if key not in _CONVERSIONS:
        model, args, kwargs = build(name)
        conv = converter.convert(copy.deepcopy(model), (args, kwargs), precision=precision, opt_level=opt_level,
                                 device="cuda")
        _CONVERSIONS[key] = (conv, model)
    return _CONVERSIONS[key]


def record(module: nn.Module, args: tuple, kwargs: dict, *, scale: float) -> tuple[DtypeRecorder, DtypeRecorder, object]:
    """The aten calls of one forward and of its backward, recorded separately."""
    fwd, bwd = DtypeRecorder(), DtypeRecorder()
    with fwd:
        out = module(*args, **kwargs)
    loss = loss_of(out) * scale
    with bwd:
        loss.backward()
    return fwd, bwd, out


def by_class(rec: DtypeRecorder) -> dict[str, list[tuple]]:
    found: dict[str, list[tuple]] = {}
    for name, dtypes in rec.calls:
        cls = op_class(name)
        if cls is not None:
            found.setdefault(cls, []).append((name, dtypes))
    return found


# ------------------------------------------------------------------------------------------------ dtypes + numerics
@pytest.mark.parametrize("size", ["example", "other"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_dtypes_and_sqnr_on_the_gpu(precision, name, mode, size):
    half = HALF[precision]
    conv, model = conversion(name, precision)
    args, kwargs = conv.example_inputs if size == "example" else other_inputs(name)
    training = mode == "train"
    scale = 1024.0 if precision == "fp16" else 1.0  # fp16 gradients of mean(out²) would underflow unscaled

    ref, amp, mixed = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(conv.module)
    for m in (ref, amp, mixed):
        m.train(training)

    # what runs: dtypes and counts
    fwd, bwd, out = record(mixed, args, kwargs, scale=scale)
    got = by_class(fwd)
    expected = EXPECTED[name]
    for cls in HALF_CLASSES:
        calls = got.get(cls, [])
        # the sdpa kernels take q, k, v first; everything else is checked on every floating input
        bad = [c for c in calls if any(d != half for d in (c[1][:3] if cls == "sdpa" else c[1]))]
        assert not bad, f"{name} {mode}: {cls} not in {precision}: {bad}"
        assert len(calls) == expected["half"].get(cls, 0), f"{name} {mode}: {len(calls)} {cls} calls, expected " \
            f"{expected['half'].get(cls, 0)}: {calls}"
    for cls in FP32_CLASSES:
        calls = got.get(cls, [])
        bad = [c for c in calls if any(d != F32 for d in c[1])]
        assert not bad, f"{name} {mode}: {cls} not in fp32: {bad}"
        assert len(calls) == expected["fp32"].get(cls, 0), f"{name} {mode}: {len(calls)} {cls} calls, expected " \
            f"{expected['fp32'].get(cls, 0)}: {calls}"
    for cls in HALF_IO_CLASSES:
        calls = got.get(cls, [])
        bad = [c for c in calls if c[1][0] != half or any(d != F32 for d in c[1][1:])]
        assert not bad, f"{name} {mode}: {cls} not on {precision} activations with fp32 statistics: {bad}"
        assert len(calls) == expected.get("half_io", {}).get(cls, 0), f"{name} {mode}: {len(calls)} {cls} calls: {calls}"
    back = by_class(bwd)
    matmuls = [c for cls in ("mm", "addmm", "bmm", "backward_matmul") for c in back.get(cls, [])]
    assert len(matmuls) >= sum(expected["half"].values()), f"{name}: backward has only {len(matmuls)} matmul-class calls"
    # an attention backward also reads its fp32 logsumexp: check grad_out, q, k, v
    bad = [c for c in matmuls if any(d != half for d in (c[1][:4] if c[0].startswith("_scaled_dot_product") else c[1]))]
    assert not bad, f"{name} {mode} backward: matmul-class calls not in {precision}: {bad}"
    assert all(t.device.type == DEVICE for t in [first_tensor(out)])

    # numerics: against IEEE fp32 on the same device, autocast measured the same way
    with ieee_fp32():
        ref_out = ref(*args, **kwargs)
        (loss_of(ref_out) * scale).backward()
        with torch.autocast(DEVICE, dtype=half):
            amp_out = amp(*args, **kwargs)
        (loss_of(amp_out) * scale).backward()
    names = sorted(n for n, p in mixed.named_parameters() if p.grad is not None)
    names = [n for n in names if n in dict(ref.named_parameters())]
    assert names, "no shared parameters with gradients"
    ref_g = grad_vector(ref, names)
    s_out = {"ours": sqnr(first_tensor(ref_out), first_tensor(out)), "autocast": sqnr(first_tensor(ref_out), first_tensor(amp_out))}
    s_grad = {"ours": sqnr(ref_g, grad_vector(mixed, names)), "autocast": sqnr(ref_g, grad_vector(amp, names))}
    detail = (f"{precision} {name} {mode} {size}: output SQNR {s_out['ours']:.2f} dB vs autocast {s_out['autocast']:.2f} dB; "
              f"grad SQNR {s_grad['ours']:.2f} dB vs autocast {s_grad['autocast']:.2f} dB")
    print(detail)
    assert first_tensor(out).dtype == first_tensor(ref_out).dtype, detail  # keep_io_types
    assert math.isfinite(s_out["ours"]) or s_out["ours"] == math.inf, detail
    # the SQNR of one number (the CNN returns its loss) is luck: there the output only has to be within the
    # half dtype's rounding (ε: 66 dB fp16, 48 dB bf16) when autocast happens to be closer; the gradient is the vector
    floor = -20 * math.log10(torch.finfo(half).eps) if first_tensor(out).numel() == 1 else math.inf
    assert s_out["ours"] >= min(s_out["autocast"] - 1.0, floor), detail
    assert s_grad["ours"] >= s_grad["autocast"] - 1.0, detail


# ------------------------------------------------------------------------------------------------ training
def _sequences(steps: int, batch: int = 8, length: int = 32) -> list[torch.Tensor]:
    """Learnable token streams: t_i = (start + i·stride) mod 128, random start and stride 1..4 per row."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        start = torch.randint(0, 128, (batch, 1), generator=gen)
        stride = torch.randint(1, 5, (batch, 1), generator=gen)
        out.append(((start + stride * torch.arange(length)) % 128).to(DEVICE))
    return out


def _train(variant: str, precision: str, batches: list[torch.Tensor]) -> dict:
    sample = load_sample("tiny_transformer")
    torch.manual_seed(0)
    model = sample.build_model().to(DEVICE)
    half = HALF[precision]
    losses, skipped = [], []
    info: dict = {}
    if variant == "O2":
        conv = converter.convert(model, (batches[0][:2],), precision=precision, opt_level="O2", device="cuda")
        module = conv.module
        opt = torch.optim.AdamW(module.parameters(), lr=3e-3)
        trainer = converter.MixedPrecisionTrainer(module, opt, precision=precision, master_weights=True)
        info["scaler"] = trainer.scaler
        info["half_params"] = sum(p.dtype == half for p in module.parameters())
        for i, tokens in enumerate(batches):
            trainer.zero_grad()
            if i == 0:
                with DtypeRecorder() as rec:
                    out = module(tokens)
                info["forward"] = by_class(rec)
            else:
                out = module(tokens)
            loss = sample.loss_fn(out, (tokens,))
            trainer.backward(loss)
            stepped = trainer.step()
            losses.append(loss.item())
            skipped.append(not stepped)
        info["stats"] = trainer.stats
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        scaler = torch.amp.GradScaler(DEVICE) if variant == "autocast" and precision == "fp16" else None
        for tokens in batches:
            opt.zero_grad(set_to_none=True)
            with ieee_fp32(), torch.autocast(DEVICE, dtype=half, enabled=variant == "autocast"):
                out = model(tokens)
            loss = sample.loss_fn(out, (tokens,))
            if scaler is None:
                loss.backward()
                opt.step()
                skipped.append(False)
            else:
                before = scaler.get_scale()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                skipped.append(scaler.get_scale() < before)
            losses.append(loss.item())
    return {"losses": losses, "skipped": skipped, **info}


FIRST_FEW = 5  # a dynamic loss scale may back off during the first steps (both scalers start at 2**16)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_o2_trainer_matches_autocast_over_20_steps(precision):
    batches = _sequences(20)
    runs = {v: _train(v, precision, batches) for v in ("fp32", "autocast", "O2")}
    final = {v: sum(r["losses"][-3:]) / 3 for v, r in runs.items()}
    detail = "; ".join(f"{v}: {r['losses'][0]:.4f} -> {final[v]:.4f} (skipped at "
                       f"{[i for i, s in enumerate(r['skipped']) if s]})" for v, r in runs.items())
    print(f"{precision} training: {detail}")
    for v, r in runs.items():
        assert all(math.isfinite(x) for x in r["losses"]), f"{v}: {detail}"
        assert final[v] < 0.8 * r["losses"][0], f"{v}'s loss did not fall: {detail}"
        late = [i for i, s in enumerate(r["skipped"]) if s and i >= FIRST_FEW]
        assert not late, f"{v} skipped steps {late}: {detail}"
    # the O2 trainer ends where autocast ends, and both near fp32 (tolerance: 5 % of the loss, + 0.05)
    for v in ("O2", "autocast"):
        assert abs(final[v] - final["fp32"]) <= 0.05 * final["fp32"] + 0.05, detail
    assert abs(final["O2"] - final["autocast"]) <= 0.05 * final["autocast"] + 0.05, detail
    o2 = runs["O2"]
    if precision == "bf16":
        assert o2["scaler"] is None and o2["stats"].skipped == 0, detail
    else:
        assert o2["scaler"] is not None and o2["stats"].steps + o2["stats"].skipped == 20, detail
    # O2 stores the matmul weights in half: the forward reads them without casts, on the tensor cores
    assert o2["half_params"] == 11, o2["half_params"]
    fwd = o2["forward"]
    for cls, n in EXPECTED["tiny_transformer"]["half"].items():
        calls = fwd.get(cls, [])
        assert len(calls) == n and all(d == HALF[precision] for c in calls for d in c[1][:3]), (cls, calls)
    for cls, n in EXPECTED["tiny_transformer"]["fp32"].items():
        calls = fwd.get(cls, [])
        assert len(calls) == n and all(d == F32 for c in calls for d in c[1]), (cls, calls)


# ------------------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_emitted_model_loads_and_runs_on_the_gpu(precision, tmp_path):
    conv, model = conversion("tiny_transformer", precision)
    notes: list[str] = []
    out = emit(conv, tmp_path / "o", device=DEVICE, messages=notes)
    if DEVICE == "cuda":
        assert any("runs on cuda" in n for n in notes), notes
    emitted = import_file(out / "model.py").load(device=DEVICE)
    assert {p.device.type for p in emitted.parameters()} == {DEVICE}
    args, kwargs = conv.example_inputs
    with torch.no_grad():
        assert torch.equal(emitted(*args, **kwargs), copy.deepcopy(conv.module)(*args, **kwargs))
        (tokens,), _ = other_inputs("tiny_transformer")
        got = emitted(tokens)
        ref = model(tokens)
    assert got.dtype == F32 and got.device.type == DEVICE and torch.isfinite(got).all()
    assert sqnr(ref, got) > 25.0, sqnr(ref, got)


def test_cli_device_cuda_writes_a_model_that_runs_on_the_gpu(tmp_path, capfd):
    out = tmp_path / "tt"
    code = cli_main([str(SAMPLES / "tiny_transformer.py"), "--device", "cuda", "--precision", "fp16", "--out", str(out)])
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr
    report = (out / "report.json").read_text()
    assert '"device": "cuda"' in report
    if DEVICE == "cuda":
        assert "CUDA is not available" not in stderr
    model = import_file(out / "model.py").load(device=DEVICE)
    sample = load_sample("tiny_transformer")
    ref = sample.build_model().to(DEVICE).eval()
    tokens = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.no_grad():
        got = model(tokens)
        want = ref(tokens)
    assert got.device.type == DEVICE and got.dtype == F32 and torch.isfinite(got).all()
    assert sqnr(want, got) > 25.0, sqnr(want, got)
    kinds = Counter(p.dtype for p in model.parameters())
    assert kinds, "model.py has no parameters"


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_portable_graphs_kernels_take_the_fused_and_native_ops_on_the_gpu(precision, monkeypatch):
    """A portable conversion's dispatching kernels (converter/passes/dispatch.py), moved to the GPU, run the fused
    attention and the native GEMMs, bit-equal to the plain ops, even when forced to the CPU path (their choice
    is per device): the same graph with its kernels pointed back at the plain ops gives the same bits."""
    from converter.kernels import upcast
    from converter.passes import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "MIN_GEMM_FLOPS", 0)
    monkeypatch.setattr(upcast, "UPCAST_ON_CPU", True)
    sample = load_sample("tiny_transformer")
    torch.manual_seed(0)
    model = sample.build_model()
    conv = converter.convert(model, sample.example_inputs(), precision=precision)
    names = [getattr(n.target, "__name__", "") for n in conv.module.graph.nodes if n.op == "call_function"]
    # block 0's SDPA, the 11 linears, block 1's explicit attention matmuls
    assert (names.count("dispatch_attention"), names.count("dispatch_linear"), names.count("dispatch_matmul")) == (1, 11, 2)
    module = copy.deepcopy(conv.module).to(DEVICE)
    plain = copy.deepcopy(module)
    assert cpu_gemm.native_gemms(plain) == 14
    args, _ = split_inputs(sample.example_inputs())
    args = [a.to(DEVICE) for a in args]
    with torch.no_grad():
        got, want = first_tensor(module(*args)), first_tensor(plain(*args))
    if DEVICE == "cuda":
        assert torch.equal(got, want), (got - want).abs().max()
    else:  # MPCONVERT_TEST_DEVICE=cpu: the forced CPU path, fp32 arithmetic, close to the plain half ops
        assert sqnr(want.float(), got.float()) >= 35, sqnr(want.float(), got.float())
