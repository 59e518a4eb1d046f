"""Smoke test of the benchmark suite: the measurement helpers are exact on toy models, and
``benchmarks/run.py --quick`` runs end to end and writes valid JSON and Markdown.

No timing assertions: performance is measured by the suite, never by tests (benchmarks/README.md).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.common import (
    CastCounter,
    OpTimer,
    SavedTensorMeter,
    first_tensor,
    interleaved,
    peak_step_memory,
    sqnr_db,
    summarize,
    unique_storage_bytes,
)

ROOT = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16


def _nbytes(numel: int, *dtypes: torch.dtype) -> int:
    return sum(numel * torch.empty((), dtype=d).element_size() for d in dtypes)


# ---------------------------------------------------------------- casts
def test_cast_counter_counts_autocast_linear_exactly():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    counter = CastCounter()
    with counter:
        counter.phase = "fwd"
        with torch.autocast("cpu", dtype=BF16):
            out = lin(x)
        loss = out.float().sum()
        counter.phase = "bwd"
        loss.backward()
    both = _nbytes(1, torch.float32, BF16)  # an fp32<->bf16 cast reads one and writes the other
    # forward: weight, bias and input to bf16 (autocast), the output back to fp32 (the loss)
    assert counter.totals(phases=["fwd"]) == (4, both * (16 * 8 + 8 + 4 * 16 + 4 * 8))
    # backward: the loss cast's grad to bf16, weight and bias grads to fp32 (x needs no grad)
    assert counter.totals(phases=["bwd"]) == (3, both * (4 * 8 + 16 * 8 + 8))
    assert counter.totals(op="copy") == (0, 0)
    shapes = {(e.phase, e.src, e.dst, e.shape) for e in counter.events}
    assert ("fwd", "float32", "bfloat16", (8, 16)) in shapes
    assert ("bwd", "bfloat16", "float32", (8, 16)) in shapes


def test_cast_counter_ignores_non_casts_and_counts_copies_separately():
    a = torch.randn(10)
    half = torch.empty(10, dtype=BF16)
    with CastCounter() as counter:
        a.to(torch.float32)                     # same dtype: no _to_copy at all
        a.clone()
        torch.arange(10).to(torch.float32)      # int -> float: not mixed-precision traffic
        a.to(torch.float64)                     # float -> float: counted
        half.copy_(a)                           # dtype-changing copy_: counted as "copy"
        torch._foreach_copy_([half], [a])
    assert counter.totals() == (1, _nbytes(10, torch.float32, torch.float64))
    assert counter.totals(op="copy") == (2, 2 * _nbytes(10, torch.float32, BF16))
    rows = counter.by_signature(op="copy")
    assert rows == [{"phase": "step", "cast": "float32->bfloat16", "shape": [10], "count": 2,
                     "bytes": 2 * _nbytes(10, torch.float32, BF16)}]


# ---------------------------------------------------------------- saved activations
def test_saved_tensor_meter_counts_distinct_storages_and_excludes_params():
    w = nn.Parameter(torch.randn(32, 8))
    x = torch.randn(32, 8, requires_grad=True)
    with SavedTensorMeter(exclude=[w]) as meter:
        y = x.exp()                 # saves its result y
        z = y * w                   # saves y (again) and w (excluded)
        v = y.view(-1).sin()        # saves a view of y: same storage, counted once
        h = (x.to(BF16) * 2).relu()  # relu saves its bf16 output
    (z.sum() + v.sum() + h.float().sum()).backward()
    assert meter.bytes == 32 * 8 * 4 + 32 * 8 * 2
    assert meter.by_dtype == {"float32": 32 * 8 * 4, "bfloat16": 32 * 8 * 2}
    assert meter.count >= 4


def test_unique_storage_bytes_counts_views_once():
    t = torch.zeros(100)
    assert unique_storage_bytes([t, t[:10], t.view(10, 10), torch.zeros(5, dtype=BF16)]) == 400 + 10


# ---------------------------------------------------------------- accuracy
def test_sqnr_db_exact_values():
    ref = torch.ones(100)
    assert sqnr_db(ref, ref.clone()) == math.inf
    assert sqnr_db(ref, ref + 2.0**-7) == pytest.approx(20 * math.log10(2.0**7), abs=1e-12)  # exact in fp32
    assert sqnr_db(ref, ref * 0.9) == pytest.approx(20.0, abs=1e-5)
    assert sqnr_db(ref, ref.to(BF16)) == math.inf  # 1.0 is exact in bf16
    with pytest.raises(ValueError, match="shapes differ"):
        sqnr_db(ref, torch.ones(99))


def test_first_tensor_walks_outputs():
    t = torch.randn(2)
    assert first_tensor({"loss": None, "logits": t}) is t
    assert first_tensor((torch.arange(3), [t])) is t
    with pytest.raises(LookupError):
        first_tensor((torch.arange(3),))


# ---------------------------------------------------------------- timing and memory (no timing asserts)
def test_interleaved_runs_variants_in_rounds():
    calls: list[str] = []

    def make(name):
        def step(clock):
            calls.append(name)
            clock.mark("fwd")
            clock.mark("bwd")
        return step

    samples = interleaved({"A": make("A"), "B": make("B"), "C": make("C")}, rounds=3, warmup=1, inner=2,
                          clock="cpu")
    assert calls == ["A", "A", "B", "B", "C", "C"] * 4
    assert {k: len(v) for k, v in samples.items()} == {"A": 3, "B": 3, "C": 3}
    stats = summarize(samples["A"])
    assert stats["n"] == 3 and set(stats) >= {"fwd_ms", "bwd_ms", "total_ms"}
    with pytest.raises(ValueError):
        interleaved({"A": make("A")}, rounds=0)


def test_peak_step_memory_sees_torch_allocations():
    def fn():
        a = torch.empty(1 << 20)        # 4 MiB
        b = torch.empty(1 << 19)        # +2 MiB while a is alive
        del a, b
        c = torch.empty(1 << 20)        # 4 MiB again after both were freed
        del c

    peak = peak_step_memory(fn)
    assert peak["peak_bytes"] == 6 << 20


def test_op_timer_keys_ops_by_dtype():
    a = torch.randn(8, 8)
    with OpTimer("cpu") as timer:
        timer.phase = "fwd"
        a.to(BF16) @ a.to(BF16)
    keys = {k for _, k in timer.times}
    assert "aten.mm[bf16,bf16]" in keys
    assert "aten._to_copy[f32->bf16]" in keys
    assert timer.calls[("fwd", "aten._to_copy[f32->bf16]")] == 2


# ---------------------------------------------------------------- the suite end to end
def _strict_json(text: str):
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=reject)


def test_run_quick_tiniest_model_writes_valid_json(tmp_path):
    out = tmp_path / "cpu.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--models", "cnn", "--clock", "cpu",
           "--rounds", "2", "--budget", "0", "--warmup", "1", "--graphs", "on", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _strict_json(out.read_text())
    assert results["schema"] == 1
    assert results["machine"]["torch"] == torch.__version__
    assert results["config"]["clock"] == "cpu"
    cnn = results["models"]["cnn"]
    assert set(cnn["variants"]) == {"fp32", "autocast", "O1", "O2", "floor", "O2g"}  # O2g: --graphs on
    assert cnn["conversion"]["tracer"] == "fx"
    assert cnn["conversion"]["capture_s"] > 0 and cnn["conversion"]["pass_s"] > 0
    for name, v in cnn["variants"].items():
        assert v["step_ms"] > 0 and v["samples"] == 2, name
        assert isinstance(v["casts"], int) and v["cast_bytes"] >= 0, name
        assert v["saved_bytes"] > 0 and v["peak_bytes"] >= v["state_bytes"] > 0, name
    assert cnn["variants"]["fp32"]["casts"] == 0
    assert cnn["variants"]["fp32"]["sqnr_db"] == "inf"  # +inf against itself: report.json's non-finite convention
    assert cnn["variants"]["autocast"]["casts"] > 0
    assert cnn["variants"]["O2"]["copy_casts"] > 0      # master-grad harvest and master->model copy
    assert math.isfinite(cnn["variants"]["O2"]["sqnr_db"])
    # O2g on the CPU: the CUDA-graph wrapper runs every call eagerly (no CUDA device), the code path end to end
    graph = cnn["variants"]["O2g"]["cuda_graph"]
    expected_reason = "no CUDA device" if not torch.cuda.is_available() else "not on one CUDA device"
    assert graph["captures"] == 0 and graph["replays"] == 0 and graph["eager_calls"] > 0
    assert set(graph["eager_reasons"]) <= {expected_reason, "gradients disabled", "dispatch or function mode active",
                                           "saved-tensor hooks active"}, graph
    assert cnn["variants"]["O2g"]["casts"] == cnn["variants"]["O2"]["casts"]  # the same graph, run eagerly
    targets = {(t["target"], t["model"]) for t in results["targets"]}
    assert ("O2 SQNR ≥ autocast − 1 dB", "cnn") in targets
    o2g_rows = [t for t in results["targets"] if t["target"].startswith("O2g")]
    assert len(o2g_rows) == 2 and not any(t["binding"] for t in o2g_rows)  # GPU targets: information on the CPU
    md = out.with_suffix(".md").read_text()
    assert "| model | variant | step ms |" in md and "| cnn | O2 |" in md and torch.__version__ in md
    assert "| cnn | O2g |" in md


def test_partial_table_of_one_research_model_writes_its_breaks_and_numerics(tmp_path):
    """``benchmarks/partial.py --table`` (the source of docs/partial.md's table) on the tiniest research model: the
    figures the table reads are there, and the numerics prove half precision ran (finite, and under fp32's)."""
    out = tmp_path / "partial.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "partial.py"), "--table", "--models", "gnn_pool", "--rounds", "1",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (entry,) = _strict_json(out.read_text())["models"]
    assert entry["model"] == "gnn_pool" and entry["break_count"] == 1 and entry["captured_flop_fraction"] == 1.0
    assert set(entry["vs_autocast"]) == {"fp32", "autocast", "partial", "partial_cpu", "partial_fixed_gate"}
    assert entry["vs_autocast"]["autocast"] == 1.0 and all(v > 0 for v in entry["ms"].values())
    for precision, n in entry["numerics"].items():
        for kind in ("output", "grad"):
            ours, auto = n[f"{kind}_db"], n[f"autocast_{kind}_db"]
            assert 20.0 < ours < 120.0 and ours >= auto - 1.0, (precision, kind, ours, auto)
    assert "gnn_pool" in proc.stdout and "bf16: output" in proc.stdout
