"""In-place and out-of-place accumulation ops (index_add_, scatter_add_, index_put_, scatter_reduce…)
follow the promote semantics of their rules, and their operands are cast to the accumulator's dtype.

The classic top-k MoE (``out = zeros_like(x); out.index_add_(0, idx, y.to(x.dtype))``) and a
message-passing GNN (``x.new_zeros(...).scatter_add_(0, dst, msg)``) crashed in the forward check
(``index_add_(): self (BFloat16) and source (Float) must have the same scalar type``), or summed in
bf16 where autocast sums in fp32.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from helpers import assert_half_ran
from torch import nn

import converter
from converter.ir.meta import META_CAST, META_DECISION, META_INFO

TRACERS = ["fx", "export"]


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().double(), out.detach().double()
    noise = (ref - out).norm()
    return math.inf if noise == 0 else float(20 * torch.log10(ref.norm() / noise))


class TopKMoE(nn.Module):
    """A top-2 mixture of experts written the way HF's Mixtral/Qwen-MoE blocks are: a routing softmax
    in fp32, each expert's weighted output cast back to the hidden dtype and index_add_-ed into a
    zeros_like buffer."""

    def __init__(self, dim: int = 32, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim)) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x):
        h = self.norm(x)
        weights, chosen = self.router(h).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(h)
        tokens = torch.arange(h.shape[0])
        for e, expert in enumerate(self.experts):
            gate = (weights * (chosen == e)).sum(-1, keepdim=True)  # 0 for tokens not routed here
            y = expert(h) * gate
            out.index_add_(0, tokens, y.to(h.dtype))
        return x + out


class MessagePassing(nn.Module):
    """One GNN layer, PyG style: messages from a linear, summed per destination with scatter_add_
    into a buffer made from the fp32 node features (no cast in the model code)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, src, dst):
        msg = self.lin(x)[src]
        out = x.new_zeros(x.shape)
        out.scatter_add_(0, dst.unsqueeze(-1).expand(-1, x.shape[1]), msg)
        return out


class FixedBuffer(nn.Module):
    """The accumulator's dtype is fixed by the model (``dtype=torch.float32``): the operand is cast to it."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, idx):
        out = x.new_zeros(x.shape, dtype=torch.float32)
        out.index_put_((idx,), self.lin(x), accumulate=True)
        return out


class OutOfPlace(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, idx):
        y = self.lin(x)
        a = torch.index_add(x, 0, idx, y)
        b = x.scatter_reduce(0, idx.unsqueeze(-1).expand(-1, x.shape[1]), y, reduce="sum")
        return a + b


def _moe():
    torch.manual_seed(0)
    return TopKMoE().eval(), (torch.randn(12, 32),)


def _gnn():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 16)
    return MessagePassing().eval(), (x, torch.randint(0, 10, (40,), generator=g), torch.randint(0, 10, (40,), generator=g))


def _accumulators(gm: torch.fx.GraphModule, op: str) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.meta.get(META_INFO) is not None and n.meta[META_INFO].op == op and n.meta[META_INFO].inplace]


def _casts_into(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in node.all_input_nodes if META_CAST in a.meta and a.meta[META_CAST].inserted]


@pytest.mark.parametrize("tracer", TRACERS)
def test_moe_index_add_accumulates_in_fp32_like_autocast(tracer, tmp_path):
    model, example = _moe()
    conv = converter.convert(model, example, tracer=tracer)
    adds = _accumulators(conv.module, "index_add")
    assert len(adds) == 4, [n.name for n in adds]
    buffer = adds[0].args[0]
    decision = buffer.meta[META_DECISION]
    # the buffer's producer is decided by the index_add rule (promote: its fp32-model dtype), with provenance
    assert decision.precision == "fp32" and decision.rule.pattern == "index_add", (decision.precision, decision.rule)
    assert f"accumulator of in-place index_add_ {adds[0].name!r}" in decision.reason, decision.reason
    for node in adds:
        d = node.meta[META_DECISION]
        assert d.precision == "fp32" and d.rule.pattern == "index_add" and f"accumulates into {buffer.name!r}" in d.reason, (node.name, d)
    # the experts' matmuls still run in half
    linears = [n for n in conv.module.graph.nodes if n.meta.get(META_INFO) is not None and n.meta[META_INFO].op == "linear"]
    assert len(linears) == 9 and {n.meta[META_DECISION].precision for n in linears if "experts" in n.meta[META_INFO].module} == {"bf16"}
    x = example[0]
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = model(x)
        out = conv.module(x)
    ours, theirs = _sqnr(ref, out), _sqnr(ref, amp)
    assert ours >= theirs - 0.5 and ours > 35, f"{tracer}: converted {ours:.1f} dB vs autocast {theirs:.1f} dB"
    # other batch sizes, and the emitted model.py bit-equal
    for rows in (1, 7):
        x2 = torch.randn(rows, 32)
        with torch.no_grad():
            db = _sqnr(model(x2), conv.module(x2))
        assert db > 35, f"{tracer} at {rows} rows: {db:.1f} dB"
    conv.save(tmp_path / "out")
    spec = importlib.util.spec_from_file_location(f"moe_{tracer}", tmp_path / "out" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.no_grad():
        assert torch.equal(module.load()(x), conv.module(x))


@pytest.mark.parametrize("tracer", TRACERS)
def test_scatter_add_into_fp32_buffer_casts_the_half_messages(tracer):
    """msg comes from a bf16 linear, the buffer from fp32 features: one inserted cast, msg -> fp32."""
    model, example = _gnn()
    conv = converter.convert(model, example, tracer=tracer)
    (node,) = _accumulators(conv.module, "scatter_add")
    buffer = node.args[0]
    assert buffer.meta[META_DECISION].precision == "fp32", buffer.meta[META_DECISION]
    (cast,) = _casts_into(node)
    record = cast.meta[META_CAST]
    assert (record.src_dtype, record.dtype) == ("bf16", "fp32") and record.rule.pattern == "scatter_add", record
    assert "accumulates in place in fp32" in record.reason, record.reason
    with torch.no_grad():
        db = _sqnr(model(*example), conv.module(*example))
    assert db > 40, f"{tracer}: SQNR {db:.1f} dB vs fp32"


@pytest.mark.parametrize("tracer", TRACERS)
def test_an_accumulation_rule_decides_the_buffer(tracer, tmp_path):
    """``index_add = "half"`` in a user rule file: the buffer goes to bf16, the fp32 source is cast down."""
    rules = tmp_path / "acc.toml"
    rules.write_text('[op]\nindex_add = "half"\n')
    model, example = _moe()
    conv = converter.convert(model, example, tracer=tracer, rules=[str(rules)])
    adds = _accumulators(conv.module, "index_add")
    buffer = adds[0].args[0]
    assert buffer.meta[META_DECISION].precision == "bf16" and buffer.meta[META_DECISION].rule.file == str(rules)
    down = [c for node in adds for c in _casts_into(node)]
    assert len(down) == 4 and {(c.meta[META_CAST].src_dtype, c.meta[META_CAST].dtype) for c in down} == {("fp32", "bf16")}, down
    with torch.no_grad():
        out = conv.module(*example)
    assert out.dtype == torch.float32 and _sqnr(model(*example), out) > 25


@pytest.mark.parametrize("tracer", TRACERS)
def test_a_buffer_of_fixed_dtype_gets_its_operand_cast(tracer):
    torch.manual_seed(0)
    model = FixedBuffer().eval()
    x, idx = torch.randn(8, 16), torch.randint(0, 8, (8,), generator=torch.Generator().manual_seed(2))
    conv = converter.convert(model, (x, idx), tracer=tracer)
    (node,) = _accumulators(conv.module, "index_put")
    assert node.args[0].meta[META_DECISION].requested == "fixed"
    (cast,) = _casts_into(node)
    assert (cast.meta[META_CAST].src_dtype, cast.meta[META_CAST].dtype) == ("bf16", "fp32")
    with torch.no_grad():
        assert _sqnr(model(x, idx), conv.module(x, idx)) > 40


@pytest.mark.parametrize("tracer", TRACERS)
def test_out_of_place_accumulation_promotes(tracer):
    torch.manual_seed(0)
    model = OutOfPlace().eval()
    x, idx = torch.randn(8, 16), torch.randint(0, 8, (8,), generator=torch.Generator().manual_seed(3))
    conv = converter.convert(model, (x, idx), tracer=tracer)
    ops = {n.meta[META_INFO].op: n for n in conv.module.graph.nodes if n.meta.get(META_INFO) is not None
           and n.meta[META_INFO].op in ("index_add", "scatter_reduce")}
    assert set(ops) == {"index_add", "scatter_reduce"}
    assert_half_ran(conv, label="the linear feeding the accumulations")
    for op, node in ops.items():
        assert node.meta[META_DECISION].precision == "fp32" and node.meta[META_DECISION].requested == "promote", (op, node.meta[META_DECISION])
    with torch.no_grad():
        assert _sqnr(model(x, idx), conv.module(x, idx)) > 40
