"""fp16 on a device without fast fp16 math is said, measured: one warning line naming bf16, and a note
in the report (a char-level LM trained 12x slower in fp16 than fp32 on this CPU, silently)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import converter
from converter.cli.main import main
from converter.numerics import device as device_mod
from tests.helpers import SAMPLES


@pytest.fixture(autouse=True)
def _advice_on(monkeypatch):
    """conftest turns the advice off for the rest of the suite (its output must not depend on the CPU)."""
    monkeypatch.delenv("MPCONVERT_NO_DEVICE_ADVICE", raising=False)


def test_the_environment_switch_turns_it_off(monkeypatch):
    _timings(monkeypatch, 1.0, 0.6, 15.0)
    assert device_mod.half_speed_advice("fp16", "cpu") is not None
    monkeypatch.setenv("MPCONVERT_NO_DEVICE_ADVICE", "1")
    assert device_mod.half_speed_advice("fp16", "cpu") is None


def _timings(monkeypatch, fp32: float, bf16: float, fp16: float) -> None:
    table = {torch.float32: fp32, torch.bfloat16: bf16, torch.float16: fp16}
    monkeypatch.setattr(device_mod, "cpu_matmul_seconds", table.__getitem__)
    monkeypatch.setattr(device_mod.torch.cuda, "is_available", lambda: False)


def test_advice_from_measured_matmul_times(monkeypatch):
    _timings(monkeypatch, 1.0, 0.6, 15.0)
    text = device_mod.half_speed_advice("fp16", None)
    assert text == ("fp16 matmuls on this CPU are 15x slower than fp32 (measured: it has no fast fp16 math), bf16 runs "
                    "at 0.6x: convert with precision='bf16' (CLI --precision bf16) to train on this CPU"), text
    assert device_mod.half_speed_advice("bf16", "cpu") is None
    _timings(monkeypatch, 1.0, 1.0, 1.5)  # a CPU with fp16 math (AVX512-FP16, AMX): nothing to say
    assert device_mod.half_speed_advice("fp16", None) is None
    _timings(monkeypatch, 1.0, 9.0, 15.0)  # neither half dtype is fast: no alternative to name
    assert device_mod.half_speed_advice("fp16", "cpu").endswith("(measured: it has no fast fp16 math)")


def test_the_real_probe_agrees_with_the_ratio():
    """The probe times real matmuls on this CPU: its verdict is the ratio it measured."""
    ratio = device_mod.cpu_matmul_seconds(torch.float16) / device_mod.cpu_matmul_seconds(torch.float32)
    said = device_mod.half_speed_advice("fp16", "cpu")
    assert (said is not None) == (ratio > device_mod.SLOW_FACTOR), (ratio, said)
    if said is not None:
        assert f"are {ratio:.0f}x slower than fp32" in said, (ratio, said)


def test_convert_warns_and_reports(monkeypatch):
    _timings(monkeypatch, 1.0, 0.6, 15.0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(2, 8)
    with pytest.warns(converter.SlowHalfWarning, match="precision='bf16'"):
        conv = converter.convert(model, (x,), precision="fp16")
    assert conv.report.extra["device_advice"].startswith("fp16 matmuls on this CPU are 15x slower")
    assert "> **Warning:** fp16 matmuls on this CPU are 15x slower" in conv.report.to_markdown()
    assert "15x slower than fp32" in conv.report.to_html()
    with warnings.catch_warnings():
        warnings.simplefilter("error", converter.SlowHalfWarning)
        assert converter.convert(model, (x,), precision="bf16").report.extra["device_advice"] is None


def test_cli_says_it_once(monkeypatch, tmp_path, capfd):
    _timings(monkeypatch, 1.0, 0.6, 15.0)
    code = main([str(SAMPLES / "mlp.py"), "--precision", "fp16", "--no-measure", "--out", str(tmp_path / "o")])
    err = capfd.readouterr().err
    assert code == 0, err
    lines = [line for line in err.splitlines() if "slower than fp32" in line]
    assert len(lines) == 1 and lines[0].startswith("mpconvert: warning: fp16 matmuls on this CPU are 15x slower"), err
    assert "hidden" not in err, err


def test_the_timings_are_measured_once_per_machine_and_cached(monkeypatch, tmp_path):
    """Identical runs print the same advice (issue 31 item 6: it appeared in 1 of 5 identical runs): the
    first run's timings are kept per machine; later processes read them instead of measuring again."""
    monkeypatch.setenv("MPCONVERT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(device_mod.torch.cuda, "is_available", lambda: False)
    measured = []
    slow = {torch.float32: 1e-4, torch.bfloat16: 0.6e-4, torch.float16: 15e-4}

    def measure(dtype):
        measured.append(dtype)
        return slow[dtype]

    monkeypatch.setattr(device_mod, "measure_matmul_seconds", measure)
    device_mod.cpu_matmul_seconds.cache_clear()
    first = device_mod.half_speed_advice("fp16", "cpu")
    assert first is not None and "15x slower" in first and len(measured) == 3
    # a new process (cleared in-process cache) on a busy machine would now measure fp16 as fast: it reads the cache
    slow[torch.float16] = 1e-4
    device_mod.cpu_matmul_seconds.cache_clear()
    assert device_mod.half_speed_advice("fp16", "cpu") == first and len(measured) == 3
    assert (tmp_path / "device.json").is_file()
    # a broken cache file is measured again, not trusted
    (tmp_path / "device.json").write_text("{not json")
    device_mod.cpu_matmul_seconds.cache_clear()
    assert device_mod.half_speed_advice("fp16", "cpu") is None and len(measured) == 5  # fp32 and fp16 again
    device_mod.cpu_matmul_seconds.cache_clear()
