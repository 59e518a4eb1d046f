"""The Lightning precision plugin (converter.lightning.MixedPrecision): Trainer(plugins=[...]) trains the
converted module in bf16 and fp16 (loss scaling, O2 master weights), checkpoints the scaler and the
masters, and resumes from them. Tiny tensors: fp16 matmuls are slow on this CPU."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

pl = pytest.importorskip("pytorch_lightning")

import converter  # noqa: E402
from converter.lightning import MixedPrecision  # noqa: E402

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.linear.default, torch.ops.aten.bmm.default}


class _MatmulDtypes(TorchDispatchMode):
    """The dtypes of the matmuls a step runs (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _MATMULS:
            self.dtypes.add(args[1].dtype if func is torch.ops.aten.addmm.default else args[0].dtype)
        return func(*args, **(kwargs or {}))


class TinyRegressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Dropout(0.1), nn.Linear(32, 1))
        self.example_input_array = torch.randn(8, 16)
        self.seen: list[set] = []
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        probe = _MatmulDtypes()
        with probe:
            loss = nn.functional.mse_loss(self(x).float(), y)
        self.seen.append(probe.dtypes)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(n: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = x[:, :4].sum(-1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _fit(plugin, tmp_path, *, steps: int, ckpt_path=None, model=None):
    torch.manual_seed(0)
    model = model or TinyRegressor()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, plugins=[plugin], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return model, trainer


def test_bf16_plugin_converts_at_setup_and_trains(tmp_path):
    model, trainer = _fit(MixedPrecision("bf16-mixed"), tmp_path, steps=8)
    assert converter.conversion_of(model) is not None, "the plugin did not convert the module"
    assert trainer.precision == "bf16-mixed"
    assert all(seen == {torch.bfloat16} for seen in model.seen), model.seen  # every matmul, forward and backward
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # O1: fp32 parameters
    assert model.losses[-1] < model.losses[0], model.losses


def test_without_the_plugin_nothing_is_converted(tmp_path):
    """The check above can fail: plain fp32 Lightning runs fp32 matmuls and converts nothing."""
    torch.manual_seed(0)
    model = TinyRegressor()
    pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False, default_root_dir=tmp_path).fit(model, _data())
    assert converter.conversion_of(model) is None and all(seen == {torch.float32} for seen in model.seen), model.seen


def test_fp16_o2_trains_checkpoints_and_resumes(tmp_path):
    plugin = MixedPrecision("16-mixed", opt_level="O2", loss_scale=2.0 ** 12)
    model, trainer = _fit(plugin, tmp_path, steps=6)
    (mp,) = plugin.trainers
    assert mp.scaler is not None and mp.stats.steps == 6 and mp.stats.skipped == 0, mp.stats
    assert all(seen == {torch.float16} for seen in model.seen), model.seen
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["net.0.weight"] == torch.float16 and dtypes["net.4.weight"] == torch.float16  # O2: weights in half
    assert dtypes["net.2.weight"] == torch.float32  # the LayerNorm keeps fp32 storage
    assert all(m.dtype == torch.float32 for m in mp.master_params)
    # the checkpoint holds the plugin's state: scaler and fp32 masters
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    state = ckpt["MixedPrecision"]["trainers"][0]
    assert state["scaler"]["scale"] == mp.scaler.get_scale() and set(state["master"]) == {"net.0.weight", "net.0.bias",
                                                                                          "net.4.weight", "net.4.bias"}
    saved_master = state["master"]["net.0.weight"]
    # resume in a fresh Trainer with a fresh plugin: scaler, masters and counters come back exactly
    plugin2 = MixedPrecision("16-mixed", opt_level="O2", loss_scale=2.0 ** 12)
    resumed = TinyRegressor()
    captured = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            (t,) = plugin2.trainers
            captured["scale"] = t.scaler.get_scale()
            captured["master"] = dict(zip(("net.0.weight",), (m.detach().clone() for m in t.master_params[:1])))
            captured["steps"] = t.stats.steps

    trainer2 = pl.Trainer(max_steps=8, accelerator="cpu", plugins=[plugin2], logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[Probe()])
    trainer2.fit(resumed, _data(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert captured["scale"] == state["scaler"]["scale"] and captured["steps"] == 6, captured
    assert torch.equal(captured["master"]["net.0.weight"], saved_master)
    assert plugin2.trainers[0].stats.steps == 8
    assert all(seen == {torch.float16} for seen in resumed.seen), resumed.seen


def test_plugin_needs_example_inputs(tmp_path):
    class NoExample(TinyRegressor):
        def __init__(self):
            super().__init__()
            self.example_input_array = None

    with pytest.raises(converter.MpconvertError, match="example_input_array"):
        _fit(MixedPrecision("bf16-mixed"), tmp_path, steps=1, model=NoExample())
