"""Issue 46.2, nothing hidden: a conversion's inputs are its arguments. No environment variable, module flag
or disk cache decides a kernel; the device figures that do are an explicit
:class:`~converter.numerics.profile.DeviceProfile`, recorded in report.json. The same model converted in two
processes with different environments (home and cache folders, a cold and a warm old timing cache, the old
``MPCONVERT_*`` switches set one way and the other) and the same saved profile gives the same report.json
(timings aside) and the same graph code."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import converter
from converter.numerics.profile import DeviceProfile
from tests.helpers import ROOT, load_sample

#: the child: convert a sample with the given profile file and device, write its report.json and graph code
_CHILD = textwrap.dedent("""
    import json, sys
    import converter
    from tests.helpers import load_sample

    name, device, profile, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    sample = load_sample(name)
    model, example = sample.build_model(), sample.example_inputs()
    conv = converter.convert(model, tuple(example), precision="bf16", device=None if device == "none" else device,
                             device_profile=profile)
    codes = [conv.module.code]
    if hasattr(conv.module, "for_mode"):
        codes.append(conv.module.for_mode(False).code)
    with open(out, "w") as f:
        json.dump({"report": conv.report.to_dict(), "codes": codes}, f)
""")

#: the only fields of report.json that measure time (seconds of each stage): everything else must be equal
TIMING_KEYS = ("timings",)


def _slow_profile(bf16: float = 4.5) -> DeviceProfile:
    """A CPU whose bf16 GEMM is ``bf16`` times slower than its fp32 GEMM (no AMX): the CPU kernels apply."""
    return DeviceProfile(cpu="Test CPU without AMX", cores=2, torch_version=torch.__version__,
                         matmul_seconds=(("fp32", 1e-4), ("bf16", bf16 * 1e-4), ("fp16", 9e-4)))


def _environments(tmp_path: Path) -> list[dict[str, str]]:
    """Two environments that differ in everything the converter once read: HOME and XDG_CACHE_HOME, the old
    timing cache (absent in one, filled with timings that would flip every choice in the other) and switches."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MPCONVERT_")}
    base["PYTHONPATH"] = str(ROOT)
    cold, warm = tmp_path / "cold", tmp_path / "warm"
    for home in (cold, warm):
        (home / ".cache" / "mpconvert").mkdir(parents=True)
    (warm / ".cache" / "mpconvert" / "device.json").write_text(json.dumps(
        {f"{'0' * 16}:{dtype}": seconds for dtype, seconds in (("float32", 9e-3), ("bfloat16", 1e-5), ("float16", 1e-5))}))
    return [
        {**base, "HOME": str(cold), "XDG_CACHE_HOME": str(cold / ".cache")},
        {**base, "HOME": str(warm), "XDG_CACHE_HOME": str(warm / ".cache"), "MPCONVERT_CACHE_DIR": str(warm / ".cache" / "mpconvert"),
         "MPCONVERT_NO_DEVICE_ADVICE": "1", "MPCONVERT_CHECK": "1", "OMP_NUM_THREADS": "1"},
    ]


def _convert_in(env: dict[str, str], name: str, device: str, profile: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, name, device, str(profile), str(out)], cwd=out.parent, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _without_timings(report: dict) -> dict:
    return {key: value for key, value in report.items() if key not in TIMING_KEYS}


@pytest.mark.parametrize("name,device", [("tiny_transformer", "cpu"), ("cnn", "none")])
def test_the_same_profile_gives_the_same_report_and_graph_in_any_environment(name, device, tmp_path):
    profile = _slow_profile().save(tmp_path / "profile.json")
    runs = [_convert_in(env, name, device, profile, tmp_path / f"run{i}.json") for i, env in enumerate(_environments(tmp_path))]
    first, second = (_without_timings(run["report"]) for run in runs)
    differ = sorted(key for key in set(first) | set(second) if first.get(key) != second.get(key))
    assert not differ, f"{name}: report.json differs in {differ}"
    assert runs[0]["codes"] == runs[1]["codes"], f"{name}: the graph code differs"
    assert set(runs[0]["report"]) - set(first) == set(TIMING_KEYS), sorted(runs[0]["report"])  # only timings left out
    assert first["device_profile"] == _slow_profile().to_dict(), first["device_profile"]
    if device == "cpu":  # the profile is what chose the kernels: its slow bf16 GEMM, whatever the old cache said
        [choice] = [c for c in first["lowering"] if c["lowering"] == "upcast_gemm"]
        assert "measured 4.5x" in choice["why"], choice


def test_a_profile_with_other_figures_shows_them_and_chooses_by_them():
    sample = load_sample("tiny_transformer")
    model, example = sample.build_model(), tuple(sample.example_inputs())
    reports = {}
    for bf16 in (4.5, 1.0):
        with warnings.catch_warnings():  # the slow profile's advice (its GEMMs are too small for the upcast kernels)
            warnings.simplefilter("ignore", converter.SlowHalfWarning)
            conv = converter.convert(model, example, precision="bf16", device="cpu", device_profile=_slow_profile(bf16))
        reports[bf16] = conv.report.to_dict()
    figures = {bf16: r["device_profile"]["matmul_seconds"]["bf16"] for bf16, r in reports.items()}
    assert figures == {4.5: 4.5 * 1e-4, 1.0: 1e-4}, figures
    advice = {bf16: r["device_advice"] for bf16, r in reports.items()}
    assert advice[1.0] is None and "bf16 matmuls on this CPU are 4x slower than fp32" in advice[4.5], advice
    why = {bf16: next(c["why"] for c in r["lowering"] if c["lowering"] == "upcast_gemm") for bf16, r in reports.items()}
    assert "measured 4.5x" in why[4.5] and "measured 1.00x" in why[1.0] and "native half GEMMs" in why[1.0], why
    attention = {bf16: sum(c["lowering"] == "upcast_attention" for c in r["lowering"]) for bf16, r in reports.items()}
    assert attention[4.5] >= 1 and attention[1.0] == 0, attention  # fp32-arithmetic attention only where bf16 is slow


def test_no_profile_is_recorded_as_null_and_chooses_the_fixed_kernels():
    sample = load_sample("tiny_transformer")
    model, example = sample.build_model(), tuple(sample.example_inputs())
    report = converter.convert(model, example, precision="bf16", device="cpu", device_profile=None).report.to_dict()
    assert report["device_profile"] is None
    [choice] = [c for c in report["lowering"] if c["lowering"] == "upcast_gemm"]
    assert choice["chosen"] is False and "not measured (device_profile=None)" in choice["why"], choice
