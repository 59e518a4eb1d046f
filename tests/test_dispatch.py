"""Portable graphs' dispatching kernels (issue 32): the calls whose best kernel depends on the device choose it at
run time (converter/kernels/attention.py, converter/kernels/upcast.py's dispatch_*, converter/passes/dispatch.py).

What is checked: the unfused attention computes what the fused op computes (outputs and gradients against fp32,
masks that hide whole rows included), each kernel picks the fused/native path wherever the fast path does not
apply, the recomputed variant saves what the fused kernel saves, the GEMM choice follows the measurement, a
portable conversion retargets exactly its bf16 attentions and large half GEMMs (FX and torch.export graphs, an
HF Llama with the library's defaults on left- and right-padded batches, gradients included) with the choices in
the report, model.py carries the kernels and runs with torch only, and the ONNX file has no trace of them.
"""
from __future__ import annotations

import ast
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import converter
from converter.export.model_py import generate_model_source
from converter.ir.meta import META_DECISION
from converter.kernels import upcast
from converter.kernels.upcast import dispatch_attention, dispatch_linear, dispatch_matmul
from converter.passes import cpu_gemm
from tests.helpers import assert_half_ran, sqnr
from tests.test_cpu_gemm import Block, run_model_py_alone


def test_the_kernels_module_imports_only_torch_and_the_standard_library():
    tree = ast.parse(open(upcast.__file__, encoding="utf-8").read())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert roots <= {"__future__", "typing", "math", "os", "time", "torch"}, roots


def _qkv(b=2, h=4, t=12, e=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, e, generator=g) for _ in range(3)]


def _masks(b=2, t=12):
    padded = torch.ones(b, 1, t, t, dtype=torch.bool)
    padded[1, :, :, :5] = False  # left padding: keys 0-4 of row 1 take no part
    hidden = padded.clone()
    hidden[1, :, :5, :] = False  # ... and queries 0-4 see nothing (a left-padded causal batch has such rows)
    additive = torch.zeros(b, 1, t, t).masked_fill(~padded, torch.finfo(torch.float32).min)
    return {"none": {}, "bool": {"attn_mask": padded}, "hidden_rows": {"attn_mask": hidden},
            "additive": {"attn_mask": additive}, "causal": {"is_causal": True}, "scale": {"scale": 0.3}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(_masks()))
def test_the_upcast_attention_is_at_least_as_close_to_fp32_as_the_fused_half_kernel(case, dtype, monkeypatch):
    monkeypatch.setattr(upcast, "UPCAST_ON_CPU", True)
    kwargs = _masks()[case]
    q, k, v = _qkv()
    half = {key: val.to(dtype) if isinstance(val, torch.Tensor) and val.is_floating_point() else val
            for key, val in kwargs.items()}
    results = {}
    for name, fn, kind in (("fp32", F.scaled_dot_product_attention, torch.float32),
                           ("fused", F.scaled_dot_product_attention, dtype), ("upcast", dispatch_attention, dtype)):
        ins = [t.to(kind).detach().requires_grad_() for t in (q, k, v)]
        out = fn(*ins, **(kwargs if kind == torch.float32 else half))
        out.float().pow(2).sum().backward()
        results[name] = (out, [t.grad for t in ins])
    out, grads = results["upcast"]
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert out.grad_fn.name().startswith("UpcastAttention"), out.grad_fn.name()
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    if case == "hidden_rows":  # zeros where no key takes part, as the fused kernel gives (softmax alone: NaN)
        assert torch.equal(out[1, :, :5].float(), torch.zeros_like(out[1, :, :5].float()))
    ref_out, ref_grads = results["fp32"]
    for got, fused, want in zip([out, *grads], [results["fused"][0], *results["fused"][1]], [ref_out, *ref_grads]):
        mine, theirs = sqnr(want.float(), got.float()), sqnr(want.float(), fused.float())
        # fp32 arithmetic rounded once: never worse than the fused half kernel (a wrong term costs tens of dB)
        assert mine >= theirs - 1.0, (case, mine, theirs)


def _grad_fn_of(fn, *args, **kwargs) -> str:
    return fn(*[a.requires_grad_() if a.is_floating_point() else a for a in args], **kwargs).grad_fn.name()


def test_dispatch_attention_runs_the_fused_op_wherever_the_fast_path_does_not_apply(monkeypatch):
    monkeypatch.setattr(upcast, "UPCAST_ON_CPU", True)
    q, k, v = _qkv()
    ins = [t.bfloat16() for t in (q, k, v)]
    fused = "ScaledDotProduct"
    assert _grad_fn_of(dispatch_attention, *ins).startswith("UpcastAttention")
    assert torch.equal(dispatch_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))  # fp32: the fused op
    kv_heads = [ins[0], ins[1][:, :2], ins[2][:, :2]]
    assert torch.equal(dispatch_attention(*kv_heads, enable_gqa=True),
                       F.scaled_dot_product_attention(*kv_heads, enable_gqa=True))
    shared = [ins[0], ins[1][:1], ins[2][:1]]  # k and v broadcast over the batch
    assert torch.equal(dispatch_attention(*shared), F.scaled_dot_product_attention(*shared))
    learned = torch.zeros(2, 1, 12, 12, dtype=torch.bfloat16, requires_grad=True)  # a mask that wants a gradient
    assert torch.equal(dispatch_attention(*ins, learned), F.scaled_dot_product_attention(*ins, learned))
    on_meta = dispatch_attention(*[t.to("meta") for t in ins])
    assert on_meta.device.type == "meta" and on_meta.shape == q.shape
    monkeypatch.setattr(upcast, "MAX_UNFUSED_SCORES_BYTES", 2 * 4 * 12 * 12 * 4 - 1)  # one byte under the call's
    assert fused in _grad_fn_of(dispatch_attention, *ins)
    monkeypatch.setattr(upcast, "MAX_UNFUSED_SCORES_BYTES", 2 * 4 * 12 * 12 * 4)
    assert not _grad_fn_of(dispatch_attention, *ins).startswith(fused)
    monkeypatch.setattr(upcast, "UPCAST_ON_CPU", False)  # a CPU with fast half GEMMs
    assert fused in _grad_fn_of(dispatch_attention, *ins)


def _saved_bytes(fn) -> int:
    saved: list = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_the_upcast_attention_saves_what_the_fused_kernel_saves(dropout_p, monkeypatch):
    monkeypatch.setattr(upcast, "UPCAST_ON_CPU", True)
    q, k, v = [t.bfloat16() for t in _qkv(t=64)]
    mask = torch.ones(2, 1, 64, 64, dtype=torch.bool).tril()
    saved = {}
    for fn in (dispatch_attention, F.scaled_dot_product_attention):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        saved[fn] = _saved_bytes(lambda fn=fn, ins=ins: fn(*ins, mask, dropout_p))
    # q, k, v and the mask (slack: a (B, H, L) fp32 vector); never a (B, H, L, S) matrix (2·4·64·64·2 bytes in bf16)
    assert saved[dispatch_attention] <= saved[F.scaled_dot_product_attention] + mask.numel() + 2 * 4 * 64 * 4, saved
    if dropout_p:  # recomputed in backward with the RNG state kept: the gradients of one forward's mask
        grads = []
        for recompute in (True, False):
            ins = [t.clone().requires_grad_() for t in (q, k, v)]
            torch.manual_seed(3)
            if recompute:
                out = dispatch_attention(*ins, mask, dropout_p)
            else:
                out = upcast._attention_dropout(*ins, mask, dropout_p, False, 0.25)
            out.float().pow(2).sum().backward()
            grads.append([out, *(t.grad for t in ins)])
        assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_gemm_choice_follows_the_device_and_a_measurement_made_once(monkeypatch):
    calls = []
    timings = {torch.float32: 1.0, torch.bfloat16: 4.5, torch.float16: 1.1}

    def fake_seconds(dtype):
        calls.append(dtype)
        return timings[dtype]

    def fake_crossover(dtype):
        calls.append(("crossover", dtype))
        return 10_000  # FLOPs: from 2·M·K·N = 10k the upcast kernels pay

    monkeypatch.setattr(upcast, "matmul_seconds", fake_seconds)
    monkeypatch.setattr(upcast, "gemm_crossover_flops", fake_crossover)
    monkeypatch.setattr(upcast, "_cpu_choice", {})
    monkeypatch.setattr(upcast, "_cpu_min_flops", {})
    monkeypatch.delenv("MPCONVERT_NO_DEVICE_ADVICE", raising=False)
    x, w = torch.randn(4, 64), torch.randn(32, 64)  # 2·4·64·32 = 16k FLOPs
    upcast_name = upcast.UpcastLinear.__name__
    for _ in range(2):
        assert dispatch_linear(x.bfloat16(), w.bfloat16().requires_grad_()).grad_fn.name().startswith(upcast_name)
    assert calls == [torch.bfloat16, torch.float32, ("crossover", torch.bfloat16)], calls  # once per dtype and process
    # below the measured crossover (2·1·64·32 = 4k FLOPs): the native GEMM, whose fixed cost is lower
    assert not dispatch_linear(x[:1].bfloat16(), w.bfloat16().requires_grad_()).grad_fn.name().startswith(upcast_name)
    del calls[2]
    assert not dispatch_linear(x.half(), w.half().requires_grad_()).grad_fn.name().startswith(upcast_name)  # 1.1x: native
    assert torch.equal(dispatch_linear(x, w), F.linear(x, w)) and len(calls) == 4  # fp32: plain, nothing measured
    a = torch.randn(3, 8, 64).bfloat16().requires_grad_()
    assert dispatch_matmul(a, w.t().bfloat16()).grad_fn.name().startswith(upcast.UpcastMatmul.__name__)
    assert torch.equal(dispatch_matmul(a, w.t().bfloat16()), upcast.upcast_matmul(a, w.t().bfloat16()))
    on_meta = dispatch_linear(x.bfloat16().to("meta"), w.bfloat16().to("meta"))
    assert on_meta.device.type == "meta" and len(calls) == 4  # not a CPU tensor: the plain op
    # the emitted model's run-time switch (no conversion reads it) keeps them native
    monkeypatch.setenv("MPCONVERT_NO_DEVICE_ADVICE", "1")
    monkeypatch.setattr(upcast, "_cpu_choice", {})
    assert not dispatch_linear(x.bfloat16(), w.bfloat16().requires_grad_()).grad_fn.name().startswith(upcast_name)
    monkeypatch.setattr(upcast, "UPCAST_ON_CPU", True)
    assert dispatch_linear(x.bfloat16(), w.bfloat16().requires_grad_()).grad_fn.name().startswith(upcast_name)
    assert len(calls) == 4


def _names(gm) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]


def _fast(monkeypatch, on: bool) -> None:
    """The run-time choice of the dispatching kernels, forced (the suite sets the run-time switch
    MPCONVERT_NO_DEVICE_ADVICE=1, which only the emitted kernels read)."""
    monkeypatch.setattr(upcast, "UPCAST_ON_CPU", on)


def _grads(module, *args, **kwargs) -> tuple[torch.Tensor, dict]:
    module.zero_grad()
    out = module(*args, **kwargs)
    loss = out.loss if hasattr(out, "loss") else out.float().pow(2).mean()
    loss.backward()
    return loss.detach().float(), {name: p.grad.float().clone() for name, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_portable_conversion_retargets_its_attentions_and_large_gemms(tracer, monkeypatch):
    torch.manual_seed(0)
    model, x = nn.Sequential(Block(), Block()), torch.randn(3, 10, 64)
    monkeypatch.setattr(cpu_gemm, "MIN_GEMM_FLOPS", 2 * 30 * 64 * 192)  # qkv (and the MLP) dispatched, not out
    conv = converter.convert(model, (x,), precision="bf16", tracer=tracer, opt_level="O2")
    assert_half_ran(conv, min_share=0.9, label=tracer)
    names = _names(conv.module)
    assert names.count("dispatch_linear") == 6 and names.count("linear") + names.count("linear.default") == 2, names
    assert names.count("dispatch_attention") == 2 and not {"scaled_dot_product_attention", "scaled_dot_product_attention.default"} & set(names)
    lowering = conv.report.to_dict()["lowering"]
    assert [c["lowering"] for c in lowering] == ["dispatch_attention", "dispatch_attention", "dispatch_gemm"], lowering
    assert lowering[2]["node"] == "6 bf16 GEMM call(s)" and "2 smaller GEMM call(s)" in lowering[2]["why"], lowering[2]
    assert ("portable (no device named): 2 attention call(s) and 6 bf16 GEMM call(s) choose their kernel per device at "
            "run time") in conv.report.to_markdown()
    retargeted = [n for n in conv.module.graph.nodes if n.op == "call_function" and _names_of(n).startswith("dispatch")]
    assert all(any(stage == "lower" for stage, _ in n.meta[META_DECISION].notes) for n in retargeted)
    fp16 = converter.convert(model, (x,), precision="fp16", tracer=tracer)
    assert _names(fp16.module).count("dispatch_attention") == 2 and _names(fp16.module).count("dispatch_linear") == 6
    tuned = converter.convert(model, (x,), precision="bf16", tracer=tracer, device="cpu")
    assert not any(n.startswith("dispatch") for n in _names(tuned.module))  # converted for the CPU: its own lowering
    reference = {}
    for on in (True, False):
        _fast(monkeypatch, on)
        reference[on] = _grads(conv.module, x)
    fp32_loss, fp32_grads = _grads(model, x)
    for on, (loss, grads) in reference.items():
        worst = min(sqnr(fp32_grads[k], grads[k]) for k in fp32_grads)
        assert worst >= 25, (on, {k: round(sqnr(fp32_grads[k], grads[k]), 1) for k in grads})  # a sign flip: < 0 dB
        assert abs(loss - fp32_loss) <= 2e-2 * fp32_loss, (on, loss, fp32_loss)


def _names_of(node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _llama(transformers):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)  # SDPA attention and use_cache: the library's defaults


@pytest.mark.parametrize("device", [None, "cpu"])
def test_an_hf_llama_with_library_defaults_on_left_and_right_padded_batches(device, monkeypatch):
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers)
    ids = torch.randint(0, 128, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding: with the causal mask, queries 0-3 of row 1 see no key at all
    mask[2, 7:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    example = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    _fast(monkeypatch, True)
    conv = converter.convert(model, example, precision="bf16", device=device)
    assert_half_ran(conv, min_share=0.9)
    names = _names(conv.module)
    if device is None:  # portable: the two layers' attentions dispatch; forced here, they run in fp32 arithmetic
        assert names.count("dispatch_attention") == 2, names
    else:  # converted for the CPU: lowered in the graph, the masked softmax is the safe one
        assert names.count("_safe_softmax") == 2 and not any(n.startswith("dispatch") for n in names), names
    fp32_loss, fp32_grads = _grads(model, **example)
    loss, grads = _grads(conv.module, **example)
    with torch.no_grad():
        logits = conv.module(**example).logits
    assert torch.isfinite(logits).all() and all(torch.isfinite(g).all() for g in grads.values())
    want = model(input_ids=ids, attention_mask=mask).logits.detach()
    keep = mask.bool()  # padded positions' logits are not compared (their values are arbitrary in both)
    assert sqnr(want[keep], logits[keep].float()) >= 25, sqnr(want[keep], logits[keep].float())
    assert abs(loss - fp32_loss) <= 1e-2 * fp32_loss, (loss, fp32_loss)
    worst = min(sqnr(fp32_grads[k], grads[k]) for k in fp32_grads if fp32_grads[k].abs().sum() > 0)
    assert worst >= 20, {k: round(sqnr(fp32_grads[k], grads[k]), 1) for k in grads}


def test_model_py_carries_the_dispatching_kernels_and_runs_with_only_torch(monkeypatch, tmp_path):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 16, 64)
    monkeypatch.setattr(cpu_gemm, "MIN_GEMM_FLOPS", 0)
    conv = converter.convert(model, (x,), precision="bf16")
    code = generate_model_source(conv).code
    assert "def dispatch_attention(" in code and "class UpcastAttention(" in code and "def dispatch_linear(" in code
    assert "from converter" not in code and code.count("dispatch_linear(") >= 5
    # without the run-time switch the child measures its CPU and picks its kernels itself
    got = run_model_py_alone(conv, x, tmp_path, env_drop=("MPCONVERT_NO_DEVICE_ADVICE",))
    assert got["modules"] == [] and got["grads"] == len(list(model.parameters())), got
    with torch.no_grad():
        want = conv.module(x)  # the kernels' native path (the suite's run-time switch)
    assert got["out"].dtype == want.dtype and sqnr(want.float(), got["out"].float()) >= 40, sqnr(want.float(), got["out"].float())


def test_the_onnx_export_writes_the_plain_ops(monkeypatch, tmp_path):
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 16, 64)
    monkeypatch.setattr(cpu_gemm, "MIN_GEMM_FLOPS", 0)
    conv = converter.convert(model, (x,), precision="bf16")
    plain = converter.convert(model, (x,), precision="bf16", dispatch_kernels=False)
    assert not any(n.startswith("dispatch") for n in _names(plain.module))
    results = [c.export_onnx(tmp_path / f"{i}.onnx") for i, c in enumerate((conv, plain))]
    assert all(r.ok for r in results), [r.notes for r in results]
    assert results[0].cast_count == results[1].cast_count == results[0].expected_casts, [r.cast_count for r in results]
    assert results[0].cast_pairs == [], results[0].cast_pairs
    assert _names(conv.module).count("dispatch_linear") == 4  # the conversion itself is untouched


def test_an_hf_bert_with_attention_dropout_trains_through_the_dispatching_kernel(monkeypatch):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64)  # attention dropout 0.1
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config)
    ids = torch.randint(0, 128, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    example = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    _fast(monkeypatch, True)
    conv = converter.convert(model, example, precision="bf16")
    assert _names(conv.module).count("dispatch_attention") == 2, _names(conv.module)
    assert_half_ran(conv, min_share=0.9)
    runs = []
    for _ in range(2):  # train mode: dropout inside the kernel, recomputed in backward with the same mask
        torch.manual_seed(7)
        runs.append(_grads(conv.module.train(), **example))
    assert torch.equal(runs[0][0], runs[1][0]) and all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    assert all(torch.isfinite(g).all() for g in runs[0][1].values())
    conv.module.eval()
    model.eval()
    fp32_loss, fp32_grads = _grads(model, **example)
    loss, grads = _grads(conv.module, **example)
    assert abs(loss - fp32_loss) <= 1e-2 * fp32_loss, (loss, fp32_loss)
    # the key biases' gradients are zero in exact arithmetic (softmax ignores a per-row constant): rounding noise
    largest = max(g.norm() for g in fp32_grads.values())
    worst = min(sqnr(fp32_grads[k], grads[k]) for k in fp32_grads if fp32_grads[k].norm() > 1e-4 * largest)
    assert worst >= 20, {k: round(sqnr(fp32_grads[k], grads[k]), 1) for k in grads}


@pytest.mark.slow
@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("name", ["t5", "llama"])
def test_stock_models_with_the_cpu_kernels_match_autocast_in_outputs_and_gradients(name, device, monkeypatch):
    """tests/test_defaults_caches.py's stock-model check (output and gradient SQNR against fp32 at least
    autocast's − 1 dB) with the kernels' CPU path on, portable and converted for the CPU. T5's unscaled attention
    is where rounding the scores to bf16 (the bf16 matmul·softmax·matmul lowering) lost 2.7 dB of gradient SQNR
    against autocast (30.6 dB against 33.3)."""
    import tests.test_defaults_caches as stock

    _fast(monkeypatch, True)
    applied, original = [], converter.apply

    def apply(model, example, **options):  # the stock check's converter.apply, for the device, its choices kept
        # device="cpu": as on a CPU whose half GEMM measured slow
        original(model, example, device=device, upcast_half_gemms=True, **options)
        applied.append(converter.conversion_of(model).report.to_dict()["lowering"])

    monkeypatch.setattr(converter, "apply", apply)
    stock.test_stock_model_applied_in_bf16_matches_autocast_in_outputs_and_gradients(name)
    kernels = [c["lowering"] for c in applied[0] if c["lowering"].endswith("_attention")]
    assert kernels and set(kernels) == {"dispatch_attention" if device is None else "upcast_attention"}, applied


@pytest.mark.slow
def test_a_portable_graph_with_its_cpu_kernels_compiles_without_graph_breaks(monkeypatch):
    _fast(monkeypatch, True)
    monkeypatch.setattr(cpu_gemm, "MIN_GEMM_FLOPS", 0)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model, x = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train(), torch.randn(2, 8, 32)
    conv = converter.convert(model, (x,), precision="bf16")
    names = _names(conv.module)
    assert names.count("dispatch_attention") == 2 and names.count("dispatch_linear") == 8, names
    torch._dynamo.reset()
    explained = torch._dynamo.explain(conv.module)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, [str(b.reason) for b in explained.break_reasons]
    compiled = torch.compile(copy.deepcopy(conv.module), backend="aot_eager")  # AOTAutograd traces the Functions
    (loss, grads), (want, want_grads) = _grads(compiled, x), _grads(conv.module, x)
    torch._dynamo.reset()
    grads = {k.removeprefix("_orig_mod."): g for k, g in grads.items()}  # a compiled module's parameter names
    assert grads.keys() == want_grads.keys() and abs(loss - want) <= 1e-2 * want, (loss, want)
    pooled = sqnr(torch.cat([want_grads[k].reshape(-1) for k in sorted(want_grads)]),
                  torch.cat([grads[k].reshape(-1) for k in sorted(want_grads)]))
    assert pooled >= 35, pooled  # tests/test_compile.py's bound for the CPU lowering's graphs


def test_torchscript_compiles_the_kernels_plain_branch(monkeypatch):
    """``torch.jit.script`` of a portable conversion compiles each kernel's ``torch.jit.is_scripting()`` branch: the
    plain ops (TorchScript cannot run the autograd Functions), so the scripted module computes what the module
    computes with its kernels native."""
    monkeypatch.setattr(cpu_gemm, "MIN_GEMM_FLOPS", 0)
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 16, 64)
    conv = converter.convert(model, (x,), precision="bf16", tracer="fx")
    kernels = [n for n in _names(conv.module) if n.startswith("dispatch_")]
    assert len(kernels) == 5, kernels  # 4 linears and the attention
    scripted = torch.jit.script(conv.module)
    _fast(monkeypatch, False)
    with torch.no_grad():
        got, want = scripted(x), conv.module(x)
    assert torch.equal(got, want), (got - want).abs().max()
