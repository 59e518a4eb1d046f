"""The audit report: report.json against docs/report.md on every sample, casts against a TorchDispatchMode,
memory and numerics measurements, the rollups, Markdown/terminal escaping, and ``explain``."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import load_sample
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import converter
from converter.numerics.measure import measure
from converter.report.render import explain, md_escape, print_report, to_markdown, write_reports

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ["mlp", "cnn", "tiny_transformer", "hf_gpt2", "hf_bert"]
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)




_CONVERTED: dict[str, converter.Conversion] = {}


def converted(name: str) -> converter.Conversion:
    """The sample converted to bf16 with measurements attached, once per test module."""
    if name not in _CONVERTED:
        module = load_sample(name)
        conv = converter.convert(module.build_model(), module.example_inputs())
        conv.report.add_measurements(measure(conv))
        _CONVERTED[name] = conv
    return _CONVERTED[name]


@pytest.fixture(scope="module", params=SAMPLES)
def sample(request):
    """(name, Conversion); module-scoped: the HF samples are captured by torch.export (seconds each)."""
    if request.param.startswith("hf_"):
        pytest.importorskip("transformers")
    yield request.param, converted(request.param)
    if request.param.startswith("hf_"):  # keep the small ones: later tests reuse them
        _CONVERTED.pop(request.param, None)


@pytest.fixture(scope="module")
def tiny():
    return converted("tiny_transformer")


# ---------------------------------------------------------------------------------------------
# report.json against docs/report.md

_INT, _STR, _FLOAT, _BOOL = "int", "str", "float", "bool"
#: docs/report.md, the binding minimum: {key: type} for objects, [item] for lists
SCHEMA_V1 = {
    "schema": _INT,
    "precision": _STR,
    "tracer": _STR,
    "summary": {
        "nodes": _INT,
        "compute_nodes": _INT,
        "by_precision": {"fp16": _INT, "bf16": _INT, "fp32": _INT},
        "casts": _INT,
        "cast_bytes": _INT,
        "half_flop_fraction": _FLOAT,
        "unmatched_ops": [_STR],
    },
    "nodes": [{"name": _STR, "op": _STR, "module": _STR, "module_type": _STR, "precision": _STR, "rule": _STR,
               "reason": _STR, "flops": _INT, "out_bytes": _INT}],
    "casts": [{"name": _STR, "src": _STR, "dtype": _STR, "bytes": _INT}],
}


def validate(value, schema, path="$") -> list[str]:
    """Every place where ``value`` does not match ``schema`` (extra keys are allowed: 'add freely')."""
    errors: list[str] = []
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{path}: expected an object, got {type(value).__name__}"]
        for key, sub in schema.items():
            if key not in value:
                errors.append(f"{path}.{key}: missing")
            else:
                errors += validate(value[key], sub, f"{path}.{key}")
    elif isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {type(value).__name__}"]
        for i, item in enumerate(value):
            errors += validate(item, schema[0], f"{path}[{i}]")
    else:
        ok = {
            _INT: isinstance(value, int) and not isinstance(value, bool),
            _STR: isinstance(value, str),
            _FLOAT: isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
            _BOOL: isinstance(value, bool),
        }[schema]
        if not ok:
            errors.append(f"{path}: expected {schema}, got {value!r}")
    return errors


def test_report_json_validates_against_design_6(sample):
    name, conv = sample
    text = conv.report.to_json()  # allow_nan=False: strict JSON
    data = json.loads(text)
    assert validate(data, SCHEMA_V1) == [], name
    assert data["schema"] == 1
    assert data["precision"] == "bf16"
    assert data["tracer"] == ("export" if name.startswith("hf_") else "fx")
    assert 0.0 <= data["summary"]["half_flop_fraction"] <= 1.0
    assert data["summary"]["nodes"] >= data["summary"]["compute_nodes"] == len(data["nodes"]) > 0
    for row in data["nodes"]:
        assert row["precision"] in ("fp16", "bf16", "fp32"), row
        assert row["rule"] and row["reason"], row
    assert data["summary_line"] == conv.report.line


def test_precision_counts_sum_to_compute_nodes(sample):
    _, conv = sample
    summary = conv.report.summary
    assert sum(summary["by_precision"].values()) == summary["compute_nodes"]
    assert summary["by_precision"]["bf16"] > 0


class DtypeCasts(TorchDispatchMode):
    """Counts dtype-changing aten._to_copy calls and their bytes, split by whether the input is a
    parameter/buffer of the module (a weight cast) or not (an activation cast)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.weights = {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}
        self.activation: list[int] = []
        self.weight: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            src = args[0]
            # int/bool -> float conversions are the model's own (attention masks), identical in fp32
            if out.dtype != src.dtype and src.dtype in _FLOATS and out.dtype in _FLOATS:
                nbytes = src.numel() * (src.element_size() + out.element_size())
                on_weight = src.untyped_storage().data_ptr() in self.weights
                (self.weight if on_weight else self.activation).append(nbytes)
        return out


def test_casts_equal_what_a_dispatch_mode_counts(sample):
    name, conv = sample
    args, kwargs = conv.example_inputs
    counter = DtypeCasts(conv.module)
    with torch.no_grad(), counter:
        conv.module(*args, **kwargs)
    s = conv.report.summary
    assert (len(counter.activation), sum(counter.activation)) == (s["casts"], s["cast_bytes"]), name
    assert (len(counter.weight), sum(counter.weight)) == (s["weight_casts"], s["weight_cast_bytes"]), name
    # and the report's own measurement agrees
    assert conv.report.measured_casts["converted"] == {k: s[k] for k in ("casts", "cast_bytes", "weight_casts", "weight_cast_bytes")}


def test_summary_line(sample):
    _, conv = sample
    s = conv.report.summary
    half = s["by_precision"]["bf16"] + s["by_precision"]["fp16"]
    pattern = (rf"^Converted {half}/{s['compute_nodes']} compute nodes \(\d+\.\d% of FLOPs\) to bf16 with "
               rf"{s['casts']} casts, \d+\.\d\d MiB per forward")
    assert re.match(pattern, conv.report.line), conv.report.line


def test_op_table_and_module_tree_add_up(sample):
    _, conv = sample
    report = conv.report
    assert sum(o["total"] for o in report.ops) == report.summary["compute_nodes"]
    for o in report.ops:
        assert o["fp16"] + o["bf16"] + o["fp32"] + o["other"] == o["total"]
        assert sum(r["count"] for r in o["rules"]) == o["total"]
    root = report.modules[0]
    assert root["depth"] == 0 and root["nodes"] == report.summary["compute_nodes"]
    assert root["flops"] == report.summary["flops"]
    assert root["casts"] == report.summary["casts"]
    by_path = {m["path"]: m for m in report.modules}
    for mod in report.modules[1:]:
        parent = by_path[mod["parent"]]
        assert mod["nodes"] <= parent["nodes"] and mod["depth"] == parent["depth"] + 1
        children = [m for m in report.modules if m["parent"] == mod["path"]]
        assert sum(c["nodes"] for c in children) <= mod["nodes"]


def test_numerics_are_measured_against_fp32_and_autocast(sample):
    name, conv = sample
    n = conv.report.numerics
    assert 30 < n["vs_fp32"]["sqnr_db"] < math.inf, n["vs_fp32"]
    assert n["vs_fp32"]["nonfinite_mismatch"] == 0
    assert n["autocast_vs_fp32"]["sqnr_db"] > 30, n["autocast_vs_fp32"]  # +inf when exact
    if name in ("tiny_transformer", "hf_gpt2", "hf_bert"):
        # benchmark target (benchmarks/README.md): SQNR >= autocast - 1 dB (a scalar loss output, as in cnn, is too noisy for this)
        auto = n["autocast_vs_fp32"]["sqnr_db"]
        assert n["vs_fp32"]["sqnr_db"] >= auto - 1.0, (n["vs_fp32"], n["autocast_vs_fp32"])
    per_node = n["per_node"]
    names = {r["name"] for r in conv.report.nodes}
    assert set(per_node) <= names and per_node
    worst = n["worst"]
    assert worst and [w["local_sqnr_db"] for w in worst] == sorted(w["local_sqnr_db"] for w in worst)
    assert worst[0]["precision"] in ("bf16", "fp16")


def test_saved_activations_are_measured(sample):
    _, conv = sample
    m = conv.report.memory
    saved = m["saved_activation_bytes"]
    assert saved["fp32"] > 0 and saved["converted"] > 0
    assert m["saved_ratio"] == pytest.approx(saved["converted"] / saved["fp32"])
    assert m["saved_weight_copy_bytes"]["fp32"] == 0


def test_error_attribution_finds_the_lowered_nodes(tiny):
    per_node = tiny.report.numerics["per_node"]
    # the hand-written RMSNorm runs in fp32 on fp32 inputs: it adds no error of its own
    # (no local SQNR: no input dtype changes; the cumulative one is exact: +inf)
    assert per_node["pow_1"]["local_sqnr_db"] is None and per_node["pow_1"]["sqnr_db"] == math.inf
    # a bf16 linear on rounded inputs adds about bf16's 8-bit mantissa worth: ~50 dB
    qkv = per_node["layers_0_attn_qkv"]
    assert 40 < qkv["local_sqnr_db"] < 60, qkv
    row = tiny.report.node("layers_0_attn_qkv")
    assert row["local_sqnr_db"] == qkv["local_sqnr_db"]


# ---------------------------------------------------------------------------------------------
# memory


def test_memory_saved_activations_at_most_autocast(tiny):
    """Benchmark target (benchmarks/README.md): saved activations <= autocast, both measured with saved_tensors_hooks."""
    m = tiny.report.memory
    assert m["saved_activation_bytes"]["converted"] <= m["saved_activation_bytes"]["autocast"], m
    md = tiny.report.to_markdown()
    assert "saved activations, fp32 model (measured)" in md and "saved activations, converted (measured)" in md


def test_memory_saved_activations_at_most_0_6_of_fp32():
    """The converted sample transformer saves no more activations than torch.autocast (0.61x fp32).

    Measured in O2 (weights stored in half, as the trainer's master_weights mode does). The RMSNorm
    scales are no matmul weights: O2 keeps them in fp32 storage (their gradients sum over every
    token), so placement keeps the scale multiply in fp32 as in O1 and the figure equals autocast's;
    storing them in half (the old O2) saved 0.59x at the price of fp16-overflowing norm gradients.
    Both numbers are in the report.
    """
    mod = load_sample("tiny_transformer")
    conv = converter.convert(mod.build_model(), mod.example_inputs(), opt_level="O2")
    conv.report.add_measurements(measure(conv, per_node=False))
    m = conv.report.memory
    saved = m["saved_activation_bytes"]
    ratio = saved["converted"] / saved["fp32"]
    assert ratio <= 0.611, f"saved activations {ratio:.3f}x fp32 ({saved})"
    assert saved["converted"] <= saved["autocast"], saved
    md = conv.report.to_markdown()
    assert "saved activations, fp32 model (measured)" in md and "saved activations, converted (measured)" in md


def test_parameter_bytes_o1_and_o2(tiny):
    gm = tiny.module
    dtypes = gm.meta["mp_param_dtypes"]
    o1 = sum(p.numel() * 4 for p in gm.parameters())
    o2 = sum(p.numel() * torch.empty((), dtype=dtypes[n]).element_size() for n, p in gm.named_parameters())
    m = tiny.report.memory
    assert (m["param_bytes_o1"], m["param_bytes_o2"]) == (o1, o2)
    assert o2 < o1  # the linears are stored in bf16 under O2; the embedding and the norms stay fp32


def test_measure_leaves_the_models_untouched():
    conv = converted("cnn")
    model = conv.original  # train mode: BatchNorm updates its running statistics when it runs
    before = {k: v.clone() for k, v in list(model.state_dict().items()) + [("gm." + k, v) for k, v in conv.module.state_dict().items()]}
    measure(conv)
    after = {k: v for k, v in list(model.state_dict().items()) + [("gm." + k, v) for k, v in conv.module.state_dict().items()]}
    assert model.training and conv.module.training
    for key, value in before.items():
        assert torch.equal(value, after[key]), key


# ---------------------------------------------------------------------------------------------
# explain


def test_explain_rmsnorm_pow_module_type_beats_op(tiny):
    node = next(r for r in tiny.report.nodes if r["op"] == "pow" and r["module_type"] == "RMSNorm")
    text = explain(tiny, node["name"])
    lines = text.splitlines()
    first = next(i for i, l in enumerate(lines) if "1. [module_type] '*RMSNorm'" in l)
    assert "WINS: module_type outranks op" in lines[first + 1]
    second = next(i for i, l in enumerate(lines) if "2. [op] 'pow'" in l)
    assert "-> fp32" in lines[second] and "loses to rule 1: module_type outranks op" in lines[second + 1]
    assert "node > module > module_type > op > default" in text
    assert "scope module 'layers.0.attn_norm'" in text


def test_explain_rmsnorm_mul_ops_entry_beats_module_and_op(tiny):
    """The RMSNorm's multiplies: the module_type rule's ``ops`` entry (follow) wins over the module's own
    fp32 and over the op rule; placement then decides (fp32 in O1, where the weight cast would cost)."""
    muls = [r for r in tiny.report.nodes if r["op"] == "mul" and r["module_type"] == "RMSNorm"]
    assert len(muls) == 10
    for row in muls:
        text = explain(tiny.module, row["name"])  # from the GraphModule as well
        assert re.search(r"\* 1\. \[module_type\] '\*RMSNorm\.ops\.mul' .*-> follow", text), text
        assert re.search(r"2\. \[module_type\] '\*RMSNorm' .*-> fp32\n\s+loses to rule 1: same module; an ops entry outranks", text), text
        assert re.search(r"3\. \[op\] 'mul' in default\.toml -> follow\n\s+loses to rule 1: module_type outranks op", text), text
        assert "placement: min-cut chose" in text
        assert row["precision"] == "fp32"


def test_explain_placement_note_and_report_input(tiny):
    row = next(r for r in tiny.report.nodes if r["requested"] == "follow" and r["precision"] == "bf16")
    text = explain(tiny.report, row["name"])
    assert f"{row['name']}: op {row['op']}" in text
    assert "placement" in text


def test_explain_unknown_node_lists_close_names(tiny):
    with pytest.raises(ValueError, match=r"no compute node named 'pow_9'.*did you mean .*'pow_\d'"):
        explain(tiny, "pow_9")


def test_explain_cast_node(tiny):
    cast = tiny.report.casts[0]
    text = explain(tiny, cast["name"])
    assert f"converts {cast['src']} from {cast['src_dtype']} to {cast['dtype']}" in text


# ---------------------------------------------------------------------------------------------
# escaping, terminal and files

EVIL = "ev|l`<b>x</b>*_[y](z)#"


class EvilNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module(EVIL, nn.Linear(8, 8))
        self.add_module("[red]boom[/red]", nn.Linear(8, 4))

    def forward(self, x):
        return getattr(self, "[red]boom[/red]")(torch.relu(getattr(self, EVIL)(x)))


@pytest.fixture(scope="module")
def evil():
    return converter.convert(EvilNames(), (torch.randn(2, 8),))


def _cells(line: str) -> list[str]:
    return re.split(r"(?<!\\)\|", line.strip())[1:-1]


def test_markdown_escapes_model_names(evil):
    md = to_markdown(evil.report)
    assert "<b>" not in md and "&lt;b&gt;x&lt;/b&gt;" in md
    assert md_escape(EVIL) in md
    # every table row has as many cells as its header: no name broke a row
    for block in re.split(r"\n\n", md):
        rows = [l for l in block.splitlines() if l.startswith("|")]
        if rows:
            assert {len(_cells(r)) for r in rows} == {len(_cells(rows[0]))}, block


def test_md_escape():
    assert md_escape("a|b") == r"a\|b"
    assert md_escape("<script>") == "&lt;script&gt;"
    assert md_escape("`x`\n*y*") == r"\`x\` \*y\*"


def test_print_report_renders_names_literally(evil, tiny):
    from rich.console import Console

    console = Console(record=True, width=160, color_system=None)
    print_report(evil.report, console, nodes=True)
    text = console.export_text()
    assert evil.report.line in text, f"the summary line {evil.report.line!r} is not printed as is:\n{text[:600]}"
    assert evil.report.line.startswith("Converted 3/3 compute nodes (100.0% of FLOPs) to bf16"), evil.report.line
    assert "[red]boom[/red]" in text  # shown, not interpreted as rich markup
    console = Console(record=True, width=160, color_system=None)
    print_report(tiny.report, console)
    text = console.export_text()
    assert "saved activations converted" in text and "SQNR converted vs fp32" in text


def test_write_reports(tiny, tmp_path):
    paths = write_reports(tiny.report, tmp_path / "out")
    assert [p.name for p in paths] == ["report.json", "report.md", "report.html"]
    data = json.loads(paths[0].read_text())
    assert validate(data, SCHEMA_V1) == []
    assert data["summary"] == tiny.report.summary
    assert tiny.report.line in paths[1].read_text()
    assert paths[2].read_text().startswith("<!DOCTYPE html>")


def test_audit_reports_without_measuring():
    module = load_sample("mlp")
    report = converter.audit(module.build_model(), module.example_inputs())
    assert validate(json.loads(report.to_json()), SCHEMA_V1) == []
    md = report.to_markdown()
    assert "Not measured" in md and report.line in md


class WithUnmatched(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.erf(self.fc(x))  # erf is on no rule list


def test_unmatched_ops_are_listed_and_kept_fp32():
    conv = converter.convert(WithUnmatched(), (torch.randn(2, 8),))
    report = conv.report
    assert report.summary["unmatched_ops"] == ["erf"]
    row = next(r for r in report.nodes if r["op"] == "erf")
    assert row["unmatched"] and row["precision"] == "fp32"
    assert next(o for o in report.ops if o["op"] == "erf")["unmatched"] == 1
    md = report.to_markdown()
    assert "## Unmatched ops" in md and "- erf: " in md
    html = report.to_html()
    assert "(unmatched)" in html and 'data-u="1"' in html
    assert "UNMATCHED" in explain(conv, row["name"])


class Overflowing(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)
        with torch.no_grad():
            self.a.weight.mul_(3000.0)  # outputs around 5e4: fp16-safe alone, not with calibration's margin

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * 0.001)


def test_calibration_section_and_explain():
    torch.manual_seed(0)
    x = torch.randn(4, 16) * 10
    conv = converter.convert(Overflowing(), (x,), precision="fp16", calibration=[(x,)])
    report = conv.report
    risky = [r["name"] for r in report.calibration["risky_nodes"]]
    assert "a" in risky
    assert report.node("a")["precision"] == "bf16"
    assert re.search(r"to fp16 \(\d+ fp16 \+ \d+ bf16\)", report.line), report.line
    text = explain(conv, "a")
    assert "1. [calibration]" in text and "WINS: calibration overrides every rule" in text
    assert "2. [op] 'linear' in default.toml -> half" in text
    assert "## Calibration" in report.to_markdown()
    assert 'id="calibration"' in report.to_html()
    assert validate(json.loads(report.to_json()), SCHEMA_V1) == []


def test_explain_from_a_bare_graph_module_knows_precision_and_tracer():
    """The GraphModule carries gm.meta["mp_graph"], so explain() needs nothing else."""
    conv = converter.convert(load_sample("mlp").build_model(), load_sample("mlp").example_inputs(), precision="fp16")
    graph = conv.module.meta["mp_graph"]
    assert (graph.tracer, graph.precision, graph.rule_files) == ("fx", "fp16", ("default.toml",))
    text = explain(conv.module, "fc1")
    assert "precision: fp16" in text, text


def test_renderers_never_import_build():
    """Report.to_markdown/to_html call the renderers, so the renderers read a Report through
    converter.report.common.ReportView and never import converter.report.build (no build <-> render cycle)."""
    import ast

    for name in ("common", "markdown", "html", "terminal", "plots"):
        path = ROOT / "converter" / "report" / f"{name}.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m and m.startswith("converter.report.build") for m in imported), (name, sorted(m for m in imported if m))
