"""Files our emitted scripts write over the user's data are written atomically (issue 31 item 3).

``train.py --save CKPT`` wrote ``torch.save`` straight into CKPT: a kill during the save destroyed the
previous good checkpoint (11 of 12 kills). It now writes a temporary file beside CKPT, flushes it and
renames it over CKPT. The kill is simulated deterministically: ``torch.save`` is replaced, in the
train.py process only, by one that writes half of the real bytes and then kills the process.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

from converter.cli.modelfile import load_model_file
from converter.export.emit import emit
from tests.helpers import ROOT, SAMPLES

_KILLED_DURING_SAVE = r"""
import io, os, runpy, sys
import torch

real = torch.save

def torn_save(obj, f, *args, **kwargs):
    buffer = io.BytesIO()
    real(obj, buffer, *args, **kwargs)
    data = buffer.getvalue()
    if hasattr(f, "write"):
        f.write(data[: len(data) // 2]); f.flush()
    else:
        with open(f, "wb") as out:
            out.write(data[: len(data) // 2])
    os._exit(137)  # SIGKILL-like: no cleanup, no finally

torch.save = torn_save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    mf = load_model_file(SAMPLES / "mlp.py")
    import converter

    conv = converter.convert(mf.model, mf.example_inputs, precision="bf16")
    return emit(conv, tmp_path_factory.mktemp("atomic") / "o", model_file=str(SAMPLES / "mlp.py"))


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_train_py_save_writes_a_loadable_checkpoint_and_no_temporaries(emitted, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    run = subprocess.run([sys.executable, str(emitted / "train.py"), "--steps", "2", "--save", str(ckpt)],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    state = torch.load(ckpt, weights_only=True)
    assert "fc1.weight" in state
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_a_kill_during_train_py_save_keeps_the_previous_checkpoint(emitted, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    good = {"fc1.weight": torch.arange(12.0).reshape(3, 4)}
    buffer = io.BytesIO()
    torch.save(good, buffer)
    ckpt.write_bytes(buffer.getvalue())
    wrapper = tmp_path / "killed_during_save.py"
    wrapper.write_text(_KILLED_DURING_SAVE)
    run = subprocess.run([sys.executable, str(wrapper), str(emitted / "train.py"), "--steps", "1", "--save", str(ckpt)],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 137, (run.returncode, run.stderr[-3000:])
    assert "step    1" in run.stdout, run.stdout  # it trained, then died while saving
    kept = torch.load(ckpt, weights_only=True)
    assert set(kept) == {"fc1.weight"} and torch.equal(kept["fc1.weight"], good["fc1.weight"])
