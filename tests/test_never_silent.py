"""Issue 30 item 5, "never silently wrong": the fp16 overflow check, bf16 next to fp16 in placement, and
train/eval mode rewriting.

* The overflow check that ``convert(precision="fp16")`` runs ignores mask fills (``torch.finfo(dtype).min``,
  ``-inf``, ``-1e9`` written by ``masked_fill``/``full``/``where``, additive masks built from them) and
  ``empty``/``new_empty`` memory that a ``copy_``/``index_put_`` fills later; data that overflows is still refused.
* An op a rule runs in bf16 inside an fp16 conversion hands bf16 to its follow consumers: no bf16 -> fp16
  cast right after it; the cast sits where the bf16 value meets an fp16 consumer, and says so.
* ``F.batch_norm(w, None, None, training=True)`` (weight standardisation) and ``F.dropout(x, p, training=True)``
  (MC dropout) do the same in both modes: they are not made to follow ``self.training``.
* A model built without weights gets no "branches on self.training" note.
"""
from __future__ import annotations

import collections
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_half_ran, sqnr
from torch import nn

import converter
from converter.api import Fp16OverflowError
from converter.ir.graphmodule import TwoModeGraphModule
from converter.ir.meta import META_CAST, META_DECISION

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # SlowHalfWarning: fp16 on a CPU

FP32_MIN = torch.finfo(torch.float32).min


def _grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])


def _zero(*modules: nn.Module) -> None:
    for m in modules:
        for p in m.parameters():
            p.grad = None


# --------------------------------------------------------------------------------------------------------
# (a) overflow check: mask fills are not overflow


def test_stock_t5_converts_to_fp16_close_to_fp32():
    """A T5 from a small config with the library's defaults (SDPA attention, relative position bias, a
    causal mask filled with torch.finfo(fp32).min) converts to fp16: outputs and gradients within 1 dB of
    autocast's. Before, the check counted the mask's fill, -inf once cast to fp16, as overflow."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    assert model.config._attn_implementation == "sdpa"
    # the config and the call are stock (use_cache=True in the config: captured without the cache)
    kwargs = {"input_ids": torch.randint(0, 128, (2, 8)), "decoder_input_ids": torch.randint(0, 128, (2, 6))}
    conv = converter.convert(model, ((), kwargs), precision="fp16")
    assert_half_ran(conv, min_share=0.8)
    conv.module.eval()

    ref = model(**kwargs).logits
    ref.pow(2).mean().backward()
    g_ref = _grads(model)
    _zero(model)
    with torch.autocast("cpu", dtype=torch.float16):
        amp = model(**kwargs).logits
    amp.float().pow(2).mean().backward()
    g_amp = _grads(model)
    _zero(model)
    out = conv.module(**kwargs).logits
    out.float().pow(2).mean().backward()
    g_out = _grads(conv.module)

    ours, theirs = sqnr(ref, out), sqnr(ref, amp)
    assert ours >= theirs - 1.0 and ours > 40, f"output SQNR {ours:.1f} dB vs autocast {theirs:.1f} dB"
    ours, theirs = sqnr(g_ref, g_out), sqnr(g_ref, g_amp)
    assert ours >= theirs - 1.0 and ours > 35, f"gradient SQNR {ours:.1f} dB vs autocast {theirs:.1f} dB"


class MaskedAttention(nn.Module):
    """Attention whose causal mask, written in one of the ways models write it, plus a learned relative
    bias (T5-style), is an additive float mask read by half attention: cast to fp16, its fill is -inf."""

    def __init__(self, style: str, d: int = 16, t: int = 6):
        super().__init__()
        self.style = style
        self.qkv = nn.Linear(d, 3 * d)
        self.rel_bias = nn.Parameter(0.1 * torch.randn(t, t))
        self.out = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        t = x.shape[1]
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        low = torch.finfo(x.dtype).min
        if self.style == "masked_fill_finfo_min":
            mask = torch.zeros(t, t, device=x.device).masked_fill(future, low)
        elif self.style == "masked_fill_1e9":
            mask = torch.zeros(t, t, device=x.device).masked_fill(future, -1e9)
        elif self.style == "where_finfo_min":
            mask = torch.where(future, low, torch.zeros(t, t, device=x.device))
        elif self.style == "full_triu":  # HF's older causal masks
            mask = torch.full((t, t), low, device=x.device).triu(1)
        elif self.style == "one_minus_mask":  # (1 - mask) * finfo.min, BERT-style
            mask = (1.0 - (~future).to(x.dtype)) * low
        else:
            raise ValueError(self.style)
        mask = mask + self.rel_bias[:t, :t]  # an additive mask built from the fill
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


_FILLS = ["masked_fill_finfo_min", "masked_fill_1e9", "where_finfo_min", "full_triu", "one_minus_mask"]


@pytest.mark.parametrize("style", _FILLS)
def test_mask_fills_convert_to_fp16(style):
    torch.manual_seed(0)
    model = MaskedAttention(style)
    x = torch.randn(2, 6, 16, requires_grad=True)
    conv = converter.convert(model, (x,), precision="fp16")
    assert_half_ran(conv, min_share=0.9, label=style)
    ref = model(x)
    ref.pow(2).sum().backward()
    g_ref = _grads(model)
    _zero(model)
    out = conv.module(x)
    out.float().pow(2).sum().backward()
    g_out = _grads(conv.module)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        amp = model(x)
    ours, theirs = sqnr(ref, out), sqnr(ref, amp)
    assert ours >= theirs - 1.0 and ours > 40, f"{style}: output SQNR {ours:.1f} dB vs autocast {theirs:.1f} dB"
    assert sqnr(g_ref, g_out) > 35, f"{style}: gradient SQNR {sqnr(g_ref, g_out):.1f} dB"


class OverflowBesideMask(nn.Module):
    """The mask is a fill, but the masked scores are then scaled beyond fp16's range: a real overflow in the
    very tensor that carries the fill (``where``: in its unmasked elements; ``matmul``: before the mask)."""

    def __init__(self, where: str, d: int = 16):
        super().__init__()
        self.where = where
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.where == "matmul":
            q, k = q * 300.0, k * 300.0
        scores = q @ k.transpose(-1, -2)  # half; |scores| > 65504 for "matmul"
        t = x.shape[1]
        scores = scores + torch.full((t, t), torch.finfo(scores.dtype).min, device=x.device).triu(1)
        if self.where == "masked":
            scores = scores * 30000.0  # half by the rule below: the data elements overflow, the mask ones are fills
        return self.out(scores.softmax(-1) @ v)


@pytest.mark.parametrize("where", ["matmul", "masked"])
def test_data_overflow_beside_a_mask_fill_is_still_refused(where, tmp_path):
    torch.manual_seed(0)
    rules = tmp_path / "mul.toml"
    rules.write_text('[node]\n"mul" = { precision = "half", reason = "test: the scale in half" }\n')
    with pytest.raises(Fp16OverflowError, match=f"fp16 overflow: node '{'matmul' if where == 'matmul' else 'mul'}'"):
        converter.convert(OverflowBesideMask(where), (10 * torch.randn(2, 6, 16),), precision="fp16", rules=[rules])


class LatentAttentionMoE(nn.Module):
    """DeepSeek-style: the query and key are assembled in ``new_empty`` tensors by slice assignment (MLA),
    and a top-1 mixture of experts scatters its outputs into ``new_empty`` with ``index_put_``."""

    def __init__(self, d: int = 32, heads: int = 4, nope: int = 8, rope: int = 4, experts: int = 4):
        super().__init__()
        self.h, self.nope, self.rope = heads, nope, rope
        self.q = nn.Linear(d, heads * (nope + rope))
        self.kv_a = nn.Linear(d, 16 + rope)
        self.kv_b = nn.Linear(16, heads * 2 * nope)
        self.o = nn.Linear(heads * nope, d)
        self.gate = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):
        b, t, _ = x.shape
        q_nope, q_pe = self.q(x).view(b, t, self.h, -1).transpose(1, 2).split([self.nope, self.rope], -1)
        latent, k_pe = self.kv_a(x).split([16, self.rope], -1)
        k_pe = k_pe.view(b, t, 1, self.rope).transpose(1, 2)
        k_nope, v = self.kv_b(latent).view(b, t, self.h, -1).transpose(1, 2).split([self.nope, self.nope], -1)
        query = k_pe.new_empty(b, self.h, t, self.nope + self.rope)
        query[:, :, :, : self.nope] = q_nope
        query[:, :, :, self.nope:] = q_pe
        key = k_pe.new_empty(b, self.h, t, self.nope + self.rope)
        key[:, :, :, : self.nope] = k_nope
        key[:, :, :, self.nope:] = k_pe
        y = x + self.o(F.scaled_dot_product_attention(query, key, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        flat = y.reshape(-1, y.shape[-1])
        choice = self.gate(flat).argmax(-1)
        routed = flat.new_empty(flat.shape)
        for i, expert in enumerate(self.experts):
            sel = choice == i
            routed[sel] = expert(flat[sel])
        return y + routed.view_as(y)


def test_new_empty_filled_by_copy_and_index_put_converts_to_fp16_every_time():
    """Before, the check read new_empty's bits before the slice assignment wrote them: a different node
    failed, or none, from run to run (4 of 6 conversions failed)."""
    torch.manual_seed(0)
    model = LatentAttentionMoE()
    x = torch.randn(2, 8, 32)
    ref = model(x)
    for attempt in range(5):
        conv = converter.convert(model, (x,), precision="fp16")  # raised Fp16OverflowError at random
        ops = collections.Counter((r["op"], r["precision"]) for r in conv.report.nodes)
        # the MLA query/key buffers and their slice copies, every Linear and the attention run in fp16 (the
        # MoE's index_put_ accumulator stays fp32, as autocast leaves a buffer made from an fp32 tensor)
        want = {("new_empty", "fp16"): 2, ("copy", "fp16"): 4, ("linear", "fp16"): 9,
                ("scaled_dot_product_attention", "fp16"): 1}
        assert {k: ops[k] for k in want} == want, f"attempt {attempt}: decided {dict(ops)}"
        assert_half_ran(conv, min_share=0.99, label=f"attempt {attempt}")
        got = sqnr(ref, conv.module(x))
        assert got > 35, f"attempt {attempt}: output SQNR {got:.1f} dB"


# --------------------------------------------------------------------------------------------------------
# (b) placement: bf16 and fp16 are distinct


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down_proj = nn.Linear(32, 16)
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        h = self.down_proj(F.gelu(self.up(x)))
        h = F.dropout(h, 0.1, self.training) * 2.0  # follow ops after the bf16 op
        return self.head(h)


class LlamaLikeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Mlp()

    def forward(self, x):
        return self.mlp(x)


class LlamaLike(nn.Module):
    """``rules/llm.toml`` runs ``*.mlp.down_proj`` in bf16."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([LlamaLikeBlock()])

    def forward(self, x):
        return self.layers[0](x)


@pytest.mark.parametrize("how", ["node rule", "llm.toml"])
def test_bf16_rule_in_fp16_conversion_keeps_follow_ops_bf16(how, tmp_path):
    torch.manual_seed(0)
    if how == "node rule":
        model, down = Mlp(), "down_proj"
        rules = tmp_path / "bf16.toml"
        rules.write_text('[node]\n"down_proj" = { precision = "bf16", reason = "test: the down-projection in bf16" }\n')
        rules = [rules]
    else:
        model, down = LlamaLike(), "layers_0_mlp_down_proj"
        rules = ["llm"]
    x = torch.randn(4, 16, requires_grad=True)
    conv = converter.convert(model, (x,), precision="fp16", rules=rules, tracer="fx")
    nodes = {n.name: n for n in conv.module.graph.nodes}
    decided = {name: n.meta[META_DECISION].precision for name, n in nodes.items() if META_DECISION in n.meta}
    head = "head" if how == "node rule" else "layers_0_mlp_head"
    assert (decided[down], decided["dropout"], decided["mul"], decided[head]) == ("bf16", "bf16", "bf16", "fp16"), decided
    casts = [n.meta[META_CAST] for n in nodes.values() if META_CAST in n.meta and n.meta[META_CAST].inserted]
    pairs = collections.Counter((c.src_dtype, c.dtype) for c in casts)
    # x, up's weight and bias, head's weight and bias to fp16; gelu, down's weight and bias to bf16; the
    # bf16 run once to fp16 before head; head's output back to fp32
    assert pairs == {("fp32", "fp16"): 5, ("fp16", "bf16"): 1, ("fp32", "bf16"): 2, ("bf16", "fp16"): 1,
                     ("fp16", "fp32"): 1}, pairs
    [meets] = [c for c in casts if (c.src_dtype, c.dtype) == ("bf16", "fp16")]
    assert meets.src == "mul" and meets.consumers == (head,), meets  # not between down_proj and dropout
    assert "a bf16 value meets an fp16 consumer" in meets.reason, meets.reason
    # numerics against fp32, gradients too
    model.eval(), conv.module.eval()
    ref = model(x)
    ref.pow(2).sum().backward()
    g_ref = _grads(model)
    _zero(model)
    out = conv.module(x)
    out.float().pow(2).sum().backward()
    g_out = _grads(conv.module)
    got, grad = sqnr(ref, out), sqnr(g_ref, g_out)
    assert got > 30 and grad > 25, f"output {got:.1f} dB, gradients {grad:.1f} dB"


# --------------------------------------------------------------------------------------------------------
# (c) mode rewriting only where behaviour depends on self.training

WS_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class WSConv2d(nn.Conv2d):
    """Weight standardisation: each filter normalised by its own mean and variance (no running stats)."""

    def forward(self, x):
        w = self.weight
        w = F.batch_norm(w.reshape(1, w.shape[0], -1), None, None, training=True, momentum=0.0, eps=1e-5).reshape_as(w)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = WSConv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.c2 = WSConv2d(8, 4, 3)

    def forward(self, x):
        return self.c2(F.relu(self.norm(self.c1(x)))).mean((2, 3))


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(2, 3, 8, 8),)
'''


def _ws_module(tmp_path):
    import importlib.util

    path = tmp_path / "ws_net.py"
    path.write_text(WS_MODEL)
    spec = importlib.util.spec_from_file_location("ws_net_never_silent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_weight_standardised_conv_keeps_batch_statistics_in_both_modes(tracer, tmp_path):
    """F.batch_norm(w, None, None, training=True) normalises by the batch's statistics whatever the mode:
    it stays training=True, so one graph serves both modes and eval mode runs (it crashed in the CLI)."""
    _, mod = _ws_module(tmp_path)
    model = mod.build_model()
    (x,) = mod.example_inputs()
    conv = converter.convert(model, (x,), precision="bf16", tracer=tracer)
    assert_half_ran(conv, label=tracer)
    modes = conv.report.records.capture.modes
    assert not isinstance(conv.module, TwoModeGraphModule) and "branches on" not in modes, modes
    assert modes.startswith("follows train()/eval(): traced in train mode, 0 mode-dependent ops"), modes
    for training in (True, False):
        model.train(training), conv.module.train(training)
        _zero(model, conv.module)
        ref = model(x)
        ref.pow(2).sum().backward()
        out = conv.module(x)
        out.float().pow(2).sum().backward()
        got, grad = sqnr(ref, out), sqnr(_grads(model), _grads(conv.module))
        assert got > 30 and grad > 25, f"{tracer} training={training}: output {got:.1f} dB, gradients {grad:.1f} dB"


def test_weight_standardised_conv_cli_exits_0(tmp_path, capfd):
    from converter.cli.main import main

    path, _ = _ws_module(tmp_path)
    code = main([str(path), "--out", str(tmp_path / "out"), "-q"])
    _, err = capfd.readouterr()
    assert code == 0, err  # was 3: "running_mean must be defined in evaluation mode"


def test_batch_norm_without_running_stats_keeps_batch_statistics_in_eval():
    """nn.BatchNorm2d(track_running_stats=False) normalises by the batch in both modes (export records
    aten.batch_norm(x, weight, bias, None, None, True, ...)): one graph, equal to the original in both modes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, track_running_stats=False), nn.ReLU(), nn.Conv2d(8, 4, 3))
    x = torch.randn(4, 3, 10, 10)
    conv = converter.convert(model, (x,), precision="bf16", tracer="export")
    assert_half_ran(conv)
    modes = conv.report.records.capture.modes
    assert not isinstance(conv.module, TwoModeGraphModule) and "branches on" not in modes, modes
    for training in (True, False):
        model.train(training), conv.module.train(training)
        got = sqnr(model(x), conv.module(x))
        assert got > 30, f"training={training}: {got:.1f} dB"


class McDropoutNet(nn.Module):
    """MC dropout (``training=True`` always) on one branch, ordinary dropout on the other."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.fc(x)
        return F.dropout(h, 0.5, training=True), self.drop(h)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_mc_dropout_stays_stochastic_in_eval(tracer):
    torch.manual_seed(0)
    model = McDropoutNet().eval()
    x = torch.randn(16, 8)
    conv = converter.convert(model, (x,), precision="bf16", tracer=tracer)
    assert_half_ran(conv, label=tracer)
    modes = conv.report.records.capture.modes
    assert not isinstance(conv.module, TwoModeGraphModule) and "branches on" not in modes, modes
    # export: nn.Dropout's aten.dropout reads self.training (FX keeps nn.Dropout a module, which follows it)
    assert f"{int(tracer == 'export')} mode-dependent ops" in modes and "1 train-mode literal(s) kept" in modes, modes
    conv.module.eval()
    (mc1, plain1), (mc2, plain2) = conv.module(x), conv.module(x)
    assert not torch.equal(mc1, mc2), "MC dropout must stay random in eval mode"
    assert torch.equal(plain1, plain2) and sqnr(model(x)[1], plain1) > 30, "nn.Dropout must be off in eval mode"
    conv.module.train()
    (_, p1), (_, p2) = conv.module(x), conv.module(x)
    assert not torch.equal(p1, p2), "nn.Dropout must be on in train mode"


# --------------------------------------------------------------------------------------------------------
# (d) no weights, no false note


def test_empty_weights_llama_has_no_branches_on_training_note():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    with converter.empty_weights():
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = converter.convert(model, ((), {"input_ids": ids}), precision="bf16")
    modes = conv.report.records.capture.modes
    assert "branches on" not in modes and not isinstance(conv.module, TwoModeGraphModule), modes
    assert "not compared by value (the model has no weights)" in modes, modes
