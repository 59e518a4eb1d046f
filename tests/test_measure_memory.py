"""Measuring streams (issue 32): ``measure()`` gives the numbers that holding every saved tensor gave,
holds no second copy of the weights, leaves the global autocast state as it found it, and says how
it measured.

The reference below is the old way, made exact: every tensor autograd saves is kept, every weight
cast's output too (so no storage address is reused and misread), under ``torch.autocast`` with its
weight-cast cache. ``measure()`` counts each saved tensor and keeps none, runs autocast without the
cache and counts as the cache would (converter/numerics/measure.py, module docstring).
"""
from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from helpers import load_sample
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import converter
from converter.ir.meta import DTYPES
from converter.numerics import measure as measure_mod
from converter.numerics.measure import count_casts, measure, saved_activations

_HALF = (torch.float16, torch.bfloat16)


class _KeepingCounter(TorchDispatchMode):
    """The reference cast counter: keeps every cast's output, so addresses are never reused."""

    def __init__(self, weight_ptrs: set[int]):
        super().__init__()
        self.weight_ptrs, self.kept, self.copies = weight_ptrs, [], set()
        self.summary = {"casts": 0, "cast_bytes": 0, "weight_casts": 0, "weight_cast_bytes": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].dtype != out.dtype \
                and args[0].is_floating_point() and out.is_floating_point():
            self.kept.append(out)
            src = args[0]
            nbytes = src.numel() * (src.element_size() + out.element_size())
            if src.untyped_storage().data_ptr() in self.weight_ptrs:
                self.copies.add(out.untyped_storage().data_ptr())
                self.summary["weight_casts"] += 1
                self.summary["weight_cast_bytes"] += nbytes
            else:
                self.summary["casts"] += 1
                self.summary["cast_bytes"] += nbytes
        return out


def _reference_saved(module: nn.Module, args: tuple, kwargs: dict, autocast: str | None) -> dict:
    """Saved bytes per unique storage with every saved tensor held, autocast with its cache."""
    params = {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}
    seen: dict[int, int] = {}
    kept: list[torch.Tensor] = []

    def pack(tensor):
        kept.append(tensor)
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    counter = _KeepingCounter(params)
    amp = torch.autocast("cpu", dtype=DTYPES[autocast], cache_enabled=True) if autocast else contextlib.nullcontext()
    with torch.random.fork_rng(), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter, amp:
        torch.manual_seed(0)
        module(*args, **kwargs)
    copies = sum(b for p, b in seen.items() if p in counter.copies)
    return {"activation_bytes": sum(seen.values()) - copies, "weight_copy_bytes": copies, "tensors": len(seen),
            "casts": counter.summary}


class _Loop(nn.Module):
    """One Linear applied three times (autocast's cache casts its weight once per forward), a frozen
    one applied twice (not cached: it does not require grad), a tied head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.cell = nn.Linear(64, 64)
        self.frozen = nn.Linear(64, 64).requires_grad_(False)
        self.head = nn.Linear(64, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for _ in range(3):
            x = torch.tanh(self.cell(x))
        x = self.frozen(self.frozen(x))
        return self.head(torch.softmax(x, -1))


def _cases():
    torch.manual_seed(0)
    yield "loop", _Loop().eval(), ((torch.randint(0, 32, (2, 5)),), {})
    sample = load_sample("tiny_transformer")
    yield "tiny_transformer", sample.build_model(), sample.example_inputs()
    sample = load_sample("mlp")
    yield "mlp", sample.build_model(), sample.example_inputs()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("case", ["loop", "tiny_transformer", "mlp"])
def test_saved_activations_and_casts_match_holding_everything(case, precision):
    name, model, example = next(c for c in _cases() if c[0] == case)
    conv = converter.convert(model, example, precision=precision)
    args, kwargs = conv.example_inputs
    runs = [("converted", conv.module, None, True), ("fp32", conv.original, None, False),
            ("autocast", conv.original, precision, True)]
    for label, module, amp, casts in runs:
        got = saved_activations(module, args, kwargs, autocast=amp, count_casts=casts)
        want = _reference_saved(module, args, kwargs, amp)
        if not casts:  # without a cast counter every non-parameter storage is an activation
            want = {**want, "activation_bytes": want["activation_bytes"] + want["weight_copy_bytes"], "weight_copy_bytes": 0}
            want.pop("casts")
        assert got == want, (name, precision, label, got, want)
    if name == "loop":  # the cache case is really exercised: the cell's weight is cast once, the frozen one twice
        assert count_casts(conv.original, args, kwargs, autocast=precision)["weight_casts"] == 1 + 1 + 2 + 2 + 1, \
            count_casts(conv.original, args, kwargs, autocast=precision)


class _Wide(nn.Module):
    """Eight 256×256 layers: 8 half weight copies per forward, 128 KiB each in bf16."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class _HalfCopies(TorchDispatchMode):
    """Tracks every half copy of a parameter (by a weak reference to its storage) and the most bytes of
    them alive at once, checked after every op."""

    def __init__(self, params: list[torch.Tensor]):
        super().__init__()
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.copies: list[weakref.ref] = []
        self.peak = 0

    def live_bytes(self) -> int:
        return sum(s.nbytes() for s in (r() for r in self.copies) if s is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype in _HALF \
                and args[0].untyped_storage().data_ptr() in self.params:
            self.copies.append(weakref.ref(out.untyped_storage()))
        self.peak = max(self.peak, self.live_bytes())
        return out


def test_measure_holds_at_most_two_half_copies_of_a_weight_and_leaks_none():
    """Before, each saved-activation forward kept its half weight copies alive through a reference cycle
    (a saved output -> its grad_fn -> the packed tensor) and autocast's cache held all of them: at 1.1B
    parameters the default `mpconvert` peaked at 2.2x its build. Now at most two copies of one weight
    are alive at once (node_errors' local pass rounds a weight its converted twin already holds)."""
    torch.manual_seed(0)
    model = _Wide().eval()
    conv = converter.convert(model, (torch.randn(4, 256),))
    one_copy = 256 * 256 * 2
    tracker = _HalfCopies(list(model.parameters()))
    with tracker:
        result = measure(conv)
    gc.collect()
    made = len(tracker.copies)
    assert made >= 8 * 4, f"the tracker saw {made} half weight copies; expected at least 8 per forward in 4 forwards"
    assert tracker.peak <= 2 * one_copy + 8 * 256 * 2, \
        f"{tracker.peak} bytes of half weight copies alive at once (one weight's copy is {one_copy})"
    assert tracker.live_bytes() == 0, f"{tracker.live_bytes()} bytes of half weight copies outlive measure()"
    # the numbers are still counted: layers 2-8 save their weight copy for the input's gradient (layer 1's
    # input needs none), biases are not saved
    assert result["memory"]["saved_weight_copy_bytes"] == {"converted": 7 * one_copy, "fp32": 0, "autocast": 7 * one_copy}, \
        result["memory"]


def test_measure_leaves_the_global_autocast_state():
    """node_errors ran the graph's _enter_autocast/_exit_autocast twice (mixed and reference passes) and
    left them in the wrong order: measuring the zoo's mel_frontend switched autocast's cache off for the
    rest of the process (then autocast measured on a later model cast shared weights once per use)."""
    from zoo_models import build

    model, example = build("mel_frontend")
    conv = converter.convert(model, example)
    assert any(n.target is torch.amp.autocast_mode._enter_autocast for n in conv.module.graph.nodes)
    before = (torch.is_autocast_cache_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    measure(conv)
    after = (torch.is_autocast_cache_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    assert after == before, (before, after)


def test_report_says_how_it_measured(tmp_path):
    sample = load_sample("mlp")
    conv = converter.convert(sample.build_model(), sample.example_inputs())
    conv.report.add_measurements(measure(conv))
    method = conv.report.to_dict()["numerics"]["method"]
    assert method["scope"] == "full" and method["memory"] == "streamed", method
    assert method == measure_mod.METHOD
    assert "each saved tensor counted, none kept" in conv.report.to_dict()["memory"]["saved_method"]
    md = conv.report.to_markdown()
    assert "Method: full, streamed — every output and every node on the full example inputs (no slice, no subset)" in md


def test_scale_table_shows_the_default_command_beside_no_measure():
    from benchmarks import scale

    GiB = 1024 ** 3
    results = {"1.1b": {
        "build": {"build_s": 10.0, "params": 1_100_000_000, "W_bytes": 4 * GiB, "peak_rss": 4 * GiB},
        "cli": {"stage_s": 30.0, "stage_cpu_s": 50.0, "exit": 0, "peak_rss": 5 * GiB, "measure_s": 9.5},
        "cli_nomeasure": {"stage_s": 20.0, "stage_cpu_s": 35.0, "exit": 0, "peak_rss": 4.8 * GiB},
    }}
    rows = {line.split(" | ")[3]: line for line in scale._table(results).splitlines()[2:]}
    assert set(rows) == {"build", "cli", "cli_nomeasure"}, rows
    assert "| 30.0 | 50.0 | — | 5.00 | 1.25× | 1.25× | measure 9.5 s |" in rows["cli"], rows["cli"]
    assert "| 20.0 | 35.0 |" in rows["cli_nomeasure"] and "| 1.20× |" in rows["cli_nomeasure"], rows["cli_nomeasure"]
