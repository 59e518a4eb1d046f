"""The docs say what the code does: every flag, module, report key and error class they name exists.

* docs/cli.md names every flag and every choice of every `mpconvert` parser (converter/cli/parsers.py,
  read programmatically), and every flag it or any `mpconvert ...` / `train.py ...` command line of the
  docs names exists;
* docs/architecture.md names every module of `converter/`, and every module its index names exists;
* docs/report.md names every top-level key of a real report.json (the tiny transformer sample);
* every error or warning class the README and docs name is importable from where they say
  (`converter.X`, or the dotted module they write);
* the README is at most 300 lines, its test command is the one .ci/run runs, its quick start's summary
  line is what the sample converts to, and no page speaks of issue numbers, commit hashes or sessions.

Each checker is a function, and each is shown to fail on a planted mistake.
"""
from __future__ import annotations

import argparse
import builtins
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from converter.cli.parsers import build_parsers
from converter.vocab import ALIASES, PRECISIONS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CLI_MD = ROOT / "docs" / "cli.md"
ARCH_MD = ROOT / "docs" / "architecture.md"
REPORT_MD = ROOT / "docs" / "report.md"
TRAIN_TEMPLATE = ROOT / "converter" / "export" / "templates" / "train.py.tmpl"

FLAG = re.compile(r"(?<![\w/.-])(--[a-z][a-z0-9-]*|-[a-z])(?![\w-])")


def _mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


# ---------------------------------------------------------------------------------------------
# the command line

def _parser_flags() -> dict[str, argparse.Action]:
    """Every option string of every mpconvert parser -> its action."""
    return {opt: action for parser in build_parsers().values() for action in parser._actions
            for opt in action.option_strings}


def _train_flags() -> set[str]:
    """The flags of the generated train.py (its argparse in the template)."""
    return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", TRAIN_TEMPLATE.read_text())) | {"-h", "--help"}


def _rows_naming(doc: str, flag: str) -> list[str]:
    return [line for line in doc.splitlines() if _mentions(line, flag)]


def undocumented_flags(doc: str, flags: dict[str, argparse.Action]) -> list[str]:
    """Flags missing from ``doc``, and choices missing from every line of ``doc`` that names their flag."""
    missing = []
    for opt, action in sorted(flags.items()):
        rows = _rows_naming(doc, opt)
        if not rows:
            missing.append(opt)
            continue
        if action.help == argparse.SUPPRESS:
            continue
        # in the options table, the choices are spelled in the first cell: `--tracer auto\|fx\|export`
        cells = [row.split(" | ")[0] if row.startswith("| ") else row for row in rows]
        for choice in action.choices or ():
            if not any(_mentions(cell, str(choice)) for cell in cells):
                missing.append(f"{opt} {choice}")
    return missing


def unknown_flags(text: str, known: set[str]) -> list[str]:
    """Flags ``text`` names that no parser takes (``python -m converter`` is the command, not a flag)."""
    text = re.sub(r"python3? -m ", "", text)
    return sorted({flag for flag in FLAG.findall(text) if flag not in known})


def _command_lines(text: str, command: str) -> list[str]:
    """The command lines of ``command`` in ``text``: from the command to the end of its inline code or line."""
    found = []
    for line in text.splitlines():
        for match in re.finditer(rf"(?<![\w/.-]){re.escape(command)}\b", line):
            rest = line[match.end():]
            found.append(re.split(r"`|\s#|\s{3,}", rest)[0])
    return found


def test_every_help_flag_and_choice_is_in_cli_md():
    flags = _parser_flags()
    assert {"--precision", "--static", "--empty-weights", "--load-weights", "--trust-remote-code", "--strict-modes",
            "--version", "--help"} <= set(flags)
    missing = undocumented_flags(CLI_MD.read_text(), flags)
    assert missing == [], f"docs/cli.md does not name these flags / choices of `mpconvert --help`: {missing}"


def test_precision_help_and_docs_name_every_target():
    """--precision has no argparse choices: its help and its docs row must name fp16, bf16, fp8 and the aliases."""
    names = [*PRECISIONS, *(a for a, c in ALIASES.items() if c in PRECISIONS and not a.isdigit())]
    for command, parser in build_parsers().items():
        if command in ("rules check", "profile"):  # no model: no precision
            continue
        help_text = next(a.help for a in parser._actions if "--precision" in a.option_strings)
        assert [n for n in names if not _mentions(help_text, n)] == [], (command, help_text)
    rows = " ".join(_rows_naming(CLI_MD.read_text(), "--precision"))
    assert [n for n in names if not _mentions(rows, n)] == [], "docs/cli.md's --precision row"


def test_every_flag_the_docs_name_exists():
    known = set(_parser_flags())
    train = _train_flags()
    assert unknown_flags(CLI_MD.read_text(), known | train) == []
    for path in DOCS:
        text = path.read_text()
        bad = unknown_flags(" ".join(_command_lines(text, "mpconvert")), known)
        bad += unknown_flags(" ".join(_command_lines(text, "python -m converter")), known)
        bad += unknown_flags(" ".join(_command_lines(text, "train.py")), train)
        assert bad == [], f"{path.relative_to(ROOT)} names flags no parser takes: {bad}"


def test_the_flag_checkers_fail_on_planted_mistakes():
    flags = _parser_flags()
    doc = CLI_MD.read_text()
    planted = "\n".join(line for line in doc.splitlines() if not _mentions(line, "--static"))
    assert undocumented_flags(planted, flags) == ["--static"]
    planted = doc.replace("`--tracer auto\\|fx\\|export`", "`--tracer auto\\|fx`")
    assert "--tracer export" in undocumented_flags(planted, flags)
    assert unknown_flags("mpconvert m.py --precison fp16 -q", set(flags)) == ["--precison"]
    assert _command_lines("run `mpconvert m.py --onnx` then pip install --upgrade x", "mpconvert") == [" m.py --onnx"]


# ---------------------------------------------------------------------------------------------
# modules

def _modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT / "converter")) for p in (ROOT / "converter").rglob("*.py")
                  if p.name != "__init__.py")


def unnamed_modules(doc: str, modules: list[str]) -> list[str]:
    return [m for m in modules if f"`{m}`" not in doc and f"`converter/{m}`" not in doc]


def test_every_module_is_named_in_architecture_md():
    modules = _modules()
    assert len(modules) > 100 and "passes/place/mincut.py" in modules
    assert unnamed_modules(ARCH_MD.read_text(), modules) == []


def test_every_module_the_index_names_exists():
    index = ARCH_MD.read_text().split("## Every module", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"^\| `([\w/]+\.py)` \|", index, flags=re.M)
    assert len(named) > 100
    assert [m for m in named if not (ROOT / "converter" / m).is_file()] == []


def test_the_module_checker_fails_on_a_planted_module():
    assert unnamed_modules(ARCH_MD.read_text(), _modules() + ["passes/new_stage.py"]) == ["passes/new_stage.py"]


# ---------------------------------------------------------------------------------------------
# report.json

def _documented_keys(doc: str, section: str) -> set[str]:
    body = doc.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return {key for row in body.splitlines() if row.startswith("| `")
            for key in re.findall(r"`(\w+)`", row.split(" | ")[0])}


@pytest.fixture(scope="module")
def tiny_report() -> dict:
    import converter

    spec = importlib.util.spec_from_file_location("tiny_transformer_sample", ROOT / "samples" / "tiny_transformer.py")
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    conv = converter.convert(sample.build_model(), sample.example_inputs(), precision="bf16")
    return conv.report.to_dict()


def test_every_report_json_key_is_in_report_md(tiny_report):
    doc = REPORT_MD.read_text()
    top = _documented_keys(doc, "Top level")
    assert sorted(set(tiny_report) - top) == [], "top-level report.json keys missing from docs/report.md"
    # the other way: what the docs promise is there (source: checkpoint folders through the CLI only)
    assert sorted(top - set(tiny_report) - {"source"}) == []
    summary = _documented_keys(doc, "`summary`")
    assert sorted(set(tiny_report["summary"]) - summary) == [], "summary keys missing from docs/report.md"


def test_the_key_checker_fails_on_a_planted_key(tiny_report):
    doc = REPORT_MD.read_text().replace("| `simplified` |", "| simplified |")
    assert set(tiny_report) - _documented_keys(doc, "Top level") == {"simplified"}


# ---------------------------------------------------------------------------------------------
# error classes

ERROR = re.compile(r"(?<![\w.])((?:converter\.[\w.]+\.)?[A-Z]\w*(?:Error|Warning|NotMet))\b")


def named_errors(text: str) -> set[str]:
    return {name for name in ERROR.findall(text) if not hasattr(builtins, name.rsplit(".", 1)[-1])}


def unimportable(names: set[str]) -> list[str]:
    import converter

    bad = []
    for name in sorted(names):
        module, _, attr = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module) if module else converter, attr)
        except (ImportError, AttributeError):
            bad.append(name)
            continue
        if not (isinstance(found, type) and issubclass(found, (Exception, Warning))):
            bad.append(name)
    return bad


def test_every_error_class_the_docs_name_is_importable():
    names = set().union(*(named_errors(path.read_text()) for path in DOCS))
    assert {"Fp16OverflowError", "CacheCallError", "ForwardCheckError", "ToleranceNotMet"} <= names
    assert unimportable(names) == [], "error classes the docs name that `converter` does not export"


def test_the_error_checker_fails_on_a_planted_name():
    names = named_errors("raises `NoSuchError`, a `ValueError`, or converter.api.Fp16OverflowError")
    assert names == {"NoSuchError", "converter.api.Fp16OverflowError"}
    assert unimportable(names) == ["NoSuchError"]
    assert unimportable({"converter.api.NoSuchError", "converter.nowhere.Fp16OverflowError"}) == [
        "converter.api.NoSuchError", "converter.nowhere.Fp16OverflowError"]


# ---------------------------------------------------------------------------------------------
# the README

README = ROOT / "README.md"


def _ci_pytest_command() -> str:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip().startswith("python -m pytest")]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_readme_is_short_and_runs_the_ci_test_command():
    text = README.read_text()
    assert len(text.splitlines()) <= 300, len(text.splitlines())
    command = _ci_pytest_command()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert any(line.strip() == command for block in blocks for line in block.splitlines()), (
        f"the README's test command is not .ci/run's: {command}")


def test_the_readme_quick_start_is_what_the_sample_gives(tiny_report):
    text = README.read_text()
    assert f"$ mpconvert samples/tiny_transformer.py\n{tiny_report['summary_line']}\n" in text, tiny_report["summary_line"]
    by = tiny_report["summary"]["by_precision"]
    assert f"| by precision | bf16 {by['bf16']} · fp16 {by['fp16']} · fp32 {by['fp32']} |" in text, by


INTERNAL = re.compile(r"\bissues? #?\d+\b|\b(?:this|one|that|an earlier|a previous|the previous) session\b"
                      r"|\b(?:on|commit|before|after) [0-9a-f]{7,40}\b|--compare-ref [0-9a-f]{7,40}\b", re.I)


def internal_references(text: str) -> list[str]:
    return [m.group(0) for m in INTERNAL.finditer(text)]


def test_no_page_speaks_of_issues_commits_or_sessions():
    found = {str(path.relative_to(ROOT)): internal_references(path.read_text()) for path in DOCS}
    assert {page: refs for page, refs in found.items() if refs} == {}


def test_the_internal_reference_check_fails_on_planted_ones():
    assert internal_references("fixed in issue 30, on 2ae973b, lent to one session; an onnxruntime session") == [
        "issue 30", "on 2ae973b", "one session"]


# ---------------------------------------------------------------------------------------------
# paths and links

PATH = re.compile(r"(?<![\w/.-])((?:converter|benchmarks|tests|rules|samples|tools|docs)/[\w./-]*[\w/])")


def missing_paths(path: Path, text: str) -> list[str]:
    """Repository paths and relative links ``text`` names that do not exist (module index rows are relative
    to converter/)."""
    named = set(PATH.findall(text)) | {link for link in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in link}
    return sorted(name for name in named
                  if not any((base / name).exists() for base in (ROOT, path.parent, ROOT / "converter")))


def test_every_path_and_link_the_docs_name_exists():
    found = {str(path.relative_to(ROOT)): missing_paths(path, path.read_text()) for path in DOCS}
    assert {page: names for page, names in found.items() if names} == {}


def test_the_path_check_fails_on_planted_paths():
    text = "see `converter/lower.py`, `converter/report/flops.py` and [the guide](guide.md)"
    assert missing_paths(README, text) == ["converter/lower.py", "guide.md"]


# ---------------------------------------------------------------------------------------------
# the README's results table: every figure is in the results file its row names

NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+)(?![\w.])")


def _leaves(value, path: tuple = ()) -> list[tuple[tuple, float]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, (*path, str(k)))]
    if isinstance(value, list):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, (*path, i))]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [(path, float(value))]
    return []


def _candidates(files: list[Path]) -> list[float]:
    """Every number of the files, in GiB and MiB too, and every ratio of two numbers of the same field whose
    paths differ in one place only (one variant's step time against another's of the same model, a stage's peak RSS
    against another stage's of the same size)."""
    import json

    leaves = [leaf for f in files if f.suffix == ".json" for leaf in _leaves(json.loads(f.read_text()))]
    values = [v for _, v in leaves] + [float(n) for f in files if f.suffix == ".md" for n in NUMBER.findall(f.read_text())]
    found = values + [v / 2**30 for v in values] + [v / 2**20 for v in values]
    groups: dict[tuple, list[float]] = {}
    for path, v in leaves:
        for i in range(len(path) - 1):  # the same field of another variant, model or stage
            groups.setdefault((len(path), i, path[:i], path[i + 1:]), []).append(v)
    for same in groups.values():
        found += [x / y for x in same for y in same if y]
    return found


def unsourced_figures(cell: str, files: list[Path]) -> list[str]:
    candidates = _candidates(files)
    missing = []
    for text in NUMBER.findall(cell):
        tol = 0.5 * 10 ** -len(text.split(".")[1]) + 1e-9
        if not any(abs(c - float(text)) <= tol for c in candidates):
            missing.append(text)
    return missing


def _results_rows() -> list[tuple[str, list[Path]]]:
    table = README.read_text().split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        if not line.startswith("| ") or line.startswith("| result") or "---" in line:
            continue
        cells = line.split(" | ")
        files = [ROOT / "benchmarks" / "results" / name for name in re.findall(r"\(benchmarks/results/([\w.]+\.json)\)", cells[2])]
        rows.append((cells[0], files))
    return rows


def test_every_figure_of_the_readme_results_table_is_in_its_results_file():
    """Strong for measured values (ms, dB, GiB, losses: a wrong one fails, see the planted test); weak for a
    two-decimal ratio near 1, which some pair of a large results file nearly always gives."""
    rows = _results_rows()
    assert len(rows) >= 5
    for cell, files in rows:
        assert files and all(f.is_file() for f in files), (cell, files)
        assert unsourced_figures(cell, files) == [], f"figures of {cell[:60]!r} that {[f.name for f in files]} does not hold"


def test_the_figure_check_fails_on_a_planted_figure():
    cell, files = next((c, f) for c, f in _results_rows() if "cpu_dispatch.json" in str(f))
    assert unsourced_figures(cell.replace("446.0", "446.7"), files) == ["446.7"]


#: the pages whose every figure is in a results file their section links
MEASURED_PAGES = ["performance.md", "fp8.md", "scale.md", "partial.md"]


def unsourced_sections(text: str) -> list[tuple[str, list[str]]]:
    """(section title, figures no linked results file holds) for each ``## `` section of ``text`` with a
    figure: the numbers in its prose and tables (code blocks are commands) must be in the
    ``benchmarks/results/`` files the section links (a ``.md`` file's own ``.json`` when there is one)."""
    found = []
    for section in re.split(r"\n## ", re.sub(r"```.*?```", "", text, flags=re.S)):
        figures = NUMBER.findall(section)
        if not figures:
            continue
        files = []
        for name, ext in set(re.findall(r"benchmarks/results/([\w.]+)\.(json|md)", section)):
            json_file = ROOT / "benchmarks" / "results" / f"{name}.json"
            files.append(json_file if json_file.is_file() else ROOT / "benchmarks" / "results" / f"{name}.{ext}")
        missing = unsourced_figures(section, files) if files else figures
        if missing:
            found.append((section.splitlines()[0][:60], missing))
    return found


@pytest.mark.parametrize("page", MEASURED_PAGES)
def test_every_figure_of_the_measured_pages_is_in_a_results_file(page):
    assert unsourced_sections((ROOT / "docs" / page).read_text()) == []


def test_the_section_check_fails_on_planted_figures():
    text = (ROOT / "docs" / "scale.md").read_text()
    assert unsourced_sections(text.replace("| 16.4 |", "| 17.3 |")) == [("Measured", ["17.3"])]
    assert unsourced_sections("# T\n\n## Speed\n\nabout 1.5 ms faster\n") == [("Speed", ["1.5"])]
