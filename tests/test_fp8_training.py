"""FP8 training on real batches and through every training integration (issue 34, deliver item 5).

Padded and odd batches: the token count M (batch x sequence) is the contraction of the grad_weight GEMM, which
CUDA ``_scaled_mm`` wants a multiple of 16; the kernels zero-pad it on the float8 operands. Here, for odd M
(21 and 1): bit-equal to the dequantise-then-matmul emulation with oneDNN off, the recipe's exact number of
``_scaled_mm`` calls, every call shaped as CUDA accepts it (torch's ``ScaledBlas.cpp`` checks), the padded
grad_weight GEMM's scales identical to the unpadded operands' and its result equal to a float64 matmul of
the unpadded operands. Then transformers' Llama (library defaults: SDPA, use_cache) converted in place with
``precision="fp8"`` trains on a right-padded batch (lengths 13/9/5, mask 0 and labels -100 at the pads), on
batch 1 and on an odd 5x7 batch: each fp8 layer's weight gradient against the bf16 conversion's.

Integrations: ``MixedPrecisionTrainer`` (O2: fp32 masters, bf16 storage; its checkpoint holds no float8 and
resumes bit-identically), the CLI's train.py (runs the scaled GEMMs on odd batches; ``--save`` and
model.safetensors keep the stored fp32), FSDP2 over gloo (2 processes, equal to one process), the Lightning
plugin (``MixedPrecision("fp8")``), and a ``save_pretrained`` round-trip of the fp8-converted Llama.
"""
from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import textwrap
import warnings
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import converter
from converter.fp8.kernels import ALIGN, RECIPES, emulate_linear, fp8_linear, quantize_operand
from converter.inplace import converted_forward
from converter.train.trainer import MixedPrecisionTrainer
from tests.helpers import ROOT, sqnr
from tests.test_fp8_rules import _MODEL_FILE as _NET

#: the per-layer floors of a weight gradient against the bf16 conversion, whole model, one batch: the fp8 layers'
#: errors compound (measured 15.9-21.1 dB, cosine 0.987-0.996); a dropped gradient is 0 dB (cosine 0), a wrong
#: sign -6 dB (cosine -1)
GW_DB, GW_COS = 14.0, 0.98
#: a fp8 conversion's loss against the bf16 conversion's (measured within 0.3 %)
LOSS_RTOL = 0.02


class ScaledMM(TorchDispatchMode):
    """Each ``aten._scaled_mm`` call's operands and scales, as passed."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            self.calls.append(tuple(args[:4]))
        return func(*args, **(kwargs or {}))


def _cuda_refusals(a: torch.Tensor, b: torch.Tensor) -> list[str]:
    """What CUDA ``_scaled_mm`` would refuse in ``a @ b`` (torch's aten/src/ATen/native/cuda/ScaledBlas.cpp,
    ``_scaled_mm_out_cuda``: mat1's columns and both dims of mat2 multiples of 16; cuBLASLt on sm90: mat1
    row-major, mat2 column-major). mat1's rows (M in the forward and grad_input GEMMs) are not checked."""
    found = []
    if a.shape[1] % 16:
        found.append(f"mat1 {tuple(a.shape)}: trailing dimension not divisible by 16")
    if b.shape[0] % 16 or b.shape[1] % 16:
        found.append(f"mat2 {tuple(b.shape)}: not divisible by 16")
    if not a.is_contiguous():
        found.append(f"mat1 strides {a.stride()}: not row-major")
    if not b.t().is_contiguous():
        found.append(f"mat2 strides {b.stride()}: not column-major")
    return found


# ------------------------------------------------------------------------------ the kernels on odd M


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(3, 7), (1,)], ids=["M21", "M1"])
@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_gw_hp"])
def test_odd_token_counts_train_bit_equal_to_the_emulation(name, lead, dtype):
    recipe, k, n = RECIPES[name], 64, 48
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    g = torch.randn(*lead, n, generator=gen).to(dtype)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.backends.mkldnn.flags(enabled=False):
        with ScaledMM() as seen:
            y = fp8_linear(xg, wg, b, name)
            y.backward(g)
        want = emulate_linear(x, w, b, g, name)
    for label, got, ref in zip(("output", "grad_input", "grad_weight"), (y.detach(), xg.grad, wg.grad), want):
        assert got.dtype == dtype and torch.equal(got, ref), f"{name} M={x[..., 0].numel()} {label} differs from the emulation"
    assert len(seen.calls) == recipe.scaled_mm_calls, [tuple(a.shape) for a, *_ in seen.calls]
    refused = {i: _cuda_refusals(a8, b8) for i, (a8, b8, _, _) in enumerate(seen.calls)}
    assert not any(refused.values()), refused
    if "grad_weight" not in recipe.scaled_gemms:
        return
    m = x[..., 0].numel()
    padded = -(-m // ALIGN) * ALIGN
    a8, b8, scale_a, scale_b = seen.calls[-1]  # grad_weight: (dy^T, x) with M zero-padded
    assert (tuple(a8.shape), tuple(b8.shape)) == ((n, padded), (padded, k)), (a8.shape, b8.shape)
    assert not a8[:, m:].float().any() and not b8[m:].float().any()
    g2, x2 = g.reshape(-1, n), x.reshape(-1, k)
    a_ref = quantize_operand(g2.t(), recipe.grad_output_dtype, recipe, contract_dim=1)
    b_ref = quantize_operand(x2, recipe.input_dtype, recipe, contract_dim=0)
    assert torch.equal(scale_a, a_ref[1]) and torch.equal(scale_b, b_ref[1]), "padding changed a scale"
    if dtype == torch.float32:  # the padded GEMM sums exactly the unpadded terms (fp32 rounding: <= 1.4e-7 measured)
        exact = (a_ref[0].double() * a_ref[1].double()) @ (b_ref[0].double() * b_ref[1].double())
        err = (wg.grad.double() - exact).abs().max().item() / exact.abs().max().item()
        assert err < 1e-6, f"{name} M={m}: grad_weight off the float64 product of the unpadded operands by {err:.2e}"


# ------------------------------------------------------------------ transformers' Llama, padded batches

_LLAMA = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
#: (lengths, padded width): a right-padded batch, batch 1, an odd 5 x 7 batch
BATCHES = {"padded_3x13": ([13, 9, 5], 13), "batch_1x9": ([9], 9), "odd_5x7": ([7] * 5, 7)}
#: the fp8 layers of the 2-layer Llama: 7 linears a layer, less the first (q_proj of layer 0); lm_head stays bf16
LLAMA_FP8 = 13


def _padded(lengths: list[int], width: int, seed: int = 0) -> dict:
    """A right-padded batch: attention_mask 0 and labels -100 at the pads (the pad id 0)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, _LLAMA["vocab_size"], (len(lengths), width), generator=gen)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal LM loss (next-token cross-entropy, -100 ignored), computed outside the model: labels passed to
    the model add a guard that ties its batch and length to the example's (no dynamic dims)."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def _rules(tmp_path, floor: int) -> str:
    path = tmp_path / "fp8_gates.toml"
    path.write_text(f"[settings]\nfp8_min_flops_per_token = {floor}\n", encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The Llama converted in place with precision fp8 on a padded batch, and its bf16 conversion."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA))
    assert model.config._attn_implementation == "sdpa" and model.config.use_cache, "not the library's defaults"
    lengths, width = BATCHES["padded_3x13"]
    example = {k: v for k, v in _padded(lengths, width, seed=99).items() if k != "labels"}
    stored = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", converter.SlowHalfWarning)
        reference = converter.convert(copy.deepcopy(model), ((), example), precision="bf16").module
        converter.apply(model, example, precision="fp8", rules=[_rules(tmp_path_factory.mktemp("rules"), 1024)])
    fp8 = converter.conversion_of(model).report.records.fp8.to_dict()
    assert fp8["recipe"] == "tensorwise" and fp8["count"] == LLAMA_FP8, fp8
    return SimpleNamespace(model=model, reference=reference, layers=set(fp8["layers"]), stored=stored)


def _fp8_weight_grads(module: nn.Module, layers: set) -> dict:
    return {n: p.grad for n, p in module.named_parameters() if n.endswith(".weight") and n[:-7].replace(".", "_") in layers}


@pytest.mark.parametrize("which", list(BATCHES))
def test_hf_llama_trains_in_fp8_on_padded_and_odd_batches(llama, which):
    batch = _padded(*BATCHES[which], seed=len(which))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    losses = {}
    for label, module in (("fp8", llama.model), ("bf16", llama.reference)):
        module.zero_grad(set_to_none=True)
        with ScaledMM() as seen:
            out = module(**inputs)
            loss = _lm_loss(out["logits"], batch["labels"])
            loss.backward()
        losses[label] = loss.item()
        if label == "fp8":
            assert len(seen.calls) == 3 * LLAMA_FP8, f"{which}: {len(seen.calls)} _scaled_mm calls"
            refused = [r for a8, b8, _, _ in seen.calls for r in _cuda_refusals(a8, b8)]
            assert not refused, refused
    forward = converted_forward(llama.model)
    assert forward.calls["fallback"] == 0 and forward.calls["recaptured"] == 0, forward.calls
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values()), losses
    assert abs(losses["fp8"] - losses["bf16"]) <= LOSS_RTOL * losses["bf16"], losses
    got, want = _fp8_weight_grads(llama.model, llama.layers), _fp8_weight_grads(llama.reference, llama.layers)
    assert len(got) == len(want) == LLAMA_FP8
    measured = {n: (sqnr(want[n].float(), got[n].float()), F.cosine_similarity(want[n].flatten().float(),
                                                                               got[n].flatten().float(), dim=0).item())
                for n in want}
    worst_db = min(measured.items(), key=lambda item: item[1][0])
    worst_cos = min(measured.items(), key=lambda item: item[1][1])
    print(f"\nLlama fp8 vs bf16, {which}: loss {losses['fp8']:.4f} vs {losses['bf16']:.4f}, weight gradients worst "
          f"{worst_db[1][0]:.2f} dB ({worst_db[0]}), worst cosine {worst_cos[1][1]:.4f} ({worst_cos[0]})")
    assert worst_db[1][0] >= GW_DB, f"{which}: weight-gradient SQNR {worst_db[1][0]:.2f} dB < {GW_DB} ({worst_db[0]})"
    assert worst_cos[1][1] >= GW_COS, f"{which}: weight-gradient cosine {worst_cos[1][1]:.4f} < {GW_COS} ({worst_cos[0]})"


def test_save_pretrained_of_the_fp8_model_round_trips_its_fp32_weights(llama, tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    model = llama.model
    assert {k: v.dtype for k, v in model.state_dict().items()} == {k: v.dtype for k, v in llama.stored.items()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = _padded(*BATCHES["padded_3x13"], seed=7)
    optimizer.zero_grad()
    _lm_loss(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["logits"], batch["labels"]).backward()
    optimizer.step()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        changed = [k for k in trained if not torch.equal(trained[k], before[k])]
        assert sum(k.endswith("_proj.weight") for k in changed) == 14, changed  # the fp8 layers and layer 0's q_proj
        model.save_pretrained(tmp_path / "ckpt")
        files = sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors"))
        saved = {k: v for f in files for k, v in load_file(tmp_path / "ckpt" / f).items()}
        assert {str(v.dtype) for v in saved.values()} == {"torch.float32"}, {str(v.dtype) for v in saved.values()}
        plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ckpt")
        loaded = plain.state_dict()
        assert sorted(loaded) == sorted(trained)
        bad = [k for k in trained if loaded[k].dtype != trained[k].dtype or not torch.equal(loaded[k], trained[k])]
        assert not bad, f"save_pretrained/from_pretrained changed {bad}"
    finally:
        model.load_state_dict(before)  # the module-scoped fixture's weights, for any later test


# ------------------------------------------------------------------------------------ the trainer

class Mlp(nn.Module):
    """Four linears 32 -> 64 -> 64 -> 64 -> 32: the gates keep the first and the last bf16, ``a`` and ``b`` fp8."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.out = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.out(torch.relu(self.b(torch.relu(self.a(torch.relu(self.inp(x)))))))


def _mlp_conversion(rules: str, opt_level: str = "O1"):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", converter.SlowHalfWarning)
        conv = converter.convert(Mlp(), (torch.randn(2, 7, 32),), precision="fp8", rules=[rules], opt_level=opt_level)
    assert conv.report.records.fp8.layers == ["a", "b"], conv.report.records.fp8.to_dict()
    return conv


def _mlp_batch(step: int, rows: int = 3):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(rows, 7, 32, generator=gen), torch.randn(rows, 7, 32, generator=gen)


def _tensors(value, path=""):
    """Every tensor in a nested checkpoint, with its path."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{path}[{i}]")


def test_trainer_o2_checkpoint_holds_fp32_masters_and_stored_weights_and_resumes(tmp_path):
    conv = _mlp_conversion(_rules(tmp_path, 1024), "O2")
    fresh = copy.deepcopy(conv.module)

    def trainer_for(module):
        return MixedPrecisionTrainer(module, torch.optim.AdamW(module.parameters(), lr=1e-3), precision=conv.precision,
                                     master_weights=True)

    trainer = trainer_for(conv.module)
    for step in range(2):  # 3 x 7 = 21 tokens: an odd M in every grad_weight GEMM
        x, y = _mlp_batch(step)
        trainer.zero_grad()
        with ScaledMM() as seen:
            trainer.backward(F.mse_loss(conv.module(x).float(), y))
        assert trainer.step() and len(seen.calls) == 2 * 3, len(seen.calls)
    state = trainer.state_dict()
    dtypes = {path: t.dtype for path, t in _tensors(state)}
    assert not any(d in (torch.float8_e4m3fn, torch.float8_e5m2) for d in dtypes.values()), dtypes
    stored = {n: p.dtype for n, p in conv.module.named_parameters()}
    assert set(stored.values()) == {torch.bfloat16}, stored  # O2: every linear's weight stored in bf16
    assert {n: t.dtype for n, t in state["model"].items()} == stored
    masters = list(_tensors(state["master"]))
    assert len(masters) == len(stored) and {t.dtype for _, t in masters} == {torch.float32}, masters
    path = tmp_path / "trainer.pt"
    torch.save(state, path)
    resumed = trainer_for(fresh)
    resumed.load_state_dict(torch.load(path, weights_only=True))
    for module, run in ((conv.module, trainer), (fresh, resumed)):
        x, y = _mlp_batch(5)
        run.zero_grad()
        run.backward(F.mse_loss(module(x).float(), y))
        assert run.step()
    diff = [n for (n, p), q in zip(conv.module.named_parameters(), fresh.parameters()) if not torch.equal(p, q)]
    assert not diff, f"the resumed run differs from the continued one in {diff}"


# ------------------------------------------------------------------------------------- train.py (CLI)

# the CLI model file: test_fp8_rules' Net, with real batches of an odd token count and a loss
_MODEL_FILE = _NET + '''

def train_batches():  # 3 x 7 = 21 tokens: no multiple of 16
    gen = torch.Generator().manual_seed(0)
    while True:
        tokens = torch.randint(0, 128, (3, 7), generator=gen)
        yield (tokens,), tokens


def loss_fn(output, batch):
    return torch.nn.functional.cross_entropy(output.float().flatten(0, 1), batch.flatten())
'''

#: runs train.py (argv[2:]) under a dispatch mode that counts aten._scaled_mm, and writes the count to argv[1]
_COUNTING = textwrap.dedent(
    """
    import runpy, sys
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is torch.ops.aten._scaled_mm.default
            return func(*args, **(kwargs or {}))

    out, sys.argv = sys.argv[1], sys.argv[2:]
    try:
        with Count():
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code:
            raise
    open(out, "w").write(str(Count.n))
    """
)


def test_train_py_of_an_fp8_conversion_runs_the_scaled_gemms_and_saves_fp32(tmp_path, capfd):
    from safetensors.torch import load_file

    from converter.cli.main import main

    (tmp_path / "net.py").write_text(_MODEL_FILE, encoding="utf-8")
    out = tmp_path / "out"
    code = main([str(tmp_path / "net.py"), "--precision", "fp8", "--rules", _rules(tmp_path, 4096), "--out", str(out),
                 "-q", "--no-measure"])
    assert code == 0, capfd.readouterr().err
    weights = load_file(out / "model.safetensors")
    assert {str(v.dtype) for v in weights.values()} == {"torch.float32"}, {k: v.dtype for k, v in weights.items()}
    (tmp_path / "count.py").write_text(_COUNTING, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(tmp_path / "count.py"), str(tmp_path / "calls.txt"), str(out / "train.py"),
                          "--steps", "2", "--save", str(tmp_path / "ckpt.pt")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "in bf16 (O1), the GEMMs of 2 linear(s) in fp8 (tensorwise) on cpu with train_batches()/loss_fn" in run.stdout, run.stdout
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and "skipped 0" in steps[-1], run.stdout
    calls = int((tmp_path / "calls.txt").read_text())
    assert calls == 2 * 3 * 2, f"{calls} _scaled_mm calls for 2 steps of 2 fp8 linears"  # down and mid
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert sorted(saved) == sorted(weights) and {v.dtype for v in saved.values()} == {torch.float32}, saved.keys()
    assert any(not torch.equal(saved[k], weights[k]) for k in ("down.weight", "mid.weight")), "train.py did not train"


# ----------------------------------------------------------------------------------------- FSDP2

WORLD, FSDP_STEPS = 2, 3


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fsdp_worker(rank: int, port: int, rules: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)  # two processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    module = fully_shard(_mlp_conversion(rules).module, mesh=init_device_mesh("cpu", (WORLD,)))
    trainer = MixedPrecisionTrainer(module, torch.optim.SGD(module.parameters(), lr=0.05), precision="bf16")
    calls = []
    for step in range(FSDP_STEPS):  # rank r: rows 2r, 2r + 1 of a 4-row batch, 2 x 7 = 14 tokens
        x, y = _mlp_batch(step, rows=2 * WORLD)
        rows = slice(2 * rank, 2 * rank + 2)
        with ScaledMM() as seen:
            trainer.zero_grad()
            trainer.backward(F.mse_loss(module(x[rows]).float(), y[rows]))
            assert trainer.step()
        calls.append(len(seen.calls))
    params = {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}
    stored = sorted({str(v.dtype) for v in trainer.state_dict()["model"].values()})
    torch.save({"calls": calls, "params": params, "stored": stored}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # no rank tears gloo down while a peer still has a collective in flight
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_fsdp2_trains_an_fp8_conversion_as_one_process_does(tmp_path):
    import torch.multiprocessing as mp

    rules = _rules(tmp_path, 1024)
    mp.spawn(_fsdp_worker, args=(_free_port(), rules, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for rank in ranks:  # the unsharded weights reach Fp8Linear: 2 fp8 linears x 3 GEMMs on each rank, each step
        assert rank["calls"] == [6] * FSDP_STEPS and rank["stored"] == ["torch.float32"], (rank["calls"], rank["stored"])
    assert all(torch.equal(ranks[0]["params"][n], ranks[1]["params"][n]) for n in ranks[0]["params"])
    # one process: each rank's rows one micro-batch of a 2-step accumulation window (FSDP averages the ranks)
    module = _mlp_conversion(rules).module
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = MixedPrecisionTrainer(module, torch.optim.SGD(module.parameters(), lr=0.05), precision="bf16",
                                    accumulation_steps=WORLD)
    for step in range(FSDP_STEPS):
        x, y = _mlp_batch(step, rows=2 * WORLD)
        for rank in range(WORLD):
            rows = slice(2 * rank, 2 * rank + 2)
            trainer.zero_grad()
            trainer.backward(F.mse_loss(module(x[rows]).float(), y[rows]))
            trainer.step()
    diff = max((ranks[0]["params"][n] - p).abs().max().item() for n, p in module.named_parameters())
    moved = max((start[n] - p).abs().max().item() for n, p in module.named_parameters())
    print(f"\nFSDP2 fp8 vs one process after {FSDP_STEPS} steps: max |diff| {diff:.3g} (training moved {moved:.3g})")
    assert diff < 1e-6 and moved > 1e-3, (diff, moved)


# ------------------------------------------------------------------------------------------ Lightning


def test_lightning_plugin_trains_fp8_and_checkpoints_stored_dtypes(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from converter.lightning import MixedPrecision

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Mlp()
            self.example_input_array = torch.randn(2, 7, 32)
            self.losses: list[float] = []

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self(batch[0]).float(), batch[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Count(pl.Callback):  # forward, backward and step of each batch
        def __init__(self):
            self.calls: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.mode = ScaledMM().__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.mode.__exit__(None, None, None)
            self.calls.append(len(self.mode.calls))

    x, y = _mlp_batch(0, rows=24)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=3)  # 21 tokens a batch
    plugin, count = MixedPrecision("fp8", opt_level="O2", rules=[_rules(tmp_path, 1024)]), Count()
    torch.manual_seed(0)
    model = Regressor()
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", devices=1, plugins=[plugin], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[count, pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])
    trainer.fit(model, data)
    assert plugin.options.fp8_recipe == "auto" and trainer.precision == "bf16-mixed"
    assert converter.conversion_of(model).report.records.fp8.layers == ["net_a", "net_b"]
    assert count.calls == [6] * 6, count.calls
    assert model.losses[-1] < model.losses[0], model.losses
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    weights = {k: v.dtype for k, v in ckpt["state_dict"].items()}
    assert set(weights.values()) == {torch.bfloat16}, weights  # O2: the stored dtype, never float8
    (state,) = ckpt["MixedPrecision"]["trainers"]
    assert {v.dtype for v in state["master"].values()} == {torch.float32} and len(state["master"]) == len(weights)
