"""fp16 on a device without fast fp16 math is said, from the conversion's device profile: one warning line
naming bf16, and a note in the report (a char-level LM trained 12x slower in fp16 than fp32 on this CPU,
silently). The figures are the profile's only (no environment variable, no disk cache: issue 46)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import converter
from converter.cli.main import main
from converter.numerics import device as device_mod
from converter.numerics.profile import DTYPES, DeviceProfile, DeviceProfileError, measured_once
from tests.helpers import SAMPLES


def _profile(fp32: float, bf16: float, fp16: float, capability=None) -> DeviceProfile:
    return DeviceProfile(cpu="Test CPU", cores=2, torch_version="2.x", cuda_device="Test GPU" if capability else None,
                         matmul_seconds=(("fp32", fp32 * 1e-4), ("bf16", bf16 * 1e-4), ("fp16", fp16 * 1e-4)),
                         cuda_capability=capability)


def test_no_profile_no_advice():
    assert device_mod.half_speed_advice("fp16", "cpu", None) is None
    assert device_mod.half_gemm_slowdown("bf16", None) is None
    assert device_mod.half_speed_advice("fp16", "cpu", _profile(1.0, 0.6, 15.0)) is not None


def test_advice_from_the_profiles_matmul_times():
    text = device_mod.half_speed_advice("fp16", None, _profile(1.0, 0.6, 15.0))
    assert text == ("fp16 matmuls on this CPU are 15x slower than fp32 (measured: it has no fast fp16 math), bf16 runs "
                    "at 0.6x: convert with precision='bf16' (CLI --precision bf16) to train on this CPU"), text
    assert device_mod.half_speed_advice("bf16", "cpu", _profile(1.0, 0.6, 15.0)) is None
    assert device_mod.half_speed_advice("fp16", None, _profile(1.0, 1.0, 1.5)) is None  # fp16 math (AMX): nothing to say
    # neither half dtype is fast: no alternative to name
    assert device_mod.half_speed_advice("fp16", "cpu", _profile(1.0, 9.0, 15.0)).endswith("(measured: it has no fast fp16 math)")


def test_cuda_advice_reads_the_profiles_capability():
    turing = _profile(1.0, 1.0, 1.0, capability=(7, 5))
    said = device_mod.half_speed_advice("bf16", None, turing)
    assert said == ("bf16 has no tensor-core math on Test GPU (compute capability 7.5, bf16 needs 8.0): expect no "
                    "speed-up over fp32: convert with precision='fp16'"), said
    assert device_mod.half_speed_advice("fp16", "cuda", turing) is None
    assert device_mod.half_speed_advice("bf16", "cuda", _profile(1.0, 9.0, 9.0)) is None  # no CUDA device in the profile


def test_the_real_probe_agrees_with_the_ratio():
    """A measured profile times real matmuls on this CPU: the advice's verdict is the ratio it holds."""
    profile = DeviceProfile.measure()
    ratio = profile.seconds("fp16") / profile.seconds("fp32")
    said = device_mod.half_speed_advice("fp16", "cpu", profile)
    assert (said is not None) == (ratio > device_mod.SLOW_FACTOR), (ratio, said)
    if said is not None:
        assert f"are {ratio:.0f}x slower than fp32" in said, (ratio, said)
    assert measured_once() is measured_once()  # "auto": measured once per process


def test_convert_warns_and_reports():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(2, 8)
    slow = _profile(1.0, 0.6, 15.0)
    with pytest.warns(converter.SlowHalfWarning, match="precision='bf16'"):
        conv = converter.convert(model, (x,), precision="fp16", device_profile=slow)
    assert conv.report.records.advice.text.startswith("fp16 matmuls on this CPU are 15x slower")
    assert "> **Warning:** fp16 matmuls on this CPU are 15x slower" in conv.report.to_markdown()
    assert "15x slower than fp32" in conv.report.to_html()
    assert conv.report.to_dict()["device_profile"] == slow.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error", converter.SlowHalfWarning)
        assert converter.convert(model, (x,), precision="bf16", device_profile=slow).report.records.advice.text is None
        assert converter.convert(model, (x,), precision="fp16").report.records.advice.text is None  # the suite: none


def test_cli_says_it_once(tmp_path, capfd):
    profile = _profile(1.0, 0.6, 15.0).save(tmp_path / "slow.json")
    code = main([str(SAMPLES / "mlp.py"), "--precision", "fp16", "--no-measure", "--out", str(tmp_path / "o"),
                 "--device-profile", str(profile)])
    err = capfd.readouterr().err
    assert code == 0, err
    lines = [line for line in err.splitlines() if "slower than fp32" in line]
    assert len(lines) == 1 and lines[0].startswith("mpconvert: warning: fp16 matmuls on this CPU are 15x slower"), err
    assert "hidden" not in err, err
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["device_profile"]["matmul_seconds"] == {"fp32": 1e-4, "bf16": 0.6e-4, "fp16": 15e-4}, report["device_profile"]


def test_a_profile_round_trips_and_a_bad_one_is_one_line(tmp_path):
    profile = _profile(1.0, 4.5, 1.1, capability=(8, 0))
    path = profile.save(tmp_path / "p.json")
    assert DeviceProfile.load(path) == profile and DeviceProfile.from_dict(profile.to_dict()) == profile
    assert converter.ConvertOptions(device_profile=str(path)).device_profile == profile  # a path: loaded once
    assert converter.ConvertOptions(device_profile="none").device_profile is None
    good = profile.to_dict()
    cases = {
        "missing.json": (None, "cannot read device profile"),
        "text.json": ("{not json", "is not JSON"),
        "list.json": ("[]", "expected a JSON object, got list"),
        "format.json": (json.dumps({**good, "format": 2}), "format 2 is not 1"),
        "extra.json": (json.dumps({**good, "flags": "avx"}), "unknown key(s) ['flags']"),
        "seconds.json": (json.dumps({**good, "matmul_seconds": {"fp32": 1e-4, "bf16": -1, "fp16": 1e-4}}),
                         "matmul_seconds['bf16'] must be seconds in (0, 60), got -1"),
        "dtypes.json": (json.dumps({**good, "matmul_seconds": {"fp32": 1e-4}}), f"must map exactly {list(DTYPES)}"),
        "capability.json": (json.dumps({**good, "cuda_capability": [8]}), "cuda_capability must be [major, minor]"),
    }
    for name, (text, needle) in cases.items():
        bad = tmp_path / name
        if text is not None:
            bad.write_text(text)
        with pytest.raises(DeviceProfileError) as info:
            DeviceProfile.load(bad)
        message = str(info.value)
        assert needle in message and "\n" not in message and isinstance(info.value, converter.MpconvertError), (name, message)


def test_the_cli_refuses_a_bad_profile_file_in_one_line(tmp_path, capfd):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 1}')
    code = main(["audit", str(SAMPLES / "mlp.py"), "--out", str(tmp_path / "a"), "--device-profile", str(bad)])
    err = capfd.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    assert "missing key(s) ['cores', 'cpu', 'matmul_seconds', 'torch_version']" in err and not (tmp_path / "a").exists(), err


def test_mpconvert_profile_writes_what_device_profile_reads(tmp_path, capfd):
    path = tmp_path / "cpu.json"
    assert main(["profile", "-o", str(path), "--json"]) == 0
    said = json.loads(capfd.readouterr().out)
    loaded = DeviceProfile.load(path)
    assert said["device_profile"] == loaded.to_dict() and said["path"] == str(path), said
    assert set(dict(loaded.matmul_seconds)) == {"fp32", "bf16", "fp16"} and loaded.cores >= 1
    assert main(["profile", "-o", str(tmp_path / "no" / "p.json")]) == 2
    assert "does not exist" in capfd.readouterr().err
