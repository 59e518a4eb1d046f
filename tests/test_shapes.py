"""Dynamic shapes under torch.export (issue 14 item 1): RNNs keep a dynamic sequence length, the
emitted model.py checks the input sizes its graph serves, and a dynamic export whose size
expressions blow up (Swin) falls back to dynamic batch dims in seconds."""
from __future__ import annotations

import copy
import importlib.util
import time

import pytest
import torch
from helpers import assert_half_ran, first_tensor, sqnr
from torch import nn
from torch.export import Dim

import converter
from converter.export.emit import emit
from converter.inplace import RecaptureWarning
from converter.passes import size_budget
from converter.passes.capture import capture
from converter.passes.capture.served import ShapeNotServedError

# ---------------------------------------------------------------------------------------------
# RNNs: the sequence length stays dynamic


class _Recurrent(nn.Module):
    """A linear in, one torch RNN module, a linear head; returns the outputs and the final state."""

    def __init__(self, kind: str, *, batch_first: bool, bidirectional: bool = False, layers: int = 1, proj: int = 0):
        super().__init__()
        common = dict(num_layers=layers, batch_first=batch_first, bidirectional=bidirectional,
                      dropout=0.2 if layers > 1 else 0.0)
        if kind == "lstm":
            self.rnn = nn.LSTM(16, 24, proj_size=proj, **common)
        elif kind == "gru":
            self.rnn = nn.GRU(16, 24, **common)
        else:
            self.rnn = nn.RNN(16, 24, nonlinearity=kind.split("_")[1], **common)
        self.inp = nn.Linear(16, 16)
        width = (2 if bidirectional else 1) * (proj or 24)
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        y, state = self.rnn(self.inp(x))
        h = state[0] if isinstance(state, tuple) else state  # LSTM: (h, c)
        return self.head(y), h


RNN_CASES = {
    "lstm-bidirectional-2layers": ("lstm", dict(batch_first=True, bidirectional=True, layers=2)),
    "lstm-proj-time-first": ("lstm", dict(batch_first=False, proj=8)),
    "gru-2layers": ("gru", dict(batch_first=True, layers=2)),
    "rnn-tanh-bidirectional-time-first": ("rnn_tanh", dict(batch_first=False, bidirectional=True)),
    "rnn-relu": ("rnn_relu", dict(batch_first=True)),
}


def _rnn_input(batch: int, length: int, batch_first: bool) -> torch.Tensor:
    return torch.randn(batch, length, 16) if batch_first else torch.randn(length, batch, 16)


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("case", list(RNN_CASES))
def test_rnn_sequence_length_stays_dynamic(case):
    kind, kwargs = RNN_CASES[case]
    torch.manual_seed(0)
    model = _Recurrent(kind, **kwargs).eval()
    first = kwargs["batch_first"]
    conv = converter.convert(model, (_rnn_input(2, 12, first),), tracer="export", precision="bf16")
    assert_half_ran(conv, label=case)
    assert conv.tracer == "export"
    assert conv.report.records.capture.dynamic_dims == {"x": [0, 1]}, conv.report.records.capture.shapes
    ops = _ops(conv.module)
    assert ops.count(f"aten.{kind}.input") == 1, ops
    assert not [op for op in ops if op.startswith("mpconvert.")], "a capture stand-in op is left in the graph"
    for batch, length in [(3, 7), (1, 1), (4, 30)]:
        x = _rnn_input(batch, length, first)
        with torch.no_grad():
            want, want_h = model(x)
            got, got_h = conv.module(x)
        assert got.shape == want.shape and got_h.shape == want_h.shape, (got.shape, want.shape, got_h.shape, want_h.shape)
        db = sqnr(want, got.float())
        assert db > 30, f"{case} at batch {batch}, length {length}: SQNR {db:.1f} dB"
    conv.module.train()
    with torch.no_grad():
        out, _ = conv.module(_rnn_input(3, 9, first))  # train mode (inter-layer dropout) at a new length
    assert out.shape[:2] == ((3, 9) if first else (9, 3)) and torch.isfinite(out).all()


class _GivenState(nn.Module):
    """A 2-layer GRU given its initial state: h0 (layers, batch, hidden) shares the batch with x."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(16, 24, num_layers=2, batch_first=True)

    def forward(self, x, h0):
        y, h = self.gru(x, h0)
        return y.sum(-1), h


def test_rnn_given_initial_state_is_dynamic():
    """A shape test on an fp32 graph: no rule matches aten.gru with a given h0, so it stays fp32 (reported as
    unmatched) and the converted graph must equal the original exactly at other sizes (an SQNR floor would pass
    anything close)."""
    torch.manual_seed(0)
    model = _GivenState().eval()
    conv = converter.convert(model, (torch.randn(2, 12, 16), torch.randn(2, 2, 24)), tracer="export")
    assert conv.report.records.capture.dynamic_dims == {"x": [0, 1], "h0": [1]}, conv.report.records.capture.shapes
    assert conv.report.summary["unmatched_ops"] == ["gru"] and conv.report.summary["half_flop_fraction"] == 0, (
        conv.report.summary)
    x, h0 = torch.randn(5, 3, 16), torch.randn(2, 5, 24)
    with torch.no_grad():
        want, got = model(x, h0)[0], conv.module(x, h0)[0]
    assert torch.equal(want, got), f"fp32 graph at a new size: SQNR {sqnr(want, got.float()):.1f} dB, not exact"


# ---------------------------------------------------------------------------------------------
# the emitted model.py checks the sizes its graph serves


def _load_model_py(out) -> nn.Module:
    spec = importlib.util.spec_from_file_location(f"emitted_{out.name}", out / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load()


def _forward_checks(out) -> int:
    source = (out / "model.py").read_text()
    forward = source[source.index("    def forward("):]
    forward = forward[:forward.index("\ndef ")]
    return forward.count("raise ValueError(")


def test_model_py_refuses_a_size_the_graph_fixed(tmp_path):
    torch.manual_seed(0)
    model = _Recurrent("lstm", batch_first=True, bidirectional=True).eval()
    x = torch.randn(2, 12, 16)
    conv = converter.convert(model, (x,), tracer="export", dynamic=False)
    out = emit(conv, tmp_path / "static_mp")
    assert _forward_checks(out) == 4, "expected a rank check and one check per fixed dim (3)"
    emitted = _load_model_py(out)
    with torch.no_grad():
        got, want = emitted(x), conv.module(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match=r"^x: dim 1 has size 7, but the converted graph fixed it at 12: "):
        emitted(torch.randn(2, 7, 16))
    with pytest.raises(ValueError, match=r"^x: dim 0 has size 3, but the converted graph fixed it at 2: "):
        emitted(torch.randn(3, 12, 16))
    with pytest.raises(ValueError, match=r"^x: expected a 3-d tensor, got 2-d$"):
        emitted(torch.randn(12, 16))


def test_model_py_serves_the_dynamic_sizes(tmp_path):
    torch.manual_seed(0)
    model = _Recurrent("lstm", batch_first=True, bidirectional=True, layers=2).eval()
    conv = converter.convert(model, (torch.randn(2, 12, 16),), tracer="export")
    out = emit(conv, tmp_path / "dynamic_mp")
    assert _forward_checks(out) == 2, "expected a rank check and one for the feature dim the Linear fixes"
    emitted = _load_model_py(out)
    for shape in [(3, 7, 16), (1, 1, 16), (4, 40, 16)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            got, want = emitted(x), conv.module(x)
        assert torch.equal(got[0], want[0]), f"model.py differs from conv.module at {shape}"
    with pytest.raises(ValueError, match=r"^x: dim 2 has size 8, but the converted graph fixed it at 16: "):
        emitted(torch.randn(2, 12, 8))


class _TwoInputs(nn.Module):
    """x (B, T, 16) and y (B, 2T, 16): y is split into two halves that meet x."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, y):
        t = x.shape[1]
        return self.fc(x) * y[:, :t] + y[:, t:]


def test_model_py_checks_ranges_and_relations(tmp_path):
    torch.manual_seed(0)
    t = Dim("t", min=4, max=64)
    model = _TwoInputs().eval()
    conv = converter.convert(model, (torch.randn(2, 6, 16), torch.randn(2, 12, 16)), tracer="export",
                             dynamic_shapes={"x": {0: Dim("b"), 1: t}, "y": {0: Dim("b"), 1: 2 * t}})
    emitted = _load_model_py(emit(conv, tmp_path / "ranges_mp"))
    x, y = torch.randn(3, 9, 16), torch.randn(3, 18, 16)
    with torch.no_grad():
        assert torch.equal(emitted(x, y), conv.module(x, y))
    with pytest.raises(ValueError, match=r"^x: dim 1 has size 3, but the converted graph serves sizes >= 4 there"):
        emitted(torch.randn(3, 3, 16), torch.randn(3, 6, 16))
    with pytest.raises(ValueError, match=r"^x: dim 1 has size 65, but the converted graph serves sizes <= 64 there"):
        emitted(torch.randn(3, 65, 16), torch.randn(3, 130, 16))
    with pytest.raises(ValueError, match=r"^y: dim 1 has size 16, but the converted graph needs 18 there \(set by x: dim 1\)"):
        emitted(x, torch.randn(3, 16, 16))
    with pytest.raises(ValueError, match=r"^y: dim 0 has size 2, but the converted graph needs 3 there \(set by x: dim 0\)"):
        emitted(x, torch.randn(2, 18, 16))


class _Windows(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        b, t, c = x.shape
        return self.fc(x.view(b, t // 4, 4, c).mean(2))


def test_model_py_checks_a_multiple_of(tmp_path):
    model = _Windows().eval()
    conv = converter.convert(model, (torch.randn(2, 12, 16),), tracer="export",
                             dynamic_shapes={"x": {1: 4 * Dim("k", max=16)}})
    emitted = _load_model_py(emit(conv, tmp_path / "multiple_mp"))
    x = torch.randn(2, 20, 16)
    with torch.no_grad():
        assert torch.equal(emitted(x), conv.module(x))
    with pytest.raises(ValueError, match=r"^x: dim 1 has size 10, but the converted graph serves only a multiple of 4 there"):
        emitted(torch.randn(2, 10, 16))
    with pytest.raises(ValueError, match=r"^x: dim 1 has size 68, but the converted graph serves sizes <= 64 there"):
        emitted(torch.randn(2, 68, 16))


# ---------------------------------------------------------------------------------------------
# size expressions that blow up: dynamic batch dims only


def test_blown_up_sizes_fall_back_to_dynamic_batch_dims(monkeypatch, tmp_path):
    """With the budget at 0 operations, ``t // 4`` is already too complex: capture must export with
    only the batch dim dynamic, say so, and model.py must refuse another length."""
    monkeypatch.setattr(size_budget, "MAX_SIZE_OPS", 0)
    model = _Windows().eval()
    conv = converter.convert(model, (torch.randn(2, 12, 16),), tracer="export")
    assert_half_ran(conv)
    note = conv.report.records.capture.shapes
    assert conv.report.records.capture.dynamic_dims == {"x": [0]}, note
    assert note.startswith("Dim.AUTO on dim 0 of every input only") and "`view`" in note, note
    x = torch.randn(5, 12, 16)
    with torch.no_grad():
        assert sqnr(model(x), conv.module(x).float()) > 30
    emitted = _load_model_py(emit(conv, tmp_path / "budget_mp"))
    with pytest.raises(ValueError, match=r"^x: dim 1 has size 8, but the converted graph fixed it at 12"):
        emitted(torch.randn(2, 8, 16))


def test_swin_captures_dynamic_batch_in_seconds():
    pytest.importorskip("transformers")
    from zoo_models import build, build_inputs

    model, (args, kwargs) = build("swin")
    start = time.perf_counter()
    captured = capture(model, (args, kwargs), tracer="export")
    seconds = time.perf_counter() - start
    assert seconds < 40, f"Swin capture took {seconds:.1f} s"
    assert captured.dynamic_dims == {"pixel_values": [0]}, captured.shapes_note
    assert "dim 0 of every input only" in captured.shapes_note, captured.shapes_note
    graph = captured.gm if captured.eval_gm is None else captured.eval_gm  # stochastic depth: two graphs
    graph.eval()
    for batch in (1, 3):
        args, kwargs = build_inputs("swin", batch=batch)
        with torch.no_grad():
            want = model(*args, **kwargs).logits
            got = graph(*args, **kwargs)["logits"]
        assert got.shape == want.shape and sqnr(want, got) > 60, f"batch {batch}: {sqnr(want, got):.1f} dB"


def test_size_budget_names_the_op():
    x = torch.randn(2, 12, 16)
    with pytest.raises(Exception) as info:
        with size_budget.SizeBudget(max_ops=0):
            torch.export.export(_Windows(), (x,), dynamic_shapes={"x": {1: Dim.AUTO}}, strict=False)
    assert isinstance(info.value, size_budget.SizesTooComplex), repr(info.value)
    assert info.value.op == "view" and info.value.ops >= 1, str(info.value)


def test_packed_sequences_are_left_to_torch():
    """RecurrentOps routes only the padded-batch overloads; a packed LSTM call (lstm.data, also 9
    arguments, hx a tuple) must reach torch unchanged."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    from converter.passes.recurrent import RecurrentOps

    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8, batch_first=True)
    x = torch.randn(2, 5, 8)
    packed = pack_padded_sequence(x, torch.tensor([5, 3]), batch_first=True)
    want = pad_packed_sequence(lstm(packed)[0], batch_first=True)[0]
    with RecurrentOps():
        got = pad_packed_sequence(lstm(packed)[0], batch_first=True)[0]
        padded = lstm(x)[0]
    assert torch.equal(got, want)
    # the padded call goes through the stand-in op, which runs aten.lstm below autograd (another kernel)
    diff = (padded - lstm(x)[0]).abs().max().item()
    assert diff < 1e-5, diff


# ---------------------------------------------------------------------------------------------
# honest dynamic dims: a dim that a guard in the model's code pins is not reported dynamic


class _PatchPositions(torch.nn.Module):
    """The number of 4x4 patches picks a code path (a position table for the example's patch
    count), as ViT-style position embeddings do: torch.export keeps H and W symbolic but guards
    their patch count to the example's."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 8, 4, stride=4)
        self.pos = torch.nn.Parameter(torch.zeros(16, 8))

    def forward(self, x):
        h = self.proj(x).flatten(2).transpose(1, 2)
        if (x.shape[-2] // 4) * (x.shape[-1] // 4) == self.pos.shape[0]:
            h = h + self.pos
        return h


def test_a_pinned_dim_is_not_reported_dynamic_and_the_guard_line_is_named():
    import inspect

    model = _PatchPositions()
    conv = converter.convert(model, (torch.randn(2, 3, 16, 16),), tracer="export")
    capture = conv.report.records.capture
    assert capture.dynamic_dims == {"x": [0]}, (capture.dynamic_dims, capture.narrowed_dims)
    line = inspect.getsourcelines(_PatchPositions.forward)[1] + 2
    narrowed = capture.narrowed_dims["x"]
    assert sorted(narrowed) == [2, 3] and all(f"test_shapes.py:{line} in forward" in w for w in narrowed.values()), narrowed
    with torch.no_grad():
        conv.module(torch.randn(3, 3, 16, 16))  # the batch is served
        other = torch.randn(2, 3, 24, 24)
        with pytest.raises(ShapeNotServedError, match=r"x of shape \(2, 3, 24, 24\)"):  # the graph does not serve it
            copy.deepcopy(conv.module)(other)
        with pytest.warns(RecaptureWarning, match="x of shape"):  # conv.module converts it again
            got = conv.module(other)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(other)
        db, auto_db = sqnr(model(other), got), sqnr(model(other), auto)
        assert auto_db - 1.0 <= db < 100.0, f"at 24x24: {db:.1f} dB, autocast {auto_db:.1f} dB (fp32 gives > 100)"
    md = conv.report.to_markdown()
    assert "x dim 2, 3: guard" in md and f"test_shapes.py:{line}" in md, md[:1000]


@pytest.mark.parametrize("family", ["dinov2", "mobilevit"])
def test_vision_models_report_only_the_image_dims_they_serve(family):
    transformers = pytest.importorskip("transformers")
    cfg, cls, where = {
        "dinov2": (lambda: transformers.Dinov2Config(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                                     num_attention_heads=4, intermediate_size=64),
                   "Dinov2Model", "in interpolate_pos_encoding"),
        "mobilevit": (lambda: transformers.MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 24, 32],
                                                           neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_labels=4),
                      "MobileViTForImageClassification", "in unfolding"),
    }[family]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(cfg()).eval()
    conv = converter.convert(model, ((), {"pixel_values": torch.randn(2, 3, 32, 32)}))
    assert_half_ran(conv, min_share=0.3, label=family)
    capture = conv.report.records.capture
    assert capture.dynamic_dims == {"pixel_values": [0]}, (capture.dynamic_dims, capture.narrowed_dims)
    narrowed = capture.narrowed_dims["pixel_values"]
    assert sorted(narrowed) == [2, 3] and all(f"modeling_{family}.py:" in w and where in w for w in narrowed.values()), narrowed
    with torch.no_grad():
        conv.module(pixel_values=torch.randn(3, 3, 32, 32))  # the batch is served
        other = torch.randn(2, 3, 48, 48)
        with pytest.raises(ShapeNotServedError, match=r"pixel_values of shape \(2, 3, 48, 48\)"):  # the graph does not
            copy.deepcopy(conv.module)(pixel_values=other)
        with pytest.warns(RecaptureWarning, match="pixel_values of shape"):  # conv.module converts it again
            got = first_tensor(conv.module(pixel_values=other))
        want = first_tensor(model(pixel_values=other))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = first_tensor(model(pixel_values=other))
        db, auto_db = sqnr(want, got), sqnr(want, auto)
        assert db >= auto_db - 1.0, f"{family} at 48x48: {db:.1f} dB, autocast {auto_db:.1f} dB"
