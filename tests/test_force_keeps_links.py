"""Issue 44.6: ``--force`` keeps what is the user's.

A recorded output file (report.md, model.py, ...) that the user turned into a symlink (to their notes,
to their data folder) or into a folder is refused with exit 2; the link and its target are kept.
Before, a link or an empty folder in place of a recorded file counted as ours and was deleted.
"""
from __future__ import annotations

import os

import pytest

from tests.test_cli import assert_bad_input, run, write

MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(2, 8),)
"""


@pytest.fixture
def converted(tmp_path, capfd):
    model = write(tmp_path, "net.py", MODEL)
    out = tmp_path / "out"
    code, _, err = run(capfd, model, "--out", out, "--no-measure", "-q")
    assert code == 0, err
    return model, out


@pytest.mark.parametrize("name", ["report.md", "model.py"])
def test_a_recorded_file_turned_into_a_link_to_a_file_is_kept(converted, tmp_path, capfd, name):
    model, out = converted
    notes = tmp_path / "notes.md"
    notes.write_text("my notes\n")
    (out / name).unlink()
    os.symlink(notes, out / name)
    assert_bad_input(*run(capfd, model, "--out", out, "--no-measure", "-q", "--force"), name)
    assert (out / name).is_symlink() and os.readlink(out / name) == str(notes)
    assert notes.read_text() == "my notes\n"


def test_a_recorded_file_turned_into_a_link_to_a_data_folder_is_kept(converted, tmp_path, capfd):
    model, out = converted
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes(b"\x01" * 64)
    (out / "train.py").unlink()
    os.symlink(data, out / "train.py")
    assert_bad_input(*run(capfd, model, "--out", out, "--no-measure", "-q", "--force"), "train.py")
    assert (out / "train.py").is_symlink()
    assert (data / "train.bin").read_bytes() == b"\x01" * 64


def test_a_recorded_file_turned_into_an_empty_folder_is_kept(converted, capfd):
    model, out = converted
    (out / "report.md").unlink()
    (out / "report.md").mkdir()
    assert_bad_input(*run(capfd, model, "--out", out, "--no-measure", "-q", "--force"), "report.md")
    assert (out / "report.md").is_dir()


def test_an_untouched_output_is_still_replaced(converted, capfd):
    model, out = converted
    code, _, err = run(capfd, model, "--out", out, "--no-measure", "-q", "--force")
    assert code == 0, err
    assert (out / "report.md").is_file() and not (out / "report.md").is_symlink()
