"""Ranges are served (issue 30 item 2): a dim that the export's guards bound only by a range stays
dynamic within it, and calls of sizes no graph serves are converted again (bounded re-capture).

BERT's position table of ``max_position_embeddings`` rows leaves the sequence length ``2..64``: the
old capture took that range for a pin, so with dynamic padding (HF Trainer batches of other lengths)
every call after the first ran the original fp32 forward.
"""
from __future__ import annotations

import copy
import importlib.util
import inspect
import warnings
from collections import Counter

import pytest
import torch
from helpers import DtypeRecorder, sqnr
from torch import nn

import converter
from converter.export.emit import emit
from converter.inplace import FallbackWarning, InPlaceError, RecaptureWarning, converted_forward

#: the matmul-class aten ops (forward and backward) whose input dtypes the BERT test counts
_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


def _is_matmul(name: str) -> bool:
    return name in _MATMULS or "scaled_dot_product" in name


def _half_share(recorder: DtypeRecorder) -> tuple[int, int]:
    """(matmul-class ops whose floating inputs are all bf16, all matmul-class ops) run under ``recorder``."""
    ops = [dtypes for name, dtypes in recorder.calls if _is_matmul(name)]
    return sum(1 for d in ops if d and all(t == torch.bfloat16 for t in d)), len(ops)


# ---------------------------------------------------------------------------------------------
# stock BERT with dynamic padding: every batch runs the converted forward


def _bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    return transformers.BertForSequenceClassification(cfg)  # library defaults: SDPA attention


def _padded(batch: int, length: int, seed: int) -> dict:
    """A batch as a collator with dynamic padding makes it: rows padded to the longest, mask 0 there."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 64, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, length // 2:] = 0
    mask[-1, length - 2:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (batch,), generator=gen)}


def _step(model: nn.Module, batch: dict, *, autocast: bool = False):
    """Logits, the flat gradient of every parameter, and the (bf16, all) matmul-class op counts."""
    model.zero_grad()
    with DtypeRecorder() as recorder:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(**batch)
        out.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return out.logits.detach().float(), grads, _half_share(recorder)


def test_bert_dynamic_padding_runs_the_converted_forward_for_every_batch():
    model = _bert()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", converter.SlowHalfWarning)
        converter.apply(model, _padded(4, 12, seed=0), precision="bf16")
    capture = converter.conversion_of(model).report.records.capture
    assert capture.dynamic_dims["input_ids"] == [0, 1] and capture.dynamic_dims["attention_mask"] == [0, 1], (
        capture.dynamic_dims, capture.narrowed_dims)
    span = capture.dynamic_ranges["input_ids"][1]
    assert (span["min"], span["max"]) == (2, 64), span
    assert "input_ids.size(1) <= 64" in span["why"] and "modeling_bert.py:" in span["why"], span
    assert not capture.narrowed_dims, capture.narrowed_dims
    md = converter.conversion_of(model).report.to_markdown()
    line = next((ln for ln in md.splitlines() if ln.startswith("Input sizes:")), "")
    assert "input_ids dim 1: sizes 2..64 (guard input_ids.size(1) &lt;= 64 at modeling_bert.py:" in line, md[:1500]

    model.eval()
    reference.eval()  # dropout off: the three runs see the same function
    forward = converted_forward(model)
    for i, (batch_size, length) in enumerate([(3, 11), (4, 10), (2, 30), (5, 7)]):
        batch = _padded(batch_size, length, seed=length)
        fp32_logits, fp32_grads, _ = _step(reference, batch)
        auto_logits, auto_grads, (auto_half, auto_all) = _step(reference, batch, autocast=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            warnings.simplefilter("error", RecaptureWarning)
            logits, grads, (half, total) = _step(model, batch)
        assert forward.calls == {"converted": i + 1, "fallback": 0, "recaptured": 0}, (batch_size, length, forward.calls)
        for what, got, want, auto in (("logits", logits, fp32_logits, auto_logits), ("gradients", grads, fp32_grads, auto_grads)):
            ours, theirs = sqnr(want, got), sqnr(want, auto)
            assert ours >= theirs - 1.0, f"({batch_size}, {length}) {what}: SQNR {ours:.1f} dB vs autocast's {theirs:.1f} dB"
            assert ours < 80, f"({batch_size}, {length}) {what}: SQNR {ours:.1f} dB, as if fp32 had run"
        # autocast: 44 of 46 (the mask's fp32 SDPA backward aside); the fp32 fallback ran none
        assert total == auto_all and half >= auto_half - 2 and half > 0.8 * total, (
            f"({batch_size}, {length}): {half}/{total} matmul-class ops in bf16, autocast {auto_half}/{auto_all}")


# ---------------------------------------------------------------------------------------------
# a position table: the range in the report, model.py's checks, in place below the range


class _Positions(nn.Module):
    """Adds rows of a 16-row position table: export leaves the length 2..16 (a range, not a pin)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 8) * 0.1)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x + self.table[: x.shape[1]])


_SLICE_LINE = inspect.getsourcelines(_Positions.forward)[1] + 1


def _load_model_py(out) -> nn.Module:
    spec = importlib.util.spec_from_file_location(f"emitted_{out.name}", out / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load()


def test_a_range_is_reported_dynamic_and_model_py_serves_it(tmp_path):
    torch.manual_seed(0)
    conv = converter.convert(_Positions().eval(), (torch.randn(2, 6, 8),), tracer="export")
    capture = conv.report.records.capture
    assert capture.dynamic_dims == {"x": [0, 1]}, (capture.dynamic_dims, capture.narrowed_dims)
    assert capture.dynamic_ranges == {"x": {1: {"min": 2, "max": 16, "why": capture.dynamic_ranges["x"][1]["why"]}}}, capture
    why = capture.dynamic_ranges["x"][1]["why"]
    assert why == f"guard x.size(1) <= 16 at test_ranges.py:{_SLICE_LINE} in forward", why
    md = conv.report.to_markdown()
    assert f"x dim 1: sizes 2..16 (guard x.size(1) &lt;= 16 at test_ranges.py:{_SLICE_LINE} in forward)" in md, md[:800]

    emitted = _load_model_py(emit(conv, tmp_path / "positions_mp"))
    with torch.no_grad():
        for length in (2, 9, 16):  # anywhere in the range
            x = torch.randn(3, length, 8)
            assert torch.equal(emitted(x), conv.module(x)), length
        with pytest.raises(ValueError, match=r"^x: dim 1 has size 17, but the converted graph serves sizes <= 16 there "
                                             r"\(its range is 2\.\.16\)"):
            emitted(torch.randn(3, 17, 8))
        with pytest.raises(ValueError, match=r"^x: dim 1 has size 1, but the converted graph serves sizes >= 2 there "
                                             r"\(its range is 2\.\.16\)"):
            emitted(torch.randn(3, 1, 8))


def test_in_place_serves_the_range_and_converts_again_below_it():
    torch.manual_seed(0)
    model = _Positions()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", converter.SlowHalfWarning)
        converter.apply(model, (torch.randn(2, 6, 8),), tracer="export")
    forward = converted_forward(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        warnings.simplefilter("error", RecaptureWarning)
        for length in (2, 11, 16):
            model(torch.randn(3, length, 8))
    assert forward.calls == {"converted": 3, "fallback": 0, "recaptured": 0}
    # length 1: below the range (the graph was traced for lengths >= 2): converted again, not fp32
    x = torch.randn(3, 1, 8)
    with pytest.warns(RecaptureWarning, match=r"x of shape \(3, 1, 8\) \(dim 1 is served for sizes 2\.\.16\); "
                                              r"converting it again"):
        got = model(x)
    assert forward.calls == {"converted": 4, "fallback": 0, "recaptured": 1}
    want = _Positions.forward(model, x)
    err = sqnr(want, got)
    assert 20 < err < 80, f"length 1: SQNR {err:.1f} dB vs fp32 (bf16 expected)"


# ---------------------------------------------------------------------------------------------
# re-capture: a truly static dim, another rank, the cache, the limit


class _Static(nn.Module):
    """``x.shape[1] == 4`` picks a branch: export pins dim 1 to the example's size (static)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if x.shape[1] == 4:
            h = h * 2
        return h.reshape(-1, 8).sum(0)


def _converted_call(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Counter]:
    with DtypeRecorder() as recorder:
        out = model(x)
    return out, Counter(dtypes for name, dtypes in recorder.calls if name in ("addmm", "mm"))


def test_a_static_dim_or_another_rank_is_converted_again_once_and_the_limit_holds():
    torch.manual_seed(0)
    model = _Static()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", converter.SlowHalfWarning)
        converter.apply(model, (torch.randn(2, 4, 8),), max_recaptures=2)
    forward = converted_forward(model)
    assert converter.conversion_of(model).report.records.capture.dynamic_dims == {"x": [0]}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)
        model(torch.randn(3, 4, 8))  # the batch is dynamic
    assert forward.calls == {"converted": 1, "fallback": 0, "recaptured": 0}

    x = torch.randn(2, 6, 8, requires_grad=True)
    with pytest.warns(RecaptureWarning, match=r"x of shape \(2, 6, 8\) \(dims \[1\] are static, captured \(2, 4, 8\)\); "
                                              r"converting it again for these sizes \(capture 1 of at most 2\)"):
        out = model(x)
    assert forward.calls == {"converted": 2, "fallback": 0, "recaptured": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)
        _, matmuls = _converted_call(model, torch.randn(4, 6, 8))  # served by the new graph: no capture
    assert matmuls == Counter({(torch.bfloat16, torch.bfloat16, torch.bfloat16): 1}), matmuls  # the linear ran in bf16
    assert forward.calls == {"converted": 3, "fallback": 0, "recaptured": 1}
    [again] = forward.recaptures
    gm = again.conversion.module
    assert gm.get_parameter("fc.weight") is model.fc.weight and gm is not forward.conversion.module
    want = _Static.forward(model, x)
    assert 20 < sqnr(want, out) < 80, sqnr(want, out)
    out.sum().backward()  # gradients reach the model's own parameters
    assert model.fc.weight.grad is not None and x.grad is not None

    with warnings.catch_warnings():  # these sizes again (any batch): the cached graph, no capture
        warnings.simplefilter("error", RecaptureWarning)
        warnings.simplefilter("error", FallbackWarning)
        model(torch.randn(5, 6, 8))
        model(torch.randn(2, 7, 8))  # the new graph took dim 1 dynamic (its guard is only x.shape[1] != 4)
        model(torch.randn(2, 4, 8))  # the first graph still serves its own
    assert forward.calls == {"converted": 6, "fallback": 0, "recaptured": 1}

    with pytest.warns(RecaptureWarning, match=r"x of rank 2 \(captured: rank 3\); converting it again .*capture 2 of at most 2"):
        model(torch.randn(3, 8))
    assert forward.calls == {"converted": 7, "fallback": 0, "recaptured": 2}

    # the limit: a third signature runs the original forward, saying so
    with pytest.warns(RecaptureWarning, match=r"the re-capture limit of 2 captures is reached"):
        with pytest.warns(FallbackWarning, match=r"x of rank 4 \(captured: rank 3\)"):
            model(torch.randn(2, 3, 5, 8))
    assert forward.calls == {"converted": 7, "fallback": 1, "recaptured": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)  # said once
        model(torch.randn(2, 3, 6, 8))
    assert forward.calls == {"converted": 7, "fallback": 2, "recaptured": 2}
    assert len(forward.recaptures) == 2


def test_max_recaptures_zero_keeps_the_fallback_and_bad_values_are_refused():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", converter.SlowHalfWarning)
        model = converter.apply(_Static(), (torch.randn(2, 4, 8),), max_recaptures=0)
    with pytest.warns(FallbackWarning, match=r"dims \[1\] are static"):
        model(torch.randn(2, 6, 8))
    assert converted_forward(model).calls == {"converted": 0, "fallback": 1, "recaptured": 0}
    with pytest.raises(InPlaceError, match="max_recaptures must be an int >= 0"):
        converter.apply(_Static(), (torch.randn(2, 4, 8),), max_recaptures=-1)


class _Dropped(nn.Module):
    """A static dim (``x.shape[1] == 4`` picks a branch) and dropout: a re-capture must follow train()/eval()."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(self.fc(x))
        if x.shape[1] == 4:
            h = h * 2
        return h


def test_a_recaptured_graph_follows_train_eval_and_the_device():
    torch.manual_seed(0)
    model = _Dropped()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", converter.SlowHalfWarning)
        converter.apply(model, (torch.randn(2, 4, 8),))
    forward = converted_forward(model)
    x = torch.randn(3, 6, 8)
    with pytest.warns(RecaptureWarning, match="converting it again"):
        trained = model(x)  # captured while training: dropout on
    assert forward.calls == {"converted": 1, "fallback": 0, "recaptured": 1}
    assert (trained == 0).float().mean() > 0.2, "dropout did not run in train mode"
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)
        warnings.simplefilter("error", FallbackWarning)
        with torch.no_grad():
            got = model(x)
    want = _Dropped.forward(model, x)
    assert 20 < sqnr(want, got) < 80, f"eval: SQNR {sqnr(want, got):.1f} dB vs fp32 eval"
    model.to("meta")  # the meta device stands for any other device
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)
        warnings.simplefilter("error", FallbackWarning)
        out = model(torch.randn(3, 6, 8, device="meta"))
    assert out.device.type == "meta" and out.shape == (3, 6, 8)
    assert forward.calls == {"converted": 3, "fallback": 0, "recaptured": 1}
