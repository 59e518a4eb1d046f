"""Issue 33: the code never parses its own prose. What code reads back is a typed field (ModesNote.kind,
EmitNote.kind, NodeInfo.opaque_leaf, a rule's scope); messages, notes and reasons are for people.

The scan below fails on a ``startswith``/``endswith``, an ``in`` test or a regex search whose subject is
named like our own prose (a message, note, reason, why, modes note, description): rewording such text
must never change behaviour. Parsing *foreign* text (torch's exception messages) is allowed, listed in
:data:`ALLOWED` with why.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from converter.ir.meta import META_INFO, MODES_KINDS, ModesNote, NodeInfo

PACKAGE = Path(__file__).resolve().parent.parent / "converter"
#: names of our own prose: a test on a value so named decides behaviour by wording
PROSE = re.compile(r"(^|_)(message|messages|msg|note|notes|reason|reasons|why|described|description|modes|warning|warnings)$")
#: (file relative to converter/, the prose name, the literal tested): parses text that is not ours
ALLOWED = {
    # errors[tracer] is _short(exc) of torch's own exception: "Cache ... in output" is torch's wording
    ("passes/capture/advice.py", "why", "Cache"), ("passes/capture/advice.py", "why", "in output"),
    # `"export" not in reasons`: a key of the tracer -> reason dict, not a test on the wording
    ("passes/capture/advice.py", "reasons", "export"),
    # the first line of a CUDA graph capture's exception (torch's wording)
    ("train/cuda_graph.py", "why", "synchroniz"),
}
#: entries another module's owner may drop without touching this test (converter/train is maintained apart)
_OPTIONAL = {("train/cuda_graph.py", "why", "synchroniz")}


def _prose_name(expr: ast.AST) -> str:
    """The name a subject is known by: ``x``, ``a.x``, ``a["x"]``, ``a.get("x")``, ``str(x)``; "" if none."""
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant) and isinstance(expr.slice.value, str):
        return expr.slice.value
    if isinstance(expr, ast.Call):
        func = expr.func
        if isinstance(func, ast.Name) and func.id == "str" and expr.args:
            return _prose_name(expr.args[0])
        if isinstance(func, ast.Attribute) and func.attr == "get" and expr.args and isinstance(expr.args[0], ast.Constant):
            return str(expr.args[0].value)
    if isinstance(expr, ast.BoolOp):  # (x or "")
        return next(filter(None, map(_prose_name, expr.values)), "")
    return ""


def _literal(expr) -> str:
    """The string a test looks for (the first of a tuple), or "" when it is not a literal."""
    if isinstance(expr, ast.Tuple) and expr.elts:
        expr = expr.elts[0]
    return expr.value if isinstance(expr, ast.Constant) and isinstance(expr.value, str) else ""


def prose_tests(source: str) -> list[tuple[int, str, str, str]]:
    """(line, prose name, what, literal) for every wording test in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("startswith", "endswith"):
                subjects, literal = [node.func.value], _literal(node.args[0]) if node.args else ""
            elif node.func.attr in ("search", "match", "fullmatch", "findall"):
                subjects, literal = node.args[:2], ast.unparse(node.func.value)
            else:
                continue
            for subject in subjects:
                name = _prose_name(subject)
                if PROSE.search(name):
                    found.append((node.lineno, name, node.func.attr, literal))
        elif isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, (ast.In, ast.NotIn)) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
                    name = _prose_name(right)
                    if PROSE.search(name):
                        found.append((node.lineno, name, "in", node.left.value))
    return found


def test_no_module_decides_by_the_wording_of_its_own_prose():
    bad, allowed_used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for line, name, what, literal in prose_tests(path.read_text(encoding="utf-8")):
            if (rel, name, literal) in ALLOWED:
                allowed_used.add((rel, name, literal))
            else:
                bad.append(f"{rel}:{line}: {what} {literal!r} on {name!r}")
    assert bad == [], "behaviour decided by the wording of a message/note/reason; read a typed field instead:\n" + "\n".join(bad)
    assert allowed_used | _OPTIONAL == ALLOWED, f"stale allow-list entries: {ALLOWED - allowed_used - _OPTIONAL}"


@pytest.mark.parametrize("snippet", [
    'if captured.modes.startswith("frozen"): pass',
    'if note.startswith(("model.py reproduces", "the weight files")): pass',
    'x = "opaque leaf module" in node.meta[META_INFO].why',
    'x = _NORM_WORD.search(reason)',
    'x = str(report.extra.get("modes") or "").startswith("frozen in train")',
    'x = described.startswith("synthetic")',
])
def test_the_scan_catches_the_old_prose_tests(snippet):
    assert len(prose_tests(snippet)) == 1, snippet


def test_modes_note_is_read_by_kind_never_by_text():
    from converter.report.common import frozen_mode

    assert set(MODES_KINDS) == {"follows", "two_graphs", "frozen_train", "frozen_eval"}
    reworded = ModesNote("frozen_eval", "stuck in evaluation mode")
    assert reworded.frozen == "eval" and str(reworded) == "stuck in evaluation mode"
    assert frozen_mode(SimpleNamespace(modes=reworded, extra={})) == "stuck in evaluation mode"
    misleading = ModesNote("follows", "frozen in train mode (not really)")
    assert misleading.frozen is None and frozen_mode(SimpleNamespace(modes=misleading, extra={})) is None
    assert ModesNote("two_graphs", "x").extended("; y") == ModesNote("two_graphs", "x; y")
    with pytest.raises(ValueError, match="not one of"):
        ModesNote("frozen", "frozen in train mode")  # type: ignore[arg-type]


def test_capture_writes_typed_modes_and_the_prose_stays_in_the_report():
    import converter
    from tests.helpers import load_sample

    sample = load_sample("mlp")
    conv = converter.convert(sample.build_model(), sample.example_inputs())
    assert conv.report.modes is not None and conv.report.modes.kind == "follows" and conv.report.modes.frozen is None
    assert conv.report.records.capture.modes == conv.report.modes.text and conv.report.records.capture.modes.startswith("follows train()/eval()")
    assert '"modes": "follows train()/eval()' in conv.report.to_json()


def test_emit_tags_checks_and_warnings(tmp_path):
    import converter
    from converter.export.emit import emit
    from converter.export.notes import EmitNote
    from tests.helpers import load_sample

    sample = load_sample("mlp")
    conv = converter.convert(sample.build_model(), sample.example_inputs())
    notes: list = []
    emit(conv, tmp_path / "out", messages=notes)
    assert all(isinstance(n, EmitNote) for n in notes), [type(n) for n in notes]
    checks = sorted(n for n in notes if n.kind == "check")
    assert len(checks) == 2 and checks[0].startswith("model.py reproduces") and checks[1].startswith("the weight files"), checks
    assert [n for n in notes if n.kind == "warning"] == [n for n in notes if n not in checks]


def test_opaque_leaf_is_a_flag():
    import torch
    from torch import nn

    import converter

    class WithMha(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x)[0]

    conv = converter.convert(WithMha(), (torch.randn(2, 4, 16),), tracer="fx")
    infos = [n.meta.get(META_INFO) for n in conv.module.graph.nodes]
    flagged = [i for i in infos if i is not None and i.opaque_leaf]
    assert [i.module_type for i in flagged] == ["MultiheadAttention"], flagged
    assert NodeInfo(op="linear").opaque_leaf is False


def test_graph_meta_is_declared_fields_set_by_each_stage():
    """Graph-level results are declared, frozen fields (no untyped ``extra`` dict); each stage's are set."""
    import dataclasses

    import converter
    from converter.ir.meta import GM_GRAPH, GraphMeta
    from tests.helpers import load_sample

    names = [f.name for f in dataclasses.fields(GraphMeta)]
    assert "extra" not in names and {"device", "lowered", "lowering", "simplified", "fp32_math",
                                     "fp32_math_regions", "checkpoint"} <= set(names), names
    sample = load_sample("tiny_transformer")
    conv = converter.convert(sample.build_model(), sample.example_inputs(), device="cpu")
    graph_meta = conv.module.meta[GM_GRAPH]
    with pytest.raises(dataclasses.FrozenInstanceError):
        graph_meta.device = None  # type: ignore[misc]
    assert graph_meta.device == "cpu" and graph_meta.lowered and len(graph_meta.lowering) == len(graph_meta.lowered) + 1
    assert graph_meta.lowering[-1]["lowering"] == "upcast_gemm"  # the GEMM kernels' choice (not measured in tests: native)
    assert graph_meta.fp32_math is not None and graph_meta.checkpoint is not None
    assert conv.report.records.lowering.lowering == list(graph_meta.lowering)
    assert conv.report.fp32_math["setting"] == graph_meta.fp32_math
    assert isinstance(graph_meta.simplified, tuple)
