"""One vocabulary (:mod:`converter.vocab`), one precision normaliser, and errors that carry their facts.

* no choice list of the vocabulary is spelled out anywhere else in ``converter/`` (an AST scan);
* no function but :func:`converter.vocab.precision` turns precision spellings into canonical names, and no
  other table maps them;
* ``"fp8"`` is accepted by every entry point where it means something: ``ConvertOptions``, the trainer, the
  Lightning plugin, the CLI's ``--precision``;
* an unknown precision (or choice) names the allowed values and carries them as fields;
* no handler of one of mpconvert's own errors reads the facts back out of the message.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import converter
from converter import vocab
from converter.options import ConvertOptions, OptionsError
from converter.vocab import ALIASES, HALF_PRECISIONS, PRECISIONS, ChoiceError, PrecisionError, choice, precision
from tests.helpers import ROOT

PACKAGE = ROOT / "converter"
#: every choice list of the vocabulary, by name
LISTS = {name: getattr(vocab, name) for name in (
    "PRECISIONS", "HALF_PRECISIONS", "FLOAT_PRECISIONS", "RULE_PRECISIONS", "OPT_LEVELS", "TRACERS", "DEVICES",
    "FP8_RECIPES", "FP8_RECIPE_CHOICES", "FP32_MATHS", "PLACEMENTS")}
#: spellings that only a precision normaliser has a reason to hold next to a canonical name ("half" is also the
#: rule precision "the target", so it is not among them)
_ALIAS_ONLY = frozenset(a for a in ALIASES if a not in ALIASES.values() and a not in ("half", "16"))
_HALF_NAMES = frozenset(HALF_PRECISIONS)
#: the functions of converter/vocab.py that read its alias table: the normaliser and its two helpers
_VOCAB_READERS = frozenset({"precision", "_canonical", "describe"})


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), filename=str(path))) for path in sorted(PACKAGE.rglob("*.py"))]


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _body_strings(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The string constants of a function's body: no docstring, no parameter defaults."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return {s for statement in body for s in _strings(statement)}


def test_the_vocabulary_lists_match_their_literal_types():
    for name, values in LISTS.items():
        assert len(set(values)) == len(values) and all(isinstance(v, str) for v in values), (name, values)
    assert set(vocab.PRECISIONS) == set(vocab.RUNS_IN) and set(vocab.RUNS_IN.values()) == set(HALF_PRECISIONS)
    assert set(vocab.ALIASES.values()) == {"fp32", "fp16", "bf16", "fp8"}


def test_no_choice_list_is_spelled_out_outside_the_vocabulary():
    """A tuple/list/set of string constants equal (as a set) to one of the vocabulary's lists is a second
    spelling of it: it must be the vocabulary's name instead."""
    wanted = {frozenset(values): name for name, values in LISTS.items()}
    assert len(wanted) == len(LISTS), "two vocabulary lists hold the same values"
    found, seen_in_vocab = [], set()
    for path, tree in _modules():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Tuple, ast.List, ast.Set)) or len(node.elts) < 2:
                continue
            if not all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                continue
            name = wanted.get(frozenset(e.value for e in node.elts))  # type: ignore[attr-defined]
            if name is None:
                continue
            if path.name == "vocab.py" and path.parent == PACKAGE:
                seen_in_vocab.add(name)
            else:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} spells {name}")
    assert found == [], found
    # the scan sees the vocabulary's own spellings (every list written once, FP8_RECIPE_CHOICES built from another)
    assert seen_in_vocab == set(LISTS) - {"FP8_RECIPE_CHOICES"}, seen_in_vocab


def test_only_one_function_normalises_precision_names():
    """A function whose body holds an alias (``float16``, ``bf16-mixed``...) and a canonical half name, or a
    torch half dtype and a canonical half name, is a precision normaliser; there is none outside the vocabulary,
    whose one function reads its table instead. And only the vocabulary holds a table of aliases."""
    normalisers, tables = [], []
    for path, tree in _modules():
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                strings = _body_strings(node)
                inner = [n for statement in node.body for n in ast.walk(statement)]
                attrs = {n.attr for n in inner if isinstance(n, ast.Attribute)}
                names = {n.id for n in inner if isinstance(n, ast.Name)} | attrs
                spells = strings & _HALF_NAMES and (strings & _ALIAS_ONLY or attrs & {"float16", "bfloat16"})
                # reads an alias table, or judges a precision name itself (raises PrecisionError)
                judges = "ALIASES" in names or any(isinstance(n, ast.Raise) and "PrecisionError" in ast.dump(n) for n in inner)
                if spells or (judges and not (str(where) == "converter/vocab.py" and node.name in _VOCAB_READERS)):
                    normalisers.append(f"{where}:{node.lineno} {node.name}")
            elif isinstance(node, ast.Dict):
                pairs = [(k.value, v.value) for k, v in zip(node.keys, node.values)
                         if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)]
                if sum(1 for k, v in pairs if k in _ALIAS_ONLY and v in ALIASES.values()) >= 2:
                    tables.append(f"{where}:{node.lineno}")
    assert normalisers == [], normalisers
    assert tables == ["converter/vocab.py:" + str(_line_of("ALIASES: dict"))], tables
    # the one normaliser is not vacuous: it reads every spelling, any case, and torch dtypes
    assert {a: precision(a.upper(), allowed=tuple(ALIASES.values())) for a in ALIASES} == ALIASES
    assert [precision(d, allowed=vocab.FLOAT_PRECISIONS) for d in (torch.float32, torch.float16, torch.bfloat16)] \
        == ["fp32", "fp16", "bf16"]


def _line_of(text: str) -> int:
    lines = (PACKAGE / "vocab.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.startswith(text))


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


@pytest.mark.parametrize("spelling", ["fp8", "FP8", " fp8 "])
def test_fp8_is_accepted_by_the_options_the_trainer_and_the_lightning_plugin(spelling):
    from converter.lightning import MixedPrecision
    from converter.train.trainer import MixedPrecisionTrainer

    options = ConvertOptions(precision=spelling)
    assert (options.precision, options.fp8_recipe) == ("bf16", "auto")
    conv = converter.convert(_Tiny(), (torch.randn(4, 8),), precision=spelling)
    assert (conv.precision, conv.options) == ("bf16", options)
    trainer = MixedPrecisionTrainer(conv.module, torch.optim.SGD(conv.module.parameters(), lr=0.1), precision=spelling)
    state = trainer.state_dict()
    assert state["precision"] == "bf16" and trainer.scaler is None, state["precision"]  # fp8 trains as its bf16
    trainer.zero_grad()
    trainer.backward(conv.module(torch.randn(4, 8)).float().square().mean())
    assert trainer.step() is True and trainer.stats.steps == 1, trainer.stats
    plugin = MixedPrecision(spelling)
    assert (plugin.options, plugin.half, plugin.precision) == (options, "bf16", "bf16-mixed")


def test_the_cli_takes_fp8(tmp_path, capfd):
    from converter.cli.main import main
    from converter.cli.parsers import parse

    assert parse(["model.py", "--precision", "fp8"]).namespace.precision == "fp8"
    code = main(["audit", str(ROOT / "samples" / "mlp.py"), "--precision", "fp8", "--out", str(tmp_path / "a"),
                 "--json"])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert json.loads(out)["precision"] == "bf16", out[:300]  # fp8: the GEMMs the rules mark fp8, the rest bf16


@pytest.mark.parametrize("bad", ["fp4", "flaot16", torch.float32, torch.int8, 16.0])
def test_an_unknown_precision_names_the_allowed_values_and_carries_them(bad):
    with pytest.raises(PrecisionError) as info:
        ConvertOptions(precision=bad)
    error = info.value
    assert (error.value, error.allowed, error.what) == (bad, PRECISIONS, "precision")
    assert error.canonical == ("fp32" if bad is torch.float32 else None)
    message = str(error)
    assert "\n" not in message and "precision must be one of fp16, bf16 or fp8 (aliases: " in message, message
    assert isinstance(error, ChoiceError) and isinstance(error, ValueError) and error.exit_code == 2
    with pytest.raises(PrecisionError) as half:
        precision("fp8", allowed=HALF_PRECISIONS, what="--onnx-precision")
    assert (half.value.value, half.value.allowed, half.value.canonical) == ("fp8", HALF_PRECISIONS, "fp8")
    assert str(half.value).startswith("--onnx-precision 'fp8' is not a half precision; --onnx-precision must be one "
                                      "of fp16 or bf16"), str(half.value)


def test_a_bad_choice_carries_what_value_and_allowed():
    with pytest.raises(OptionsError) as info:
        ConvertOptions(tracer="jit")
    assert (info.value.what, info.value.value, info.value.allowed) == ("tracer", "jit", vocab.TRACERS)
    assert str(info.value) == "tracer must be one of 'auto', 'fx', 'export', got 'jit'"
    with pytest.raises(ChoiceError) as close:
        choice("O3 ", vocab.OPT_LEVELS, what="opt_level")
    assert close.value.allowed == ("O1", "O2") and type(close.value) is ChoiceError
    assert choice("cuda", vocab.DEVICES, what="device") == "cuda"


# ---------------------------------------------------------------------------------------------
# errors carry their facts


def _own_error_names(trees: list[tuple[Path, ast.Module]]) -> set[str]:
    """The names of mpconvert's exception classes: MpconvertError and every class derived from one (to a fixpoint),
    plus the search's own LookupError."""
    names = {"MpconvertError", "NoPassingSet"}
    classes = [n for _, tree in trees for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    while True:
        more = {c.name for c in classes if c.name not in names
                and any(isinstance(b, ast.Name) and b.id in names or isinstance(b, ast.Attribute) and b.attr in names
                        for b in c.bases)}
        if not more:
            return names
        names |= more


def _caught(handler: ast.ExceptHandler) -> set[str]:
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return {t.id if isinstance(t, ast.Name) else t.attr for t in types if isinstance(t, (ast.Name, ast.Attribute))}


def _reads_message(body: list[ast.stmt], name: str) -> list[int]:
    """Lines where ``str(name)`` (or ``name.args``) is searched, split, compared or matched."""
    def is_text(node: ast.AST) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str"
                and len(node.args) == 1 and isinstance(node.args[0], ast.Name) and node.args[0].id == name)

    lines = []
    for statement in body:
        for node in ast.walk(statement):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                    and any(is_text(c) for c in node.comparators):
                lines.append(node.lineno)
            elif isinstance(node, ast.Attribute) and is_text(node.value) and node.attr in (
                    "startswith", "endswith", "split", "partition", "splitlines", "find", "index", "removeprefix"):
                lines.append(node.lineno)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "search", "match", "fullmatch", "findall") and any(is_text(a) for a in node.args):
                lines.append(node.lineno)
            elif isinstance(node, ast.Attribute) and node.attr == "args" and isinstance(node.value, ast.Name) \
                    and node.value.id == name:
                lines.append(node.lineno)
    return lines


def test_no_handler_of_our_own_errors_parses_their_message():
    trees = _modules()
    ours = _own_error_names(trees)
    assert {"PassError", "CaptureError", "RandomAtTraceTime", "PrecisionError", "ForwardCheckError"} <= ours
    found = []
    for path, tree in trees:
        for handler in (n for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler)):
            if handler.name and handler.type is not None and _caught(handler) & ours:
                found += [f"{path.relative_to(ROOT)}:{line}" for line in _reads_message(handler.body, handler.name)]
    assert found == [], found


def test_pass_error_names_its_stage_and_the_stages_before_it():
    import torch

    from converter.api import PassError
    from converter.options import ConvertOptions
    from converter.stages import Stage, State, _run_one

    state = State(torch.nn.Linear(1, 1), (), ConvertOptions())
    state.done = ["capture", "decide"]
    with pytest.raises(PassError) as info:
        _run_one(Stage("calibrate", ("model",), (), "api.py", lambda s: {}["missing"]), state)
    assert (info.value.stage, info.value.ran, info.value.node) == ("calibrate", ("capture", "decide"), None)
    assert isinstance(info.value.__cause__, KeyError)


def test_random_at_trace_time_and_the_search_carry_their_reasons():
    from converter.numerics.search import NoPassingSet, Outcome, search_ranked
    from converter.passes.capture.fx_trace import RandomAtTraceTime

    error = RandomAtTraceTime(function="rand", location="model.py:12")
    assert (error.function, error.location) == ("rand", "model.py:12")
    assert error.reason == str(error) and "at model.py:12 (torch.rand of no traced tensor)" in error.reason
    runs = []

    def never(keep):
        runs.append(len(keep))
        return Outcome(ok=False, sqnr_db=1.0)

    with pytest.raises(NoPassingSet) as info:
        search_ranked(never, ["a", "b", "c"], max_keep=3)
    assert info.value.why == "keeping the 3 most sensitive node(s) in fp32 is not enough" and runs == [1, 2, 3], runs
