"""Tied parameters (``head.weight is emb.weight``) keep every name: the converted module's state_dict
has the original's keys and strict-loads into the original class, under both tracers, and model.py too."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import converter


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.emb(ids))))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_tied_weights_keep_every_name_and_load_strictly(tracer, tmp_path):
    torch.manual_seed(0)
    model = TiedLM().eval()
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    conv = converter.convert(model, (ids,), tracer=tracer)
    state = conv.module.state_dict()
    assert sorted(state) == sorted(model.state_dict()) == ["emb.weight", "head.weight", "mid.bias", "mid.weight"], sorted(state)
    assert conv.module.get_parameter("emb.weight") is conv.module.get_parameter("head.weight")
    assert len(list(conv.module.parameters())) == 3  # still one tensor, trained once
    fresh = TiedLM()
    fresh.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(ids), model(ids))
    conv.save(tmp_path / "out")
    spec = importlib.util.spec_from_file_location(f"tied_{tracer}", tmp_path / "out" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    emitted = module.load()
    assert sorted(emitted.state_dict()) == sorted(state)
    assert emitted.get_parameter("emb.weight") is emitted.get_parameter("head.weight")
    with torch.no_grad():
        assert torch.equal(emitted(ids), conv.module(ids))
