"""Hardening of the output directory (issue 19 items 2, 3, 5, 7, 8; issue 18 item 1).

* generated code is injection-proof: file and class names with ``\"\"\"``, ``\\N``, backslashes,
  newlines, quotes, non-ASCII and undecodable bytes go in only as literals or escaped text;
* the output directory is portable: train.py reads only its own files (a copy of the model file);
* publishing never replaces what appeared at ``--out`` meanwhile (no-replace rename), ``--force``
  swaps atomically, and temp directories of killed runs are cleaned up by the next run;
* ``model.load()`` checks the name, shape and dtype of every tensor in model.safetensors;
* train.py runs under ``torchrun`` with DDP and matches a single-process run on the same global batch,
  and exits 0 without gloo's abort at interpreter teardown (issue 31).
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import converter
from converter.cli.modelfile import load_model_file
from converter.export import artifacts
from converter.export.emit import (
    USER_MODEL_FILE,
    EmitError,
    OutputExistsError,
    emit,
    import_file,
)
from tests.helpers import ROOT, SAMPLES

MLP_SOURCE = (SAMPLES / "mlp.py").read_text()


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _literal(code: str, name: str):
    """The value of the module-level assignment ``name = <literal>`` in ``code``."""
    for node in ast.parse(code).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"no {name} = ... in the generated code")


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


def _emit_mlp(model_file: Path, out: Path, **kwargs) -> tuple:
    mf = load_model_file(model_file)
    conv = converter.convert(mf.model, mf.example_inputs)
    return conv, emit(conv, out, model_file=str(model_file), **kwargs)


@pytest.fixture(scope="module")
def mlp_conv():
    mf = load_model_file(SAMPLES / "mlp.py")
    return converter.convert(mf.model, mf.example_inputs)


# ---------------------------------------------------------------------------------------------
# injection-proof generated code

PWNED_NAME = 'x""";__import__("os").system("touch PWNED");"""y.py'
NAMES = [
    PWNED_NAME,
    "C:\\Users\\Nils\\U0001F600\\model.py",  # backslashes, \N and \U: one Linux file name
    "line one\nimport os\r\n'''.py",
    "it's \"quoted\" '''.py",
    "modèle_ü_模型.py",
    os.fsdecode(b"bytes_\xff_undecodable.py"),  # a lone surrogate in Python
]


@pytest.mark.parametrize("name", NAMES, ids=["pwned", "backslashes", "newlines", "quotes", "non_ascii", "surrogate"])
def test_file_names_go_into_generated_code_as_literals(name, tmp_path):
    model_file = tmp_path / name
    model_file.write_text(MLP_SOURCE)
    conv, out = _emit_mlp(model_file, tmp_path / "out")
    model_py = (out / "model.py").read_text(encoding="utf-8")
    train_py = (out / "train.py").read_text(encoding="utf-8")
    assert _literal(model_py, "SOURCE") == name
    assert _literal(train_py, "MODEL_FILE_NAME") == name
    assert _literal(train_py, "USER_MODEL") == USER_MODEL_FILE
    assert (out / USER_MODEL_FILE).read_text() == MLP_SOURCE
    for code in (model_py, train_py):
        compile(code, "generated.py", "exec")
        assert str(tmp_path) not in code  # no absolute path of the conversion machine
    loaded = import_file(out / "model.py").load()
    args, kwargs = conv.example_inputs
    with torch.no_grad():
        assert torch.equal(loaded(*args, **kwargs), conv.module(*args, **kwargs))
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.modèle = _Inner()  # a non-ASCII attribute name
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.modèle(x))


def test_class_names_go_into_docstrings_and_comments_escaped(tmp_path):
    evil = 'Evil"""\nimport os; os.system("touch PWNED")\n#\\N'
    outer = type(evil + "Root", (_Outer,), {})()
    outer.modèle = type(evil, (_Inner,), {})()
    torch.manual_seed(0)
    example = (torch.randn(3, 8),)
    for tracer in ("fx", "export"):
        conv = converter.convert(outer, example, tracer=tracer)
        out = emit(conv, tmp_path / tracer)
        code = (out / "model.py").read_text(encoding="utf-8")
        compile(code, "model.py", "exec")
        module = import_file(out / "model.py")
        assert module.__doc__.startswith(evil + "Root converted to mixed precision")  # read back as it is
        comments = [line for line in code.splitlines() if line.lstrip().startswith("# ---")]
        assert comments and all("\n" not in c for c in comments)
        assert not any(line.strip().startswith("import os;") for line in code.splitlines())
        with torch.no_grad():
            assert torch.equal(module.load()(*example), conv.module(*example)), tracer
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


def test_cli_with_a_malicious_file_name_runs_nothing(tmp_path):
    """The CLI converts it (exit 0); importing model.py and running train.py runs no injected code."""
    model_file = tmp_path / PWNED_NAME
    model_file.write_text(MLP_SOURCE)
    proc = subprocess.run([sys.executable, "-m", "converter", model_file.name, "--out", "out", "-q", "--device-profile", "none"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    train = subprocess.run([sys.executable, "out/train.py", "--steps", "1"], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-2000:]
    assert f"train_batches()/loss_fn from {PWNED_NAME}" in train.stdout
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "out" / "PWNED").exists()


@pytest.mark.parametrize("name", ['y"""; import os', "class", "self", "a b", "x\ny"])
def test_unsafe_forward_argument_names_are_refused(name):
    """torch.export itself refuses most of these; model.py's signature refuses them all the same."""
    from converter.export.model_signature import check_argument_names

    check_argument_names(["input_ids", "attention_mask"])
    with pytest.raises(EmitError, match="not a valid Python parameter name"):
        check_argument_names(["x", name])


# ---------------------------------------------------------------------------------------------
# a portable output directory


def test_copied_output_dir_trains_without_the_original_model_file(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    model_file = src / "mlp.py"
    model_file.write_text(MLP_SOURCE)
    _emit_mlp(model_file, tmp_path / "first" / "out")
    moved = tmp_path / "elsewhere" / "copied"
    shutil.copytree(tmp_path / "first" / "out", moved)
    shutil.rmtree(tmp_path / "first")
    model_file.rename(src / "renamed.py")
    for name in ("model.py", "train.py"):
        text = (moved / name).read_text()
        assert str(tmp_path) not in text and str(ROOT) not in text, name
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    proc = subprocess.run([sys.executable, str(moved / "train.py"), "--steps", "2"], cwd=run_dir, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train_batches()/loss_fn from mlp.py" in proc.stdout and "NOTICE" not in proc.stdout
    assert len([line for line in proc.stdout.splitlines() if line.startswith("step ")]) == 2
    assert os.listdir(run_dir) == []


# ---------------------------------------------------------------------------------------------
# publishing never clobbers; stale temp directories


def _plant(out: Path, kind: str):
    def extra(_tmp: Path) -> None:  # runs after the files are written, right before the publish
        if kind == "file":
            out.write_text("theirs")
            return
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")

    return extra


@pytest.mark.parametrize("renameat2", [True, False], ids=["renameat2", "fallback"])
@pytest.mark.parametrize("kind", ["dir", "file"])
def test_output_that_appeared_meanwhile_is_never_replaced(mlp_conv, tmp_path, monkeypatch, renameat2, kind):
    if not renameat2:
        monkeypatch.setattr(artifacts, "_renameat2", lambda *a: False)
    out = tmp_path / "o"
    with pytest.raises(OutputExistsError, match="appeared while this run was converting"):
        emit(mlp_conv, out, extra=_plant(out, kind))
    if kind == "file":
        assert out.read_text() == "theirs"
    else:
        assert os.listdir(out) == ["theirs.txt"] and (out / "theirs.txt").read_text() == "theirs"
    assert _leftovers(tmp_path, "o") == ["o"]


@pytest.mark.parametrize("renameat2", [True, False], ids=["exchange", "fallback"])
def test_force_replaces_an_old_output_atomically(mlp_conv, tmp_path, monkeypatch, renameat2):
    out = tmp_path / "o"
    emit(mlp_conv, out)
    calls = []
    real = artifacts._renameat2

    def spy(src, dst, flags):
        calls.append(flags)
        return real(src, dst, flags) if renameat2 else False

    monkeypatch.setattr(artifacts, "_renameat2", spy)
    emit(mlp_conv, out, force=True)
    assert (out / "model.py").is_file() and (out / artifacts.MARKER).is_file()
    assert _leftovers(tmp_path, "o") == ["o"]
    assert calls == [artifacts._RENAME_EXCHANGE], calls  # one atomic swap, no window without `o`


@pytest.mark.parametrize("renameat2", [True, False], ids=["exchange", "fallback"])
def test_force_never_replaces_what_appeared_meanwhile(mlp_conv, tmp_path, monkeypatch, renameat2):
    """A folder of someone else's that appears at OUT during the run is swapped back, not deleted."""
    if not renameat2:
        monkeypatch.setattr(artifacts, "_renameat2", lambda *a: False)
    out = tmp_path / "o"
    with pytest.raises(OutputExistsError, match="is not one"):
        emit(mlp_conv, out, force=True, extra=_plant(out, "dir"))
    assert os.listdir(out) == ["theirs.txt"] and (out / "theirs.txt").read_text() == "theirs"
    assert _leftovers(tmp_path, "o") == ["o"]


@pytest.mark.slow
def test_two_concurrent_cli_runs_one_wins(tmp_path):
    out = tmp_path / "shared"
    cmd = [sys.executable, "-m", "converter", str(SAMPLES / "mlp.py"), "--out", str(out), "-q", "--device-profile", "none"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    loser_err = next(err for code, _, err in results if code == 2)
    assert len(loser_err.strip().splitlines()) == 1 and "Traceback" not in loser_err
    assert re.search(r"already exists|appeared while this run was converting", loser_err), loser_err
    assert {"model.py", "model.safetensors", "train.py", "user_model.py", "report.json"} <= set(os.listdir(out))
    loaded = import_file(out / "model.py").load()
    assert loaded(torch.randn(5, 32)).shape == (5, 10)
    assert _leftovers(tmp_path, "shared") == ["shared"]


# the CLI sends everything printed during a command to stderr (and hides it), so the script
# signals "a file is written" through a marker file next to itself
_SLOW_EMIT = """
import sys, time
from pathlib import Path
import converter.export.artifacts as artifacts
import converter.export.watchdog as watchdog
watchdog._start = lambda *args, **kwargs: None  # no watcher (as when none can start): the next run must clean up
_write = artifacts._write_text
def _slow(path, text):
    _write(path, text)
    Path(__file__).with_name("wrote.marker").write_text(path.name)
    time.sleep(60)
artifacts._write_text = _slow
from converter.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_temp_dirs_of_killed_runs_are_cleaned_by_the_next_run(mlp_conv, tmp_path):
    script = tmp_path / "slow_emit.py"
    script.write_text(_SLOW_EMIT)
    work = tmp_path / "work"
    work.mkdir()
    out = work / "o"
    proc = subprocess.Popen([sys.executable, str(script), str(SAMPLES / "mlp.py"), "--out", str(out), "-q"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marker = tmp_path / "wrote.marker"
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), (proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    stale = [p.name for p in work.iterdir()]
    assert len(stale) == 1 and stale[0].startswith(f".o.tmp-{proc.pid}-"), stale
    alive = work / f".o.tmp-{os.getpid()}-0123abcd"  # a live process's temp dir is left alone
    alive.mkdir()
    other = work / f".p.tmp-{proc.pid}-0123abcd"  # another output's temp dir too
    other.mkdir()
    emit(mlp_conv, out)
    assert sorted(p.name for p in work.iterdir()) == sorted([".o.tmp-%d-0123abcd" % os.getpid(), ".p.tmp-%d-0123abcd" % proc.pid, "o"])


# ---------------------------------------------------------------------------------------------
# model.load() checks the weights file


@pytest.fixture
def emitted_mlp(mlp_conv, tmp_path):
    out = emit(mlp_conv, tmp_path / "o")
    return out, load_file(out / "model.safetensors")


@pytest.mark.parametrize("change, message", [
    (lambda s: s.__setitem__("fc1.bias", torch.zeros(1)), r"'fc1.bias' is \(1,\) torch.float32, but the model expects \(64,\) torch.float32"),
    (lambda s: s.__setitem__("fc2.weight", s["fc2.weight"].t()[:, :32].contiguous()), r"'fc2.weight' is \(64, 32\)"),
    (lambda s: s.__setitem__("head.weight", s["head.weight"].double()), r"'head.weight' is \(10, 64\) torch.float64, but the model expects \(10, 64\) torch.float32"),
    (lambda s: s.__setitem__("extra.weight", torch.zeros(2)), r"has 'extra.weight', which this model does not have"),
    (lambda s: s.pop("norm.weight"), r"lacks \['norm.weight'\]"),
], ids=["broadcastable_shape", "wrong_shape", "dtype", "unexpected_key", "missing_key"])
def test_load_checks_every_tensor_in_the_weights_file(emitted_mlp, change, message):
    out, state = emitted_mlp
    change(state)
    save_file(state, out / "model.safetensors")
    module = import_file(out / "model.py")
    with pytest.raises(ValueError, match=message):
        module.load()


# ---------------------------------------------------------------------------------------------
# torchrun


_GLOO_START_ABORT = "terminate called without an active exception"


def _losses(stdout: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r"^step +\d+  loss (\S+)", stdout, re.M)]


@pytest.mark.slow
def test_train_py_under_torchrun_matches_one_process(mlp_conv, tmp_path):
    """2 DDP processes (gloo), rank r taking batches r, r+2, ...: the same global batch as one process
    accumulating 2 batches per step. Losses within 1e-5 absolute, parameters within 1e-5 relative."""
    _, out = _emit_mlp(SAMPLES / "mlp.py", tmp_path / "o")
    env = _env(OMP_NUM_THREADS="1")
    common = ["--steps", "3", "--device", "cpu"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(out / "train.py"), *common, "--save", str(tmp_path / "ddp.pt")]
    ddp = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    if ddp.returncode != 0 and _GLOO_START_ABORT in ddp.stderr and not _losses(ddp.stdout):
        # Seen twice in ~40 runs, only on a loaded 2-core machine: a rank aborts inside gloo's start-up
        # ("terminate called without an active exception") before any step ran. One more launch;
        # every check below stays as strict, and a second abort fails the test.
        ddp = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert ddp.returncode == 0, ddp.stderr[-4000:]
    one = subprocess.run([sys.executable, str(out / "train.py"), *common, "--accumulation-steps", "2",
                          "--save", str(tmp_path / "one.pt")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert one.returncode == 0, one.stderr[-4000:]
    assert "on 2 processes (gloo)" in ddp.stdout, ddp.stdout
    assert ddp.stdout.count("training ") == 1  # only rank 0 prints
    ddp_losses, one_losses = _losses(ddp.stdout), _losses(one.stdout)
    assert len(ddp_losses) == len(one_losses) == 3, (ddp.stdout, one.stdout)
    loss_diff = max(abs(a - b) for a, b in zip(ddp_losses, one_losses))
    assert loss_diff <= 1e-5, f"losses differ by {loss_diff:g}: {ddp_losses} vs {one_losses}"
    a, b = torch.load(tmp_path / "ddp.pt", weights_only=True), torch.load(tmp_path / "one.pt", weights_only=True)
    assert set(a) == set(b)
    start = load_file(out / "model.safetensors")
    assert not torch.equal(a["fc1.weight"], start["fc1.weight"])  # it trained
    worst = max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in a)
    assert worst <= 1e-5, f"parameters differ by {worst:g} (relative to each tensor's max)"


_FINITE = MLP_SOURCE.replace("    while True:\n        x = torch.randn(8, 32, generator=gen)", "    for _ in range(3):\n        x = torch.randn(8, 32, generator=gen)")


def test_train_py_stops_cleanly_when_train_batches_runs_out(tmp_path, capsys):
    assert _FINITE != MLP_SOURCE
    model_file = tmp_path / "finite.py"
    model_file.write_text(_FINITE)
    _, out = _emit_mlp(model_file, tmp_path / "o")
    train = import_file(out / "train.py")
    assert train.main(["--steps", "5", "--device", "cpu", "--accumulation-steps", "2"]) == 0
    stdout = capsys.readouterr().out
    assert len(_losses(stdout)) == 1 and "ran out of batches after 1 steps" in stdout, stdout


# A DDP run must not end in the interpreter's teardown: gloo's worker threads outlive
# destroy_process_group (DDP keeps the group referenced) and one that needs the GIL after the
# interpreter began finalizing is ended by CPython with pthread_exit, which aborts the process
# ("terminate called without an active exception" when a worker drops the last reference to a
# collective's tensor made in Python; measured before the fix: 1 abort in 115 plain launches of
# `--steps 10 --save` on a loaded 2-core machine, 20 in 50 with _IDLE_GLOO_THREADS below; after
# it, 0 in 50 and 0 in 50, old and new launched in turn). Where the scheduler puts that drop
# cannot be forced from Python, so this driver makes rank 0's gloo worker need the GIL 1 s after
# the final barrier completed (a Python callback on the barrier's future: it sleeps, then takes
# the GIL back) while rank 0's interpreter, if it is torn down, is kept finalizing for 3 s.
_BUSY_GLOO_WORKER_AT_EXIT = """
import os, runpy, sys, time
import torch.distributed as dist

RANK = int(os.environ["RANK"])
_barrier = dist.barrier


def _late_gil(future):
    time.sleep(1.0)  # on the gloo worker, without the GIL; it takes the GIL back when it wakes


def barrier(*args, **kwargs):
    if RANK == 1:
        time.sleep(0.5)  # rank 0 adds its callback before the barrier can complete
    work = _barrier(*args, async_op=True, **kwargs)
    future = work.get_future()
    if RANK == 0:
        future.then(_late_gil)  # runs on the worker that completes the barrier
    future.wait()  # returns once the barrier is complete, while the callback still runs


dist.barrier = barrier


class _SlowTeardown:
    def __del__(self):  # runs only when the interpreter tears its modules down
        time.sleep(3.0)


sys.modules["_slow_teardown"] = type(sys)("_slow_teardown")
sys.modules["_slow_teardown"].sentinel = _SlowTeardown()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _torchrun(script: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), *args]


@pytest.mark.slow
def test_train_py_under_torchrun_exits_cleanly_with_a_gloo_worker_still_busy(mlp_conv, tmp_path):
    """Fails before the fix every time: rank 0 aborts (exit 1, "Fatal Python error ... finalizing")."""
    _, out = _emit_mlp(SAMPLES / "mlp.py", tmp_path / "o")
    driver = tmp_path / "busy_worker.py"
    driver.write_text(_BUSY_GLOO_WORKER_AT_EXIT)
    run = subprocess.run(_torchrun(driver, str(out / "train.py"), "--steps", "1", "--device", "cpu"), cwd=tmp_path,
                         env=_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    assert len(_losses(run.stdout)) == 1, run.stdout
    assert "terminate called" not in run.stderr and "Fatal Python error" not in run.stderr, run.stderr[-4000:]


# Launches train.py with gloo's threads in SCHED_IDLE: they run only when nothing else wants the
# CPU, so the scheduler delays a worker's drop of its finished works past the main thread's exit
# far more often than a loaded machine does: before the fix 20 aborts in 50 `--steps 3 --save`
# launches with it, 1 in 115 without (2 cores, load 2 to 7).
_IDLE_GLOO_THREADS = """
import os, runpy, sys
import torch.distributed as dist

_init = dist.init_process_group


def init_process_group(*args, **kwargs):
    _init(*args, **kwargs)
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != os.getpid():  # every thread but the main one: gloo's workers and its tcp loop
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))


dist.init_process_group = init_process_group
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task"), reason="Linux scheduling")
def test_train_py_under_torchrun_exits_cleanly_run_after_run(mlp_conv, tmp_path):
    """The race itself, in repeated launches (MPCONVERT_TORCHRUN_RUNS, default 5; 50 for the issue's
    count): every one exits 0 with no abort."""
    _, out = _emit_mlp(SAMPLES / "mlp.py", tmp_path / "o")
    driver = tmp_path / "idle_gloo_threads.py"
    driver.write_text(_IDLE_GLOO_THREADS)
    runs = int(os.environ.get("MPCONVERT_TORCHRUN_RUNS", "5"))
    failed = []
    for i in range(runs):
        run = subprocess.run(_torchrun(driver, str(out / "train.py"), "--steps", "3", "--device", "cpu",
                                       "--save", str(tmp_path / "s.pt")),
                             cwd=tmp_path, env=_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=400)
        if run.returncode != 0 or "terminate called" in run.stderr:
            failed.append((i, run.returncode, len(_losses(run.stdout)), run.stderr[:800]))
    assert not failed, f"{len(failed)} of {runs} torchrun launches failed (run, exit code, steps printed, start of stderr): {failed}"


def test_ddp_exit_does_what_a_normal_exit_does_first_then_os_exit(mlp_conv, tmp_path, monkeypatch, capsys):
    """_exit_after_ddp joins non-daemon threads, runs the atexit handlers and flushes before os._exit."""
    _, out = _emit_mlp(SAMPLES / "mlp.py", tmp_path / "o")
    train = import_file(out / "train.py")
    events = []

    class _Exited(Exception):
        pass

    def fake_exit(code):
        events.append(("os._exit", code))
        raise _Exited

    worker = threading.Thread(target=lambda: (time.sleep(0.2), events.append(("thread", None))))
    worker.start()
    monkeypatch.setattr(train.atexit, "_run_exitfuncs", lambda: events.append(("atexit", None)))
    monkeypatch.setattr(train.os, "_exit", fake_exit)
    monkeypatch.setattr(sys, "stdout", _FlushRecorder(events, "stdout"))
    with pytest.raises(_Exited):
        train._exit_after_ddp(0)
    assert events == [("thread", None), ("atexit", None), ("flush", "stdout"), ("os._exit", 0)], events


class _FlushRecorder:
    def __init__(self, events: list, name: str):
        self.events, self.name = events, name

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        self.events.append(("flush", self.name))


class _WithObjectDefault(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale=1.5, mode="a'\\\"b"):
        return self.fc(x) * scale


def test_forward_defaults_are_literals(tmp_path):
    model = _WithObjectDefault()
    conv = converter.convert(model, (torch.randn(2, 4),), tracer="fx")
    out = emit(conv, tmp_path / "o")
    assert "scale = 1.5" in (out / "model.py").read_text()
    loaded = import_file(out / "model.py").load()
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(loaded(x), conv.module(x))


def test_forward_default_with_a_code_repr_is_refused():
    """torch.fx refuses such defaults itself today; model.py refuses anything but plain values anyway."""
    from converter.export.model_forward import check_defaults

    check_defaults("def forward(self, x, scale = 1.5, dtype = torch.float32, ks = (1, -2), m = {'a': None}):\n    pass")
    with pytest.raises(EmitError, match="not a plain literal"):
        check_defaults("def forward(self, x, cfg = __import__('os').system('touch PWNED')):\n    pass")


_WITHOUT_MPCONVERT = """
import runpy, sys
sys.modules["converter"] = None  # mpconvert is not installed on this machine
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_train_py_without_mpconvert_trains_with_torch_alone(tmp_path):
    """Same losses as with converter.MixedPrecisionTrainer (fp16: GradScaler with the same defaults)."""
    mf = load_model_file(SAMPLES / "mlp.py")
    out = emit(converter.convert(mf.model, mf.example_inputs, precision="fp16"), tmp_path / "o",
               model_file=str(SAMPLES / "mlp.py"))
    (tmp_path / "without.py").write_text(_WITHOUT_MPCONVERT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    args = [str(out / "train.py"), "--steps", "3", "--device", "cpu"]
    alone = subprocess.run([sys.executable, "-I", str(tmp_path / "without.py"), *args], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "NOTICE: the mpconvert package is not installed" in alone.stdout
    with_it = subprocess.run([sys.executable, *args], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert with_it.returncode == 0, with_it.stderr[-3000:]
    assert "NOTICE" not in with_it.stdout
    a, b = _losses(alone.stdout), _losses(with_it.stdout)
    assert len(a) == len(b) == 3 and max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    train = import_file(out / "train.py")
    with pytest.raises(SystemExit, match="--o2 needs the mpconvert package"):
        train._TorchTrainer(nn.Linear(2, 2), None, precision="fp16", master_weights=True, max_grad_norm=None, accumulation_steps=1)


def test_forward_annotations_kept_as_text_are_emitted(tmp_path):
    """A model file with ``from __future__ import annotations`` and an annotated ``forward``: FX keeps
    the annotations as strings ('torch.Tensor'), which model.py binds as literals (no import, no eval)."""
    model_file = tmp_path / "annotated.py"
    model_file.write_text(textwrap.dedent('''
        from __future__ import annotations

        import torch
        from torch import nn


        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(16, 16)

            def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
                return torch.relu(self.fc(x)) * scale


        def build_model():
            return Net()


        def example_inputs():
            return (torch.randn(2, 16),)
    '''))
    mf = load_model_file(model_file)
    conv = converter.convert(mf.model, mf.example_inputs, tracer="fx")
    out = emit(conv, tmp_path / "o", model_file=str(model_file))
    source = (out / "model.py").read_text()
    assert "= 'torch.Tensor'" in source, source[:2000]
    loaded = import_file(out / "model.py").load()
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x), conv.module(x))
