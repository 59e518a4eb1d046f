"""The type checker is part of CI: pyproject.toml configures mypy (the package, strict on the IR and the options),
.ci/run runs it after the lint and before the tests, and it finds 0 errors."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
# The flags `mypy --strict` turns on that can be set per module (warn_redundant_casts is global only).
STRICT_FLAGS = (
    "disallow_any_generics", "disallow_subclassing_any", "disallow_untyped_calls", "disallow_untyped_defs",
    "disallow_incomplete_defs", "check_untyped_defs", "disallow_untyped_decorators", "warn_unused_ignores",
    "warn_return_any", "no_implicit_reexport", "strict_equality", "extra_checks",
)


def _mypy_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]


def test_pyproject_configures_mypy_on_the_package():
    config = _mypy_config()
    assert config["files"] == ["converter"], config.get("files")
    assert config["python_version"] == "3.11", config.get("python_version")
    # ignoring missing imports is per library (overrides), never for everything
    assert "ignore_missing_imports" not in config, "ignore_missing_imports is set globally; set it per library"


def test_the_ir_and_the_options_are_checked_strictly():
    overrides = _mypy_config()["overrides"]
    strict = [o for o in overrides if "converter.ir.*" in o["module"]]
    assert len(strict) == 1, overrides
    assert set(strict[0]["module"]) == {"converter.ir.*", "converter.options"}, strict[0]["module"]
    missing = [flag for flag in STRICT_FLAGS if strict[0].get(flag) is not True]
    assert missing == [], f"strict flags not set for converter.ir.* and converter.options: {missing}"
    # `strict = true` in an override would turn strict mode on for every module
    assert all("strict" not in o for o in overrides), overrides
    ignored = [m for o in overrides if o.get("ignore_missing_imports") for m in o["module"]]
    assert not any(m.startswith("converter") for m in ignored), ignored


def test_ci_runs_mypy_after_ruff_and_before_pytest():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    steps = [line for line in lines if line and not line.startswith("#")]
    mypy = [i for i, line in enumerate(steps) if re.match(r"^(python -m )?mypy(\s|$)", line)]
    ruff = [i for i, line in enumerate(steps) if line.startswith("ruff check")]
    pytest_ = [i for i, line in enumerate(steps) if line.startswith("python -m pytest")]
    assert len(mypy) == 1 and len(ruff) == 1 and len(pytest_) == 1, (mypy, ruff, pytest_)
    assert ruff[0] < mypy[0] < pytest_[0], steps


def test_mypy_and_its_stubs_are_in_the_test_extra_and_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extra = {re.split(r"[<>=\[ ]", r, maxsplit=1)[0].lower() for r in project["optional-dependencies"]["test"]}
    pins = {line.split("==")[0].lower() for line in (ROOT / "constraints.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    for name in ("mypy", "types-networkx"):
        assert name in extra, f"{name} is not in the test extra: {sorted(extra)}"
        assert name in pins, f"{name} is not pinned in constraints.txt"


@pytest.mark.slow
def test_mypy_finds_no_errors():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -c constraints.txt '.[test]')")
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"^Success: no issues found in \d+ source files", done.stdout, flags=re.M), done.stdout[-2000:]
