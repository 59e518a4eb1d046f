"""Checkpoint folders are untrusted input (issue 31 items 1, 5 and 6).

On the old code:
* a folder whose config.json has ``auto_map`` ran its own Python after transformers asked
  "run the custom code? [y/N]" on a stdout mpconvert captures: any ``y`` on stdin ran it;
* ``../`` in ``model.safetensors.index.json`` pulled a file from outside the folder into our output;
* a truncated safetensors file and a ``pytorch_model.bin`` with pickled code were "internal errors"
  (exit 3), the latter relaying torch's advice to load it with ``weights_only=False``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from test_cli import assert_bad_input, run

from tests.helpers import ROOT

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("folders") / "good"
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                     eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def _copy(good, tmp_path, name):
    folder = tmp_path / name
    shutil.copytree(good, folder)
    return folder


def _remote(good, tmp_path):
    folder = _copy(good, tmp_path, "remote")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_mine.MyConfig", "AutoModelForCausalLM": "modeling_mine.MyModel"}
    (folder / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "REMOTE_CODE_RAN"
    (folder / "configuration_mine.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import GPT2Config\n\nclass MyConfig(GPT2Config):\n    pass\n")
    (folder / "modeling_mine.py").write_text("from transformers import GPT2LMHeadModel as MyModel\n")
    return folder, marker


def test_remote_code_never_runs_without_consent_even_with_yes_on_stdin(good, tmp_path):
    folder, marker = _remote(good, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "converter", str(folder), "--out", str(tmp_path / "out"), "--device-profile", "none"],
                          input="y\ny\ny\n", capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "configuration_mine.py, modeling_mine.py" in lines[0] and "--trust-remote-code" in lines[0], lines[0]
    assert not marker.exists(), "the folder's code ran"
    assert not (tmp_path / "out").exists()


def test_trust_remote_code_is_the_users_consent(good, tmp_path, monkeypatch, capfd):
    folder, marker = _remote(good, tmp_path)
    monkeypatch.chdir(tmp_path)
    run(capfd, folder, "--out", tmp_path / "out", "--trust-remote-code", "--no-measure")
    assert marker.read_text() == "ran"


def test_a_weight_index_pointing_outside_its_folder_is_refused_before_reading(good, tmp_path, monkeypatch, capfd):
    from safetensors.torch import load_file

    monkeypatch.chdir(tmp_path)
    folder = _copy(good, tmp_path, "trav")
    (tmp_path / "outside").mkdir()
    shutil.move(folder / "model.safetensors", tmp_path / "outside" / "model-00001-of-00001.safetensors")
    names = load_file(tmp_path / "outside" / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {k: "../outside/model-00001-of-00001.safetensors" for k in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_bad_input(*run(capfd, folder, "--out", tmp_path / "out", "--load-weights"),
                     "names '../outside/model-00001-of-00001.safetensors', which is outside", "nothing was read")
    assert not (tmp_path / "out").exists()


def test_a_truncated_safetensors_file_is_bad_input(good, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    folder = _copy(good, tmp_path, "trunc")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert_bad_input(*run(capfd, folder, "--load-weights"), "a safetensors weight file is damaged", "save_pretrained")


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_with_code_is_refused_without_relaying_weights_only_false(good, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    folder = _copy(good, tmp_path, "evil")
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "PICKLE_RAN"
    torch.save({"transformer.wte.weight": _Payload(marker)}, folder / "pytorch_model.bin")
    code, out, err = run(capfd, folder, "--load-weights")
    assert_bad_input(code, out, err, "holds pickled objects other than tensors", "nothing in it ran", "safetensors")
    assert "weights_only=False" not in err and "weights_only` set to `False`" not in err, err
    assert not marker.exists()
