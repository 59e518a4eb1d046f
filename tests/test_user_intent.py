"""The user's precision intent outranks the rules (issue 30, item 4).

A region under ``torch.autocast(enabled=False)`` is fp32, the matmul-class ops of a region under
``torch.autocast(dtype=torch.bfloat16)`` are bf16 whatever the conversion's target, and
transformers' ``_keep_in_fp32_modules`` keeps those modules fp32 in fp16 — each decided with a
``[user] ...`` rule ranked above every rule file, with both tracers.

The front end below is what users write on purpose: a log-mel spectrogram of int16-scale audio
(samples ~8000) whose squared DFT magnitudes reach ~1e10. Before the fix, the rules decided its
matmuls half: fp16 overflowed (the conversion raised Fp16OverflowError), bf16 rounded the
features (79.9 dB instead of exact) and their gradient w.r.t. the audio (48.6 dB instead of exact).
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import sqnr
from torch import nn

import converter
from converter.ir.meta import META_CAST, META_DECISION
from converter.report.explain import explain, explain_rows
from converter.report.markdown import md_escape

pytestmark = pytest.mark.filterwarnings("ignore::converter.api.SlowHalfWarning")


class MelFront(nn.Module):
    """DFT as two matmuls, power, mel filterbank, log: in fp32 on purpose (the power reaches ~1e10)."""

    def __init__(self, n_fft: int = 64, hop: int = 32, n_mels: int = 16):
        super().__init__()
        k = torch.arange(n_fft // 2 + 1).float()[:, None]
        t = torch.arange(n_fft).float()[None]
        self.register_buffer("cos", torch.cos(2 * math.pi * k * t / n_fft).t().contiguous())
        self.register_buffer("sin", -torch.sin(2 * math.pi * k * t / n_fft).t().contiguous())
        self.register_buffer("window", torch.hann_window(n_fft))
        self.register_buffer("fb", torch.rand(n_fft // 2 + 1, n_mels, generator=torch.Generator().manual_seed(1)))
        self.n_fft, self.hop = n_fft, hop

    def forward(self, wav):
        with torch.autocast("cpu", enabled=False):  # FRONT
            frames = wav.unfold(-1, self.n_fft, self.hop) * self.window
            re = frames @ self.cos
            im = frames @ self.sin
            power = re * re + im * im
            return torch.log(power @ self.fb + 1e-6)


class SpecNet(nn.Module):
    """Front end → conv → self-attention → pooled head. ``pool``: the head's region, fp32
    (``enabled=False``) or bf16 (``dtype=torch.bfloat16``)."""

    def __init__(self, pool: str = "fp32", n_mels: int = 16, d: int = 32, classes: int = 5):
        super().__init__()
        self.front = MelFront(n_mels=n_mels)
        self.conv = nn.Conv1d(n_mels, d, 3, padding=1)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)
        self.pool, self.d = pool, d

    def forward(self, wav):
        feats = self.front(wav)
        h = F.gelu(self.conv(feats.transpose(1, 2))).transpose(1, 2)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(self.d), dim=-1) @ v
        h = h + self.proj(a)
        if self.pool == "fp32":
            with torch.autocast("cpu", enabled=False):  # POOL32
                logits = self.head(h.mean(1))
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):  # POOL16
                logits = self.head(h.mean(1))
            logits = logits.float()
        return logits, feats


def _line(tag: str) -> str:
    """``test_user_intent.py:LINE`` of the ``with`` statement marked ``# tag``."""
    lines, start = inspect.getsourcelines(SpecNet if tag.startswith("POOL") else MelFront)
    offset = next(i for i, text in enumerate(lines) if text.rstrip().endswith(f"# {tag}"))
    return f"test_user_intent.py:{start + offset}"


FRONT_OPS = ["unfold", "mul", "matmul", "matmul", "mul", "mul", "add", "matmul", "add", "log"]


def _wav() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(3, 1056) * 8000  # int16-scale audio: |DFT|^2 up to ~1e10


def _run(module: nn.Module, wav: torch.Tensor):
    """(logits, features, parameter gradients of a loss on both, gradient of the features alone w.r.t. the audio)."""
    for p in module.parameters():
        p.grad = None
    logits, feats = module(wav)
    (logits.square().sum() + feats.mean()).backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    audio = wav.clone().requires_grad_(True)
    module(audio)[1].sum().backward()  # the front end's own backward: every op of it in fp32
    return logits.detach(), feats.detach(), grads, audio.grad


def _rows(conv, rule: str) -> list[dict]:
    return [r for r in conv.report.nodes if r["rule"] == rule]


def _region_reads(conv, names: set[str]) -> dict[str, str]:
    """For each node in ``names``: input node -> the dtype it reads it in (a cast's target, else the input's precision)."""
    reads = {}
    for node in conv.module.graph.nodes:
        if node.name not in names:
            continue
        for arg in node.all_input_nodes:
            cast = arg.meta.get(META_CAST)
            decision = arg.meta.get(META_DECISION)
            if cast is not None:
                reads[f"{node.name}<-{arg.name}"] = cast.dtype
            elif decision is not None:
                reads[f"{node.name}<-{arg.name}"] = decision.precision
    return reads


@pytest.fixture(scope="module")
def reference_fp32():
    torch.manual_seed(0)
    model = SpecNet("fp32")
    wav = _wav()
    return model, wav, _run(model, wav)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_autocast_disabled_regions_are_fp32_with_the_user_rule(reference_fp32, precision, tracer):
    model, wav, (ref_logits, ref_feats, ref_grads, ref_audio_grad) = reference_fp32
    conv = converter.convert(model, (wav,), precision=precision, tracer=tracer)  # fp16 before the fix: Fp16OverflowError
    assert conv.tracer == tracer

    front_rule, pool_rule = f"[user] autocast region at {_line('FRONT')}", f"[user] autocast region at {_line('POOL32')}"
    front = _rows(conv, front_rule)
    pool = _rows(conv, pool_rule)
    # every compute node of the front end is in the region, fp32, decided by the user's rule
    assert [r["op"] for r in front] == FRONT_OPS, [(r["name"], r["op"], r["rule"]) for r in front]
    assert {r["name"] for r in conv.report.nodes if r["module"] == "front"} == {r["name"] for r in front}
    assert [r["op"] for r in pool] == ["mean", "linear"], [(r["name"], r["rule"]) for r in pool]
    for r in front + pool:
        assert (r["precision"], r["requested"], r["rule_level"]) == ("fp32", "fp32", "user"), r
        assert r["matches"][0]["level"] == "user" and "enabled=False" in r["reason"], r
    head = next(r for r in pool if r["op"] == "linear")
    assert [m["level"] for m in head["matches"]] == ["user", "op"] and head["matches"][1]["precision"] == "half"
    # the rest is decided by the rules: the conv and attention matmuls in the target dtype
    assert {r["precision"] for r in conv.report.nodes if r["op"] in ("conv1d", "linear", "matmul") and r["rule_level"] != "user"} \
        == {precision}

    # casts at the region boundaries: one out of the front end (the log-mel to the conv's dtype), one into
    # the pooled head (the half attention output to fp32, shared by the region's reads); nothing half inside
    region = {r["name"] for r in front + pool}
    act = [c for c in conv.report.casts if not c["on_weight"]]
    out_of = [(c["src_dtype"], c["dtype"]) for c in act if c["src"] in region]
    into = [(c["src_dtype"], c["dtype"], c["consumers"]) for c in act if set(c["consumers"]) & region]
    mean = next(r["name"] for r in pool if r["op"] == "mean")
    assert out_of == [("fp32", precision)], act
    assert into == [(precision, "fp32", [mean])], act
    assert not [c for c in conv.report.casts if c["on_weight"] and set(c["consumers"]) & region]
    reads = _region_reads(conv, region)
    assert set(reads.values()) == {"fp32"}, reads

    logits, feats, grads, audio_grad = _run(conv.module, wav)
    assert torch.isfinite(logits).all() and torch.isfinite(feats).all() and torch.isfinite(audio_grad).all()
    # the features and their gradient are computed in fp32 exactly as the model does (measured: exact;
    # with the rules' bf16 front end 79.9 dB and 48.6 dB; an fp16 one overflows)
    assert sqnr(ref_feats, feats) >= 120, sqnr(ref_feats, feats)
    assert sqnr(ref_audio_grad, audio_grad) >= 120, sqnr(ref_audio_grad, audio_grad)
    # logits, worst parameter gradient: measured 74.8 / 67.0 dB (fp16), 58.5 / 48.6 dB (bf16; bf16 front end: 50.3 / 47.4)
    floor = {"fp16": (65.0, 58.0), "bf16": (54.0, 44.0)}[precision]
    assert sqnr(ref_logits, logits) >= floor[0], sqnr(ref_logits, logits)
    worst = min((sqnr(ref_grads[n], grads[n]), n) for n in ref_grads)
    assert all(torch.isfinite(g).all() for g in grads.values()) and worst[0] >= floor[1], worst


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_bf16_autocast_region_inside_an_fp16_conversion(tracer):
    torch.manual_seed(0)
    model = SpecNet("bf16")
    wav = _wav()
    ref = _run(model, wav)  # the model itself runs its head under autocast: bf16
    conv = converter.convert(model, (wav,), precision="fp16", tracer=tracer)

    rule = f"[user] autocast region at {_line('POOL16')}"
    rows = {r["op"]: r for r in conv.report.nodes if r["module"] in ("", "head") and r["op"] in ("mean", "linear")}
    head, mean = rows["linear"], rows["mean"]
    # the matmul-class op of the region runs in the region's dtype, by the user's rule
    assert (head["precision"], head["requested"], head["rule"], head["rule_level"]) == ("bf16", "bf16", rule, "user"), head
    assert "dtype=torch.bfloat16" in head["reason"]
    # the rest of the region by the rules (a reduction: fp32), the rest of the model in fp16
    assert (mean["precision"], mean["rule"]) == ("fp32", "default.toml:[op].mean"), mean
    assert {r["precision"] for r in conv.report.nodes
            if (r["op"] in ("conv1d", "matmul") or r["name"] in ("qkv", "proj")) and r["rule_level"] != "user"} == {"fp16"}
    assert _rows(conv, f"[user] autocast region at {_line('FRONT')}") and \
        {r["precision"] for r in _rows(conv, f"[user] autocast region at {_line('FRONT')}")} == {"fp32"}

    act = [(c["src_dtype"], c["dtype"], c["consumers"]) for c in conv.report.casts if not c["on_weight"]]
    assert [c for c in act if c[2] == [mean["name"]]] == [("fp16", "fp32", [mean["name"]])], act
    assert [c for c in act if c[2] == [head["name"]]] == [("fp32", "bf16", [head["name"]])], act
    weights = [(c["src"], c["dtype"]) for c in conv.report.casts if c["on_weight"] and c["consumers"] == [head["name"]]]
    assert sorted(weights) == [("head_bias", "bf16"), ("head_weight", "bf16")], weights
    # its ops' dtypes are explicit now: the live bf16 autocast is gone, the front end's enabled=False stays
    enters = [n.args for n in conv.module.graph.nodes if n.target is torch.amp.autocast_mode._enter_autocast]
    assert [a[2] for a in enters] == [False], enters

    logits, feats, grads, audio_grad = _run(conv.module, wav)
    assert torch.isfinite(logits).all() and sqnr(ref[1], feats) >= 120, sqnr(ref[1], feats)
    assert sqnr(ref[0], logits) >= 60, sqnr(ref[0], logits)  # measured: exact (the bf16 head rounds both alike)
    worst = min((sqnr(ref[2][n], grads[n]), n) for n in ref[2])
    assert worst[0] >= 58, worst  # measured 68.6 dB


def test_user_rule_outranks_a_node_rule_and_shows_in_explain_and_report(tmp_path, reference_fp32):
    model, wav, _ = reference_fp32
    rules = tmp_path / "mine.toml"
    rules.write_text('[node]\nmatmul = "fp16"\n\n[module]\n"front" = "half"\n')
    conv = converter.convert(model, (wav,), precision="fp16", tracer="fx", rules=[str(rules)])
    row = next(r for r in conv.report.nodes if r["name"] == "matmul")
    rule = f"[user] autocast region at {_line('FRONT')}"
    assert (row["precision"], row["rule"]) == ("fp32", rule), row
    assert [(m["level"], m["precision"]) for m in row["matches"]][:3] == [("user", "fp32"), ("node", "fp16"), ("module", "half")]

    text = explain(conv, "matmul")
    assert f"decided by: {rule}" in text
    assert "precedence, highest first: user > node > module > module_type > op > default" in text
    assert f"1. [user] autocast region at {_line('FRONT')} (in the model code) -> fp32" in text
    assert "WINS: the user's precision intent in the model code outranks every rule file" in text
    assert "loses to rule 1: the user's precision intent in the model code outranks every rule file" in text
    # `mpconvert explain OUT_DIR` answers from report.json alone
    assert explain_rows(conv.report.nodes, conv.report.casts, "matmul") == text
    md = conv.report.to_markdown()
    assert "## The model's own precision intent" in md
    assert f"| {md_escape(rule)} | fp32 10 |" in md, md[:2000]
    assert f"| {md_escape('[user] autocast region at ' + _line('POOL32'))} | fp32 2 |" in md


class Nested(nn.Module):
    """An fp32 block inside a bf16 block: the innermost autocast wins."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.a(x)
            with torch.autocast("cpu", enabled=False):
                z = self.b(y.float())
        return z


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_the_innermost_autocast_region_wins(tracer):
    torch.manual_seed(0)
    model = Nested()
    x = torch.randn(4, 16)
    conv = converter.convert(model, (x,), precision="fp16", tracer=tracer)
    rows = {r["name"]: r for r in conv.report.nodes}
    lines, start = inspect.getsourcelines(Nested)
    outer, inner = (f"test_user_intent.py:{start + i}" for i, t in enumerate(lines) if "with torch.autocast" in t)
    assert (rows["a"]["precision"], rows["a"]["rule"]) == ("bf16", f"[user] autocast region at {outer}")
    assert (rows["b"]["precision"], rows["b"]["rule"]) == ("fp32", f"[user] autocast region at {inner}")
    with torch.no_grad():
        assert sqnr(model(x), conv.module(x)) >= 60


class Gated(nn.Module):
    """A module carrying transformers' keep-in-fp32 lists (matched as transformers 5 matches them)."""

    _keep_in_fp32_modules = ["head"]
    _keep_in_fp32_modules_strict = ["gate"]

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.gate = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.body(x)
        return self.head(h * torch.sigmoid(self.gate(h)))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_keep_in_fp32_modules_follow_transformers_dtype_plan(precision):
    """``_keep_in_fp32_modules`` applies to fp16 only, ``_strict`` to fp16 and bf16 (PreTrainedModel._get_dtype_plan)."""
    torch.manual_seed(0)
    model = Gated()
    conv = converter.convert(model, (torch.randn(4, 16),), precision=precision, tracer="fx")
    rows = {r["name"]: r for r in conv.report.nodes}
    assert (rows["gate"]["precision"], rows["gate"]["rule"]) == ("fp32", "[user] _keep_in_fp32_modules_strict of Gated: gate")
    want = ("fp32", "[user] _keep_in_fp32_modules of Gated: head") if precision == "fp16" else (precision, "default.toml:[op].linear")
    assert (rows["head"]["precision"], rows["head"]["rule"]) == want
    assert (rows["body"]["precision"], rows["body"]["rule"]) == (precision, "default.toml:[op].linear")


@pytest.mark.slow
def test_t5_keep_in_fp32_modules_wo_in_fp16():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
                   pad_token_id=0)  # library defaults otherwise: SDPA attention, use_cache=True in the config
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg)
    assert model.config._attn_implementation == "sdpa" and set(model._keep_in_fp32_modules) == {"wo"}
    ids, dec = torch.randint(1, 128, (2, 9)), torch.randint(1, 128, (2, 7))
    # stock call: no use_cache (captured without the cache), no calibration (the fp16 check ignores mask fills)
    example = {"input_ids": ids, "decoder_input_ids": dec}
    conv = converter.convert(model, example, precision="fp16")

    rule = "[user] _keep_in_fp32_modules of T5ForConditionalGeneration: wo"
    user = [r for r in conv.report.nodes if r["rule_level"] == "user"]
    assert sorted(r["module"] for r in user) == [
        "decoder.block.0.layer.2.DenseReluDense.wo", "decoder.block.1.layer.2.DenseReluDense.wo",
        "encoder.block.0.layer.1.DenseReluDense.wo", "encoder.block.1.layer.1.DenseReluDense.wo"], user
    assert {(r["op"], r["precision"], r["rule"]) for r in user} == {("linear", "fp32", rule)}
    assert all("in fp16" in r["reason"] for r in user)
    wi = [r for r in conv.report.nodes if r["module"].endswith("DenseReluDense.wi")]
    assert len(wi) == 4 and {r["precision"] for r in wi} == {"fp16"}
    names = {r["name"] for r in user}
    act = [c for c in conv.report.casts if set(c["consumers"]) & names]
    assert [(c["src_dtype"], c["dtype"], c["on_weight"]) for c in act] == [("fp16", "fp32", False)] * 4, act
    assert "1. [user] _keep_in_fp32_modules of T5ForConditionalGeneration: wo (in the model code) -> fp32" in explain(conv, user[0]["name"])

    model.eval()
    conv.module.eval()
    ref = model(**example).logits
    out = conv.module(**example).logits
    assert torch.isfinite(out).all() and sqnr(ref.detach(), out.detach()) >= 45, sqnr(ref.detach(), out.detach())  # measured 56.4
    ref.float().square().mean().backward()
    out.float().square().mean().backward()
    mine = dict(conv.module.named_parameters())
    for name, p in model.named_parameters():
        if name.endswith("DenseReluDense.wo.weight"):
            got = mine[name]
            assert torch.isfinite(got.grad).all() and sqnr(p.grad, got.grad) >= 30, (name, sqnr(p.grad, got.grad))


def test_fx_region_emits_to_model_py_and_runs_like_the_module(tmp_path, reference_fp32):
    """symbolic_trace graphs carry the autocast calls the model made (recorded while tracing): model.py runs them."""
    import importlib.util

    model, wav, _ = reference_fp32
    conv = converter.convert(model, (wav,), precision="fp16", tracer="fx")
    enters = [n.args for n in conv.module.graph.nodes if n.target is torch.amp.autocast_mode._enter_autocast]
    assert [(a[0], a[2]) for a in enters] == [("cpu", False), ("cpu", False)], enters
    conv.save(tmp_path / "out")
    source = (tmp_path / "out" / "model.py").read_text()
    assert source.count("torch.amp.autocast_mode._enter_autocast('cpu', torch.bfloat16, False, True)") == 2
    assert source.count("torch.amp.autocast_mode._exit_autocast(") == 2
    spec = importlib.util.spec_from_file_location("emitted_user_intent", tmp_path / "out" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    emitted = module.load()
    with torch.no_grad():
        got, want = emitted(wav), conv.module(wav)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # under an outer autocast the front end stays fp32, as the model's own block keeps it
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(conv.module(wav)[1], want[1])
    assert not torch.is_autocast_enabled("cpu")


def test_overflow_check_enters_each_autocast_region_once():
    """The fp16 overflow check runs the graph twice in lockstep: an autocast call made twice left autocast on."""
    from converter.numerics.overflow import first_overflow as _first_overflow
    from converter.passes.capture import capture

    torch.manual_seed(0)
    captured = capture(Nested(), (torch.randn(4, 16),), tracer="export")  # an enabled bf16 region, not yet converted
    enters = [n.args for n in captured.gm.graph.nodes if n.target is torch.amp.autocast_mode._enter_autocast]
    assert [a[2] for a in enters] == [True, False], enters
    assert _first_overflow(captured.gm, captured.args, captured.kwargs) is None
    assert not torch.is_autocast_enabled("cpu")
