"""The pipeline as a declared stage table: each :class:`Stage` names what it reads and what it writes,
and :func:`run_stages` runs a table of them in order over one :class:`State`.

The table itself is ``converter.api.STAGES`` (its stages call the passes, so it lives with them at the
api layer; this module holds the machinery, which the layers below it do not need). docs/architecture.md
("Stage table") lists the same stages with their reads and writes, and tests/test_stage_table.py checks
the two against each other.

The runner:

* skips a stage whose ``when`` says it does not apply (a conversion without calibration has no
  *calibrate* stage);
* runs the stages marked ``per_graph`` once for each captured graph (a model captured as a train graph
  and an eval graph converts both), graph by graph: a run of consecutive per-graph stages is one segment;
* adds each stage's seconds to ``state.timings[stage.timing]`` (report.json's ``timings``: ``capture_s``,
  ``pass_s``, ``codegen_s``, ``check_s``) and to ``state.seconds[stage.name]`` (every stage);
* wraps an unexpected failure of a ``wrap`` stage in :class:`PassError`, which names the stage and those
  that ran before it; an mpconvert error, a ``ValueError`` or a ``TypeError`` passes unchanged.

:func:`check_table` checks a table: every stage reads only the inputs and what an earlier stage wrote.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from converter.ir.errors import EXIT_INTERNAL, MpconvertError
from converter.options import ConvertOptions
from converter.passes.capture import Captured
from converter.report.build import Report
from converter.rules.loader import Rules

__all__ = ["Stage", "State", "PassError", "INPUTS", "STAGE_DEPTH", "run_stages", "check_table", "declare"]

#: what a conversion starts from: the names a stage may read before any stage wrote anything
INPUTS = ("model", "example_inputs", "options", "rule_files", "calibration", "scope")

#: the frames from a stage's ``run`` up to :func:`run_stages` (``run``, ``_run_one``, ``run_stages``): a stage's
#: warning with ``stacklevel=STAGE_DEPTH + 1`` names the function that called ``run_stages``, ``+ 2`` its caller
STAGE_DEPTH = 3


class PassError(MpconvertError, RuntimeError):
    """A stage failed; the message names it and the stages that ran before it, and so do the fields:
    ``stage`` (``"calibrate"``...), ``ran`` (the stages before it, in order) and ``node`` (the failing node,
    when the cause named one)."""

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str, *, stage: str = "", ran: tuple[str, ...] = (), node: Optional[str] = None):
        super().__init__(message)
        self.stage = stage
        self.ran = tuple(ran)
        self.node = node


@dataclass
class State:
    """What the stages read and write: the inputs, then each stage's artefacts (None until written)."""

    # the inputs (INPUTS)
    model: torch.nn.Module
    example_inputs: Any
    options: ConvertOptions
    rule_files: Any = None
    calibration: Optional[list] = None
    scope: Optional[tuple] = None
    #: how much of the pipeline runs: ``convert`` generates code and checks it; ``audit`` and
    #: ``pipeline(codegen=False)`` do not; ``simplify_graph=False`` keeps the no-op nodes
    codegen: bool = True
    simplify_graph: bool = True
    #: ``"convert"``: the stages after the pipeline that only :func:`converter.api.convert` runs run too
    purpose: str = "pipeline"
    # the artefacts
    rules: Optional[Rules] = None
    captured: Optional[Captured] = None
    graphs: list[torch.fx.GraphModule] = field(default_factory=list)
    index: int = 0  # the graph the per-graph stages work on
    fp8_recipe: Optional[str] = None
    fp8_search: Any = None
    advice: Optional[str] = None
    optional: tuple = ()
    required: dict = field(default_factory=dict)
    report: Optional[Report] = None
    # the bookkeeping
    done: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def gm(self) -> torch.fx.GraphModule:
        """The graph the per-graph stages work on."""
        return self.graphs[self.index]

    @gm.setter
    def gm(self, value: torch.fx.GraphModule) -> None:
        self.graphs[self.index] = value

    @property
    def capture(self) -> Captured:
        """The capture (after the *capture* stage)."""
        assert self.captured is not None, "the capture stage has not run"
        return self.captured

    @property
    def batches(self) -> list:
        """The calibration batches (a stage that runs only with calibration)."""
        assert self.calibration is not None, "no calibration batches"
        return self.calibration

    @property
    def recipe(self) -> str:
        """The fp8 recipe of the graph under conversion (after the *fp8_gate* stage)."""
        assert self.fp8_recipe is not None, "the fp8_gate stage has not run"
        return self.fp8_recipe

    @property
    def rule_set(self) -> Rules:
        """The rules (after the *rules* stage)."""
        assert self.rules is not None, "the rules stage has not run"
        return self.rules


def _always(state: State) -> bool:
    return True


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline: its name, what it reads and writes, the module that does the work
    (as docs/architecture.md names it) and the callable that runs it on a :class:`State`."""

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    module: str
    run: Callable[[State], None]
    #: whether the stage applies to this conversion (it is skipped, and not named as done, when not)
    when: Callable[[State], bool] = _always
    #: run once per captured graph (``state.gm``), graph by graph
    per_graph: bool = False
    #: the ``timings`` key its seconds add to ("": none)
    timing: str = ""
    #: an unexpected failure becomes a :class:`PassError` naming the stage (False: it passes unchanged)
    wrap: bool = True


def check_table(stages: Sequence[Stage], inputs: Sequence[str] = INPUTS) -> list[str]:
    """What is wrong with ``stages``: a stage reading a name no earlier stage (or the inputs) wrote, a name twice."""
    problems = []
    written = set(inputs)
    names = [s.name for s in stages]
    problems += [f"stage {n!r} is declared {names.count(n)} times" for n in sorted(set(names)) if names.count(n) > 1]
    for stage in stages:
        missing = [name for name in stage.reads if name not in written]
        if missing:
            problems.append(f"stage {stage.name!r} reads {', '.join(missing)}, which no earlier stage writes")
        written.update(stage.writes)
    return problems


def declare(*stages: Stage) -> tuple[Stage, ...]:
    """The table ``stages``, checked (:func:`check_table`) when it is declared."""
    problems = check_table(stages)
    if problems:
        raise PassError(f"the stage table is inconsistent: {'; '.join(problems)}; fix its reads and writes")
    return stages


def run_stages(state: State, stages: Sequence[Stage]) -> State:
    """Run ``stages`` in order on ``state`` (see the module docstring); returns ``state``."""
    position = 0
    while position < len(stages):
        stage = stages[position]
        if not stage.per_graph:
            _run_one(stage, state)
            position += 1
            continue
        end = position
        while end < len(stages) and stages[end].per_graph:
            end += 1
        for index in range(len(state.graphs)):  # graph by graph: every per-graph stage of the segment on this one
            state.index = index
            for graph_stage in stages[position:end]:
                _run_one(graph_stage, state)
        state.index = 0
        position = end
    return state


def _run_one(stage: Stage, state: State) -> None:
    if not stage.when(state):
        return
    start = time.perf_counter()
    if stage.wrap:
        try:
            stage.run(state)
        except (MpconvertError, ValueError, TypeError):
            raise
        except Exception as exc:
            before = ", ".join(state.done) or "none"
            node = getattr(exc, "node", None)
            raise PassError(f"stage {stage.name!r} failed after [{before}]: {type(exc).__name__}: {exc}", stage=stage.name,
                            ran=tuple(state.done), node=node if isinstance(node, str) and node else None) from exc
    else:
        stage.run(state)
    elapsed = time.perf_counter() - start
    state.seconds[stage.name] = state.seconds.get(stage.name, 0.0) + elapsed
    if stage.timing:
        state.timings[stage.timing] = state.timings.get(stage.timing, 0.0) + elapsed
    state.done.append(stage.name)
