"""The package's layout limits (issue 33): no module in converter/ over 700 lines and no function
over 80, so that each file does one job and each function fits on a screen. The limits are the
acceptance figures; the test names every offender with its size so a split can be planned."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "converter"
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_the_line_limit():
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text(encoding="utf-8").splitlines()) for p in _sources()}
    over = {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES}
    assert len(sizes) > 50, f"only {len(sizes)} modules found under {PACKAGE}"
    assert over == {}, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_function_is_over_the_line_limit():
    over = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # def line to last line; decorators excluded
                if length > MAX_FUNCTION_LINES:
                    over.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({length} lines)")
    assert over == [], f"functions over {MAX_FUNCTION_LINES} lines: {over}"


def test_the_limits_catch_an_oversized_function():
    source = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    node = ast.parse(source).body[0]
    assert node.end_lineno - node.lineno + 1 == MAX_FUNCTION_LINES + 1
