"""Issue 43 item 4 (part C): stock models whose training was silently wrong.

* train-mode dropout survives LayerDrop handling: an M2M100 encoder-decoder as shipped (dropout 0.1,
  encoder/decoder LayerDrop 0.05: its stacks copy ``config.*_layerdrop`` onto ``self.layerdrop``) is one
  graph whose train mode draws the original's dropout masks; a DETR with its ResNet backbone (its encoder
  layer's train-only ``if not torch.isfinite(x).all()`` clamp cannot be traced) is converted region by
  region instead of being frozen in eval mode, and trains with its dropout;
* buffers that forward writes are written by the converted module as by the original: a VQ-VAE whose
  codebook is an EMA updated under ``no_grad`` in train mode, and a hand-written batch norm's running
  statistics (symbolic_trace ran ``self.avg.mul_(d)`` on the real buffer at trace time: the write was
  lost and what forward computed from the buffer became a constant).
"""
from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_half_ran, first_tensor, sqnr
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import converter

transformers = pytest.importorskip("transformers")


class _Dropouts(TorchDispatchMode):
    """Every train-mode ``native_dropout``: its ``p`` and the share of elements its mask kept."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[float, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.native_dropout and args[2] and args[1] > 0:
            mask = out[1]
            self.calls.append((float(args[1]), int(mask.sum()), mask.numel()))
        return out


def _dropouts(module, kwargs) -> _Dropouts:
    with _Dropouts() as seen:
        first_tensor(module(**kwargs))
    return seen


def _assert_trains_like(conv, model, kwargs, reference) -> None:
    """Two train-mode calls of ``conv.module`` differ; its dropouts are the original's (same p, as many calls),
    and the share of kept elements is 1 - p within 4 binomial sigmas."""
    conv.module.train()
    torch.manual_seed(1)
    a = first_tensor(conv.module(**kwargs)).float()
    b = first_tensor(conv.module(**kwargs)).float()
    assert not torch.equal(a, b), "two train-mode calls of conv.module are equal: dropout is off in training"
    reference.train()
    want = sorted(p for p, _, _ in _dropouts(reference, kwargs).calls)
    seen = _dropouts(conv.module, kwargs).calls
    assert sorted(p for p, _, _ in seen) == want, (sorted(p for p, _, _ in seen), want)
    for p in set(want):
        kept = sum(k for q, k, _ in seen if q == p)
        total = sum(n for q, _, n in seen if q == p)
        sigma = (p * (1 - p) / total) ** 0.5
        assert abs(kept / total - (1 - p)) < 4 * sigma, f"p={p}: kept {kept / total:.4f} of {total}, want {1 - p}"
    conv.module.eval()
    model.eval()
    with torch.no_grad():
        db = sqnr(first_tensor(model(**kwargs)), first_tensor(conv.module(**kwargs)).float())
        again = torch.equal(first_tensor(conv.module(**kwargs)), first_tensor(conv.module(**kwargs)))
    assert again, "eval mode is not deterministic"
    assert db > 25, f"eval output vs the original's: {db:.1f} dB"


@pytest.mark.slow
def test_m2m100_with_layerdrop_trains_with_its_dropout():
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    cfg = M2M100Config(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
    assert (cfg.dropout, cfg.encoder_layerdrop, cfg.decoder_layerdrop) == (0.1, 0.05, 0.05)  # as shipped
    torch.manual_seed(0)
    model = M2M100ForConditionalGeneration(cfg).eval()
    kwargs = {"input_ids": torch.randint(3, 96, (2, 10)), "decoder_input_ids": torch.randint(3, 96, (2, 7))}
    conv = converter.convert(model, ((), kwargs), precision="bf16")
    assert conv.partition is None, [b.reason for b in conv.partition.breaks]  # one graph: ONNX and model.py serve it
    modes = conv.report.records.capture.modes
    assert modes.startswith("follows train()/eval()") and "LayerDrop is off" in modes, modes
    reference = copy.deepcopy(model)  # every layer runs, as in the train graph
    reference.model.encoder.layerdrop = reference.model.decoder.layerdrop = 0.0
    _assert_trains_like(conv, model, kwargs, reference)
    assert model.model.encoder.layerdrop == 0.05 and not model.training  # the user's model is left as it was


@pytest.mark.slow
def test_detr_with_resnet_backbone_trains_with_its_dropout():
    from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig

    backbone = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1], layer_type="basic",
                            out_features=["stage4"])
    cfg = DetrConfig(use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False, d_model=32,
                     encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                     encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=5, num_labels=3)
    torch.manual_seed(0)
    model = DetrForObjectDetection(cfg).eval()
    kwargs = {"pixel_values": torch.randn(1, 3, 64, 64)}
    conv = converter.convert(model, ((), kwargs), precision="bf16")
    # its train mode does not trace whole (a train-only data-dependent clamp): region by region, not frozen
    assert conv.partition is not None and conv.partition.regions, conv.report.records.capture.modes
    located = [b.location for b in conv.partition.breaks if b.module == "model.encoder.layers.0"]
    assert located and located[0], [b.to_dict() for b in conv.partition.breaks]
    assert conv.partition.captured_flop_fraction > 0.9, conv.partition.captured_flop_fraction
    _assert_trains_like(conv, model, kwargs, copy.deepcopy(model))


@pytest.mark.slow
def test_wavlm_ctc_trains_with_its_specaugment_masks_and_dropout():
    """WavLM for CTC as shipped draws its SpecAugment masks with numpy's RNG in train mode: converted region by
    region (the draw is glue, with its reason), so training masks time steps (the learned mask embedding gets a
    gradient) and keeps its dropout, where a graph frozen in eval mode would do neither."""
    from transformers import WavLMConfig, WavLMForCTC

    cfg = WavLMConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
                      conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                      vocab_size=12, mask_time_prob=0.5, mask_time_length=2, num_buckets=32, max_bucket_distance=64)
    torch.manual_seed(0)
    model = WavLMForCTC(cfg).train()
    kwargs = {"input_values": torch.randn(2, 1600, generator=torch.Generator().manual_seed(1))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = converter.convert(model, ((), kwargs), precision="bf16")
    assert conv.partition is not None and conv.partition.regions, conv.report.records.capture.modes
    reasons = {b.module: b.reason for b in conv.partition.breaks}
    assert "numpy.random" in reasons.get("wavlm", ""), reasons
    assert_half_ran(conv, min_share=0.9, label="wavlm")
    module = conv.module.train()
    embed = dict(module.named_parameters())["wavlm.masked_spec_embed"]
    embed.grad = None
    first_tensor(module(**kwargs)).float().sum().backward()
    assert embed.grad is not None and embed.grad.abs().sum() > 0, "no time step was masked in training"
    _assert_trains_like(conv, model, kwargs, copy.deepcopy(model))


# ---------------------------------------------------------------------------------------------
# buffers that forward writes


class EMACodebook(nn.Module):
    """A VQ-VAE codebook kept as an exponential moving average of the encodings assigned to each code
    (van den Oord et al., 2017, appendix), updated in forward in train mode."""

    def __init__(self, num_codes: int = 32, dim: int = 16, decay: float = 0.9, eps: float = 1e-5):
        super().__init__()
        self.decay, self.eps, self.num_codes = decay, eps, num_codes
        embed = torch.randn(num_codes, dim)
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.ones(num_codes))
        self.register_buffer("embed_avg", embed.clone())

    def forward(self, z):
        b, d, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, d)
        dist = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.embed.t() + self.embed.pow(2).sum(1)[None]
        codes = dist.argmin(1)
        quant = F.embedding(codes, self.embed)
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(codes, self.num_codes).type(flat.dtype)
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(onehot.t() @ flat, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                size = (self.cluster_size + self.eps) / (n + self.num_codes * self.eps) * n
                self.embed.copy_(self.embed_avg / size[:, None])
        commit = F.mse_loss(flat, quant.detach())
        quant = flat + (quant - flat).detach()  # straight-through
        return quant.reshape(b, h, w, d).permute(0, 3, 1, 2), commit


class VQVAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 32, 4, 2, 1), nn.ReLU(), nn.Conv2d(32, 16, 3, 1, 1))
        self.vq = EMACodebook()
        self.dec = nn.Sequential(nn.ConvTranspose2d(16, 32, 4, 2, 1), nn.ReLU(), nn.Conv2d(32, 3, 3, 1, 1))

    def forward(self, x):
        quant, commit = self.vq(self.enc(x))
        return self.dec(quant), commit


class HandBatchNorm(nn.Module):
    """A batch norm as a research codebase writes it: batch statistics in train mode, running ones in eval."""

    def __init__(self, channels: int, momentum: float = 0.1, eps: float = 1e-5):
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x):
        if self.training:
            mean = x.mean(dim=(0, 2))
            var = x.var(dim=(0, 2), unbiased=False)
            n = x.numel() / x.shape[1]
            with torch.no_grad():
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * var * n / (n - 1))
        else:
            mean, var = self.running_mean, self.running_var
        x = (x - mean[None, :, None]) / torch.sqrt(var[None, :, None] + self.eps)
        return x * self.weight[None, :, None] + self.bias[None, :, None]


class ConvNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(4, 32, 3, padding=1)
        self.norm1 = HandBatchNorm(32)
        self.conv2 = nn.Conv1d(32, 32, 3, padding=1)
        self.norm2 = HandBatchNorm(32)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        x = F.gelu(self.norm1(self.conv1(x)))
        x = F.gelu(self.norm2(self.conv2(x)))
        return self.head(x.mean(-1))


def _train_calls(model, batches, *, autocast=None):
    model.train()
    for x in batches:
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            model(x)


def _buffers_after_training(build, shape, steps: int = 6) -> dict:
    """(SQNR vs the fp32 original after ``steps`` train-mode calls) of each buffer and of the eval output, for the
    conversion and for autocast; the buffers of the conversion are the original's (shared), so the fp32 reference
    and autocast run on copies taken before."""
    torch.manual_seed(0)
    model = build()
    reference, amp = copy.deepcopy(model), copy.deepcopy(model)
    example = torch.randn(*shape)
    conv = converter.convert(model, (example,), precision="bf16")
    batches = [torch.randn(*shape) for _ in range(steps)]
    _train_calls(conv.module, batches)
    _train_calls(reference, batches)
    _train_calls(amp, batches, autocast=torch.bfloat16)
    out: dict = {}
    mine, theirs = dict(model.named_buffers()), dict(amp.named_buffers())
    for name, want in reference.named_buffers():
        out[name] = (sqnr(want, mine[name]), sqnr(want, theirs[name]))
    for module in (conv.module, reference, amp):
        module.eval()
    with torch.no_grad():
        want = first_tensor(reference(example))
        got = first_tensor(conv.module(example)).float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            theirs = first_tensor(amp(example)).float()
    out["eval output"] = (sqnr(want, got), sqnr(want, theirs))
    return out


def _assert_written(measured: dict, *, floor: float) -> None:
    text = ", ".join(f"{k}: ours {a:.1f} dB, autocast {b:.1f} dB" for k, (a, b) in measured.items())
    for name, (ours, amp) in measured.items():
        assert ours >= min(amp - 1.0, 60.0) and ours >= floor, f"{name} after train-mode calls: {text}"


def test_vqvae_ema_codebook_is_written_in_train_mode():
    measured = _buffers_after_training(VQVAE, (4, 3, 16, 16))
    assert set(measured) == {"vq.embed", "vq.cluster_size", "vq.embed_avg", "eval output"}, measured
    # the codebook assignments flip where a distance is within bf16's rounding, as autocast's do: the
    # eval output is held to 20 dB (the lost writes gave -6 dB), the codebook to autocast's SQNR - 1 dB
    measured_out = measured.pop("eval output")
    _assert_written(measured, floor=25.0)
    assert measured_out[0] >= 20.0 and measured_out[0] >= measured_out[1] - 6.0, f"eval output: {measured_out}"
    assert measured_out[0] < 100.0, f"eval output {measured_out[0]:.1f} dB against fp32's: did bf16 run?"


def test_hand_written_norm_running_statistics_are_written():
    measured = _buffers_after_training(ConvNormNet, (8, 4, 24))
    assert set(measured) == {"norm1.running_mean", "norm1.running_var", "norm2.running_mean", "norm2.running_var",
                             "eval output"}, measured
    _assert_written(measured, floor=30.0)


# ---------------------------------------------------------------------------------------------
# a conversion well under autocast on its own example is never silent

_OFFSET_MODEL = """\
import torch
from torch import nn


class Offset(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("offset", torch.full((16,), 1000.0))

    def forward(self, x):
        return (self.fc(x) + self.offset) - self.offset


def build_model():
    torch.manual_seed(0)
    return Offset().eval()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(8, 16),)
"""


def test_a_conversion_well_under_autocast_warns_naming_the_node_and_the_rule(tmp_path, capsys):
    """A rules file puts the buffer offset's add in bf16 (autocast promotes it to fp32): measure() warns, naming the
    add and the [node] rule; that rule closes the gap; the CLI says it once on stderr and in its summary."""
    from converter.cli.main import main as cli_main
    from converter.numerics.gap import BelowAutocastWarning
    from converter.numerics.measure import measure

    (tmp_path / "model.py").write_text(_OFFSET_MODEL)
    namespace: dict = {}
    exec(compile(_OFFSET_MODEL, "model.py", "exec"), namespace)
    model, example = namespace["build_model"](), namespace["example_inputs"]()
    bad = tmp_path / "bad.toml"
    bad.write_text('[op]\nadd = "half"\nsub = "half"\n')
    conv = converter.convert(model, example, precision="bf16", rules=[bad])
    with pytest.warns(BelowAutocastWarning) as caught:
        numbers = measure(conv)["numerics"]
    ours, amp = numbers["vs_fp32"]["sqnr_db"], numbers["autocast_vs_fp32"]["sqnr_db"]
    assert amp - ours > 3, (ours, amp)
    text = str(caught[0].message)
    node = numbers["worst"][0]["name"]
    assert node in ("add", "sub") and f"node {node!r}" in text and f'[node] "{node}" = "fp32"' in text, text
    assert f"{ours:.1f} dB" in text and f"{amp:.1f} dB" in text, text
    first = node
    pinned: list[str] = []
    for _ in range(3):  # each warning's rule, applied, until none is said
        pinned.append(node)
        fixed = tmp_path / "fixed.toml"
        fixed.write_text("[node]\n" + "".join(f'"{n}" = "fp32"\n' for n in pinned))
        conv = converter.convert(model, example, precision="bf16", rules=[bad, fixed])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", BelowAutocastWarning)
            numbers = measure(conv)["numerics"]
        said = [w for w in caught if issubclass(w.category, BelowAutocastWarning)]
        if not said:
            break
        node = numbers["worst"][0]["name"]
    assert not said, (pinned, [str(w.message) for w in said])
    assert numbers["autocast_vs_fp32"]["sqnr_db"] - numbers["vs_fp32"]["sqnr_db"] <= 3, numbers["vs_fp32"]
    capsys.readouterr()
    assert cli_main([str(tmp_path / "model.py"), "--rules", str(bad), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr()
    said = [line for line in err.err.splitlines() if "under torch.autocast" in line]
    assert len(said) == 1 and f'[node] "{first}" = "fp32"' in said[0], err.err



# ---------------------------------------------------------------------------------------------
# fully masked attention rows


class PaddedEncoder(nn.Module):
    """Self-attention over left-padded sequences, its mask built as Hugging Face builds it (``finfo(float32).min``
    where a key is padding, added to the scores): the rows of padded queries are masked entirely, and the original
    gives them the uniform average of the values."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, padding):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = padding.view(b, 1, 1, t) * torch.finfo(torch.float32).min
        causal = torch.triu(torch.ones(t, t) * torch.finfo(torch.float32).min, diagonal=1)
        mask = torch.minimum(mask, causal.view(1, 1, t, t))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def test_fully_masked_rows_equal_the_original_in_module_model_py_and_onnx(tmp_path):
    import numpy as np
    import onnxruntime as ort

    torch.manual_seed(0)
    model = PaddedEncoder().eval()
    x = torch.randn(2, 12, 32)
    padding = torch.zeros(2, 12)
    padding[0, :5], padding[1, :2] = 1.0, 1.0  # left padding: queries 0-4 and 0-1 see no key
    rows = padding.bool()
    conv = converter.convert(model, (x, padding), precision="fp16")
    assert_half_ran(conv, label="padded encoder")
    with torch.no_grad():
        want = model(x, padding)
        got = conv.module(x, padding).float()
    # the mask reaches attention in fp32 (a cast to half made it -inf, and those rows zeros)
    sdpa = [n for n in conv.module.graph.nodes if "attention" in str(n.target)]
    assert len(sdpa) == 1 and sdpa[0].args[3].name == "minimum", sdpa[0].format_node()
    masked, kept = sqnr(want[rows], got[rows]), sqnr(want[~rows], got[~rows])
    assert masked > 40 and kept > 40, f"fully masked rows {masked:.1f} dB, the others {kept:.1f} dB vs fp32"
    conv.save(tmp_path / "out")
    spec = importlib.util.spec_from_file_location("emitted_padded", tmp_path / "out" / "model.py")
    emitted = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emitted)
    with torch.no_grad():
        from_file = emitted.load()(x, padding).float()
    assert torch.equal(from_file, got), (from_file - got).abs().max()
    result = conv.export_onnx(tmp_path / "padded.onnx", compare_size=False)
    assert result.ok, (result.checks, result.notes)
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    onnx_out = torch.from_numpy(np.asarray(session.run(None, dict(zip(names, (x.numpy(), padding.numpy()))))[0])).float()
    db = sqnr(want[rows], onnx_out[rows])
    assert db > 40, f"ONNX fully masked rows vs fp32: {db:.1f} dB"
