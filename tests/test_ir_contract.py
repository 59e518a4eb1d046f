"""The intermediate representation's contract: every node.meta / gm.meta key is declared once, the
Literal vocabularies hold what the stages really write, provenance notes are data, and the three
shared tables (precision aliases, precedence, errors) are the only copies."""
from __future__ import annotations

import ast
import html
import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from typing import get_args

import pytest
import torch
from torch import nn

import converter
import converter.report.explain as explain_module
from converter.ir import meta as ir_meta
from converter.ir.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_INTERNAL, MpconvertError
from converter.report.common import node_reason as _reason
from converter.report.explain import explain
from converter.rules import precedence
from converter.vocab import ALIASES, FLOAT_PRECISIONS, HALF_PRECISIONS, PrecisionError, precision
from tests.helpers import load_sample

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "converter"
SOURCES = sorted(PACKAGE.rglob("*.py"))


# ---------------------------------------------------------------------------------------------
# 1. the meta contract


def _is_meta(expr: ast.AST) -> bool:
    return (isinstance(expr, ast.Attribute) and expr.attr == "meta") or (isinstance(expr, ast.Name) and expr.id == "meta")


def _meta_keys(tree: ast.AST):
    """Every key expression used to index, get, pop or test a ``.meta`` mapping."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_meta(node.value):
            yield node.slice
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "pop", "setdefault") and _is_meta(node.func.value) and node.args):
            yield node.args[0]
        elif (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))
              and _is_meta(node.comparators[0])):
            yield node.left
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "set_graph_facts":
            yield ast.copy_location(ast.Name("GM_GRAPH"), node)  # the one writer of the frozen GraphMeta's fields (converter.ir.meta)


def _scan() -> tuple[dict[str, set[str]], list[str]]:
    """(declared key -> files using it, problems)."""
    constants = {name: getattr(ir_meta, name) for name in ir_meta.__all__ if name.startswith(("META_", "GM_"))}
    declared = {entry.key for entry in ir_meta.CONTRACT}
    used: dict[str, set[str]] = {}
    problems = []
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        for key in _meta_keys(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{rel}:{key.lineno}"
            if isinstance(key, ast.Constant) and key.value in ir_meta.TORCH_META_KEYS:
                continue  # torch's own keys (val, stack_trace, nn_module_stack): read only
            if isinstance(key, ast.Constant):
                problems.append(f"{where}: literal meta key {key.value!r}; use the constant from converter.ir.meta")
            elif isinstance(key, ast.Name) and key.id in constants:
                if constants[key.id] not in declared:
                    problems.append(f"{where}: {key.id} is not in CONTRACT")
                used.setdefault(constants[key.id], set()).add(rel)
            else:
                problems.append(f"{where}: meta key {ast.unparse(key)!r} is not a declared constant")
    return used, problems


def test_every_meta_key_the_package_uses_is_declared():
    used, problems = _scan()
    assert problems == [], "\n".join(problems)
    declared = {entry.key for entry in ir_meta.CONTRACT}
    assert set(used) == declared, f"declared but never used: {sorted(declared - set(used))}"
    print(f"\nmeta keys: {len(declared)} declared, {len(used)} used, in {len(set().union(*used.values()))} files")


def _stage(rel: str) -> str:
    """The stage a source file belongs to, as the contract names it."""
    parts = Path(rel).with_suffix("").parts[1:]
    if parts[0] in ("passes", "numerics"):
        # the calibrate stage is split over numerics/calibrate.py, stats.py (the statistics pass)
        # and redecide.py (re-deciding and re-placing); the search stage over search.py and
        # sensitivity.py (its ranking); the lower stage's CPU GEMM kernels, a portable graph's dispatching
        # kernels and the fp32-result MoE expert GEMMs run after rewrite (cpu_gemm.py, dispatch.py, grouped_gemm.py);
        # the fp8 stage is split over passes/fp8.py, numerics/fp8_layers.py (its numerics) and
        # numerics/fp8_search.py (its accuracy target)
        return {"stats": "calibrate", "redecide": "calibrate", "sensitivity": "search",
                "cpu_gemm": "lower", "dispatch": "lower", "grouped_gemm": "lower", "fp8_layers": "fp8", "fp8_search": "fp8"}.get(parts[1], parts[1])
    return parts[0]


def test_contract_names_exactly_the_stages_that_use_each_key():
    used, _ = _scan()
    for entry in ir_meta.CONTRACT:
        stages = {_stage(rel) for rel in used[entry.key]}
        assert stages == set(entry.writers) | set(entry.readers), (entry.key, sorted(stages))


def test_contract_entries_are_complete_and_unique():
    keys = [entry.key for entry in ir_meta.CONTRACT]
    assert len(keys) == len(set(keys)) == 18, keys
    for entry in ir_meta.CONTRACT:
        assert entry.on in ("node", "graph") and entry.type and entry.writers and entry.doc, entry
    assert {e.key for e in ir_meta.CONTRACT if e.on == "graph"} == {ir_meta.GM_GRAPH, ir_meta.GM_PARAM_DTYPES, ir_meta.GM_PARAM_STORAGE,
                                                                          ir_meta.GM_CALIBRATION, ir_meta.GM_READ_CASTS}


def test_the_scanner_catches_an_undeclared_key():
    tree = ast.parse('node.meta["mp_new"] = 1\nx = n.meta.get("other")\nif "k" in n.meta: pass\nn.meta[META_INFO]\n')
    keys = [ast.unparse(k) for k in _meta_keys(tree)]
    assert keys == ["'mp_new'", "'other'", "'k'", "META_INFO"], keys


class _Block(nn.Module):
    """Pre-norm attention block with SDPA (lowered on CPU), an explicit cast and an in-place op."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        h = x + self.out(a)
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        h.relu_()
        return h.float().softmax(-1), h.shape[0]


def _graphs():
    torch.manual_seed(0)
    tiny = load_sample("tiny_transformer")
    cnn = load_sample("cnn")
    yield converter.convert(tiny.build_model(), tiny.example_inputs(), precision="fp16", rules="llm")
    yield converter.convert(cnn.build_model().train(), cnn.example_inputs(), precision="bf16", device="cpu",
                            placement="simple")
    yield converter.convert(_Block().eval(), (torch.randn(3, 5, 32),), precision="bf16", device="cpu")


def test_literal_vocabularies_hold_every_value_the_stages_write():
    kinds, precisions, requested, stages, tables, modes, opaque = set(), set(), set(), set(), set(), set(), 0
    for conv in _graphs():
        modes.add(conv.report.modes.kind)
        for node in conv.module.graph.nodes:
            info = node.meta.get(ir_meta.META_INFO)
            decision = node.meta.get(ir_meta.META_DECISION)
            if info is not None:
                kinds.add(info.kind)
                opaque += info.opaque_leaf
            if decision is not None:
                precisions.add(decision.precision)
                requested.add(decision.requested)
                stages.update(stage for stage, _ in decision.notes)
                tables.add(decision.rule.table)
            cast = node.meta.get(ir_meta.META_CAST)
            if cast is not None:
                assert cast.dtype in get_args(ir_meta.Precision) and cast.src_dtype in get_args(ir_meta.Precision), cast
    assert kinds <= set(ir_meta.NODE_KINDS) and {"compute", "cast", "passive"} <= kinds, kinds
    assert precisions <= set(get_args(ir_meta.DecisionPrecision)), precisions
    assert requested <= set(get_args(ir_meta.RequestedPrecision)), requested
    assert stages <= set(get_args(ir_meta.NoteStage)) and {"lower", "place"} <= stages, stages
    assert tables <= set(get_args(ir_meta.RuleTable)), tables
    assert modes <= set(ir_meta.MODES_KINDS) and "follows" in modes, modes
    assert opaque == 0, opaque  # no FX leaf the samples keep opaque (tests/test_typed_fields.py makes one)


# ---------------------------------------------------------------------------------------------
# 2. structured provenance


def test_notes_are_data_and_reason_stays_the_deciding_rules():
    tiny = load_sample("tiny_transformer")
    conv = converter.convert(tiny.build_model(), tiny.example_inputs(), precision="bf16", rules="llm", device="cpu")
    rows = {r["name"]: r for r in conv.report.to_dict()["nodes"]}
    placed = lowered = 0
    for name, decision in conv.decisions.items():
        row = rows[name]
        assert row["reason"] == decision.reason
        assert row["notes"] == [[s, t] for s, t in decision.notes]
        for _, text in decision.notes:
            assert not text.startswith(("placement", "lowered")), (name, text)  # the label comes from the stage
        if decision.requested in ("follow", "promote"):
            placed += 1
            assert [s for s, _ in decision.notes][-1:] == ["place"], (name, decision.notes)
            assert "; placement:" not in decision.reason, decision.reason
            assert decision.full_reason == f"{decision.reason}; " + "; ".join(ir_meta.note_text(s, t) for s, t in decision.notes)
        lowered += any(s == "lower" for s, _ in decision.notes)
    assert placed >= 10 and lowered >= 5, (placed, lowered)
    follow = next(n for n, d in conv.decisions.items() if d.requested == "follow" and d.notes)
    text = explain(conv, follow)
    assert f"  why: {conv.decisions[follow].reason}\n" in text
    assert f"  placement: {conv.decisions[follow].notes[-1][1]}" in text
    # the tables show the one-line form (reason; label: note; ...), so report.md keeps the notes
    assert _reason(rows[follow]) == conv.decisions[follow].full_reason
    assert "; placement: min-cut chose bf16" in conv.report.to_markdown()


class _Overflowing(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)
        with torch.no_grad():
            self.a.weight.mul_(3000.0)  # ~5e4: fits fp16 alone, not with calibration's margin

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * 0.001)


def test_calibration_replaces_the_decision_and_drops_stale_notes():
    torch.manual_seed(0)
    x = torch.randn(4, 16) * 10
    plain = converter.convert(_Overflowing(), (x,), precision="fp16")
    conv = converter.convert(_Overflowing(), (x,), precision="fp16", calibration=[(x,)])
    before, after = plain.decisions["a"], conv.decisions["a"]
    assert (before.precision, after.precision, after.rule.table) == ("fp16", "bf16", "calibration")
    assert after.notes == () and after.reason.startswith("calibration: ")
    assert after.reason.endswith(f"(was fp16 by {before.rule}: {before.full_reason})"), after.reason
    assert [m.level_name for m in after.matches][:1] == ["calibration"] and after.matches[0].level == precedence.rank("calibration")


def test_explain_reads_notes_and_never_parses_the_reason():
    source = inspect.getsource(explain_module)  # explain and every helper it calls
    assert "re." not in source and "split(" not in source, "explain must read Decision.notes, not parse text"


# ---------------------------------------------------------------------------------------------
# 3. one precision-alias table


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).relu()


@pytest.mark.parametrize("name", sorted(k for k, v in ALIASES.items() if v in HALF_PRECISIONS) + ["FLOAT16", "BF16-Mixed"])
def test_every_half_alias_is_accepted_by_convert_audit_and_the_trainer(name):
    from converter.train.trainer import MixedPrecisionTrainer

    want = ALIASES[name.lower()]
    x = torch.randn(4, 8)
    assert converter.convert(_Tiny(), (x,), precision=name).precision == want
    assert converter.audit(_Tiny(), (x,), precision=name).precision == want
    model = _Tiny()
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=name,
                                    loss_scale=None if want == "bf16" else "dynamic")
    assert trainer.state_dict()["precision"] == want


@pytest.mark.parametrize(("dtype", "want"), [(torch.float16, "fp16"), (torch.bfloat16, "bf16")])
def test_torch_dtypes_are_accepted(dtype, want):
    assert precision(dtype, allowed=HALF_PRECISIONS) == want and precision(dtype, allowed=FLOAT_PRECISIONS) == want
    assert precision(torch.float32, allowed=FLOAT_PRECISIONS) == "fp32"
    assert precision("Float32", allowed=FLOAT_PRECISIONS) == "fp32"


@pytest.mark.parametrize(("bad", "hint"), [("flaot16", "did you mean 'float16'?"), ("bf61", "did you mean 'bf16'?"),
                                           ("fp4", ""), ("fp32", ""), (torch.float32, ""), (torch.int8, "")])
def test_one_message_for_a_bad_precision_everywhere(bad, hint, tmp_path):
    from converter.train.trainer import MixedPrecisionTrainer

    with pytest.raises(PrecisionError) as direct:
        precision(bad, allowed=HALF_PRECISIONS)
    message = str(direct.value)
    assert "precision must be one of fp16 or bf16 (aliases: float16, half, 16-mixed, bfloat16, bf16-mixed)" in message
    assert message.endswith(hint) if hint else "did you mean" not in message, message
    assert ("is not a half precision" if bad in ("fp32", torch.float32) else "unknown precision") in message
    x = torch.randn(4, 8)
    with pytest.raises(PrecisionError) as via_convert:
        converter.convert(_Tiny(), (x,), precision=bad)
    model = _Tiny()
    with pytest.raises(PrecisionError) as via_trainer:
        MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=bad)
    # a conversion target also takes the compute mode fp8 (issue 34): same message, fp8 listed among the choices;
    # the trainer takes what convert takes (issue 43: precision="fp8" trains as bf16), with convert's message
    with pytest.raises(PrecisionError) as as_target:
        precision(bad)
    target_message = str(as_target.value)
    assert "one of fp16, bf16 or fp8 (aliases:" in target_message, target_message
    assert str(via_convert.value) == target_message, (str(via_convert.value), target_message)
    assert str(via_trainer.value) == target_message, (str(via_trainer.value), target_message)
    assert (via_convert.value.value, via_convert.value.allowed) == (bad, ("fp16", "bf16", "fp8"))
    assert isinstance(direct.value, ValueError) and direct.value.exit_code == EXIT_BAD_INPUT


def test_onnx_export_and_cli_use_the_same_table(tmp_path, capfd):
    from converter.cli.main import main

    conv = converter.convert(_Tiny(), (torch.randn(4, 8),), precision="bf16")
    with pytest.raises(PrecisionError, match="did you mean 'float16'"):
        conv.export_onnx(tmp_path / "m.onnx", precision="flaot16")
    code = main([str(ROOT / "samples" / "mlp.py"), "--precision", "flaot16", "--out", str(tmp_path / "o")])
    err = capfd.readouterr().err
    assert code == 2 and "unknown precision 'flaot16'" in err and "did you mean 'float16'?" in err, err
    code = main([str(ROOT / "samples" / "mlp.py"), "--onnx", "--onnx-precision", "fp8", "--out", str(tmp_path / "o")])
    err = capfd.readouterr().err
    assert code == 2 and "precision 'fp8' is not a half precision" in err and not (tmp_path / "o").exists(), err


# ---------------------------------------------------------------------------------------------
# 4. one precedence table


def test_precedence_is_defined_once():
    order = set(precedence.PRECEDENCE)
    offenders = []
    for path in SOURCES:
        if path.name == "precedence.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        literal_args = {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}  # Literal[...] vocabularies
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List)) and id(node) not in literal_args:
                values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if len(values & order) >= 3:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == [], "\n".join(offenders)


def test_loader_decide_report_and_explain_share_the_precedence():
    from converter.report.build import PRECEDENCE as REPORTED
    from converter.rules.loader import LEVELS

    assert LEVELS == precedence.MATCH_TABLES == precedence.PRECEDENCE[:-1] and REPORTED is precedence.PRECEDENCE
    tiny = load_sample("tiny_transformer")
    conv = converter.convert(tiny.build_model(), tiny.example_inputs(), precision="bf16", rules="llm")
    for decision in conv.decisions.values():
        ranks = [m.level for m in decision.matches]
        assert ranks == sorted(ranks) and all(m.level == precedence.rank(m.level_name) for m in decision.matches)
    name = next(n for n, d in conv.decisions.items() if len(d.matches) > 1)
    assert f"precedence, highest first: {precedence.describe()}" in explain(conv, name)
    assert f"Precedence: {html.escape(precedence.describe())}." in conv.report.to_html()
    assert precedence.rank("calibration") < precedence.rank("node") < precedence.rank("default") < precedence.rank("??")


# ---------------------------------------------------------------------------------------------
# 5. errors


def _exception_classes() -> list[type]:
    found = {}
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="converter."):
        if info.name == "converter.__main__":
            continue
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("converter."):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def test_every_exception_class_derives_from_mpconvert_error():
    classes = _exception_classes()
    defined = sum(len(re.findall(r"^class \w+\(.*(Error|Exception|NotMet|Budget|CheckFailed).*\):", p.read_text(), re.M))
                  for p in SOURCES)
    assert len(classes) == defined >= 20, ([c.__name__ for c in classes], defined)
    assert [c.__name__ for c in classes if not issubclass(c, MpconvertError)] == []
    assert all(c.exit_code in (EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL) for c in classes)
    assert converter.MpconvertError is MpconvertError


def test_exception_classes_keep_their_old_bases_and_exit_codes():
    from converter.api import PassError
    from converter.cli.main import UsageError
    from converter.cli.modelfile import ExampleInputsError, ModelFileError
    from converter.export.emit import EmitError, OutputExistsError, VerificationError
    from converter.export.onnx import OnnxExportError
    from converter.numerics.calibrate import ToleranceNotMet
    from converter.passes.capture import CaptureError
    from converter.passes.decide import BannedOpError
    from converter.rules.loader import RulesError

    for cls in (RulesError, BannedOpError, ModelFileError, ExampleInputsError, EmitError, OutputExistsError, UsageError):
        assert issubclass(cls, ValueError) and cls.exit_code == EXIT_BAD_INPUT, cls
    assert issubclass(ToleranceNotMet, ValueError) and ToleranceNotMet.exit_code == EXIT_CHECK_FAILED
    assert issubclass(VerificationError, EmitError) and VerificationError.exit_code == EXIT_CHECK_FAILED
    assert issubclass(CaptureError, RuntimeError) and CaptureError.exit_code == EXIT_BAD_INPUT
    assert issubclass(PassError, RuntimeError) and PassError.exit_code == EXIT_INTERNAL
    assert issubclass(OnnxExportError, RuntimeError) and OnnxExportError.exit_code == EXIT_CHECK_FAILED


def test_cli_maps_errors_by_type_not_by_name():
    from converter.cli import main as cli
    from converter.export.emit import VerificationError
    from converter.numerics.calibrate import ToleranceNotMet
    from converter.rules.loader import RulesError

    source = Path(cli.__file__).read_text()
    assert "type(exc).__name__ ==" not in source and "type(exc).__name__ in" not in source

    class Renamed(RulesError):  # a subclass with another name still maps to bad input
        pass

    assert cli._classify(Renamed("bad.toml: broken")) == (2, "bad.toml: broken")
    assert cli._classify(VerificationError("outputs differ")) == (1, "outputs differ; nothing was written")
    assert cli._classify(ToleranceNotMet(12.5, ["a"], tolerance="30 dB"))[0] == 1
    assert cli._classify(converter.PassError("stage 'place' failed"))[0] == 3
    assert cli._classify(KeyError("x"))[0] == 3

