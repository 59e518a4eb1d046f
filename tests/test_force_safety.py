"""``--force`` replaces only a previous mpconvert output, and never this run's inputs (issue 31 item 2).

On the old code ``mpconvert CKPT --out CKPT --force`` deleted the checkpoint being converted, and
``mpconvert proj/mlp.py --out proj --force`` deleted the model file, notes and a ``data/`` folder.
Now every output carries a marker listing what it wrote (size and mtime per file); ``--force``
refuses, with exit 2 and one line naming what would be lost, a folder without the marker, one
holding files added or changed since, and one that holds an input of the run.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_cli import assert_bad_input, run

from converter.export.artifacts import MARKER, foreign_contents
from tests.helpers import SAMPLES


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project folder: the model file, notes and data."""
    monkeypatch.chdir(tmp_path)
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    shutil.copyfile(SAMPLES / "mlp.py", proj / "mlp.py")
    (proj / "NOTES.md").write_text("my notes\n")
    (proj / "data" / "train.bin").write_bytes(b"\x00\x01" * 64)
    return proj


def test_force_never_deletes_the_folder_holding_the_model_file(project, capfd):
    before = _tree(project)
    assert_bad_input(*run(capfd, project / "mlp.py", "--out", project, "--force"),
                     "--force would delete", "mlp.py", "an input of this run")
    assert _tree(project) == before


def test_force_never_deletes_the_checkpoint_being_converted(tmp_path, monkeypatch, capfd):
    transformers = pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpt"
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                     eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(ckpt)
    capfd.readouterr()  # save_pretrained's progress bar
    before = _tree(ckpt)
    assert_bad_input(*run(capfd, ckpt, "--out", ckpt, "--force"), "--force would delete", "an input of this run")
    assert _tree(ckpt) == before


def test_force_refuses_a_folder_that_is_not_an_mpconvert_output(project, tmp_path, capfd):
    before = _tree(project)
    # the model file is elsewhere: the folder is refused because we did not write it
    assert_bad_input(*run(capfd, SAMPLES / "mlp.py", "--out", project, "--force"), "is not one", MARKER)
    assert _tree(project) == before


def test_force_never_deletes_a_rules_file_inside_the_output(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert run(capfd, SAMPLES / "mlp.py", "--out", out, "-q")[0] == 0
    rules = out / "mine.toml"
    rules.write_text('[op]\nrelu = "follow"\n')
    before = _tree(out)
    assert_bad_input(*run(capfd, SAMPLES / "mlp.py", "--out", out, "--rules", rules, "--force"), "an input of this run")
    assert _tree(out) == before


def test_force_replaces_an_untouched_output_and_refuses_one_with_added_files(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    code, _, err = run(capfd, SAMPLES / "mlp.py", "--out", out, "-q")
    assert code == 0, err
    marker = json.loads((out / MARKER).read_text())
    assert {"model.py", "model.safetensors", "train.py", "report.json"} <= set(marker["files"])
    assert foreign_contents(out) == []
    code, _, err = run(capfd, SAMPLES / "mlp.py", "--out", out, "-q", "--force")
    assert code == 0, err
    # train.py --save wrote a checkpoint into the output: --force must not take it
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "step100.safetensors").write_bytes(b"trained")
    before = _tree(out)
    assert_bad_input(*run(capfd, SAMPLES / "mlp.py", "--out", out, "--force"),
                     "--force would delete checkpoints, checkpoints/step100.safetensors", "did not write")
    assert _tree(out) == before
    # an edited report is the user's too
    (out / "checkpoints" / "step100.safetensors").unlink()
    (out / "checkpoints").rmdir()
    (out / "report.md").write_text("my annotated report\n")
    assert foreign_contents(out) == ["report.md"]
    assert_bad_input(*run(capfd, SAMPLES / "mlp.py", "--out", out, "--force"), "would delete report.md")
    assert (out / "report.md").read_text() == "my annotated report\n"


def test_a_broken_marker_counts_as_not_ours(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    for text in ("", "{", "[]", '{"files": 3}'):
        (out / MARKER).write_text(text)
        assert foreign_contents(out) is None, text
    os.remove(out / MARKER)
    os.symlink("/etc/hostname", out / MARKER)
    assert foreign_contents(out) is None
