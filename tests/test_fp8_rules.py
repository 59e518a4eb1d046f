"""fp8 as a rule target (issue 34): the vocabulary, rules/fp8.toml's exclusions and gates, the fp8 stage.

Dispatch level: on a hand-written decoder and on transformers' Llama (small config, library defaults), exactly
the rule-selected Linears run 3 ``aten._scaled_mm`` per training step (forward, grad_input, grad_weight) with
tensorwise dtypes; the excluded ones (embedding, first layer, lm_head, router gate, misaligned, small) run
none. Every fp8 and excluded decision names its rule; a user pattern that matches nothing is a one-line
error (exit 2); the fp8 conversion stays within torchao's SQNR floors of the bf16 conversion; the emitted
model.py carries the kernels and trains where only torch is importable.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import converter
from converter.export.model_py import generate_model_source
from converter.export.weights import write_weights
from converter.ir.errors import EXIT_BAD_INPUT
from converter.ir.meta import META_CAST, META_DECISION, META_INFO
from converter.passes.fp8 import Fp8PatternError, fp8_rule_set
from converter.rules.loader import RULE_PRECISIONS, Rules, RulesError, load_rules
from tests.helpers import sqnr

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TENSORWISE = [(E4M3, E4M3), (E5M2, E4M3), (E5M2, E4M3)]  # forward, grad_input, grad_weight
#: torchao's floors (its float8 tests): output 18 dB, weight gradient 17 dB
OUT_DB, GW_DB = 18.0, 17.0
VOCAB, DIM, BATCH, SEQ = 128, 64, 2, 16


class ScaledMMCalls(TorchDispatchMode):
    """Records the operand dtypes and the output shape of each ``aten._scaled_mm`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []
        self.shapes: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._scaled_mm.default:
            self.calls.append((args[0].dtype, args[1].dtype))
            self.shapes.append(tuple(out.shape))
        return out


class Block(nn.Module):
    """Attention (q, k, v, o; the q·kᵀ and p·v matmuls) + a router-like gate + an MLP of width ``hidden``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.gate = nn.Linear(DIM, 16)  # a MoE-style router: rules/fp8.toml keeps "*.gate" bf16
        self.up, self.down = nn.Linear(DIM, hidden), nn.Linear(hidden, DIM)

    def forward(self, x):
        h = self.norm1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        att = torch.softmax(q @ k.transpose(-1, -2) / DIM ** 0.5, dim=-1) @ v
        x = x + self.o(att)
        h = self.norm2(x)
        weight = torch.sigmoid(self.gate(h)).mean(-1, keepdim=True)
        return x + weight * self.down(torch.relu(self.up(h)))


class Decoder(nn.Module):
    """Embedding, two blocks (the second with a 200-wide MLP: misaligned), a final norm and lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(256), Block(200)])
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


#: what rules/fp8.toml (with fp8_min_flops_per_token lowered to 4096) selects, and why each other Linear is not
FP8_LAYERS = {f"blocks_0_{n}" for n in ("k", "v", "o", "up", "down")} | {f"blocks_1_{n}" for n in ("q", "k", "v", "o")}
EXCLUDED = {
    "blocks_0_q": "fp8.toml:[settings].fp8_keep_first",
    "blocks_0_gate": "fp8.toml:[module].*.gate",
    "blocks_1_gate": "fp8.toml:[module].*.gate",
    "blocks_1_up": "fp8.toml:[settings].fp8_align",
    "blocks_1_down": "fp8.toml:[settings].fp8_align",
    "lm_head": "fp8.toml:[module].lm_head",
}


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _user_rules(tmp_path, text: str, name: str = "user.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return str(path)


def convert_fp8_graph(model, example_inputs, *, rules=None, recipe=None):
    """``converter.convert(precision="fp8")`` and the facts these tests read (the module, the fp8 layers)."""
    conv = converter.convert(model, example_inputs, precision="fp8", rules=rules, fp8_recipe=recipe)
    assert conv.options.precision == "bf16" and conv.options.fp8_recipe == (recipe or "auto")
    fp8 = conv.report.records.fp8.to_dict()
    assert fp8["count"] == len(fp8["layers"]), fp8
    return SimpleNamespace(module=conv.module, fp8_nodes=fp8["layers"], conv=conv, recipe=fp8["recipe"])


@pytest.fixture(scope="module")
def decoder():
    torch.manual_seed(0)
    return Decoder()


@pytest.fixture(scope="module")
def converted(decoder, tmp_path_factory):
    rules = _user_rules(tmp_path_factory.mktemp("rules"), "[settings]\nfp8_min_flops_per_token = 4096\n")
    return convert_fp8_graph(decoder, (_tokens(),), rules=[rules])


def _linears(gm: torch.fx.GraphModule) -> dict:
    return {n.name: n for n in gm.graph.nodes if n.op == "call_function" and META_DECISION in n.meta
            and n.meta[META_INFO].op == "linear"}


def _train_step(gm, tokens, keyword: str = ""):
    """zero_grad, forward (``tokens`` positional, or as the keyword argument ``keyword``), cross-entropy, backward."""
    gm.zero_grad(set_to_none=True)
    out = gm(**{keyword: tokens}) if keyword else gm(tokens)
    logits = out if isinstance(out, torch.Tensor) else out["logits"]
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    loss.backward()
    return logits.detach()


# ------------------------------------------------------------------------------------- vocabulary


def test_fp8_is_a_rule_target_for_gemms_only(tmp_path):
    assert "fp8" in RULE_PRECISIONS
    rules = load_rules([_user_rules(tmp_path, '[op]\nlinear = "fp8"\n[module]\n"*.mlp" = "fp8"\n')])
    assert [r.precision for r in rules.rules if r.file == str(tmp_path / "user.toml")] == ["fp8", "fp8"]
    bad = {
        '[op]\nsoftmax = "fp8"\n': r"\[op\]\.softmax: fp8 is a GEMM compute mode: op 'softmax' is not one of the fp8 GEMMs",
        '[op]\n"*" = "fp8"\n': r"\[op\]\.\*: fp8 is a GEMM compute mode",
        '[module]\n"a" = { precision = "half", ops = { gelu = "fp8" } }\n': r"\[module\]\.a\.ops\.gelu: fp8 is a GEMM",
        '[default]\nprecision = "fp8"\n': r"the default must be",
        '[settings]\nfp8_align = 0\n': r"fp8_align: must be an integer of at least 1",
        '[settings]\nfp8_keep_last = 1\n': r"fp8_keep_last: must be true or false",
        '[settings]\nfp8_recipe = "rowwize"\n': r"fp8_recipe: must be one of tensorwise",
    }
    for i, (text, message) in enumerate(bad.items()):
        with pytest.raises(RulesError, match=message) as info:
            load_rules([_user_rules(tmp_path, text, f"bad{i}.toml")])
        assert "\n" not in str(info.value) and f"bad{i}.toml" in str(info.value)


def test_fp8_is_a_conversion_target_but_never_a_dtype():
    from converter.vocab import FLOAT_PRECISIONS, HALF_PRECISIONS, RUNS_IN, PrecisionError, precision

    assert [precision(n) for n in ("fp8", "FP8", "bf16-mixed", "16")] == ["fp8", "fp8", "bf16", "fp16"]
    assert (RUNS_IN["fp8"], RUNS_IN["fp16"]) == ("bf16", "fp16")
    for allowed, name in ((None, "fp32"), (FLOAT_PRECISIONS, "fp8"), (HALF_PRECISIONS, "fp8")):
        with pytest.raises(PrecisionError):
            precision(name) if allowed is None else precision(name, allowed=allowed)


def test_a_node_rule_marking_a_non_gemm_fp8_fails_at_decide(decoder, tmp_path):
    rules = _user_rules(tmp_path, '[node]\nrelu = "fp8"\n')
    with pytest.raises(RulesError, match=r"\[node\]\.relu: marks node 'relu' fp8, but its op 'relu' is not an fp8 GEMM"):
        convert_fp8_graph(decoder, (_tokens(),), rules=[rules])


def test_a_module_rule_fp8_reaches_only_the_gemms_of_its_scope(decoder, tmp_path):
    rules = _user_rules(tmp_path, """
        [settings]
        fp8_min_flops_per_token = 1
        fp8_keep_first = false
        [op]
        linear = "bf16"
        [module]
        "blocks.0" = "fp8"
    """)
    gm = convert_fp8_graph(decoder, (_tokens(),), rules=[rules]).module
    decisions = {n.name: n.meta[META_DECISION] for n in gm.graph.nodes if META_DECISION in n.meta}
    assert {name for name, d in decisions.items() if d.requested == "fp8"} == {
        f"blocks_0_{n}" for n in ("q", "k", "v", "o", "up", "down")}  # gate: the more specific *.gate rule wins
    assert decisions["relu"].requested == "follow" and decisions["softmax"].precision == "fp32"


# --------------------------------------------------------------------------------- selection


def test_the_rules_select_exactly_the_expected_linears_each_with_its_rule(converted):
    linears = _linears(converted.module)
    assert set(converted.fp8_nodes) == FP8_LAYERS
    assert set(linears) == FP8_LAYERS | set(EXCLUDED)
    for name in FP8_LAYERS:
        decision = linears[name].meta[META_DECISION]
        assert (decision.requested, decision.precision, str(decision.rule)) == ("fp8", "bf16", "fp8.toml:[op].linear")
        assert "recipe tensorwise" in decision.reason, decision.reason
        assert linears[name].target.__name__ == "fp8_linear"
    for name, rule in EXCLUDED.items():
        decision = linears[name].meta[META_DECISION]
        assert (decision.requested, decision.precision, str(decision.rule)) == ("bf16", "bf16", rule), (name, decision)
        assert linears[name].target is torch.nn.functional.linear, name
    assert "200" in linears["blocks_1_up"].meta[META_DECISION].reason  # the misaligned dim is named
    for node in converted.module.graph.nodes:  # the casts into a gated linear name its gate, not the fp8 rule
        cast = node.meta.get(META_CAST)
        if cast is not None and cast.consumers == ("blocks_0_q",):
            assert str(cast.rule) == EXCLUDED["blocks_0_q"], cast
    for node in converted.module.graph.nodes:  # embeddings, norms and the attention core: never fp8
        decision = node.meta.get(META_DECISION)
        if decision is not None and node.meta[META_INFO].op in ("embedding", "layer_norm", "matmul"):
            assert decision.requested != "fp8" and "fp8" not in getattr(node.target, "__name__", ""), node.name
    matmul = next(n for n in converted.module.graph.nodes if getattr(n.meta.get(META_INFO), "op", "") == "matmul")
    assert str(matmul.meta[META_DECISION].rule) == "fp8.toml:[op].matmul"


def test_the_size_gate_is_a_threshold_in_the_rules_with_provenance(decoder, tmp_path):
    rules = _user_rules(tmp_path, "[settings]\nfp8_min_flops_per_token = 10000\n", "sizes.toml")
    result = convert_fp8_graph(decoder, (_tokens(),), rules=[rules])
    assert set(result.fp8_nodes) == {"blocks_0_up", "blocks_0_down"}  # 2·64·64 = 8192 FLOPs per token < 10000
    decision = _linears(result.module)["blocks_1_q"].meta[META_DECISION]
    assert str(decision.rule) == f"{rules}:[settings].fp8_min_flops_per_token"
    assert "8192" in decision.reason and "fp8.toml:[op].linear" in decision.reason


def test_the_built_in_size_gate_keeps_a_tiny_model_in_bf16(decoder):
    result = convert_fp8_graph(decoder, (_tokens(),))
    assert result.fp8_nodes == []
    rules = {str(n.meta[META_DECISION].rule) for n in _linears(result.module).values()}
    assert "fp8.toml:[settings].fp8_min_flops_per_token" in rules


# ------------------------------------------------------------------------------------ dispatch


def test_each_selected_linear_runs_three_scaled_mm_per_training_step(converted):
    gm, tokens = converted.module, _tokens(1)
    _train_step(gm, tokens)  # warm-up
    with ScaledMMCalls() as seen:
        _train_step(gm, tokens)
    assert len(seen.calls) == 3 * len(FP8_LAYERS), len(seen.calls)
    assert Counter(seen.calls) == Counter(TENSORWISE * len(FP8_LAYERS)), seen.calls
    with ScaledMMCalls() as seen, torch.no_grad():
        gm(tokens)
    assert seen.calls == [(E4M3, E4M3)] * len(FP8_LAYERS)


def test_excluded_linears_run_none(converted):
    # the excluded Linears have distinctive dims (lm_head N=128, the gates N=16, blocks.1's MLP 200): no
    # _scaled_mm output has their GEMMs' shapes; blocks.0.q (first layer, 64x64) is covered by the count above
    m = BATCH * SEQ
    with ScaledMMCalls() as seen, torch.no_grad():
        converted.module(_tokens(2))
    assert Counter(seen.shapes) == {(m, DIM): 8, (m, 256): 1}, seen.shapes  # k, v, o, down, 4 of blocks.1; up
    with ScaledMMCalls() as seen:
        _train_step(converted.module, _tokens(2))
    excluded = {(m, VOCAB), (VOCAB, DIM), (m, 16), (16, DIM), (m, 200), (200, DIM), (DIM, 200)}
    assert not set(seen.shapes) & excluded, set(seen.shapes) & excluded
    assert len(seen.shapes) == 3 * len(FP8_LAYERS)


def test_hf_llama_with_library_defaults(tmp_path):
    from tests.zoo_models import build

    model, (args, kwargs) = build("llama", batch=2, length=16)
    assert not args and list(kwargs) == ["input_ids"]
    tokens = kwargs["input_ids"]
    rules = _user_rules(tmp_path, "[settings]\nfp8_min_flops_per_token = 1024\n")
    result = convert_fp8_graph(model, (args, kwargs), rules=[rules])
    linears = _linears(result.module)
    first, last = "model_layers_0_self_attn_q_proj", "lm_head"
    assert set(result.fp8_nodes) == set(linears) - {first, last} and len(result.fp8_nodes) == 13
    assert str(linears[first].meta[META_DECISION].rule) == "fp8.toml:[settings].fp8_keep_first"
    assert str(linears[last].meta[META_DECISION].rule) == "fp8.toml:[module].lm_head"
    with ScaledMMCalls() as seen:
        out = _train_step(result.module, tokens, "input_ids")
    assert Counter(seen.calls) == Counter(TENSORWISE * 13), seen.calls
    # the zoo decoder meets torchao's per-layer floors against the bf16 conversion, in the whole model
    ref = _bf16_reference(model, (args, kwargs))
    out_db = sqnr(_train_step(ref, tokens, "input_ids").float(), out.float())
    assert out_db >= OUT_DB, f"output SQNR {out_db:.2f} dB < {OUT_DB} dB"
    want, got = _weight_grads(ref, result.fp8_nodes), _weight_grads(result.module, result.fp8_nodes)
    assert len(want) == len(got) == 13
    worst = min((sqnr(want[n], got[n]), n) for n in want)
    assert worst[0] >= GW_DB, f"weight-gradient SQNR {worst[0]:.2f} dB < {GW_DB} dB ({worst[1]})"


# ------------------------------------------------------------------------------------- patterns


def test_a_user_pattern_that_matches_nothing_is_an_error(decoder, tmp_path):
    # torchtitan's silent LM-head bug: an exclusion written for another model's names quantised the head
    rules = _user_rules(tmp_path, '[module]\n"output" = { precision = "bf16", reason = "keep the head" }\n', "exclude.toml")
    with pytest.raises(Fp8PatternError) as info:
        convert_fp8_graph(decoder, (_tokens(),), rules=[rules])
    message = str(info.value)
    assert message.startswith(f"{rules}: [module].output: the pattern matches no module path of the model")
    assert "\n" not in message and info.value.exit_code == EXIT_BAD_INPUT
    for table, pattern in (("module_type", "RMSNorm"), ("node", "linear_99")):
        rules = _user_rules(tmp_path, f'[{table}]\n"{pattern}" = "bf16"\n', f"{table}.toml")
        with pytest.raises(Fp8PatternError, match=rf"\[{table}\]\.{pattern}: the pattern matches no"):
            convert_fp8_graph(decoder, (_tokens(),), rules=[rules])
    # patterns that do match pass, also a module rule whose ops entry names an op its module runs
    rules = _user_rules(tmp_path, """
        [module]
        "blocks.*.norm1" = { precision = "fp32", ops = { layer_norm = "fp32" } }
        "embed" = "fp32"
        [module_type]
        LayerNorm = "fp32"
    """, "matching.toml")
    assert len(convert_fp8_graph(decoder, (_tokens(),), rules=[rules]).fp8_nodes) == 0  # the built-in size gate
    # built-in patterns are generic: rules/fp8.toml's "*.router" matches nothing here and is no error
    assert any(r.pattern == "*.router" for r in fp8_rule_set().rules)


def test_fp8_rule_set_layers_default_fp8_then_the_user(tmp_path):
    rules = fp8_rule_set([_user_rules(tmp_path, '[op]\nlinear = "half"\n')])
    assert [f.split("/")[-1] for f in rules.files] == ["default.toml", "fp8.toml", "user.toml"]
    assert rules.matches_for(node="n", op="linear", module_stack=())[0].precision == "half"
    assert fp8_rule_set(rules) is rules
    for given in (Rules(), load_rules(), load_rules(["llm"])):  # Rules objects without an fp8 rule
        layered = fp8_rule_set(given)
        assert layered.files[:2] == ("default.toml", "fp8.toml") and layered.files.count("default.toml") == 1
        assert layered.matches_for(node="n", op="linear", module_stack=())[0].precision == "fp8"
    head = fp8_rule_set(load_rules(["llm"])).matches_for(node="n", op="linear", module_stack=(("lm_head", "Linear"),))
    assert (head[0].precision, head[0].rule.file) == ("fp32", "llm.toml")  # the user's files stay on top


# --------------------------------------------------------------------------------------- numerics


def _bf16_reference(model, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SlowHalfWarning: this CPU has no fast bf16 math
        return converter.convert(model, inputs, precision="bf16").module


def _weight_grads(gm, fp8_nodes) -> dict:
    return {n: p.grad for n, p in gm.named_parameters() if n.endswith(".weight") and n[:-7].replace(".", "_") in fp8_nodes}


def test_sqnr_against_the_bf16_conversion(decoder, converted):
    # whole model, one batch: the fp8 layers' errors compound. Per layer, blocks.0.up's weight gradient measures
    # ~16 dB here (its gradient passes through two e5m2 casts and a ReLU; bf16 itself is 8 dB worse there than
    # on the other layers) and torchao's tensorwise Float8Linear measures the same 16.0 dB on this model, so
    # the per-layer 17 dB floor is asserted on the zoo's Llama (below) and on isolated layers
    # (tests/test_fp8_kernels.py); here on the fp8 layers' weight gradients together
    tokens = _tokens(3)
    ref = _bf16_reference(decoder, (tokens,))
    ref_out = _train_step(ref, tokens)
    with ScaledMMCalls() as seen:  # fp8 ran: each fp8 layer's three GEMMs are float8 _scaled_mm calls
        out = _train_step(converted.module, tokens)
    assert set(converted.fp8_nodes) == FP8_LAYERS and Counter(seen.calls) == Counter(TENSORWISE * len(FP8_LAYERS)), (
        sorted(converted.fp8_nodes), Counter(seen.calls))
    out_db = sqnr(ref_out.float(), out.float())
    assert out_db >= OUT_DB, f"output SQNR {out_db:.2f} dB < {OUT_DB} dB"
    want, got = _weight_grads(ref, FP8_LAYERS), _weight_grads(converted.module, FP8_LAYERS)
    assert len(want) == len(got) == len(FP8_LAYERS)
    together = sqnr(torch.cat([want[n].flatten() for n in want]), torch.cat([got[n].flatten() for n in want]))
    worst = min((sqnr(want[n], got[n]), n) for n in want)
    assert together >= GW_DB, f"fp8 layers' weight-gradient SQNR {together:.2f} dB < {GW_DB} dB (worst {worst})"
    print(f"\nfp8 vs bf16 conversion: output {out_db:.2f} dB, weight gradients {together:.2f} dB, worst layer "
          f"{worst[0]:.2f} dB ({worst[1]})")


# ---------------------------------------------------------------------------------------- model.py

_STANDALONE = textwrap.dedent(
    """
    import importlib.util, sys
    if importlib.util.find_spec("converter") is not None:
        sys.modules["converter"] = None
    sys.modules["safetensors"] = None
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten._scaled_mm.default
            return func(*args, **(kwargs or {}))

    spec = importlib.util.spec_from_file_location("emitted_fp8", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.load()
    tokens = torch.load(sys.argv[2], weights_only=True)
    with Calls() as calls:
        out = model(tokens)
        out.float().pow(2).mean().backward()
    torch.save({"out": out.detach(), "calls": calls.n,
                "modules": sorted(n for n, m in sys.modules.items() if m is not None and n.split(".")[0] == "converter")},
               sys.argv[3])
    """
)


def test_model_py_carries_the_kernels_and_trains_with_only_torch(converted, decoder, tmp_path):
    source = generate_model_source(converted.conv)
    assert "class Fp8Linear(torch.autograd.Function):" in source.code and "from converter" not in source.code
    assert source.code.count("fp8_linear(") >= len(FP8_LAYERS)
    (tmp_path / "model.py").write_text(source.code, encoding="utf-8")
    write_weights(source.own, tmp_path, dtypes=source.dtypes)
    tokens = _tokens(4)
    torch.save(tokens, tmp_path / "tokens.pt")
    (tmp_path / "run.py").write_text(_STANDALONE, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    proc = subprocess.run([sys.executable, "-I", str(tmp_path / "run.py"), str(tmp_path / "model.py"),
                           str(tmp_path / "tokens.pt"), str(tmp_path / "out.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got["modules"] == [] and got["calls"] == 3 * len(FP8_LAYERS), got
    with torch.no_grad():
        want = converted.module(tokens)
    assert torch.equal(got["out"], want), (got["out"] - want).abs().max()


def test_the_recipe_is_a_setting_and_an_argument(decoder, tmp_path):
    rules = _user_rules(tmp_path, '[settings]\nfp8_min_flops_per_token = 4096\nfp8_recipe = "rowwise"\n')
    for recipe, want in ((None, [(E4M3, E4M3)] * 3), ("tensorwise", TENSORWISE)):
        result = convert_fp8_graph(decoder, (_tokens(),), rules=[rules], recipe=recipe)
        assert set(result.fp8_nodes) == FP8_LAYERS
        name = recipe or "rowwise"
        assert all(f"recipe {name}" in _linears(result.module)[n].meta[META_DECISION].reason for n in FP8_LAYERS)
        with ScaledMMCalls() as seen:
            _train_step(result.module, _tokens(5))
        assert Counter(seen.calls) == Counter(want * len(FP8_LAYERS)), (name, seen.calls)


# ---------------------------------------------------------------------------------------------
# the API and the CLI: precision "fp8"


def test_precision_fp8_is_bf16_with_fp8_gemms_in_the_options():
    from converter.fp8.kernels import RECIPES
    from converter.options import FP8_RECIPES, ConvertOptions, OptionsError

    assert FP8_RECIPES == ("auto", *RECIPES)
    options = ConvertOptions(precision="fp8")
    assert (options.precision, options.fp8_recipe) == ("bf16", "auto")
    assert ConvertOptions(precision=" FP8 ", fp8_recipe="rowwise").fp8_recipe == "rowwise"
    assert ConvertOptions(precision="bf16", fp8_recipe="blockwise").fp8_recipe == "blockwise"
    with pytest.raises(OptionsError, match="runs the GEMMs in fp8 and the rest in bf16, not fp16"):
        ConvertOptions(precision="fp16", fp8_recipe="rowwise")
    with pytest.raises(OptionsError, match="fp8_recipe must be one of"):
        ConvertOptions(precision="fp8", fp8_recipe="per-tensor")
    assert ConvertOptions().fp8_recipe is None


_MODEL_FILE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(128, 64)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)
        self.mid = nn.Linear(64, 64)
        self.lm_head = nn.Linear(64, 128)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.down(torch.relu(self.up(x)))
        return self.lm_head(self.mid(x))


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randint(0, 128, (2, 16)),)
'''


def test_cli_precision_fp8_converts_and_a_zero_match_exclusion_exits_2(tmp_path, capfd):
    import json

    from converter.cli.main import main

    model_file = tmp_path / "net.py"
    model_file.write_text(_MODEL_FILE, encoding="utf-8")
    typo = _user_rules(tmp_path, '[module]\n"lm_haed" = "bf16"\n', name="typo.toml")
    code = main([str(model_file), "--precision", "fp8", "--rules", typo, "--out", str(tmp_path / "bad"), "-q"])
    _, err = capfd.readouterr()
    assert code == 2 and err.count("\n") == 1, (code, err)
    assert "[module].lm_haed: the pattern matches no module path of the model; did you mean 'lm_head'?" in err, err
    assert not (tmp_path / "bad").exists()

    gates = _user_rules(tmp_path, "[settings]\nfp8_min_flops_per_token = 4096\n", name="gates.toml")
    out = tmp_path / "out"
    code = main([str(model_file), "--precision", "fp8", "--rules", gates, "--out", str(out), "-q", "--no-measure"])
    _, err = capfd.readouterr()
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    # first linear (up) and last (lm_head) stay bf16 by the gates; down and mid run in fp8
    fp8 = {key: report["fp8"][key] for key in ("recipe", "layers", "count", "fallback")}
    assert fp8 == {"recipe": "tensorwise", "layers": ["down", "mid"], "count": 2, "fallback": []}, report["fp8"]
    assert "class Fp8Linear(torch.autograd.Function):" in (out / "model.py").read_text()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_the_trainer_trains_an_fp8_conversion(decoder, tmp_path, opt_level):
    """MixedPrecisionTrainer over an fp8 conversion: bf16 (no loss scaling), O2 masters in fp32, and every
    step runs the selected linears' 3 scaled GEMMs; the loss falls."""
    import copy
    from collections import Counter

    from converter.train.trainer import MixedPrecisionTrainer

    rules = _user_rules(tmp_path, "[settings]\nfp8_min_flops_per_token = 4096\n")
    conv = converter.convert(copy.deepcopy(decoder), (_tokens(),), precision="fp8", rules=[rules], opt_level=opt_level)
    optimizer = torch.optim.AdamW(conv.module.parameters(), lr=1e-3)
    trainer = MixedPrecisionTrainer(conv.module, optimizer, precision=conv.precision, master_weights=opt_level == "O2")
    losses = []
    for step in range(12):
        tokens = _tokens(step % 3)
        with ScaledMMCalls() as calls:
            logits = conv.module(tokens)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
            trainer.backward(loss)
            assert trainer.step()
        optimizer.zero_grad(set_to_none=True)
        assert Counter(calls.calls) == Counter(TENSORWISE * len(FP8_LAYERS)), Counter(calls.calls)
        losses.append(loss.item())
    assert conv.precision == "bf16" and losses[-1] < losses[0] - 0.5, losses
    if opt_level == "O2":
        stored = {n: p.dtype for n, p in conv.module.named_parameters() if n.replace(".", "_").endswith("_up_weight")}
        assert set(stored.values()) == {torch.bfloat16}, stored
