"""The README's and docs' Python snippets run as written.

Every ```python block of README.md and docs/*.md runs in a fresh interpreter (``PYTHONPATH`` = the
repository, cwd = an empty temporary directory), on stock configs (nothing set by hand, nothing
downloaded). A block that cannot run here says so with a marker on the line before it, naming why:
``<!-- snippet: no-run (needs a GPU) -->``. The exemptions are counted, so that they stay few.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\S*)\s*$")
NO_RUN = re.compile(r"^\s*<!--\s*snippet:\s*no-run\s*\((?P<why>[^)]+)\)\s*-->\s*$")
#: blocks that honestly cannot run here (FSDP needs a torch.distributed process group: docs/training.md's two)
MAX_EXEMPT = 2


def _blocks(path: Path) -> list[tuple[str, str, str]]:
    """(``file:line``, the block's code dedented, why it does not run or "") for each ```python block."""
    lines = path.read_text().splitlines()
    found = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None or not fence.group("lang"):
            i += 1
            continue
        indent, lang, start = fence.group("indent"), fence.group("lang"), i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1
        if lang != "python":
            continue
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = NO_RUN.match(before)
        label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        found.append((f"{label}:{start + 1}", "\n".join(body) + "\n", marker.group("why") if marker else ""))
    return found


SNIPPETS = [block for path in DOCS for block in _blocks(path)]


def test_the_docs_have_snippets_and_few_exemptions():
    assert len(SNIPPETS) >= 10, [where for where, _, _ in SNIPPETS]
    exempt = [(where, why) for where, _, why in SNIPPETS if why]
    assert len(exempt) <= MAX_EXEMPT, exempt
    # the README's Python API and audit examples run, none exempt
    readme = [(where, why) for where, _, why in SNIPPETS if where.startswith("README.md:")]
    assert len(readme) >= 2 and not any(why for _, why in readme), readme


def test_the_marker_is_read(tmp_path):
    """A block after a no-run marker is skipped with its reason; a block without one, or in a list, runs."""
    path = tmp_path / "probe.md"
    path.write_text("x\n\n<!-- snippet: no-run (needs a GPU) -->\n```python\nimport torch\n```\n\n```python\n"
                    "print(1)\n```\n* item\n\n  ```python\n  if True:\n      pass\n  ```\n```bash\nls\n```\n")
    assert [(c, why) for _, c, why in _blocks(path)] == [
        ("import torch\n", "needs a GPU"), ("print(1)\n", ""), ("if True:\n    pass\n", "")]


@pytest.mark.slow
@pytest.mark.parametrize("where,code,why", SNIPPETS, ids=[where for where, _, _ in SNIPPETS])
def test_snippet_runs_as_written(where, code, why, tmp_path):
    if why:
        pytest.skip(f"{where}: {why}")
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1")  # the snippets convert as a user would: the profile measured in-process
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{where} failed (exit {done.returncode}):\n{code}\n--- stderr:\n{done.stderr[-3000:]}"
