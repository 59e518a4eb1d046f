"""Smoke test of ``benchmarks/fp8.py`` (issue 34, deliverable 6): the tiny mode runs end to end without torchao.

No timing or accuracy assertions on the benchmark's figures: they are measured by the benchmark, not by tests
(benchmarks/README.md). torchao is an optional benchmark dependency: nothing here needs it.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from benchmarks import fp8 as bench


def _strict_json(text: str):
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=reject)


def test_selection_skips_first_last_and_misaligned_linears():
    model = bench.CharLM(dim=32, heads=2, layers=2, seq=16)
    fqns = bench.select_linears(model, "tensorwise")
    assert fqns[0] == "blocks.0.proj" and "blocks.0.qkv" not in fqns and "head" not in fqns
    assert fqns == ["blocks.0.proj", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.qkv", "blocks.1.proj",
                    "blocks.1.fc1", "blocks.1.fc2"]
    odd = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 24), nn.Linear(24, 32), nn.Linear(32, 16))
    assert bench.select_linears(odd, "tensorwise") == []  # 24 is not a multiple of 16; first and last skipped


def test_swap_shares_parameters_and_runs_the_fp8_kernel():
    torch.manual_seed(0)
    model = bench.CharLM(dim=32, heads=2, layers=1, seq=16)
    weight = model.blocks[0].fc1.weight
    bench.swap_ours(model, ["blocks.0.fc1"], "rowwise")
    swapped = model.blocks[0].fc1
    assert isinstance(swapped, bench.OursFp8Linear) and swapped.weight is weight
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(kwargs.get("out_dtype"))
        return real(*args, **kwargs)

    ids = torch.randint(0, 256, (2, 16))
    try:
        torch._scaled_mm = counting
        bench.lm_loss(model, ids, ids).backward()
    finally:
        torch._scaled_mm = real
    # output and grad_input in the activations' dtype (bf16 under autocast), grad_weight in the weight's (fp32)
    assert calls == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert weight.grad is not None and weight.grad.dtype == torch.float32


def test_missing_torchao_is_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError
    assert bench.load_torchao() is None


def test_tiny_run_without_torchao_writes_strict_json(tmp_path):
    out = tmp_path / "fp8.json"
    threads = torch.get_num_threads()  # the cpu clock runs on one torch thread: restored for the other tests
    try:
        assert bench.main(["--tiny", "--no-torchao", "--sqnr-recipes", "tensorwise", "blockwise",
                           "--time-recipes", "tensorwise", "--train-recipes", "tensorwise", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = _strict_json(out.read_text())
    assert result["torchao"] is None and result["machine"]["torch"] == torch.__version__
    assert {(r["layer"], r["recipe"]) for r in result["layer_sqnr"]} == {
        (f, r) for f in result["fp8_layers"] for r in ("tensorwise", "blockwise")}
    for row in result["layer_sqnr"]:
        assert "torchao" not in row
        assert all(isinstance(v, (float, int)) or v == "inf" for v in row["ours"].values()), row
    assert set(result["timing"]) == {"bf16", "ours_tensorwise"}
    assert all(r["step_ms"] > 0 and r["peak_extra_bytes"] > 0 for r in result["timing"].values())
    runs = result["charlm"]["runs"]
    assert set(runs) == {"bf16", "ours_tensorwise"}
    assert all("val_loss" in r for r in runs.values()) and "vs_bf16" in runs["ours_tensorwise"]
    assert len(result["charlm"]["corpus"]["sha256"]) == 64
    md = out.with_suffix(".md").read_text()
    assert "## Per-layer SQNR" in md and "| ours_tensorwise |" in md and "not installed" in md


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
