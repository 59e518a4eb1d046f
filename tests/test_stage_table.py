"""The pipeline is a declared stage table (issue 46 item 6): ``converter.api.STAGES`` is what ``convert``,
``audit`` and ``pipeline`` run, through ``converter.stages.run_stages``; docs/architecture.md's "Stage table"
lists the same stages, row by row; every stage reads only the inputs and what an earlier stage wrote."""
from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from helpers import load_sample

import converter
import converter.api as api
from converter.ir.graphmodule import TwoModeGraphModule
from converter.stages import INPUTS, PassError, Stage, State, check_table, declare, run_stages

ARCH_MD = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _section() -> str:
    return ARCH_MD.read_text(encoding="utf-8").split("\n## Stage table\n", 1)[1].split("\n## ", 1)[0]


def _names(cell: str) -> tuple[str, ...]:
    return tuple(re.findall(r"`([^`]+)`", cell))


def _doc_rows() -> list[tuple[str, tuple[str, ...], tuple[str, ...], str, str]]:
    rows = []
    for line in _section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("stage", "") or set(cells[0]) <= {"-"}:
            continue
        module = _names(cells[3])
        assert len(module) == 1, f"the module cell of {cells[0]!r} should name one module: {cells[3]!r}"
        rows.append((cells[0], _names(cells[1]), _names(cells[2]), module[0], cells[4]))
    return rows


def test_the_docs_table_is_the_stage_table() -> None:
    rows = _doc_rows()
    assert len(rows) == len(api.STAGES) == 29, (len(rows), len(api.STAGES))
    assert [r[0] for r in rows] == [s.name for s in api.STAGES]  # names, in order
    declared = [(s.name, s.reads, s.writes, s.module) for s in api.STAGES]
    assert [r[:4] for r in rows] == declared
    per_graph = [r[0] for r in rows if r[4].startswith("per graph")]
    assert per_graph == [s.name for s in api.STAGES if s.per_graph]
    root = Path(converter.__file__).parent
    assert [s.module for s in api.STAGES if not (root / s.module).exists()] == []


def test_the_docs_name_the_unguarded_stages_and_every_artefact() -> None:
    section = _section()
    unguarded = re.search(r"\(unguarded: ([^)]*)\)", section.replace("\n", " "))
    assert unguarded is not None, "the Stage table section should list its unguarded stages"
    assert [n.strip() for n in unguarded.group(1).split(",")] == [s.name for s in api.STAGES if not s.wrap]
    glossary = set(_names(section.split("The names", 1)[1]))
    used = {name for s in api.STAGES for name in s.reads + s.writes}
    assert sorted(used - glossary) == [] and set(INPUTS) <= glossary


def test_every_stage_reads_only_what_was_written_before() -> None:
    assert check_table(api.STAGES) == []
    written = set(INPUTS)
    for stage in api.STAGES:
        assert set(stage.reads) <= written, (stage.name, sorted(set(stage.reads) - written))
        written |= set(stage.writes)
    assert {"report", "module", "decisions", "casts"} <= written


def _noop(state: State) -> None:
    pass


def test_the_table_check_fails_on_a_planted_order() -> None:
    early = Stage("early", ("casts",), (), "passes/rewrite.py", _noop)  # reads what only a later stage writes
    late = Stage("late", ("model",), ("casts",), "passes/rewrite.py", _noop)
    assert check_table((early, late)) == ["stage 'early' reads casts, which no earlier stage writes"]
    assert check_table((late, early)) == []
    assert check_table((late, late)) == ["stage 'late' is declared 2 times"]
    with pytest.raises(PassError, match=r"stage table is inconsistent: stage 'early' reads casts"):
        declare(early, late)


def _recording(calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace api.STAGES with the same stages, each recording (name, graph index) when it runs."""

    def wrap(stage: Stage) -> Callable[[State], None]:
        def run(state: State) -> None:
            calls.append((stage.name, state.index))
            stage.run(state)

        return run

    monkeypatch.setattr(api, "STAGES", tuple(dataclasses.replace(s, run=wrap(s)) for s in api.STAGES))


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_sample("tiny_transformer")


def test_convert_and_audit_run_the_table_in_order(tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list = []
    _recording(calls, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", converter.SlowHalfWarning)
        conv = converter.convert(tiny.build_model(), tiny.example_inputs(), precision="bf16")
    graph = ["graph_facts", "decide", "lower", "place", "rewrite", "grouped_gemm", "dispatch", "simplify", "fp32_math", "checkpoint"]
    assert [name for name, _ in calls] == (["rules", "capture"] + graph + ["codegen", "check", "combine", "device_advice",
                                                                             "optional_inputs", "report"])
    assert list(conv.timings) == ["capture_s", "pass_s", "codegen_s", "check_s"]
    assert all(type(v) is float and v >= 0 for v in conv.timings.values()), conv.timings
    assert conv.report.records.run.timings is conv.timings
    calls.clear()
    converter.audit(tiny.build_model(), tiny.example_inputs(), precision="bf16")
    assert [name for name, _ in calls] == ["rules", "capture"] + graph + ["combine", "report"]
    calls.clear()
    api.pipeline(tiny.build_model(), tiny.example_inputs(), converter.ConvertOptions(precision="bf16"), codegen=False,
                 simplify_graph=False)
    assert [name for name, _ in calls] == ["rules", "capture"] + [n for n in graph if n != "simplify"] + ["combine"]


class _TwoModes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return self.b(torch.relu(self.a(x)))
        return self.a(x)


def test_a_two_mode_capture_runs_the_graph_stages_graph_by_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list = []
    _recording(calls, monkeypatch)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", converter.SlowHalfWarning)
        conv = api.convert(_TwoModes(), (torch.randn(2, 8),), precision="bf16", device="cpu")
    per_graph = ["graph_facts", "decide", "lower", "place", "rewrite", "grouped_gemm", "cpu_gemm", "simplify", "fp32_math",
                 "checkpoint", "codegen", "check"]
    assert calls == ([("rules", 0), ("capture", 0)] + [(n, 0) for n in per_graph] + [(n, 1) for n in per_graph]
                     + [("combine", 0), ("device_advice", 0), ("optional_inputs", 0), ("report", 0)])
    assert isinstance(conv.module, TwoModeGraphModule), type(conv.module).__mro__


def test_an_unexpected_failure_names_the_stage_and_those_before_it(tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(gm: torch.fx.GraphModule) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(api, "simplify", broken)
    with pytest.raises(PassError) as err:
        api.audit(tiny.build_model(), tiny.example_inputs(), precision="bf16")
    assert str(err.value) == ("stage 'simplify' failed after [rules, capture, graph_facts, decide, lower, place, "
                              "rewrite, grouped_gemm, dispatch]: RuntimeError: boom")
    assert isinstance(err.value.__cause__, RuntimeError)


def test_mpconvert_and_value_errors_and_unguarded_stages_pass_unchanged(tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    class Planted(converter.MpconvertError):
        pass

    for exc in (ValueError("bad value"), Planted("planted")):
        def failing(*args: Any, exc: Exception = exc, **kwargs: Any) -> None:
            raise exc

        monkeypatch.setattr(api, "rewrite", failing)
        with pytest.raises(type(exc)) as err:
            api.audit(tiny.build_model(), tiny.example_inputs(), precision="bf16")
        assert err.value is exc
    monkeypatch.undo()

    def capture_fails(*args: Any, **kwargs: Any) -> None:
        raise KeyError("from capture")

    monkeypatch.setattr(api, "capture", capture_fails)  # capture is unguarded: its errors are its own
    with pytest.raises(KeyError, match="from capture"):
        api.audit(tiny.build_model(), tiny.example_inputs(), precision="bf16")


def test_the_device_advice_warning_names_the_caller_of_convert(tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "half_speed_advice", lambda precision, device, profile=None: f"planted advice for {precision}")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        conv = api.convert(tiny.build_model(), tiny.example_inputs(), precision="bf16")
    slow = [w for w in said if issubclass(w.category, converter.SlowHalfWarning)]
    assert [(str(w.message), w.filename) for w in slow] == [("planted advice for bf16", __file__)]
    assert conv.report.records.advice is not None and conv.report.records.advice.text == "planted advice for bf16"


def test_run_stages_skips_what_does_not_apply_and_times_what_runs() -> None:
    ran: list[str] = []

    def record(name: str) -> Callable[[State], None]:
        return lambda state: ran.append(name)

    table = declare(Stage("a", ("model",), ("x",), "api.py", record("a"), timing="capture_s"),
                    Stage("b", ("x",), ("y",), "api.py", record("b"), when=lambda s: False, timing="pass_s"),
                    Stage("c", ("x",), ("y",), "api.py", record("c"), per_graph=True, timing="pass_s"))
    state = State(torch.nn.Linear(1, 1), (), converter.ConvertOptions())
    state.graphs = [torch.fx.symbolic_trace(torch.nn.ReLU()), torch.fx.symbolic_trace(torch.nn.ReLU())]
    run_stages(state, table)
    assert ran == ["a", "c", "c"] and state.done == ["a", "c", "c"]
    assert list(state.timings) == ["capture_s", "pass_s"] and set(state.seconds) == {"a", "c"}
