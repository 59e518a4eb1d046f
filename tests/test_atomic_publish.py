"""Issue 44.3: every artifact is published atomically, ONNX included.

* The file-size limit (``RLIMIT_FSIZE``, SIGXFSZ ignored so that write() fails with EFBIG) hit while
  model.onnx is written under ``--force``: exit 2, the old output exactly as it was, no temporary
  beside OUT (model.onnx was published torn, over the old output, with exit 1).
* A death no Python code sees (OpenBLAS's ``exit(1)`` out of memory, simulated by ``os._exit(1)``
  after the library's message) while OUT is written: a one-line error naming it (the captured
  stderr was lost: exit 1 and nothing said) and no temporary left beside OUT.
* Temporaries of killed ``train.py --save`` runs are removed by the next save.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from converter.cli.modelfile import load_model_file
from converter.export.emit import emit
from tests.helpers import ROOT, SAMPLES
from tests.test_atomic_writes import _KILLED_DURING_SAVE


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _tree(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name and p.name.startswith(f".{out.name}"))


_FSIZE_DURING_ONNX = r"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # write() fails with EFBIG instead of killing the process
from converter import api
export = api.Conversion.export_onnx
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

def limited(self, path, **kwargs):  # the limit is hit exactly while model.onnx is written
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        return export(self, path, **kwargs)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

api.Conversion.export_onnx = limited
from converter.cli.main import main
sys.exit(main(sys.argv[1:]))
"""

_DIES_WHILE_WRITING = r"""
import os, sys
import converter.export.artifacts as artifacts

def dies(*args, **kwargs):  # what OpenBLAS does when its buffer cannot be allocated: a message, then exit(1)
    os.write(2, b"OpenBLAS error: Memory allocation still failed after 10 retries, giving up.\n")
    os._exit(1)

artifacts.verify_emitted = dies
from converter.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _old_output(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "converter", str(SAMPLES / "mlp.py"), "--out", str(out), "--no-measure",
                           "--device-profile", "none"],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_a_file_size_limit_hit_while_model_onnx_is_written_keeps_the_old_output(tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    out = _old_output(tmp_path)
    before = _tree(out)
    driver = tmp_path / "fsize.py"
    driver.write_text(_FSIZE_DURING_ONNX)
    run = subprocess.run([sys.executable, str(driver), str(SAMPLES / "mlp.py"), "--onnx", "--force", "--out", str(out),
                          "--no-measure"], env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    assert "File too large" in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert _tree(out) == before, "the old output changed"
    assert "model.onnx" not in before
    assert _beside(out) == [], _beside(out)


def test_a_death_python_never_sees_is_said_and_leaves_no_temporary(tmp_path):
    out = _old_output(tmp_path)
    before = _tree(out)
    driver = tmp_path / "dies.py"
    driver.write_text(_DIES_WHILE_WRITING)
    run = subprocess.run([sys.executable, str(driver), str(SAMPLES / "mlp.py"), "--force", "--out", str(out), "--no-measure"],
                         env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, (run.returncode, run.stderr[-3000:])
    errors = [line for line in run.stderr.splitlines() if line.startswith("mpconvert: error: ")]
    assert len(errors) == 1, run.stderr[-3000:]
    assert "died" in errors[0] and "OpenBLAS error: Memory allocation still failed" in errors[0], errors
    assert _tree(out) == before, "the old output changed"
    assert _beside(out) == [], _beside(out)


def killed_pid(run: subprocess.CompletedProcess) -> int:
    return int(run.stderr.strip().splitlines()[-1].split("=")[1])


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    mf = load_model_file(SAMPLES / "mlp.py")
    import converter

    conv = converter.convert(mf.model, mf.example_inputs, precision="bf16")
    return emit(conv, tmp_path_factory.mktemp("publish") / "o", model_file=str(SAMPLES / "mlp.py"))


@pytest.mark.slow
def test_the_next_save_removes_the_temporaries_of_killed_saves(emitted, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    wrapper = tmp_path / "killed_during_save.py"
    wrapper.write_text(_KILLED_DURING_SAVE.replace("    os._exit(137)", "    os.write(2, f'pid={os.getpid()}\\n'.encode())\n    os._exit(137)"))
    for _ in range(2):
        killed = subprocess.run([sys.executable, str(wrapper), str(emitted / "train.py"), "--steps", "1", "--save", str(ckpt)],
                                cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
        assert killed.returncode == 137, (killed.returncode, killed.stderr[-3000:])
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.pt.tmp-"))
    # each kill leaves its torn half-checkpoint; the second save removed the first one's
    assert len(left) == 1 and left[0] == f".ckpt.pt.tmp-{killed_pid(killed)}", left
    # a save still running in another process keeps its temporary: only dead writers' are removed
    live = tmp_path / f".ckpt.pt.tmp-{os.getpid()}"
    live.write_bytes(b"in progress")
    run = subprocess.run([sys.executable, str(emitted / "train.py"), "--steps", "1", "--save", str(ckpt)],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.pt")) == [live.name]
    state = torch.load(io.BytesIO(ckpt.read_bytes()), weights_only=True)
    assert "fc1.weight" in state


def test_a_sigkilled_run_leaves_no_temporary_beside_out(tmp_path):
    """The watcher sees SIGKILL too: the temporary folder goes at once (not only at the next run)."""
    import signal
    import time

    script = tmp_path / "slow.py"
    script.write_text(
        "import sys, time\nfrom pathlib import Path\nimport converter.export.artifacts as artifacts\n"
        "_write = artifacts._write_text\n"
        "def _slow(path, text):\n    _write(path, text)\n"
        "    Path(__file__).with_name('wrote.marker').write_text(path.name)\n    time.sleep(60)\n"
        "artifacts._write_text = _slow\nfrom converter.cli.main import main\nsys.exit(main(sys.argv[1:]))\n")
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(SAMPLES / "mlp.py"), "--out", str(work / "o"), "-q",
                             "--no-measure"], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "wrote.marker").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "wrote.marker").exists(), proc.poll()
        assert [p.name for p in work.iterdir()][0].startswith(".o.tmp-")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        err = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    deadline = time.monotonic() + 30
    while list(work.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(work.iterdir()) == [], list(work.iterdir())
    assert "mpconvert: error: the run died" in err, err
