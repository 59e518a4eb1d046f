"""Every call the original serves is served: ``conv.module`` of a whole capture, ``apply``, and model.py at sizes
the captured graph's shape guards refuse.

The model reshapes its sequence into chunks of 4 when the length allows (``if T % 4 == 0``), as a pooling or
chunked-attention layer of research code does: torch.export captures the branch it took and guards
``input_ids.size()[1] % 4 == 0``. Before, ``conv.module`` at length 10 raised torch's bare
``AssertionError: Guard failed``; so did ``apply`` (its own size checks pass a dynamic dim) and model.py
failed deep inside ``view``.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import DtypeRecorder, sqnr
from torch import nn

import converter
from converter.inplace import FallbackWarning, RecaptureWarning
from converter.passes.capture.served import ShapeNotServedError
from converter.serving import module_server

#: an fp32 graph gives +inf or > 140 dB against fp32; bf16 gives about 40-55 dB here
HALF_CEILING_DB = 100.0


class ChunkPool(nn.Module):
    """Embedding, a chunk-mean pooling taken only when the length is a multiple of 4, an MLP and the output layer."""

    def __init__(self, vocab: int = 50, dim: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lin = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        b, t, d = h.shape
        if t % 4 == 0:
            h = h.view(b, t // 4, 4, d).mean(2).repeat_interleave(4, 1)
        return self.out(torch.relu(self.lin(h)))


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def converted():
    torch.manual_seed(0)
    model = ChunkPool()
    return model, converter.convert(model, (_ids(2, 16, 0),), precision="bf16")


def _autocast(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x).float()


def test_conv_module_converts_again_for_sizes_its_guards_refuse(converted):
    model, conv = converted
    server = module_server(conv.module)
    assert server is not None and server.recaptures == []
    x = _ids(3, 10, 1)  # 10 % 4 != 0: the captured branch's guard refuses it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorder = DtypeRecorder()
        with recorder:
            out = conv.module(x)
    recaptured = [w for w in caught if issubclass(w.category, RecaptureWarning)]
    assert len(recaptured) == 1 and "input_ids of shape (3, 10)" in str(recaptured[0].message), [str(w.message) for w in caught]
    assert not any(issubclass(w.category, FallbackWarning) for w in caught)
    assert len(server.recaptures) == 1 and server.calls["recaptured"] == 1
    assert any(w["kind"] == "recaptured" for w in conv.report.summary["warnings"])
    # half precision ran: both linears in bf16
    assert sum(1 for d in recorder.dtypes_of("linear", "addmm", "mm") if torch.bfloat16 in d) >= 2, recorder.calls
    with torch.no_grad():
        want = model(x)
        db, auto_db = sqnr(want, out.float()), sqnr(want, _autocast(model, x))
    assert auto_db - 1.0 <= db < HALF_CEILING_DB, f"length 10: {db:.1f} dB, autocast {auto_db:.1f} dB"
    # the same sizes again reuse that graph; the captured sizes still run the first graph
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        conv.module(_ids(3, 10, 2))
        conv.module(_ids(2, 12, 3))
    assert len(server.recaptures) == 1


def test_the_graph_converted_again_trains_the_module_own_parameters(converted):
    _, conv = converted
    module = conv.module
    module.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module(_ids(4, 6, 4)).float().pow(2).mean().backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values()), \
        [name for name, g in grads.items() if g is None or g.abs().sum() == 0]


def test_past_the_bound_the_original_code_runs_under_autocast_on_the_module_tensors():
    torch.manual_seed(1)
    model = ChunkPool()
    conv = converter.convert(model, (_ids(2, 16, 0),), precision="bf16")
    module_server(conv.module).max_recaptures = 0
    with torch.no_grad():  # the module's weights differ from the original's: the fallback must use the module's
        conv.module.lin.weight.mul_(0.5)
    x = _ids(2, 7, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = conv.module(x)
    assert [w.category for w in caught] == [FallbackWarning], [str(w.message) for w in caught]
    assert module_server(conv.module).calls["fallback"] == 1
    assert out.dtype == torch.bfloat16  # autocast ran the linears in bf16
    twin = ChunkPool()
    twin.load_state_dict(conv.module.state_dict())
    with torch.no_grad():
        want = twin(x)
        db, auto_db = sqnr(want, out.float()), sqnr(want, _autocast(twin, x))
    assert auto_db - 0.1 <= db < HALF_CEILING_DB, f"fallback: {db:.1f} dB, autocast on the module's weights {auto_db:.1f} dB"


def test_a_copy_refuses_in_one_line_never_a_bare_guard_failure(converted):
    _, conv = converted
    twin = copy.deepcopy(conv.module)
    with pytest.raises(ShapeNotServedError) as caught:
        twin(_ids(2, 9, 6))
    text = str(caught.value)
    assert isinstance(caught.value, AssertionError) and "\n" not in text and not text.startswith("Guard failed"), text
    assert "input_ids of shape (2, 9)" in text and "input_ids (2, 16)" in text and "% 4" in text, text
    assert caught.value.shapes == {"input_ids": (2, 9)}


def test_apply_converts_again_where_the_guard_refuses():
    torch.manual_seed(2)
    model = ChunkPool()
    reference = copy.deepcopy(model)
    converter.apply(model, (_ids(2, 16, 0),), precision="bf16")
    x = _ids(2, 10, 7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(x)
    assert [w.category for w in caught] == [RecaptureWarning], [str(w.message) for w in caught]
    forward = converter.inplace.converted_forward(model)
    assert forward.calls == {"converted": 1, "fallback": 0, "recaptured": 1}, forward.calls
    with torch.no_grad():
        want = reference(x)
        db, auto_db = sqnr(want, out.float()), sqnr(want, _autocast(reference, x))
    assert auto_db - 1.0 <= db < HALF_CEILING_DB, f"apply at length 10: {db:.1f} dB, autocast {auto_db:.1f} dB"


def test_model_py_serves_the_guarded_sizes_and_refuses_others_in_one_line(converted, tmp_path):
    from converter.export.verify import import_file

    model, conv = converted
    out = conv.save(tmp_path / "out")
    emitted = import_file(out / "model.py").load()
    with torch.no_grad():
        for length in (16, 12, 24):
            x = _ids(2, length, length)
            db = sqnr(model(x), emitted(x).float())
            assert 30.0 < db < HALF_CEILING_DB, f"model.py at length {length}: {db:.1f} dB"
        with pytest.raises(ValueError) as caught:
            emitted(_ids(2, 10, 8))
    text = str(caught.value)
    assert "\n" not in text and "input_ids: dim 1: size 10" in text and "% 4) == 0" in text and "test_served_sizes.py:" in text, text
