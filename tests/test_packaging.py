"""A non-editable ``pip install .`` finds the rules and converts with the defaults."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


@pytest.mark.slow
def test_fresh_venv_non_editable_install(tmp_path):
    """In a fresh venv, `pip install torch==2.13.0` then a non-editable `pip install .` (both with constraints.txt);
    convert() with the default rules works, and the rules are found inside the installed package."""
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)])
    assert made.returncode == 0, made.stderr[-2000:]
    py = str(venv / "bin" / "python")
    torch_version = __import__("torch").__version__.split("+")[0]
    pins = ["-c", str(ROOT / "constraints.txt")]  # the tested releases, as the README installs them
    steps = [
        [py, "-m", "pip", "install", "-q", *pins, f"torch=={torch_version}"],
        [py, "-m", "pip", "install", "-q", *pins, str(ROOT)],
    ]
    for step in steps:
        done = _run(step, cwd=tmp_path)
        assert done.returncode == 0, (step, done.stderr[-3000:])
    script = textwrap.dedent("""
        import pathlib, torch, converter
        assert "site-packages" in converter.__file__, converter.__file__
        assert (pathlib.Path(converter.__file__).parent / "rules" / "builtin" / "default.toml").is_file()
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.LayerNorm(8))
        conv = converter.convert(model, (torch.randn(2, 8),))
        print(conv.report.line)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = _run([py, "-c", script], cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Converted 2/3 compute nodes" in run.stdout, run.stdout
    cli = _run([str(venv / "bin" / "mpconvert"), "--version"], cwd=tmp_path, env=env)
    assert cli.returncode == 0 and cli.stdout.strip(), cli.stderr


@pytest.mark.slow
def test_non_editable_install_converts_with_default_rules(tmp_path):
    target = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--target", str(target), str(ROOT)],
        capture_output=True, text=True, cwd=tmp_path,
    )
    if build.returncode != 0 and "setuptools" in build.stderr:
        build = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(ROOT)],
            capture_output=True, text=True, cwd=tmp_path,
        )
    assert build.returncode == 0, build.stderr[-2000:]
    assert (target / "converter" / "rules" / "builtin" / "default.toml").is_file(), sorted(p.name for p in target.iterdir())
    script = textwrap.dedent("""
        import torch, converter, pathlib
        assert pathlib.Path(converter.__file__).resolve().is_relative_to(pathlib.Path(%r).resolve()), converter.__file__
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.LayerNorm(8))
        conv = converter.convert(model, (torch.randn(2, 8),))
        print(conv.report.line)
        print(converter.load_rules(["llm"]).files)
    """ % str(target))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Converted 2/3 compute nodes" in run.stdout, run.stdout
    assert "('default.toml', 'llm.toml')" in run.stdout


def test_every_package_folder_is_listed_in_pyproject():
    """A new subpackage missing from [tool.setuptools] packages installs without its files (the
    non-editable install then fails at import); this names it in milliseconds."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "converter").rglob("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
