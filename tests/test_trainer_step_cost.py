"""What one ``MixedPrecisionTrainer.step()`` does, counted at the dispatcher (no timing: benchmarks/trainer_step.py
times it), and the loss-scaling semantics the fused step must keep.

Structure: an O2 fp16 step is one ``_amp_foreach_non_finite_check_and_unscale_`` over the flat fp32 gradient
arena, the optimizer's kernels, one ``copy_`` per flat master buffer, ``_amp_update_scale_``, and exactly one
read of device memory by the host (``torch.amp.GradScaler`` does one too); no gradient norm is computed when
nothing needs it. Semantics: an inf gradient skips the step and halves the scale, clean steps grow it, the
trainer matches a GradScaler loop bit for bit, and a finite gradient that overflows only when unscaled (scale
below 1) is still never stepped.
"""
from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from converter.train.scaler import LossScaler
from converter.train.trainer import MixedPrecisionTrainer

INF = float("inf")
_UNSCALE = "aten._amp_foreach_non_finite_check_and_unscale_.default"
_NORM_OPS = ("linalg_vector_norm", "_foreach_norm", "aten.norm")


class _StepCounter(TorchDispatchMode):
    """Ops under it, split into the optimizer's own and the rest, with the host reads of device memory.

    A host read is an ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``) or a
    ``Tensor.tolist()`` call (counted by the ``tolist`` fixture patch: it does not reach the dispatcher).
    """

    def __init__(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.optimizer_ops: Counter = Counter()
        self.unscale_lists: list[list[torch.Tensor]] = []
        self.copies: list[tuple[int, torch.dtype, torch.dtype]] = []  # (numel, dst dtype, src dtype)
        self.tolists = 0
        self._in_optimizer = False
        if optimizer is not None:
            step = optimizer.step

            def counted_step(*args, **kwargs):
                self._in_optimizer = True
                try:
                    return step(*args, **kwargs)
                finally:
                    self._in_optimizer = False

            optimizer.step = counted_step

    @property
    def host_reads(self) -> int:
        return self.ops["aten._local_scalar_dense.default"] + self.optimizer_ops[
            "aten._local_scalar_dense.default"] + self.tolists

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        (self.optimizer_ops if self._in_optimizer else self.ops)[name] += 1
        if name == _UNSCALE:
            self.unscale_lists.append(list(args[0]))
        if name == "aten.copy_.default" and not self._in_optimizer:
            self.copies.append((args[0].numel(), args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counter_factory(monkeypatch):
    """Makes :class:`_StepCounter` s whose ``tolists`` count every ``Tensor.tolist()`` while they are active."""
    active: list[_StepCounter] = []
    original = torch.Tensor.tolist

    def tolist(self):
        for counter in active:
            counter.tolists += 1
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)

    class _Active(_StepCounter):
        def __enter__(self):
            active.append(self)
            return super().__enter__()

        def __exit__(self, *exc):
            active.remove(self)
            return super().__exit__(*exc)

    return _Active


class _Block(nn.Module):
    """Linear layers (stored half under O2) and a LayerNorm (kept fp32: its gradients share the arena)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.to(self.inp.weight.dtype))
        h = self.norm(h.float()).to(self.out.weight.dtype)
        return self.out(torch.tanh(h)).float()


def _block(seed: int = 0) -> _Block:
    torch.manual_seed(seed)
    return _Block()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def _trainer(model: nn.Module, *, precision: str = "fp16", master_weights: bool = True, momentum: float = 0.9,
             **kwargs) -> MixedPrecisionTrainer:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    return MixedPrecisionTrainer(model, opt, precision=precision, master_weights=master_weights, **kwargs)


def _backward(trainer: MixedPrecisionTrainer, model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    trainer.zero_grad()
    loss = _loss(model, x, y)
    trainer.backward(loss)
    return loss.detach()


# ---------------------------------------------------------------- structure of one step
def test_o2_fp16_step_is_one_fused_unscale_over_the_arena_one_flat_copy_and_one_host_read(counter_factory):
    model = _block()
    trainer = _trainer(model)
    _backward(trainer, model, 0)
    trainer.step()  # the first step allocates the trainer's readout buffer
    _backward(trainer, model, 1)
    arena = trainer._masters.arena.flats
    scaled = arena[0].clone()
    counter = counter_factory(trainer.optimizer)
    with counter:
        assert trainer.step()
    assert counter.ops[_UNSCALE] == 1, counter.ops
    assert len(counter.unscale_lists[0]) == 1 and counter.unscale_lists[0][0] is arena[0], counter.unscale_lists
    assert counter.host_reads == 1 and counter.tolists == 1, (counter.tolists, counter.ops)
    assert not [op for op in counter.ops if any(n in op for n in _NORM_OPS)], counter.ops
    # the master->model copy is one copy_ of the whole fp32 master buffer into the half buffer
    flat_copies = [c for c in counter.copies if c[0] > 1]
    total = sum(p.numel() for p in trainer.master_params)
    assert flat_copies == [(total, torch.float16, torch.float32)], counter.copies
    assert counter.ops["aten._amp_update_scale_.default"] == 1
    # everything the trainer itself ran (the optimizer's kernels aside), as counted
    assert counter.ops == Counter({
        "aten.zero_.default": 1,  # the found-inf slot
        "aten.reciprocal.default": 1,  # 1/scale: one fp32 reciprocal, GradScaler's bits (its double path, rounded)
        _UNSCALE: 1,
        "aten.copy_.default": 2,  # master->model, the scale after its update (the loss is read when the stats are)
        "aten._amp_update_scale_.default": 1,  # the update; 65536 can neither grow past 2**24 nor back off below 1: no clamp
    }), counter.ops
    # stats read afterwards (the reads the step left lazy): exact values
    inv = 1.0 / trainer.scaler.get_scale()
    counter = counter_factory()
    with counter:
        stats = trainer.stats
    assert stats.grad_norm == torch.linalg.vector_norm(scaled * inv).item(), stats
    assert stats.scale == trainer.scaler.get_scale() and stats.steps == 2 and stats.skipped == 0, stats
    assert counter.host_reads == 2, counter.ops  # the scale after the update, the lazy norm


class _Deep(nn.Module):
    """``depth`` Linear layers (half under O2) with a LayerNorm (fp32) between: parameters in any number."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(depth))
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x.to(layer.weight.dtype)))
        return self.out(self.norm(x.float()).to(self.out.weight.dtype)).float()


@pytest.mark.parametrize("master_weights", [True, False])
def test_the_step_runs_the_same_ops_for_any_number_of_parameters(counter_factory, master_weights):
    """No per-parameter loop of kernels anywhere in the step: a model with 3x the parameter tensors runs exactly
    the same ops (trainer and optimizer alike: SGD's foreach kernels, one unscale, O2's one flat copy)."""
    seen = []
    for depth in (1, 7):
        torch.manual_seed(0)
        model = _Deep(depth)
        trainer = _trainer(model, master_weights=master_weights)
        for step in range(2):
            _backward(trainer, model, step)
            counter = counter_factory(trainer.optimizer)
            with counter:
                assert trainer.step()
        copies = [(dst, src) for _numel, dst, src in counter.copies]
        seen.append((len(list(model.parameters())), counter.ops, counter.optimizer_ops, copies, counter.host_reads))
    (few, *small), (many, *large) = seen
    assert (few, many) == (6, 18) and small == large, seen
    ops, optimizer_ops, copies, host_reads = small
    assert ops[_UNSCALE] == 1 and host_reads == 1, ops
    assert {op for op in optimizer_ops if "profiler" not in op} == {
        "aten._foreach_mul_.Scalar", "aten._foreach_add_.List"}, optimizer_ops
    # O2: one fp32 -> fp16 copy of the whole master buffer; both: the scale after its update into the readout
    assert Counter(copies) == Counter([(torch.float16, torch.float32)] * master_weights + [(torch.float32, torch.float32)])


def test_gradients_outside_the_arena_are_harvested_unscaled_and_checked_too():
    """After trainer.backward() the step only checks that the gradients are where it left them (the arena's
    slots, no half gradient on the model); anything else takes the general path: a half gradient from a
    backward of the caller's own is harvested, a master gradient the caller replaced is unscaled with the rest."""
    model = _block()
    trainer = _trainer(model)
    _backward(trainer, model, 0)
    assert trainer.step()
    masters, arena = trainer.master_params, trainer._masters.arena.flats
    params = trainer._optimizer_params()

    def settled():
        return trainer._masters.settled(params, [p.grad for p in params])

    _backward(trainer, model, 1)
    assert settled() is arena
    harvested = [m.grad.clone() for m in masters]  # scaled fp32
    x, y = _batch(7)
    half_params = [model.inp.weight, model.inp.bias, model.out.weight, model.out.bias]
    trainer.scaler.scale(_loss(model, x, y)).backward()  # the caller's own backward: half gradients on the model
    extra = [p.grad.clone() for p in half_params]
    assert settled() is None
    inv = 1.0 / trainer.scaler.get_scale()  # a power of two: unscaling is exact
    assert trainer.step()
    for master, before, half in zip(masters, harvested, extra):
        assert torch.equal(master.grad, (before + half.float()) * inv)
    assert all(p.grad is None for p in half_params)
    _backward(trainer, model, 2)
    replaced = torch.full_like(masters[0], 3.0)
    masters[0].grad = replaced  # not its arena slot
    assert settled() is None
    scale = trainer.scaler.get_scale()
    assert trainer.step() and torch.equal(replaced, torch.full_like(replaced, 3.0 / scale))
    _backward(trainer, model, 3)
    masters[1].grad = torch.full_like(masters[1], INF)
    assert not trainer.step() and trainer.stats.skipped == 1


def test_a_param_without_an_arena_slot_is_never_settled():
    """As many optimizer params as arena slots is not enough: a param with no slot (and no gradient) in place of
    a slot owner that left the optimizer must not let the step take the arena for the optimizer's gradients."""
    model = _block()
    trainer = _trainer(model)
    group = trainer.optimizer.param_groups[0]
    group["params"].pop()  # out.bias's master leaves the optimizer...
    group["params"].append(nn.Parameter(torch.zeros(3)))  # ...and a param the arena knows nothing of joins
    _backward(trainer, model, 0)
    params = trainer._optimizer_params()
    assert len(params) == len(trainer._masters.arena.slots)
    assert trainer._masters.settled(params, [p.grad for p in params]) is None
    assert trainer.step()


def test_o1_fp16_step_unscales_per_dtype_group_and_reads_the_host_once(counter_factory):
    model = _block()
    trainer = _trainer(model, master_weights=False)
    for step in range(2):
        _backward(trainer, model, step)
        counter = counter_factory(trainer.optimizer)
        with counter:
            assert trainer.step()
    params = list(model.parameters())
    assert counter.ops[_UNSCALE] == 1 and len(counter.unscale_lists[0]) == len(params), counter.ops
    assert counter.host_reads == 1, counter.ops
    assert not [op for op in counter.ops if any(n in op for n in _NORM_OPS)], counter.ops


def test_bf16_o2_step_checks_with_one_norm_into_the_readout_and_reads_the_host_once(counter_factory):
    model = _block()
    trainer = _trainer(model, precision="bf16")
    for step in range(2):
        _backward(trainer, model, step)
        counter = counter_factory(trainer.optimizer)
        with counter:
            assert trainer.step()
    assert counter.ops[_UNSCALE] == 0 and counter.ops["aten.linalg_vector_norm.out"] == 1, counter.ops
    assert counter.host_reads == 1, counter.ops
    assert math.isfinite(trainer.stats.grad_norm)


def test_bf16_o1_step_checks_with_the_fused_kernel_at_inv_scale_one(counter_factory):
    """O1's gradients are separate tensors: one multi-tensor check (inv_scale 1: the values stay bit for bit)
    instead of a norm per tensor; the norm is left to a stats read."""
    model = _block()
    trainer = _trainer(model, precision="bf16", master_weights=False)
    for step in range(2):
        _backward(trainer, model, step)
        grads = [p.grad.clone() for p in model.parameters()]
        counter = counter_factory(trainer.optimizer)
        with counter:
            assert trainer.step()
    assert counter.ops[_UNSCALE] == 1 and len(counter.unscale_lists[0]) == len(grads), counter.ops
    assert not [op for op in counter.ops if any(n in op for n in _NORM_OPS)], counter.ops
    assert counter.host_reads == 1, counter.ops
    for before, param in zip(grads, model.parameters()):
        assert torch.equal(before, param.grad)
    expected = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item()
    assert trainer.stats.grad_norm == expected, (trainer.stats.grad_norm, expected)


def test_gradscaler_reads_the_host_once_too(counter_factory):
    """The yardstick: torch.amp.GradScaler's unscale_/step/update read device memory once per step."""
    model = _block()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    scaler = torch.amp.GradScaler("cpu")
    x, y = _batch(0)
    scaler.scale(_loss(model, x, y)).backward()
    counter = counter_factory(opt)
    with counter:
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert counter.host_reads == 1 and counter.ops[_UNSCALE] == 1, counter.ops


@pytest.mark.parametrize("kwargs", [{"max_grad_norm": 1.0}, {"callback": lambda stats: None}])
def test_a_step_that_needs_the_norm_computes_it_once_and_still_reads_the_host_once(counter_factory, kwargs):
    model = _block()
    trainer = _trainer(model, **kwargs)
    for step in range(2):
        _backward(trainer, model, step)
        counter = counter_factory(trainer.optimizer)
        with counter:
            assert trainer.step()
    assert counter.ops["aten.linalg_vector_norm.out"] == 1 and counter.ops[_UNSCALE] == 1, counter.ops
    # the callback reads what the step left lazy (the scale after the update); clipping needs nothing more
    assert counter.host_reads == (2 if "callback" in kwargs else 1), counter.ops


# ---------------------------------------------------------------- loss-scaling semantics
@pytest.mark.parametrize("master_weights", [False, True])
def test_inf_gradient_skips_the_step_and_halves_the_scale(master_weights):
    model = _block()
    trainer = _trainer(model, master_weights=master_weights, loss_scale=LossScaler(init_scale=1024.0))
    _backward(trainer, model, 0)
    assert trainer.step()
    before = [t.detach().clone() for t in [*model.parameters(), *trainer.master_params]]
    _backward(trainer, model, 1)
    grads = trainer.master_params if master_weights else [model.inp.weight]
    grads[0].grad.view(-1)[3] = INF
    assert not trainer.step()
    stats = trainer.stats
    assert (stats.steps, stats.skipped, stats.overflows, stats.scale, stats.grad_norm) == (1, 1, 1, 512.0, INF), stats
    assert trainer.scaler.get_scale() == 512.0
    for a, b in zip(before, [*model.parameters(), *trainer.master_params]):
        assert torch.equal(a, b)


def test_clean_steps_grow_the_scale_after_the_growth_interval():
    model = _block()
    trainer = _trainer(model, loss_scale=LossScaler(init_scale=64.0, growth_interval=3))
    scales = []
    for step in range(7):
        _backward(trainer, model, step)
        assert trainer.step()
        scales.append(trainer.stats.scale)
    assert scales == [64.0, 64.0, 128.0, 128.0, 128.0, 256.0, 256.0], scales
    assert trainer.stats.overflows == 0 and trainer.stats.skipped == 0


@pytest.mark.parametrize("init_scale, poison, expected", [
    (2.0**24, False, 2.0**24),  # at the cap, the interval's growth would pass it: clamped back
    (1.0, True, 1.0),  # at the floor, the backoff would go below it: clamped back
    (2.0**23, False, 2.0**24),  # growth lands on the cap: nothing to clamp
])
def test_the_bounds_clamp_runs_exactly_when_the_update_can_cross_a_bound(counter_factory, init_scale, poison, expected):
    model = _block()
    trainer = _trainer(model, loss_scale=LossScaler(init_scale=init_scale, growth_interval=1, min_scale=1.0))
    _backward(trainer, model, 0)
    trainer._masters.arena.flats[0].fill_(0.5)  # finite at any of these scales (the fp16 backward may overflow at 2**24)
    if poison:
        trainer.master_params[0].grad.view(-1)[0] = INF
    counter = counter_factory(trainer.optimizer)
    with counter:
        trainer.step()
    assert trainer.stats.scale == expected == trainer.scaler.get_scale(), trainer.stats
    assert counter.ops["aten.clamp_.default"] == (init_scale != 2.0**23), counter.ops
    assert trainer.stats.overflows == 0, trainer.stats  # at the floor a backoff leaves the scale where it was


def test_may_leave_bounds_compares_the_double_products_exactly():
    scaler = LossScaler(init_scale=4.0, min_scale=1.0, max_scale=2.0**24, growth_factor=2.0, backoff_factor=0.5)
    assert not scaler._may_leave_bounds((False, 2.0**23)) and scaler._may_leave_bounds((False, 2.0**23 + 1))
    assert not scaler._may_leave_bounds((True, 2.0)) and scaler._may_leave_bounds((True, 1.5))
    assert scaler._may_leave_bounds(None)
    assert not LossScaler(max_scale=None)._may_leave_bounds(None)  # no bounds, nothing to clamp


def test_overflow_count_and_scale_stay_exact_when_the_stats_are_read_only_at_the_end():
    """stats.scale/overflows are settled at the next step's host read; read once after many steps they
    still count every backoff (and none for growth)."""
    model = _block()
    trainer = _trainer(model, loss_scale=LossScaler(init_scale=256.0, growth_interval=2))
    plan = ["ok", "bad", "ok", "ok", "ok", "bad", "bad", "ok"]
    for step, kind in enumerate(plan):
        _backward(trainer, model, step)
        if kind == "bad":
            trainer.master_params[0].grad.view(-1)[0] = float("nan")
        trainer.step()
    stats = trainer.stats
    # 256 -ok-> 256 (1/2) -bad-> 128 -ok-> 128 (1/2) -ok-> 256 -ok-> 256 (1/2) -bad-> 128 -bad-> 64 -ok-> 64 (1/2)
    assert (stats.scale, stats.overflows, stats.skipped, stats.steps) == (64.0, 3, 3, 5), stats


def test_a_scale_changed_between_steps_is_read_again():
    """The host keeps the scale it last read; a change outside the step (update(new_scale=...)) moves the
    scaler's version, so the next step reads the scale again and counts the next backoff from it."""
    model = _block()
    trainer = _trainer(model, loss_scale=LossScaler(init_scale=256.0))
    _backward(trainer, model, 0)
    assert trainer.step()
    trainer.scaler.update(new_scale=32.0)
    _backward(trainer, model, 1)
    trainer.master_params[0].grad.view(-1)[0] = INF
    assert not trainer.step()
    stats = trainer.stats
    assert (stats.scale, stats.overflows) == (16.0, 1), stats


def test_trainer_matches_a_gradscaler_loop_bit_for_bit_through_skips():
    """O1 fp16 with GradScaler's semantics (no floor, no cap) against torch.amp.GradScaler + SGD(foreach):
    the same parameters after every step, the same skips, the same scale."""
    torch.manual_seed(0)
    ours_model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    theirs_model = copy.deepcopy(ours_model)
    scaler = LossScaler(init_scale=2.0**10, growth_interval=2, max_scale=None)
    trainer = MixedPrecisionTrainer(ours_model, torch.optim.SGD(ours_model.parameters(), lr=0.05, momentum=0.9),
                                    precision="fp16", loss_scale=scaler)
    theirs_opt = torch.optim.SGD(theirs_model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    poisoned = {3, 4, 9, 15}
    for step in range(20):
        x, y = _batch(step)
        trainer.zero_grad()
        trainer.backward(_loss(ours_model, x, y))
        theirs_opt.zero_grad(set_to_none=True)
        theirs.scale(_loss(theirs_model, x, y)).backward()
        if step in poisoned:
            ours_model[2].weight.grad[0, 0] = INF
            theirs_model[2].weight.grad[0, 0] = INF
        before = theirs.get_scale()
        stepped = trainer.step()
        theirs.step(theirs_opt)
        theirs.update()
        assert stepped == (theirs.get_scale() >= before), step
        assert trainer.stats.scale == theirs.get_scale(), (step, trainer.stats.scale, theirs.get_scale())
        for a, b in zip(ours_model.parameters(), theirs_model.parameters()):
            assert torch.equal(a, b), (step, (a - b).abs().max())
    assert trainer.stats.skipped == len(poisoned) == trainer.stats.overflows


@pytest.mark.parametrize("master_weights", [False, True])
def test_finite_gradient_that_overflows_when_unscaled_is_never_stepped(counter_factory, master_weights):
    """1e36 is finite in fp32, 1e36 / 2**-10 is not: the fused kernel (which checks before multiplying)
    cannot see it. With a scale below 1 and no norm to catch it, the step checks the unscaled gradients
    element-wise (one more host read, only then); the scaler is not told (no backoff), as before."""
    model = _block()
    trainer = _trainer(model, master_weights=master_weights,
                       loss_scale=LossScaler(init_scale=2.0**-10, dynamic=False, max_scale=None))
    _backward(trainer, model, 0)
    assert trainer.step()
    before = [t.detach().clone() for t in [*model.parameters(), *trainer.master_params]]
    _backward(trainer, model, 1)
    grads = trainer.master_params if master_weights else [model.inp.weight]
    grads[0].grad.view(-1)[0] = 1e36
    counter = counter_factory(trainer.optimizer)
    with counter:
        assert not trainer.step()
    assert counter.host_reads == 2 and counter.ops[_UNSCALE] == 2, counter.ops
    stats = trainer.stats
    assert (stats.skipped, stats.overflows, stats.grad_norm, stats.scale) == (1, 0, INF, 2.0**-10), stats
    for a, b in zip(before, [*model.parameters(), *trainer.master_params]):
        assert torch.equal(a, b)
    # a clean step at that scale takes the extra check but steps
    _backward(trainer, model, 2)
    assert trainer.step() and trainer.stats.steps == 2


def test_a_scale_of_at_least_one_needs_no_second_check(counter_factory):
    """1/scale <= 1 cannot overflow a finite gradient: no element-wise pass, one host read."""
    model = _block()
    trainer = _trainer(model, loss_scale=LossScaler(init_scale=1.0, dynamic=False, max_scale=None))
    for step in range(2):
        _backward(trainer, model, step)
        counter = counter_factory(trainer.optimizer)
        with counter:
            assert trainer.step()
    assert counter.host_reads == 1 and counter.ops[_UNSCALE] == 1, counter.ops


# ---------------------------------------------------------------- lazy statistics
def test_lazy_grad_norm_is_exact_when_read_and_none_once_the_gradients_changed():
    model = _block()
    trainer = _trainer(model)
    _backward(trainer, model, 0)
    assert trainer.step()
    inv = 1.0 / trainer.scaler.get_scale()
    assert trainer.stats.grad_norm > 0  # read right after the step: computed from the gradients it left
    # under O2 the gradients live in the arena: still there after zero_grad(), gone after the next harvest
    _backward(trainer, model, 1)
    scaled = trainer._masters.arena.flats[0].clone()
    assert trainer.step()
    trainer.zero_grad()
    assert trainer.stats.grad_norm == torch.linalg.vector_norm(scaled * inv).item()
    _backward(trainer, model, 2)
    assert trainer.step()
    _backward(trainer, model, 3)  # the harvest rewrites the arena before stats are read
    assert trainer.stats.grad_norm is None, trainer.stats
    # O1: zero_grad() frees the gradients
    o1_model = _block()
    o1 = _trainer(o1_model, master_weights=False)
    _backward(o1, o1_model, 0)
    assert o1.step()
    o1.zero_grad()
    assert o1.stats.grad_norm is None


def test_lazy_loss_is_the_window_mean():
    model = _block()
    trainer = _trainer(model, accumulation_steps=2)
    losses = []
    trainer.zero_grad()
    for step in range(2):
        x, y = _batch(step)
        loss = _loss(model, x, y)
        losses.append(loss.item())
        trainer.backward(loss)
        trainer.step()
    assert trainer.stats.loss == pytest.approx(sum(losses) / 2, rel=1e-6), (trainer.stats.loss, losses)


def test_state_dict_carries_the_settled_stats():
    model = _block()
    trainer = _trainer(model, loss_scale=LossScaler(init_scale=128.0, growth_interval=1))
    _backward(trainer, model, 0)
    assert trainer.step()
    saved = trainer.state_dict()["stats"]
    assert saved["scale"] == 256.0 and saved["loss"] is not None and saved["grad_norm"] > 0, saved


# ---------------------------------------------------------------- fused optimizer (opt-in)
def test_optimizer_fused_switches_only_default_groups_of_sgd_adam_adamw(counter_factory):
    model = _block()
    params = list(model.parameters())
    opt = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:4], "foreach": False},
                           {"params": params[4:]}], lr=0.05, momentum=0.9)
    trainer = MixedPrecisionTrainer(model, opt, precision="fp16", master_weights=True, optimizer_fused=True)
    assert trainer.fused_groups == 2 and trainer.foreach_groups == 0
    assert [g["fused"] for g in opt.param_groups] == [True, None, True]
    for step in range(2):
        _backward(trainer, model, step)
        counter = counter_factory(opt)
        with counter:
            assert trainer.step()
    assert counter.optimizer_ops["aten._fused_sgd_.default"] == 2, counter.optimizer_ops
    rms = torch.optim.RMSprop(_block().parameters())
    assert MixedPrecisionTrainer(_block(), rms, precision="bf16", optimizer_fused=True).fused_groups == 0
    stateful = _block()
    adam = torch.optim.Adam(stateful.parameters())
    stateful(torch.randn(2, 8)).sum().backward()
    adam.step()  # state exists: left to foreach
    trainer = MixedPrecisionTrainer(stateful, adam, precision="bf16", optimizer_fused=True)
    assert trainer.fused_groups == 0 and adam.param_groups[0]["foreach"] is True
    with pytest.raises(TypeError, match="optimizer_fused must be a bool"):
        MixedPrecisionTrainer(_block(), torch.optim.SGD(_block().parameters(), lr=0.1), optimizer_fused=1)


# ---------------------------------------------------------------- the benchmark that times it
def test_trainer_step_benchmark_runs_and_reports_both_opt_baselines(tmp_path, one_thread):
    """benchmarks/trainer_step.py end to end on one variant (no timing assertion: it only has to run)."""
    from benchmarks import trainer_step

    out = tmp_path / "trainer_step.json"
    result = trainer_step.main(["--rounds", "1", "--inner", "1", "--only", "O2_fp16", "--json", str(out)])
    assert set(result["variants"]) == {"autocast", "amp16", "amp16_fe", "O2_fp16"}, result["variants"].keys()
    entry = result["variants"]["O2_fp16"]
    assert entry["opt_base"] == {"same": "amp16_fe", "user": "amp16"} and entry["skipped"] == 0, entry
    assert entry["opt_vs_same"] > 0 and entry["opt_vs_user"] > 0 and out.exists()
