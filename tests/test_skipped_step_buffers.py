"""A skipped step leaves the model as it was (issue 44 item 7): the buffers its forward wrote are put back.

On the old code a batch norm's ``running_mean``/``running_var`` kept the statistics of the batch whose fp16
activations overflowed (inf/NaN) and ``num_batches_tracked`` counted it, in ``MixedPrecisionTrainer`` and in
the emitted train.py alike (``torch.amp.GradScaler`` does the same): every eval output after that was NaN.
The models are a small ResNet-style CNN with batch norms, converted to fp16 as users convert it.
"""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import converter
from converter.train.trainer import MixedPrecisionTrainer
from tests.helpers import ROOT

_NET = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class Net(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = Block(8, 16, stride=2)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.layer1(self.stem(x)).mean(dim=(2, 3)))


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randn(4, 3, 16, 16),)


def loss_fn(output, batch):
    return nn.functional.cross_entropy(output.float(), batch)


#: the first batch overflows fp16 (activations past 65504): its step is skipped; the later ones are normal
HUGE = 1e6


def train_batches():
    gen = torch.Generator().manual_seed(1)
    for step in range(100):
        x = torch.randn(4, 3, 16, 16, generator=gen) * (HUGE if step == 0 else 1.0)
        yield (x,), torch.randint(0, 5, (4,), generator=gen)
'''


def _net_module(tmp_path):
    path = tmp_path / "bn_net.py"
    path.write_text(_NET)
    spec = importlib.util.spec_from_file_location("bn_net_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _same_bits(a: dict, b: dict) -> list[str]:
    """The names whose tensors differ bit for bit (NaN payloads and -0.0 count)."""
    def bits(t):
        return t.view(torch.int64) if t.dtype == torch.int64 else t.float().view(torch.int32)
    return [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(bits(a[n]), bits(b[n]))]


def _step(trainer, model, loss_fn, x, y) -> bool:
    trainer.zero_grad()
    trainer.backward(loss_fn(model(x), y))
    return trainer.step()


@pytest.mark.parametrize("master_weights", [False, True], ids=["O1", "O2"])
def test_an_overflowing_fp16_step_leaves_the_batch_norm_statistics_as_they_were(tmp_path, master_weights):
    net_mod, _ = _net_module(tmp_path)
    net = net_mod.build_model().train()
    conv = converter.convert(net, net_mod.example_inputs(), precision="fp16")
    model = conv.module.train()
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    precision="fp16", master_weights=master_weights)
    batches = iter(net_mod.train_batches())
    (x, ), y = next(batches)
    before = _buffers(model)
    assert len(before) == 12, sorted(before)  # 4 batch norms: running_mean, running_var, num_batches_tracked
    assert not _step(trainer, model, net_mod.loss_fn, x, y)  # the huge batch: fp16 overflow, skipped
    assert trainer.stats.skipped == 1 and trainer.stats.steps == 0, trainer.stats
    changed = _same_bits(before, _buffers(model))
    assert changed == [], f"a skipped step changed {changed}"
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(5)))
    assert bool(torch.isfinite(out).all()), out
    model.train()
    # a normal step still updates them: every running statistic moves and each counter counts the batch
    (x, ), y = next(batches)
    assert _step(trainer, model, net_mod.loss_fn, x, y)
    after = _buffers(model)
    moved = _same_bits(before, after)
    assert sorted(moved) == sorted(before), f"a taken step left {sorted(set(before) - set(moved))} unchanged"
    assert all(int(after[n]) == 1 for n in after if n.endswith("num_batches_tracked")), after
    assert all(bool(torch.isfinite(t).all()) for t in after.values())


def test_a_skipped_window_of_several_forwards_is_undone_whole_and_a_forced_inf_gradient_too(tmp_path):
    """Accumulation over two batches, the second of which overflows: both forwards' writes go. Then a step
    whose inf comes from a gradient (set by hand after backward) with finite forwards: undone too."""
    net_mod, _ = _net_module(tmp_path)
    net = net_mod.build_model().train()
    model = converter.convert(net, net_mod.example_inputs(), precision="fp16").module.train()
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), precision="fp16",
                                    accumulation_steps=2)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 3, 16, 16, generator=gen), torch.randint(0, 5, (4,), generator=gen)
    before = _buffers(model)
    assert not _step(trainer, model, net_mod.loss_fn, x, y)  # inside the window
    assert not _step(trainer, model, net_mod.loss_fn, x * 1e6, y)  # its end: overflow, skipped
    assert trainer.stats.skipped == 1
    assert _same_bits(before, _buffers(model)) == []
    trainer.zero_grad()
    for _ in range(2):
        trainer.backward(net_mod.loss_fn(model(x), y))
        next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = math.inf
        trainer.step()
    assert trainer.stats.skipped == 2, trainer.stats
    assert _same_bits(before, _buffers(model)) == []


def _load(name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("skipped")
    net_mod, path = _net_module(tmp)
    conv = converter.convert(net_mod.build_model().train(), net_mod.example_inputs(), precision="fp16")
    out = tmp / "out"
    conv.save(out, model_file=str(path))
    return out


@pytest.mark.slow  # two train.py runs: ~30 s on 2 loaded cores
def test_train_py_with_the_trainer_saves_the_statistics_of_the_taken_steps_only(emitted, tmp_path):
    """train.py's first batch overflows (the model file's train_batches): step 1 is skipped. After 1 step the
    saved statistics are model.py's own, bit for bit; after 2, finite and counted once (on the old code: NaN)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    initial = _buffers(_load("skipped_model_py", emitted / "model.py").load())
    for steps in (1, 2):
        ckpt = tmp_path / f"s{steps}.pt"
        run = subprocess.run([sys.executable, str(emitted / "train.py"), "--steps", str(steps), "--save", str(ckpt)],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        first = next(line for line in run.stdout.splitlines() if line.startswith("step    1"))
        assert "step skipped" in first, run.stdout
        saved = torch.load(ckpt, weights_only=True)
        buffers = {n: saved[n] for n in initial}
        if steps == 1:
            assert _same_bits(initial, buffers) == [], run.stdout
        else:
            assert all(bool(torch.isfinite(t.float()).all()) for t in buffers.values()), buffers
            assert all(int(buffers[n]) == 1 for n in buffers if n.endswith("num_batches_tracked")), buffers


def test_train_py_without_the_package_restores_them_too(emitted, monkeypatch):
    """train.py's torch-only trainer (torch.amp.GradScaler), used where mpconvert is not installed."""
    monkeypatch.syspath_prepend(str(emitted))
    train = _load("skipped_train_py", emitted / "train.py")
    model = _load("skipped_model_py2", emitted / "model.py").load().train()
    trainer = train._TorchTrainer(model, torch.optim.SGD(model.parameters(), lr=0.05), precision="fp16",
                                  master_weights=False, max_grad_norm=None, accumulation_steps=1)
    user = _load("skipped_user_model", emitted / "user_model.py")
    batches = iter(user.train_batches())
    before = _buffers(model)
    (x, ), y = next(batches)
    assert not _step(trainer, model, user.loss_fn, x, y)
    assert _same_bits(before, _buffers(model)) == []
    (x, ), y = next(batches)
    assert _step(trainer, model, user.loss_fn, x, y)
    assert sorted(_same_bits(before, _buffers(model))) == sorted(before)


def test_a_model_without_buffers_gets_no_guard_and_no_hook():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    trainer = MixedPrecisionTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")
    assert len(trainer._buffer_guard) == 0 and not model._forward_pre_hooks
