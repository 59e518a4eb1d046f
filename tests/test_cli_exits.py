"""Issue 19.4 and 19.6: every bad input exits 2 with one line and writes nothing; the output location
is checked before any work; the user's prints never reach stdout under --json or -q."""
from __future__ import annotations

import errno
import json
import os
import pathlib
import time
from pathlib import Path

import pytest

from tests.helpers import SAMPLES
from tests.test_cli import assert_bad_input, run, snapshot, write

MLP = str(SAMPLES / "mlp.py")

#: a model file that leaves a marker when it is imported, and prints on stdout while built and run
NOISY = """
import pathlib
import torch
from torch import nn

pathlib.Path("imported.marker").write_text("x")
print("IMPORT NOISE")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        print("FORWARD NOISE")
        return self.fc(x)


def build_model():
    print("BUILD NOISE")
    return Net()


def example_inputs():
    return (torch.randn(2, 4),)
"""


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("text, needle", [
    ("a = " + "[" * 4000 + "]" * 4000 + "\n", "nests too deeply"),
    ("[settings]\noverflow_margin = nan\n", "finite number"),
    ("[settings]\noverflow_margin = inf\n", "finite number"),
    ("[settings]\noverflow_margin = -1.0\n", "above 0"),
    ("[settings]\noverflow_margin = 1e9\n", "at most 65504"),
    ('[module]\n"layers.[0" = "fp32"\n', "unclosed '['"),
    ('[module]\n"a\\u0000b" = "fp32"\n', "NUL byte"),
])
def test_bad_rule_files_exit_2_in_check_and_in_convert(work, capfd, text, needle):
    (work / "bad.toml").write_text(text)
    assert_bad_input(*run(capfd, "rules", "check", "bad.toml"), "bad.toml", needle)
    assert_bad_input(*run(capfd, MLP, "--rules", "bad.toml", "--no-measure"), needle)
    assert snapshot(work) == ["bad.toml"]


def test_utf8_bom_and_closed_globs_are_accepted(work, capfd):
    (work / "bom.toml").write_bytes(b'\xef\xbb\xbf[op]\nlinear = "fp32"\n[module]\n"fc[12]" = "fp32"\n"x[[]" = "fp32"\n')
    code, out, err = run(capfd, "rules", "check", "bom.toml")
    assert code == 0 and "ok: bom.toml (3 rules)" in out, err
    code, out, err = run(capfd, MLP, "--rules", "bom.toml", "--json", "--no-measure")
    assert code == 0, err
    report = json.loads((work / "mlp_mp" / "report.json").read_text())
    fc1 = next(r for r in report["nodes"] if r["name"] == "fc1")
    assert fc1["precision"] == "fp32" and "fc[12]" in fc1["rule"], fc1["rule"]


def test_out_under_a_file_fails_before_the_model_is_imported(work, capfd):
    write(work, "noisy.py", NOISY)
    (work / "afile").write_text("mine")
    assert_bad_input(*run(capfd, "noisy.py", "--out", "afile/sub"), "afile", "is a file, not a directory")
    assert_bad_input(*run(capfd, "noisy.py", "--out", "afile"), "afile", "is an existing file")
    assert not (work / "imported.marker").exists()
    assert snapshot(work) == ["afile", "noisy.py"] and (work / "afile").read_text() == "mine"


def test_read_only_location_fails_fast(work, capfd):
    """/sys refuses new directories even to root; elsewhere a chmod 555 directory (non-root only)."""
    write(work, "noisy.py", NOISY)
    targets = []
    if Path("/sys").is_dir():
        try:
            os.mkdir("/sys/mpconvert-probe")
            os.rmdir("/sys/mpconvert-probe")
        except OSError:
            targets.append("/sys/mpconvert_out")
    if os.geteuid() != 0:
        (work / "ro").mkdir()
        (work / "ro").chmod(0o555)
        targets.append(str(work / "ro" / "out"))
    if not targets:
        pytest.skip("no read-only location to test on this machine")
    for target in targets:
        started = time.perf_counter()
        assert_bad_input(*run(capfd, "noisy.py", "--out", target), "cannot write the output", "--out")
        assert time.perf_counter() - started < 5
    assert not (work / "imported.marker").exists()


def test_full_disk_while_writing_exits_2_and_leaves_nothing(work, capfd, monkeypatch):
    real = pathlib.Path.write_text

    def full(self, *args, **kwargs):
        if ".tmp-" in str(self):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    line = assert_bad_input(*run(capfd, MLP, "--no-measure"), "No space left on device", "free some space")
    assert "nothing was written" in line
    monkeypatch.setattr(pathlib.Path, "write_text", real)
    assert snapshot(work) == []


def test_nul_bytes_in_names_exit_2(work, capfd):
    for args, needle in (
        ([MLP, "--out", "a\x00b"], "--out contains a NUL byte"),
        ([MLP[:-3] + "\x00.py"], "the model path contains a NUL byte"),
        ([MLP, "--rules", "x\x00.toml"], "--rules contains a NUL byte"),
        ([MLP, "--entry", "build\x00"], "--entry contains a NUL byte"),
        (["rules", "check", "x\x00.toml"], "a rules file name contains a NUL byte"),
        (["explain", MLP, "fc\x001"], "the node name contains a NUL byte"),
    ):
        assert_bad_input(*run(capfd, *args), needle)
    assert snapshot(work) == []


@pytest.mark.parametrize("flag", ["--json", "-q"])
def test_user_prints_never_reach_stdout(work, capfd, flag):
    write(work, "noisy.py", NOISY)
    code, out, err = run(capfd, "noisy.py", flag, "--no-measure")
    assert code == 0, err
    assert "NOISE" not in out, out
    if flag == "--json":
        assert json.loads(out)["ok"] is True
    else:
        assert out.strip() == str(work / "noisy_mp")
    code, out, err = run(capfd, "audit", "noisy.py", flag)
    assert code == 0 and "NOISE" not in out, (out, err)
