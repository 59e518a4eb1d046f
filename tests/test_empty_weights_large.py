"""``empty_weights()`` builds models whose single weights exceed the machine's memory (issue 31 item 6).

On the old code every parameter was allocated for real and moved to meta only when registered: a
Llama config with a 2M x 65536 embedding (500 GB in one tensor) failed in the allocator
("can't allocate memory", exit 3 from the CLI). Large factory calls are now made on meta directly;
a *buffer* that large cannot stay real and is refused in one line.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import converter
from converter.ir.empty import LARGE_BYTES, EmptyWeightsError


def test_a_llama_with_a_500_gb_embedding_builds_on_meta_with_real_buffers():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=2_000_000, hidden_size=65536, intermediate_size=131072, num_hidden_layers=1,
                                   num_attention_heads=64, num_key_value_heads=8)
    with converter.empty_weights():
        model = transformers.LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    assert params > 2.5e11, params
    assert all(p.is_meta for p in model.parameters())
    buffers = dict(model.named_buffers())
    assert buffers and all(not b.is_meta for b in buffers.values()), {k: b.device for k, b in buffers.items()}


def test_factories_below_the_threshold_stay_real_and_explicit_devices_are_kept():
    with converter.empty_weights():
        small = torch.zeros(16)
        explicit = torch.empty(LARGE_BYTES // 4 + 1, device="meta")
        large = torch.empty(LARGE_BYTES // 4 + 1)
        full = torch.full((LARGE_BYTES // 2,), 1.0)
    assert not small.is_meta and explicit.is_meta and large.is_meta and full.is_meta


class _BigBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("table", torch.zeros(2**32))  # 16 GiB


def test_a_buffer_too_large_to_keep_real_is_refused_in_one_line():
    with pytest.raises(EmptyWeightsError) as info, converter.empty_weights():
        _BigBuffer()
    text = str(info.value)
    assert "\n" not in text and text.startswith("_BigBuffer.table: a buffer of 16.0 GiB"), text
    assert "keeps buffers real" in text
    # the patch is gone afterwards: a normal module registers normally
    assert not nn.Linear(2, 2).weight.is_meta
