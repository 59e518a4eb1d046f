"""torch.compile of converted modules (issue 18 item 3): no graph breaks, and inductor matches eager.

Two converted models, one per tracer: ``samples/tiny_transformer.py`` (FX-captured: RMSNorm, SDPA
and explicit attention, SiLU MLP) and an ``nn.TransformerEncoder`` (torch.export-captured, train
mode). ``torch._dynamo.explain`` must find zero graph breaks in each converted module (our casts are
plain ``Tensor.to`` calls, the guards are a module torch itself generates), and the
inductor-compiled module must match the eager converted module's output and parameter gradients.

Tolerance: inductor fuses the bf16 elementwise chains and keeps intermediates in fp32 inside a
fused kernel, where eager rounds each op's output to bf16, so the two differ by bf16 rounding
(measured in the printout). Two checks together pin the dtype: compiled vs eager converted
≥ 35 dB (a region dropped to a narrower or wrong dtype, or a lost cast, falls below), and compiled
vs the fp32 original < 80 dB: the compiled module still computes in bf16 (a module whose casts
inductor had dropped would match fp32 to > 100 dB).
"""
import copy

import pytest
import torch
from torch import nn

import converter
from converter.numerics.common import sqnr_db
from tests.helpers import load_sample, split_inputs

MIN_SQNR_DB = 35.0


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train()
    return model, (torch.randn(2, 8, 32),)


def _tiny():
    torch.manual_seed(0)
    sample = load_sample("tiny_transformer")
    args, _ = split_inputs(sample.example_inputs())
    return sample.build_model(), tuple(args)


def _loss(out):
    out = out if isinstance(out, torch.Tensor) else out[0]
    return out.float().pow(2).mean()


def _run(module, args):
    module.zero_grad(set_to_none=True)
    out = module(*args)
    _loss(out).backward()
    out = out if isinstance(out, torch.Tensor) else out[0]
    # a compiled module names its parameters "_orig_mod.<name>"
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in module.named_parameters()
             if p.grad is not None}
    return out.detach(), grads


@pytest.mark.slow
@pytest.mark.parametrize("build, tracer", [(_encoder, "export"), (_tiny, "fx")], ids=["encoder-export", "tiny-fx"])
def test_converted_module_compiles_without_graph_breaks_and_matches_eager(build, tracer):
    model, args = build()
    with torch.no_grad():
        ref32 = copy.deepcopy(model)(*args)
        ref32 = (ref32 if isinstance(ref32, torch.Tensor) else ref32[0]).float()
    conv = converter.convert(model, args, precision="bf16", device="cpu")
    assert conv.tracer == tracer
    gm = conv.module

    torch._dynamo.reset()
    explained = torch._dynamo.explain(gm)(*args)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1

    eager_out, eager_grads = _run(gm, args)
    compiled = torch.compile(copy.deepcopy(gm), backend="inductor")
    out, grads = _run(compiled, args)
    torch._dynamo.reset()

    assert out.dtype == eager_out.dtype == torch.float32  # keep_io_types
    sqnr = sqnr_db(eager_out.float(), out.float())
    assert sqnr >= MIN_SQNR_DB, f"compiled vs eager output SQNR {sqnr:.1f} dB < {MIN_SQNR_DB}"
    vs_fp32 = sqnr_db(ref32, out.float())
    assert vs_fp32 < 80.0, f"compiled output matches fp32 to {vs_fp32:.1f} dB: the half regions did not run in bf16"
    assert grads.keys() == eager_grads.keys() and len(grads) == len(list(gm.parameters()))
    for name, grad in grads.items():
        assert grad.dtype == eager_grads[name].dtype, name
    flat = torch.cat([g.float().reshape(-1) for g in grads.values()])
    ref = torch.cat([eager_grads[n].float().reshape(-1) for n in grads])
    gsqnr = sqnr_db(ref, flat)
    assert gsqnr >= MIN_SQNR_DB, f"compiled vs eager gradient SQNR {gsqnr:.1f} dB < {MIN_SQNR_DB}"
    print(f"\n{tracer}: compiled vs eager: output SQNR {sqnr:.1f} dB, gradient SQNR {gsqnr:.1f} dB; "
          f"compiled vs fp32 {vs_fp32:.1f} dB")
