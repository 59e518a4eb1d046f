"""A weights file given where a model file is expected gets one line naming what it is (issue 31 item 6).

On the old code a ``.pt`` checkpoint given as the model said "not a Python source file (source code
string cannot contain null bytes)". Nothing in the file is unpickled or parsed to tell.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from test_cli import assert_bad_input, run


def _zip_checkpoint(path):
    torch.save({"w": torch.ones(2)}, path)


def _legacy_pickle(path):
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)


def _safetensors(path):
    save_file({"w": torch.ones(2)}, str(path))


@pytest.mark.parametrize("write, name, kind", [
    (_zip_checkpoint, "model.pt", "a zip archive such as a PyTorch checkpoint"),
    (_legacy_pickle, "model.bin", "a pickle file such as a legacy PyTorch checkpoint"),
    (_safetensors, "model.safetensors", "a safetensors file"),
], ids=["zip", "pickle", "safetensors"])
def test_a_weights_file_as_the_model_is_named_as_such(tmp_path, monkeypatch, capfd, write, name, kind):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / name)
    for command in ([], ["audit"]):
        assert_bad_input(*run(capfd, *command, tmp_path / name), f"{name} is {kind} (weights), not a model file",
                         "build_model()", "save_pretrained folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing written


_HUNGRY = '''
import torch
from torch import nn


class Hungry(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        scratch = torch.zeros(2**50, device=x.device)  # 8 PiB: no machine has it
        return self.fc(x) + scratch[:1]


def build_model():
    return Hungry()


def example_inputs():
    return (torch.randn(2, 8),)
'''


def test_running_out_of_memory_is_bad_input_with_one_line(tmp_path, monkeypatch, capfd):
    """The old code reported an allocation failure inside the conversion as 'fails at node ...' or as an
    internal error (exit 3): it is the input's size, and the line says how to make it smaller."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hungry.py").write_text(_HUNGRY)
    assert_bad_input(*run(capfd, tmp_path / "hungry.py"), "out of memory", "too large for this machine", "--batch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hungry.py"]


_WRONG_WIDTH = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        return self.fc(x).relu()


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(2, 7),)  # the model takes 8 features
'''


def test_a_shape_mismatch_in_example_inputs_is_blamed_on_the_inputs(tmp_path, monkeypatch, capfd):
    """The old line said 'neither tracer could capture Net (fx: ...; export: ...); fix the code each tracer
    names, or pick one with --tracer': the model and the tracers are fine, the inputs are not."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "wrong_width.py").write_text(_WRONG_WIDTH)
    for command in ([], ["audit"]):
        code, out, err = run(capfd, *command, tmp_path / "wrong_width.py")
        assert_bad_input(code, out, err, "the model's own forward fails on example_inputs(), before any tracing",
                         "mat1 and mat2 shapes cannot be multiplied (2x7 and 8x16)", "(at wrong_width.py:12)",
                         "fix example_inputs()")
        assert "tracer" not in err, err


@pytest.mark.parametrize("files", [[], ["model.safetensors"]], ids=["empty", "weights-only"])
def test_a_folder_without_config_json_says_what_a_folder_needs(tmp_path, monkeypatch, capfd, files):
    """The old line told the user to pass a Python file only, for a folder that is meant as a checkpoint."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in files:
        (folder / name).write_bytes(b"\x00")
    needles = ["ckpt is a folder", "save_pretrained wrote (with its config.json)", "or a Python model file"]
    if files:
        needles.append("it has model.safetensors but no config.json")
    assert_bad_input(*run(capfd, folder), *needles)


def test_a_full_disk_while_writing_the_weights_is_bad_input(tmp_path, monkeypatch, capfd):
    """The safetensors writer reports ENOSPC as text in a SafetensorError; the old code called that an internal
    error (exit 3, found with a 40 kB tmpfs as --out). The writer is made to fail the same way here."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*_args, **_kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    monkeypatch.chdir(tmp_path)
    from tests.helpers import SAMPLES

    assert_bad_input(*run(capfd, SAMPLES / "mlp.py", "--out", tmp_path / "o", "--no-measure"),
                     "No space left on device: the disk is full", "nothing was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
