"""Rule files: precedence, layering, matching semantics and error messages."""
from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

import converter
from converter.rules.loader import Rules, RulesError, load_rules


class Norm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = Norm()

    def forward(self, x):
        return self.norm(self.proj(x))


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.embedding_layer = nn.Linear(8, 8)
        self.block = Inner()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.block(self.embed(x) + self.embedding_layer(x)))


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _precisions(conv):
    return {r["name"]: (r["precision"], r["rule"]) for r in conv.report.nodes}


def test_precedence_node_module_type_op(tmp_path):
    rules = _write(tmp_path, "p.toml", """
        [op]
        linear = "half"
        [module_type]
        Inner = "fp32"
        [module]
        "block.proj" = "half"
        [node]
        head = "fp32"
    """)
    conv = converter.convert(Outer(), (torch.randn(2, 8),), rules=[rules])
    got = _precisions(conv)
    # node rule beats the op rule
    assert got["head"][0] == "fp32" and "[node].head" in got["head"][1]
    # module path rule beats the module_type rule of an enclosing module
    assert got["block_proj"][0] == "bf16" and "[module].block.proj" in got["block_proj"][1]
    # module_type rule (Inner) beats op rules for ops inside it
    assert got["add_1"][0] == "fp32" and "[module_type].Inner" in got["add_1"][1]
    # op rule applies outside
    assert got["embed"][0] == "bf16" and "[op].linear" in got["embed"][1]


def test_innermost_module_wins(tmp_path):
    rules = _write(tmp_path, "inner.toml", """
        [module_type]
        Outer = "fp32"
        Inner = "half"
        Norm = "fp32"
    """)
    conv = converter.convert(Outer(), (torch.randn(2, 8),), rules=[rules])
    got = _precisions(conv)
    assert got["block_proj"][0] == "bf16", got["block_proj"]  # Inner (inner) beats Outer
    assert got["pow_1"][0] == "fp32" and "Norm" in got["pow_1"][1]  # Norm innermost
    assert got["embed"][0] == "fp32" and "Outer" in got["embed"][1]


def test_later_file_overrides_earlier(tmp_path):
    a = _write(tmp_path, "a.toml", """
        [op]
        linear = "fp32"
    """)
    b = _write(tmp_path, "b.toml", """
        [op]
        linear = "half"
    """)
    got_ab = _precisions(converter.convert(Outer(), (torch.randn(2, 8),), rules=[a, b]))
    got_ba = _precisions(converter.convert(Outer(), (torch.randn(2, 8),), rules=[b, a]))
    assert got_ab["head"][0] == "bf16" and "b.toml" in got_ab["head"][1]
    assert got_ba["head"][0] == "fp32" and "a.toml" in got_ba["head"][1]


def test_module_glob_is_fullmatch_not_substring(tmp_path):
    rules = _write(tmp_path, "g.toml", """
        [module]
        "*embed" = "fp32"
    """)
    got = _precisions(converter.convert(Outer(), (torch.randn(2, 8),), rules=[rules]))
    assert got["embed"][0] == "fp32"
    assert got["embedding_layer"][0] == "bf16", got["embedding_layer"]
    r = Rules.from_dict({"module": {"*.embed": "fp32"}}, file="x.toml")
    match = r.matches_for(node="n", op="linear", module_stack=(("", "M"), ("model", "M"), ("model.embedding_layer", "Linear")))
    assert match == []
    match = r.matches_for(node="n", op="linear", module_stack=(("", "M"), ("model", "M"), ("model.embed", "Linear")))
    assert [m.rule.pattern for m in match] == ["*.embed"]


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("[op]\nlinear = \"half\n", ["bad.toml", "TOML syntax error", "line"]),
        ("[op]\nlinear = \"hlaf\"\n", ["bad.toml", "[op].linear", "'hlaf'", "did you mean 'half'"]),
        ("[op]\nsoftmx = \"fp32\"\n", ["bad.toml", "[op].softmx", "unknown op", "did you mean 'softmax'"]),
        ("[opp]\nlinear = \"fp32\"\n", ["bad.toml", "[opp]", "did you mean 'op'"]),
        ("[op]\nlinear = { precison = \"fp32\" }\n", ["bad.toml", "[op].linear.precison", "did you mean 'precision'"]),
        ("[op]\nlinear = \"banned\"\n", ["bad.toml", "[op].linear", "message"]),
        ("[settings]\noverflow_fallback = \"fp8\"\n", ["bad.toml", "[settings].overflow_fallback", "bf16"]),
    ],
)
def test_rule_errors_name_file_key_and_suggest(tmp_path, text, fragments):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(RulesError) as info:
        load_rules([path])
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "\n" not in message


def test_semantic_error_has_line_number(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[meta]\ndescription = 'x'\n\n[op]\nlinear = \"half\"\nsoftmx = \"fp32\"\n")
    with pytest.raises(RulesError, match=r"bad\.toml:6: \[op\]\.softmx"):
        load_rules([path])


def test_missing_rules_file_and_builtin_names(tmp_path):
    with pytest.raises(RulesError, match="not found"):
        load_rules([tmp_path / "nope.toml"])
    rules = load_rules(["llm"])
    assert rules.files == ("default.toml", "llm.toml")


def test_default_rules_reference_lists():
    rules = load_rules()

    def winner(op):
        matches = rules.matches_for(node="n", op=op, module_stack=(("", "M"),))
        return matches[0].precision if matches else None

    for op in ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "conv1d", "conv2d", "conv3d",
               "scaled_dot_product_attention"):
        assert winner(op) == "half", op
    for op in ("softmax", "log_softmax", "cross_entropy", "layer_norm", "batch_norm", "group_norm", "rms_norm",
               "exp", "log", "pow", "sum", "mean", "cumsum", "norm", "embedding"):
        assert winner(op) == "fp32", op
    for op in ("relu", "gelu", "mul", "dropout", "view", "reshape", "transpose", "getitem", "cat"):
        assert winner(op) == "follow", op
    for op in ("addcmul", "add", "sub"):
        assert winner(op) == "promote", op
    assert winner("some_op_on_no_list") is None


def test_rules_to_dict_echoes_effective_config():
    rules = load_rules(["llm"])
    d = rules.to_dict()
    assert d["files"] == ["default.toml", "llm.toml"]
    assert any(r["pattern"] == "lm_head" and r["level"] == "module" for r in d["rules"])


def test_ban_wins_over_module_rules_unless_node_exempts(tmp_path):
    ban = _write(tmp_path, "ban.toml", """
        [op]
        layer_norm = { precision = "banned", message = "use RMSNorm" }
    """)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    # default.toml's module_type "*LayerNorm" = fp32 outranks the op rule, but a ban still applies
    with pytest.raises(converter.BannedOpError, match="use RMSNorm"):
        converter.convert(model, (torch.randn(2, 4),), rules=[ban])
    exempt = _write(tmp_path, "exempt.toml", """
        [node]
        "m_1" = "fp32"
    """)
    conv = converter.convert(model, (torch.randn(2, 4),), rules=[ban, exempt])
    assert {r["name"]: r["precision"] for r in conv.report.nodes}["m_1"] == "fp32"


def test_non_utf8_rules_file_is_a_rules_error(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes("[op]\nlinear = \"half\" # caf\xe9\n".encode("latin-1"))
    with pytest.raises(RulesError, match="UTF-8"):
        load_rules([path])


def test_module_rule_ops_entries(tmp_path):
    rules = _write(tmp_path, "ops.toml", """
        [module_type]
        Norm = { precision = "fp32", ops = { mul = "half", "p*" = { precision = "fp32", reason = "squares" } } }
    """)
    got = _precisions(converter.convert(Outer(), (torch.randn(2, 8),), rules=[rules]))
    assert got["mul"][0] == "bf16" and got["mul"][1].endswith("ops.toml:[module_type].Norm.ops.mul")
    assert got["pow_1"][0] == "fp32" and "Norm.ops.p*" in got["pow_1"][1]
    assert got["rsqrt"][0] == "fp32" and got["rsqrt"][1].endswith("ops.toml:[module_type].Norm")
    bad = _write(tmp_path, "bad_ops.toml", """
        [module_type]
        Norm = { precision = "fp32", ops = { mull = "half" } }
    """)
    with pytest.raises(RulesError, match=r"\[module_type\]\.Norm\.ops\.mull: unknown op name 'mull'; did you mean 'mul'"):
        load_rules([bad])
    with pytest.raises(RulesError, match="ops: must be a table"):
        load_rules([_write(tmp_path, "bad2.toml", '[module]\n"a" = { precision = "fp32", ops = "x" }\n')])
