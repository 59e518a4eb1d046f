"""The simplify pass (issue 18 item 4): exactly the identity nodes are folded, with provenance,
and the folded module computes bit for bit what the unfolded one does."""
import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import converter
from converter.api import pipeline
from converter.ir.meta import GM_GRAPH, META_CAST
from converter.options import ConvertOptions
from converter.passes.capture.served import ShapeNotServedError
from converter.passes.simplify import LEAN_CALLS, Fold, fold_counts


def _encoder(p: float, train: bool, d: int = 32):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=p, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).train(train)


def _unsimplified(model, args, **kw):
    options = ConvertOptions(precision="bf16", placement="mincut", keep_io_types=True, opt_level=kw.get("opt_level", "O1"),
                             tracer="auto", device=kw.get("device"))
    captured, *_ = pipeline(copy.deepcopy(model), args, options, rules=None, simplify_graph=False)
    return captured.gm


def _step(module, args):
    module.zero_grad(set_to_none=True)
    out = module(*args)
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


def _folds(conv) -> tuple[Fold, ...]:
    return conv.module.meta[GM_GRAPH].simplified


def _dropouts(gm) -> int:
    return sum("dropout" in str(n.target) for n in gm.graph.nodes)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("device", [None, "cpu"])
def test_encoder_identity_dropouts_are_folded_and_nothing_else_changes(train, device):
    model, args = _encoder(0.0, train), (torch.randn(2, 8, 32),)
    conv = converter.convert(copy.deepcopy(model), args, precision="bf16", device=device)
    raw = _unsimplified(model, args, device=device)
    assert conv.tracer == "export"
    folds = _folds(conv)
    # 3 dropouts per layer (attention, feed-forward, residual) × 2 layers; torch.export's input check
    # (validate_inputs off), then its three forward hooks, all idle (no nn.Module inputs)
    assert fold_counts(folds) == {"dropout": 6, "hook": 4}, folds
    assert conv.report.records.lowering.simplified == {"dropout": 6, "hook": 4}
    assert {f.why for f in folds if f.kind == "dropout"} == {"dropout with p=0"}
    assert _dropouts(raw) == 6 and _dropouts(conv.module) == 0
    assert len(raw.graph.nodes) - len(conv.module.graph.nodes) == 6
    # every cast rewrite inserted is still there
    assert sum(META_CAST in n.meta for n in conv.module.graph.nodes) == sum(META_CAST in n.meta for n in raw.graph.nodes)
    assert conv.module.validate_inputs is False and raw.validate_inputs is True
    assert (len(raw._forward_pre_hooks), len(raw._forward_hooks)) == (2, 1)
    assert not conv.module._forward_pre_hooks and not conv.module._forward_hooks  # nn.Module's hook-free call
    out, grads = _step(conv.module, args)
    ref, ref_grads = _step(raw, args)
    assert torch.equal(out, ref)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    # another batch and length (the batch and sequence dims are captured as dynamic): still the same
    other = (torch.randn(3, 5, 32),)
    assert torch.equal(_step(conv.module, other)[0], _step(raw, other)[0])
    with pytest.raises(ShapeNotServedError, match=r"src.size\(\)\[2\] == 32"):  # the guards still run
        copy.deepcopy(conv.module)(torch.randn(2, 8, 33))
    with pytest.raises(AssertionError, match="embedding dimension of 32"):  # conv.module tries again: the original's error
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            conv.module(torch.randn(2, 8, 33))
    with pytest.raises(TypeError):  # and forward's signature still rejects a wrong call
        conv.module(*args, *args)


@pytest.mark.parametrize("train", [True, False])
def test_dropout_with_p_above_zero_is_kept_in_either_mode(train):
    # the graph follows train()/eval() (its dropouts read self.training), so even one captured
    # from an eval-mode model must keep them
    model, args = _encoder(0.1, train), (torch.randn(2, 8, 32),)
    conv = converter.convert(model, args, precision="bf16")
    assert fold_counts(_folds(conv)) == {"hook": 4}
    assert sum(str(n.target) == "aten.dropout.default" for n in conv.module.graph.nodes) == 6


class _Views(nn.Module):
    """FX-captured: literal-shape views, dropout modules and functions, explicit casts."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.0)
        self.drop_kept = nn.Dropout(0.2)

    def forward(self, x):
        h = self.lin(x).reshape(2, 8, 16)  # its own shape: folded
        h = h.view(16, 16).view(2, 8, 16)  # real reshapes: kept
        h = h.reshape(-1, 16).reshape(2, 8, 16)  # -1, then a real reshape: kept
        h = h.expand(2, 8, 16)  # its own shape: folded
        h = self.drop(h)  # p=0 module: folded
        h = F.dropout(h, 0.0, True)  # p=0: folded
        h = F.dropout(h, 0.3, False)  # never in training: folded
        h = self.drop_kept(h)  # kept (p=0.2, training)
        h = h.float()  # the model's own cast (bf16 region -> fp32): kept
        h = h.to(torch.float32)  # of a tensor the graph fixed to fp32: folded
        w = self.lin.weight.to(torch.float32)  # a parameter (O2 may store it in half): kept
        y = x.to(torch.float32)  # an input (the caller picks its dtype): kept
        return h.contiguous() + y + w.sum()  # contiguous: FX records no strides, kept


def test_fx_views_dropouts_and_casts_fold_exactly():
    torch.manual_seed(0)
    model, args = _Views().train(), (torch.randn(2, 8, 16),)
    conv = converter.convert(copy.deepcopy(model), args, precision="bf16")
    raw = _unsimplified(model, args)
    assert conv.tracer == "fx"
    folds = _folds(conv)
    assert [(f.node, f.kind) for f in folds] == [("reshape", "view"), ("expand", "view"), ("drop", "dropout"),
                                                 ("dropout", "dropout"), ("dropout_1", "dropout"), ("to", "cast")], folds
    assert folds[4].why == "dropout with train=False"
    assert len(raw.graph.nodes) - len(conv.module.graph.nodes) == 6
    assert not hasattr(conv.module, "drop") and hasattr(conv.module, "drop_kept")  # the folded module is gone
    assert set(conv.module.state_dict()) == set(model.state_dict())
    kept = {n.name for n in conv.module.graph.nodes}
    assert {"view", "view_1", "reshape_1", "reshape_2", "float_1", "to_1", "to_2", "contiguous", "drop_kept"} <= kept
    torch.manual_seed(1)
    out, grads = _step(conv.module.eval(), args)  # the kept dropout module is the identity in eval
    ref, ref_grads = _step(raw.eval(), args)
    assert torch.equal(out, ref) and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


def test_o2_trainer_runs_the_simplified_module():
    from converter.train.trainer import MixedPrecisionTrainer

    model, args = _encoder(0.0, True), (torch.randn(2, 8, 32),)
    conv = converter.convert(model, args, precision="bf16", opt_level="O2", device="cpu")
    gm = conv.module
    trainer = MixedPrecisionTrainer(gm, torch.optim.SGD(gm.parameters(), lr=1e-2), precision="bf16", master_weights=True)
    losses = []
    for _ in range(3):
        trainer.zero_grad()
        loss = gm(*args).float().pow(2).mean()
        trainer.backward(loss)
        trainer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


# ---------------------------------------------------------------- lean calls (the module's generated code)
def _t(*shape, grad=True, dtype=torch.float32):
    gen = torch.Generator().manual_seed(sum(shape) + len(shape))
    return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad)


def _lean_samples() -> dict[str, tuple]:
    """Arguments for every LEAN_CALLS entry, in the form FX passes them (positional, kwargs as printed)."""
    x, w, b = _t(2, 3, 4), _t(5, 4), _t(5)
    return {
        "add.Tensor": ((x, _t(2, 3, 4)), {}), "sub.Tensor": ((x, 2.0), {"alpha": 3}),
        "mul.Tensor": ((x, 0.5), {}), "div.Tensor": ((x, _t(4)), {}),
        "addmm.default": ((b, _t(3, 4), _t(4, 5)), {}), "bmm.default": ((x, _t(2, 4, 5)), {}),
        "mm.default": ((_t(3, 4), _t(4, 2)), {}), "matmul.default": ((x, _t(4, 2)), {}),
        "cat.default": (([x, _t(2, 3, 4)], 1), {}), "clone.default": ((x,), {}),
        "contiguous.default": ((_t(3, 2, 4).detach().transpose(0, 1).requires_grad_(),), {}), "dropout.default": ((x, 0.0, True), {}),
        "embedding.default": ((_t(10, 4), torch.tensor([[1, 2], [3, 9]])), {}),
        "exp.default": ((x,), {}), "neg.default": ((x,), {}), "rsqrt.default": (((_t(2, 3, 4, grad=False).abs() + 1).requires_grad_(),), {}),
        "sigmoid.default": ((x,), {}), "tanh.default": ((x,), {}), "relu.default": ((x,), {}),
        "gelu.default": ((x,), {"approximate": "tanh"}), "silu.default": ((x,), {}),
        "expand.default": ((_t(1, 3, 4), [2, 3, 4]), {}), "flatten.using_ints": ((x, 1), {}),
        "layer_norm.default": ((x, [4], _t(4), _t(4), 1e-05, False), {}),
        "linear.default": ((x, w, b), {}), "mean.dim": ((x, [-1], True), {}),
        "permute.default": ((x, [2, 0, 1]), {}), "pow.Tensor_Scalar": ((x, 2), {}),
        "reshape.default": ((x, [6, 4]), {}), "view.default": ((x, [3, 2, 4]), {}),
        "scaled_dot_product_attention.default": ((_t(2, 2, 3, 4), _t(2, 2, 3, 4), _t(2, 2, 3, 4)),
                                                 {"is_causal": True}),
        "select.int": ((x, 0, 1), {}), "softmax.int": ((x, -1), {}), "squeeze.dim": ((_t(2, 1, 4), -2), {}),
        "t.default": ((_t(3, 4),), {}), "transpose.int": ((x, 1, 0), {}),
        "unflatten.int": ((_t(2, 6), -1, [3, 2]), {}), "unsqueeze.default": ((x, 0), {}),
    }


class _AtenLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _run_logged(fn, args, kwargs):
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    leaves += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor) and t.requires_grad]
    assert all(leaf.is_leaf and leaf.grad is None for leaf in leaves)
    with _AtenLog() as log:
        out = fn(*args, **kwargs)
        out.float().sum().backward()
    return log.ops, out.detach(), [leaf.grad for leaf in leaves]


def test_every_lean_call_dispatches_exactly_its_aten_overload():
    """Each binding in LEAN_CALLS, called as FX calls the overload, runs the same aten ops below
    autograd (forward and backward), with bit-identical outputs and gradients; and is a C binding."""
    samples = _lean_samples()
    assert {f"torch.ops.aten.{k}" for k in samples} == set(LEAN_CALLS)
    for key in samples:
        overload, lean = eval(f"torch.ops.aten.{key}"), eval(LEAN_CALLS[f"torch.ops.aten.{key}"])
        assert type(lean).__name__ in ("builtin_function_or_method", "method_descriptor"), (key, type(lean))
        ops_ref, out_ref, grads_ref = _run_logged(overload, *_lean_samples()[key])
        ops, out, grads = _run_logged(lean, *_lean_samples()[key])  # fresh leaves, same values
        assert ops == ops_ref, (key, ops, ops_ref)
        assert torch.equal(out, out_ref), key
        assert all(torch.equal(g, r) for g, r in zip(grads, grads_ref)), key


def test_lean_calls_rewrite_the_generated_code_only():
    """The converted encoder's forward calls torch bindings (no OpOverload call but sym_size), its
    graph keeps the aten targets, and a recompile or a deep copy keeps the rewrite; outputs and
    gradients equal the unsimplified module's, for another batch and length too."""
    model, args = _encoder(0.0, True), (torch.randn(2, 8, 32),)
    conv = converter.convert(copy.deepcopy(model), args, precision="bf16")
    raw = _unsimplified(model, args)
    gm = conv.module
    left = re.findall(r"torch\.ops\.aten\.\w+\.\w+\(", gm.code)
    assert set(left) == {"torch.ops.aten.sym_size.int("}, set(left)
    assert "torch.ops.aten.transpose.int(" in raw.code and "torch.transpose(" in gm.code
    assert any(n.target is torch.ops.aten.transpose.int for n in gm.graph.nodes)
    # each submodule on the parameters' paths is looked up once: layers, layers.0, layers.1, ...
    assert gm.code.count("self.layers") == 1 and raw.code.count("self.layers") == 24, gm.code
    gm.recompile()
    assert "torch.transpose(" in gm.code and "torch.transpose(" in copy.deepcopy(gm).code
    for shape in ((2, 8, 32), (3, 5, 32)):
        x = (torch.randn(*shape),)
        out, grads = _step(gm, x)
        ref, ref_grads = _step(raw, x)
        assert torch.equal(out, ref)
        assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


def test_shared_module_lookups_keep_single_paths_and_other_lines():
    from converter.passes.simplify import _share_module_lookups

    body = ['a_w = getattr(self.a, "0").w\n', "b = self.b;  b = None\n", "y = torch.relu(a_w)\n",
            'a_v = getattr(self.a, "0").v\n', "c_x = self.c.x\n", "z = self.m(y)\n"]
    assert _share_module_lookups(body) == [
        "_mp_mod_0 = self.a\n", '_mp_mod_1 = getattr(_mp_mod_0, "0")\n', "a_w = _mp_mod_1.w\n",
        "b = self.b;  b = None\n", "y = torch.relu(a_w)\n", "a_v = _mp_mod_1.v\n", "c_x = self.c.x\n",
        "z = self.m(y)\n"]
