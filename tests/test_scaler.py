"""LossScaler: PyTorch's own GradScaler checks replayed, parity with GradScaler, and our extras."""
from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from converter.train.amp_kernels import inverse_scale, unscale_grads, update_with_tensor_ops
from converter.train.scaler import LossScaler

INF, NAN = float("inf"), float("nan")


def _param_with_grad(value: float, shape=(3,)) -> tuple[nn.Parameter, torch.optim.Optimizer]:
    param = nn.Parameter(torch.zeros(shape))
    param.grad = torch.full(shape, value)
    return param, torch.optim.SGD([param], lr=0.0)


def _fake_iteration(scaler: LossScaler, param: nn.Parameter, opt: torch.optim.Optimizer, grad_value: float) -> None:
    param.grad = torch.full_like(param, grad_value)
    scaler.step(opt)
    scaler.update()


# ---------------------------------------------------------------- PyTorch behaviours 1-10
def test_item1_update_kernel_sequence():
    scaler = LossScaler(init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    param, opt = _param_with_grad(1.0)
    seen = []
    for grad in (1.0, 1.0, INF):
        _fake_iteration(scaler, param, opt, grad)
        seen.append((scaler.state_dict()["_growth_tracker"], scaler.get_scale()))
    assert seen == [(1, 4.0), (0, 8.0), (0, 2.0)], seen


def test_item1_tensor_path_matches_kernel_sequence():
    scale = torch.full((), 4.0)
    tracker = torch.zeros((), dtype=torch.int32)
    left = torch.ones((), dtype=torch.int32)
    seen = []
    for found in (0.0, 0.0, 1.0):
        update_with_tensor_ops(
            scale=scale, growth_tracker=tracker, hysteresis_left=left, found_inf=torch.tensor(found),
            growth_factor=2.0, backoff_factor=0.25, growth_interval=2, hysteresis=1, min_scale=None, max_scale=None,
        )
        seen.append((int(tracker), float(scale)))
    assert seen == [(1, 4.0), (0, 8.0), (0, 2.0)], seen


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("bad", [None, INF, NAN])
def test_item2_unscale_values_and_found_inf(layout, bad):
    base = torch.full((10, 10) if layout != "sliced" else (10, 20), 4.0)
    grad = {"contiguous": base, "transposed": base.t(), "sliced": base[:, ::2]}[layout]
    if bad is not None:
        grad[2, 2] = bad
    param = nn.Parameter(torch.zeros(10, 10))
    param.grad = grad
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = LossScaler(init_scale=4.0)  # inv_scale 0.25
    scaler.unscale_(opt)
    expected = torch.ones(10, 10)
    if bad is not None:
        expected[2, 2] = bad
    assert torch.equal(param.grad.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(param.grad[finite], expected[finite]), param.grad
    assert scaler.found_inf(opt) is (bad is not None)


def _two_layer(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


def _batches(n: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)) for _ in range(n)]


def test_item3_scaling_case_skips_exactly_one_step():
    control, scaling = _two_layer(0), _two_layer(0)
    opt_c = torch.optim.SGD(control.parameters(), lr=1.0)
    opt_s = torch.optim.SGD(scaling.parameters(), lr=1.0)
    scaler = LossScaler(init_scale=128.0, growth_factor=2.0, growth_interval=1)
    skip_iter = 2
    for i, (x, y) in enumerate(_batches(4)):
        opt_c.zero_grad()
        nn.functional.mse_loss(control(x), y).backward()
        if i != skip_iter:
            opt_c.step()
        opt_s.zero_grad()
        scaler.scale(nn.functional.mse_loss(scaling(x), y)).backward()
        if i == skip_iter:
            scaling[1].weight.grad.fill_(INF)
        scaler.step(opt_s)
        scaler.update()
    assert scaler.get_scale() == 128.0 * 2**3 * 0.5 == 512.0, scaler.get_scale()
    for pc, ps in zip(control.parameters(), scaling.parameters()):
        assert torch.equal(pc, ps), (pc - ps).abs().max()  # power-of-two scales are exact


def test_item4_accumulation_final_scale():
    model = _two_layer(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=128.0, growth_factor=2.0, growth_interval=1)
    for i, (x, y) in enumerate(_batches(4)):
        scaler.scale(nn.functional.mse_loss(model(x), y) / 2).backward()
        if i % 2 == 1:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert scaler.get_scale() == 128.0 * 2**2 == 512.0, scaler.get_scale()


def test_item5_found_inf_is_per_optimizer():
    model0, model1 = _two_layer(0), _two_layer(1)
    before0 = [p.detach().clone() for p in model0.parameters()]
    before1 = [p.detach().clone() for p in model1.parameters()]
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.1)
    opt1 = torch.optim.SGD(model1.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=128.0, growth_interval=1)
    x, y = _batches(1)[0]
    loss = nn.functional.mse_loss(model0(x), y) + nn.functional.mse_loss(model1(x), y)
    scaler.scale(loss).backward()
    model1[1].weight.grad[0, 0] = INF
    scaler.step(opt0)
    scaler.step(opt1)
    assert (scaler.found_inf(opt0), scaler.found_inf(opt1)) == (False, True)
    scaler.update()
    assert any(not torch.equal(b, p) for b, p in zip(before0, model0.parameters())), "optimizer0 did not step"
    assert all(torch.equal(b, p) for b, p in zip(before1, model1.parameters())), "optimizer1 stepped on inf"
    assert scaler.get_scale() == 64.0, scaler.get_scale()


def test_item6_clipping_before_unscale_equals_after():
    max_norm = 0.2
    results = []
    for clip_after_unscale in (False, True):
        model = _two_layer(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        scaler = LossScaler(init_scale=128.0, growth_interval=1)
        for x, y in _batches(3):
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            if clip_after_unscale:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            else:
                nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
            scaler.step(opt)
            scaler.update()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


def test_item7_state_dict_roundtrip():
    s0 = LossScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    for lazy in (False, True):
        s1 = LossScaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
        if lazy:
            s1.scale(torch.ones(2))  # materialises the scale tensor before loading
        s1.load_state_dict(s0.state_dict())
        got = (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval(),
               s1.state_dict()["_growth_tracker"])
        assert got == (3.0, 4.0, 0.5, 2, 0), got


def test_state_dict_has_gradscaler_keys_and_interoperates():
    ours = LossScaler(init_scale=256.0, growth_interval=5, hysteresis=2, min_scale=1.0)
    theirs = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=3)
    theirs_keys = set(theirs.state_dict())
    assert theirs_keys <= set(ours.state_dict()), sorted(ours.state_dict())
    assert {"hysteresis", "_hysteresis_left", "min_scale", "max_scale"} <= set(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert (ours.get_scale(), ours.get_growth_interval()) == (512.0, 3)
    assert ours.state_dict()["hysteresis"] == 2 and ours.state_dict()["min_scale"] == 1.0
    theirs.load_state_dict({k: v for k, v in LossScaler(init_scale=64.0).state_dict().items() if k in theirs_keys})
    assert theirs.get_scale() == 64.0


def test_item8_scale_never_becomes_inf():
    scaler = LossScaler(init_scale=1e38, growth_factor=16.0, growth_interval=1, max_scale=None)
    param, opt = _param_with_grad(1.0)
    for _ in range(4):
        _fake_iteration(scaler, param, opt, 1.0)
    assert scaler.get_scale() == torch.tensor(1e38).item(), scaler.get_scale()


def test_item8_with_default_cap_init_above_cap_is_rejected():
    with pytest.raises(ValueError, match="above max_scale"):
        LossScaler(init_scale=1e38, growth_factor=16.0, growth_interval=1)


def test_item9_gradient_penalty_matches_control():
    results = []
    for use_scaler in (False, True):
        model = _two_layer(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = LossScaler(init_scale=128.0, growth_interval=1, enabled=use_scaler)
        for x, y in _batches(3):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
            inv = 1.0 / scaler.get_scale()
            grads = [g * inv for g in grads]
            penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
            scaler.scale(loss + penalty).backward()
            scaler.step(opt)
            scaler.update()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


def test_item10_disabled_scaler_is_a_pass_through():
    scaler = LossScaler(enabled=False)
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled()
    t = torch.ones(3)
    assert scaler.scale(t) is t
    param, opt = _param_with_grad(INF)
    calls = []
    scaler.step(opt, closure=lambda: calls.append(1) or torch.zeros(()))
    scaler.update()
    assert calls == [1]
    assert scaler.state_dict() == {}


# ---------------------------------------------------------------- errors (GradScaler's messages)
def test_unscale_twice_raises():
    scaler = LossScaler()
    _param, opt = _param_with_grad(1.0)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer since the last update\(\)"):
        scaler.unscale_(opt)


def test_unscale_after_step_and_step_twice_raise():
    scaler = LossScaler()
    _param, opt = _param_with_grad(1.0)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)"):
        scaler.step(opt)
    scaler.update()
    scaler.unscale_(opt)  # a new iteration is allowed after update()


def test_fp16_grads_are_rejected():
    param = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    param.grad = torch.ones(3, dtype=torch.float16)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        LossScaler().unscale_(torch.optim.SGD([param], lr=0.1))


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_closure_is_rejected(how):
    scaler = LossScaler()
    _param, opt = _param_with_grad(1.0)
    closure = lambda: torch.zeros(())  # noqa: E731
    with pytest.raises(RuntimeError, match="Closure use is not currently supported") as info:
        scaler.step(opt, closure=closure) if how == "keyword" else scaler.step(opt, closure)
    assert "scaler.scale(loss).backward()" in str(info.value)


def test_update_without_inf_checks_raises():
    scaler = LossScaler()
    scaler.scale(torch.ones(()))
    with pytest.raises(RuntimeError, match="No inf checks were recorded prior to update."):
        scaler.update()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"growth_factor": 1.0}, ValueError, "growth factor must be > 1.0"),
        ({"backoff_factor": 1.0}, ValueError, "backoff factor must be < 1.0"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor must be a finite number > 0"),
        ({"growth_interval": 0}, ValueError, "growth_interval must be >= 1"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval must be an int"),
        ({"hysteresis": 0}, ValueError, "hysteresis must be >= 1"),
        ({"init_scale": float("inf")}, ValueError, "init_scale must be a finite number"),
        ({"init_scale": -1.0}, ValueError, "init_scale must be a finite number"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, ValueError, "min_scale .* must be <= max_scale"),
        ({"init_scale": 0.5, "min_scale": 1.0}, ValueError, "below min_scale"),
        ({"enabled": 1}, TypeError, "enabled must be a bool"),
        ({"max_scale": "big"}, TypeError, "max_scale must be a float"),
    ],
)
def test_bad_configuration_is_rejected(kwargs, error, match):
    with pytest.raises(error, match=match):
        LossScaler(**kwargs)


def test_bad_new_scale_is_rejected():
    scaler = LossScaler()
    with pytest.raises(ValueError, match="new_scale must be a finite number"):
        scaler.update(float("inf"))
    with pytest.raises(ValueError, match="1-element float tensor"):
        scaler.update(torch.ones(2))
    scaler.update(1024.0)
    assert scaler.get_scale() == 1024.0


# ---------------------------------------------------------------- scale() structure
def test_scale_nested_outputs():
    scaler = LossScaler(init_scale=4.0)
    out = scaler.scale([torch.ones(2), (torch.full((1,), 2.0), [torch.ones(())])])
    assert isinstance(out, list) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
    assert torch.equal(out[0], torch.full((2,), 4.0)) and torch.equal(out[1][0], torch.full((1,), 8.0))
    assert out[1][1][0].item() == 4.0
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        scaler.scale([torch.ones(1), 3])


def test_scaled_fp16_loss_is_fp32():
    loss = torch.tensor(3.0, dtype=torch.float16)
    scaled = LossScaler().scale(loss)
    assert scaled.dtype == torch.float32 and scaled.item() == 3.0 * 2**16


# ---------------------------------------------------------------- sparse gradients
def test_fp16_sparse_grad_is_coalesced_before_the_check():
    # Two finite fp16 values at the same index sum to 80000 > 65504: only the coalesced grad shows inf.
    param = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    param.grad = torch.sparse_coo_tensor(
        torch.tensor([[1, 1]]), torch.tensor([40000.0, 40000.0], dtype=torch.float16), (4,), check_invariants=True
    )
    assert not param.grad.is_coalesced() and torch.isfinite(param.grad._values()).all()
    found_inf = torch.zeros(())
    unscale_grads([param], inv_scale=torch.ones(()), found_inf=found_inf, allow_fp16=True)
    assert param.grad.is_coalesced()
    assert found_inf.item() == 1.0, found_inf


def test_fp32_sparse_embedding_grads_are_unscaled():
    torch.manual_seed(0)
    emb = nn.Embedding(10, 3, sparse=True)
    ref = copy.deepcopy(emb)
    idx = torch.tensor([1, 2, 2, 5])
    ref(idx).sum().backward()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=8.0)
    scaler.scale(emb(idx).sum()).backward()
    scaler.unscale_(opt)
    assert emb.weight.grad.is_sparse and not scaler.found_inf(opt)
    assert torch.equal(emb.weight.grad.to_dense(), ref.weight.grad.to_dense())
    scaler.step(opt)
    scaler.update()


# ---------------------------------------------------------------- parity with torch.amp.GradScaler
def _parity_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def test_inverse_scale_is_gradscalers_reciprocal_bit_for_bit():
    """1/scale as one fp32 reciprocal (CPU) equals GradScaler's ``scale.double().reciprocal().float()`` on every
    kind of fp32 scale: 2M random positive bit patterns (subnormals to the largest finite) and the edges."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F800000, (2_000_000,), dtype=torch.int32, generator=gen)
    edges = torch.tensor([0.0, INF, 2.0**-149, 2.0**-126, 1.0, 3.0, 65536.0, 0.3 * 2**16, 3.4028234663852886e38])
    for scales in (bits.view(torch.float32), edges):
        ours = torch.reciprocal(scales)  # what inverse_scale runs on the CPU, vectorised here
        theirs = scales.double().reciprocal().float()
        mismatched = int((ours.view(torch.int32) != theirs.view(torch.int32)).sum())
        assert mismatched == 0, f"{mismatched} of {scales.numel()} reciprocals differ"
    for value in (3.0, 0.3 * 2**16, 2.0**-149):  # the 0-dim call the scaler makes
        scale = torch.tensor(value)
        assert inverse_scale(scale).item() == scale.double().reciprocal().float().item(), value


@pytest.mark.parametrize(("growth", "backoff"), [(2.0, 0.5), (1.7, 0.3)])
def test_parity_with_gradscaler_300_steps_with_injected_inf_and_nan(growth, backoff):
    steps, growth_interval = 300, 3
    rng = random.Random(1234)
    plan = {}
    for step in range(steps):
        if rng.random() < 0.15:
            plan[step] = (rng.randrange(4), rng.choice([INF, -INF, NAN]), rng.randrange(4))
    theirs_model, ours_model = _parity_model(0), _parity_model(0)
    theirs_opt = torch.optim.SGD(theirs_model.parameters(), lr=0.01, momentum=0.9)
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.01, momentum=0.9)
    theirs = torch.amp.GradScaler("cpu", growth_interval=growth_interval, growth_factor=growth, backoff_factor=backoff)
    ours = LossScaler(growth_interval=growth_interval, growth_factor=growth, backoff_factor=backoff, max_scale=None)
    data = torch.Generator().manual_seed(5)
    scales, skips, natural = [], [], 0
    for step in range(steps):
        x, y = torch.randn(8, 8, generator=data), torch.randn(8, 4, generator=data)
        decisions = []
        for model, opt, scaler in ((theirs_model, theirs_opt, theirs), (ours_model, ours_opt, ours)):
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            if step in plan:
                index, value, flat = plan[step]
                list(model.parameters())[index].grad.view(-1)[flat] = value
            scaler.step(opt)
            scaler.update()
            decisions.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        scales.append((theirs.get_scale(), ours.get_scale()))
        skips.append(tuple(decisions))
        natural += int(decisions[0] and step not in plan)
        assert scales[-1][0] == scales[-1][1], f"step {step}: GradScaler {scales[-1][0]} vs ours {scales[-1][1]}"
        assert decisions[0] == decisions[1], f"step {step}: skipped GradScaler={decisions[0]} ours={decisions[1]}"
        for a, b in zip(theirs_model.parameters(), ours_model.parameters()):
            assert torch.equal(a, b), f"step {step}: params differ by {(a - b).abs().max()}"
    n_skipped = sum(s[0] for s in skips)
    distinct = len({s for s, _ in scales})
    print(f"parity: {n_skipped} skipped ({len(plan)} injected, {natural} natural overflows), {distinct} distinct scales, "
          f"final scale {scales[-1][0]}")
    assert n_skipped >= len(plan) and distinct > 5, (n_skipped, len(plan), distinct)


def test_tensor_path_matches_fused_kernel_on_random_sequences():
    rng = random.Random(3)
    for growth, backoff, interval, init in ((2.0, 0.5, 3, 2.0**16), (1.7, 0.3, 2, 1e37), (3.0, 0.9, 1, 5.0)):
        k_scale, k_tracker = torch.full((), init), torch.zeros((), dtype=torch.int32)
        t_scale, t_tracker = torch.full((), init), torch.zeros((), dtype=torch.int32)
        left = torch.ones((), dtype=torch.int32)
        for step in range(400):
            found = torch.tensor(float(rng.random() < 0.2))
            torch._amp_update_scale_(k_scale, k_tracker, found, growth, backoff, interval)
            update_with_tensor_ops(
                scale=t_scale, growth_tracker=t_tracker, hysteresis_left=left, found_inf=found,
                growth_factor=growth, backoff_factor=backoff, growth_interval=interval, hysteresis=1,
                min_scale=None, max_scale=None,
            )
            assert torch.equal(k_scale, t_scale) and torch.equal(k_tracker, t_tracker), (
                f"growth={growth} step={step}: kernel ({k_scale.item()}, {k_tracker.item()}) "
                f"vs tensor ops ({t_scale.item()}, {t_tracker.item()})"
            )
        assert torch.isfinite(k_scale)


# ---------------------------------------------------------------- extras: hysteresis, bounds, static
class _DeepSpeedReference:
    """DeepSpeed's DynamicLossScaler update rule (consecutive_hysteresis=False), from its documentation."""

    def __init__(self, *, scale, factor, window, hysteresis, min_scale, max_scale):
        self.scale, self.factor, self.window = scale, factor, window
        self.delayed_shift = self.left = hysteresis
        self.min_scale, self.max_scale = min_scale, max_scale
        self.iteration, self.last_overflow = 0, -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.left == 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.left -= 1
            self.last_overflow = self.iteration
        elif (self.iteration - self.last_overflow) % self.window == 0:
            self.left = self.delayed_shift
            self.scale = min(self.scale * self.factor, self.max_scale)
        self.iteration += 1


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_hysteresis_matches_deepspeed_semantics(hysteresis):
    rng = random.Random(hysteresis)
    ref = _DeepSpeedReference(scale=2.0**10, factor=2.0, window=4, hysteresis=hysteresis, min_scale=1.0,
                              max_scale=2.0**14)
    scaler = LossScaler(init_scale=2.0**10, growth_interval=4, hysteresis=hysteresis, min_scale=1.0,
                        max_scale=2.0**14)
    param, opt = _param_with_grad(1.0)
    backoffs = absorbed = 0
    for step in range(500):
        overflow = rng.random() < 0.25
        before = scaler.get_scale()
        _fake_iteration(scaler, param, opt, INF if overflow else 1.0)
        ref.update(overflow)
        assert scaler.get_scale() == ref.scale, f"step {step}: ours {scaler.get_scale()} vs DeepSpeed {ref.scale}"
        assert scaler.state_dict()["_hysteresis_left"] == ref.left, step
        backoffs += int(overflow and scaler.get_scale() < before)
        absorbed += int(overflow and scaler.get_scale() == before > 1.0)
    print(f"hysteresis={hysteresis}: {backoffs} backoffs, {absorbed} overflows absorbed above the floor")
    assert backoffs > 20, backoffs
    assert (absorbed > 0) is (hysteresis > 1), f"hysteresis={hysteresis} absorbed {absorbed} overflows"


def test_hysteresis_absorbs_then_backs_off():
    scaler = LossScaler(init_scale=64.0, hysteresis=2, growth_interval=100)
    param, opt = _param_with_grad(1.0)
    trajectory = []
    for grad in (INF, INF, INF, 1.0, INF):
        _fake_iteration(scaler, param, opt, grad)
        trajectory.append(scaler.get_scale())
    # 1st overflow absorbed, 2nd backs off, counter stays exhausted until the next growth.
    assert trajectory == [64.0, 32.0, 16.0, 16.0, 8.0], trajectory


def test_min_scale_floor_and_max_scale_cap():
    floor = LossScaler(init_scale=8.0, min_scale=2.0)
    param, opt = _param_with_grad(1.0)
    floors = []
    for _ in range(5):
        _fake_iteration(floor, param, opt, INF)
        floors.append(floor.get_scale())
    assert floors == [4.0, 2.0, 2.0, 2.0, 2.0], floors

    for hysteresis in (1, 2):  # fused-kernel path and tensor path
        cap = LossScaler(init_scale=4.0, growth_factor=3.0, growth_interval=1, max_scale=10.0, hysteresis=hysteresis)
        caps = []
        for _ in range(3):
            _fake_iteration(cap, param, opt, 1.0)
            caps.append(cap.get_scale())
        assert caps == [10.0, 10.0, 10.0], (hysteresis, caps)


def test_default_max_scale_caps_growth_at_2_pow_24():
    scaler = LossScaler(init_scale=2.0**22, growth_interval=1)
    param, opt = _param_with_grad(1.0)
    for _ in range(5):
        _fake_iteration(scaler, param, opt, 1.0)
    assert scaler.get_scale() == 2.0**24


def test_static_scale_never_changes_but_skips_nonfinite():
    scaler = LossScaler(init_scale=1024.0, growth_interval=1, dynamic=False)
    param = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=1.0)
    for grad, expect_step in ((1024.0, True), (INF, False), (1024.0, True), (NAN, False)):
        before = param.detach().clone()
        _fake_iteration(scaler, param, opt, grad)
        assert scaler.get_scale() == 1024.0
        assert (not torch.equal(before, param)) is expect_step, (grad, param)
        assert torch.isfinite(param).all()
    assert torch.equal(param, torch.full((3,), -2.0)), param


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_parity_with_gradscaler():
    device = torch.device("cuda")
    theirs_model, ours_model = _parity_model(0).to(device), _parity_model(0).to(device)
    theirs_opt = torch.optim.SGD(theirs_model.parameters(), lr=0.01)
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.01)
    theirs = torch.amp.GradScaler("cuda", growth_interval=2)
    ours = LossScaler(growth_interval=2, max_scale=None)
    for step in range(60):
        x, y = torch.randn(8, 8, device=device), torch.randn(8, 4, device=device)
        for model, opt, scaler in ((theirs_model, theirs_opt, theirs), (ours_model, ours_opt, ours)):
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            if step % 7 == 3:
                model[2].weight.grad[0, 0] = INF
            scaler.step(opt)
            scaler.update()
        assert theirs.get_scale() == ours.get_scale(), step
        assert ours._scale.device.type == "cuda"
        for a, b in zip(theirs_model.parameters(), ours_model.parameters()):
            assert torch.equal(a, b), (step, (a - b).abs().max())
