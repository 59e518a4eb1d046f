"""FSDP2 (``torch.distributed.fsdp.fully_shard``): 2 CPU processes over gloo (issue 18 item 2).

Model: ``nn.TransformerEncoder`` d32, 4 heads, ff 64, 2 layers, converted with
``converter.convert(..., precision=...)`` (``.module``, a GraphModule) and also left plain.
Each step's global batch is 4 sequences; rank r trains on sequences 2r and 2r+1.

* converted bf16, O1 (FSDP's default policy: fp32 all-gather, the graph casts): an inf planted in
  rank 1's gradient shard makes both ranks skip; the parameters match a single-process run on the
  whole batch; a checkpoint saved through ``torch.distributed.checkpoint`` (the trainer's
  ``state_dict()`` uses ``get_model_state_dict``/``get_optimizer_state_dict``) and loaded into a
  differently initialised sharded model (``set_...``) resumes bit-identically;
* converted fp16, O1 with a LossScaler: ``found_inf`` is agreed (both ranks skip, both back off);
* converted bf16, accumulation over 2 micro-batches (``set_requires_gradient_sync``) and clipping
  by the global gradient norm;
* plain module under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` — FSDP's O2 —
  matches the single-process O2 trainer with every parameter stored in bf16.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import converter
from converter.train.scaler import LossScaler
from converter.train.trainer import MixedPrecisionTrainer

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.slow,  # two spawned processes that each convert the encoder: ~60 s on 2 shared cores
]

WORLD = 2
STEPS = 6
INJECT_STEP = 2
RESUME_STEPS = 2
LR = 0.01
CLIP = 0.05  # below every step's gradient norm: clipping by a rank-local norm would give other weights


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _encoder(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def _shard(module: nn.Module, **kwargs) -> nn.Module:
    """``fully_shard`` on a CPU device mesh: without one, FSDP2 builds its mesh on the machine's accelerator
    (``torch._C._get_accelerator()``), which moves the module to cuda:0 on a GPU machine while the batches
    and the gloo process group stay on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    return fully_shard(module, mesh=init_device_mesh("cpu", (dist.get_world_size(),)), **kwargs)


def _global_batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(2 * WORLD, 8, 32, generator=gen), torch.randn(2 * WORLD, 8, 32, generator=gen)


@functools.cache
def _conversion(precision: str, seed: int) -> nn.Module:
    example = torch.randn(2, 8, 32)
    return converter.convert(_encoder(seed), (example,), precision=precision).module


def _converted(precision: str, seed: int = 0) -> nn.Module:
    """A fresh copy of the converted encoder (converting once per process and precision)."""
    return copy.deepcopy(_conversion(precision, seed))


def _trainer(module: nn.Module, precision: str, *, accumulation: int = 1, sync: bool = True,
             master_weights: bool = False, clip: float | None = None) -> MixedPrecisionTrainer:
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
    scaler = LossScaler(init_scale=2.0**10, growth_interval=100, sync_found_inf=sync) if precision == "fp16" else None
    return MixedPrecisionTrainer(module, optimizer, precision=precision, loss_scale=scaler,
                                 accumulation_steps=accumulation, master_weights=master_weights,
                                 max_grad_norm=clip)


def _local_grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in module.parameters()]


def _train(module, trainer, steps, *, rows: slice, accumulation: int = 1, poison: bool = False) -> list[bool]:
    stepped = []
    for step in steps:
        for micro in range(accumulation):
            x, y = _global_batch(step, micro)
            trainer.zero_grad()
            trainer.backward(nn.functional.mse_loss(module(x[rows]).float(), y[rows]))
            if poison and step == INJECT_STEP and micro == accumulation - 1:
                _local_grads(module)[3].view(-1)[0] = float("inf")
            result = trainer.step()
        stepped.append(result)
    return stepped


def _full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in module.named_parameters()}


def _converted_bf16_with_checkpoint(rank: int, ckpt: Path, rows: slice) -> dict:
    from torch.distributed.checkpoint import load, save
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    module = _shard(_converted("bf16"), mp_policy=policy)
    trainer = _trainer(module, "bf16")
    stepped = _train(module, trainer, range(STEPS), rows=rows, poison=rank == 1)
    out = {"stepped": stepped, "stats": dataclasses.asdict(trainer.stats), "params": _full_params(module)}
    save(trainer.state_dict(), checkpoint_id=str(ckpt))
    _train(module, trainer, range(STEPS, STEPS + RESUME_STEPS), rows=rows)
    out["continued"] = _full_params(module)

    other = _shard(_converted("bf16", seed=3), mp_policy=policy)  # different weights: all must come from ckpt
    resumed = _trainer(other, "bf16")
    state = resumed.state_dict()
    load(state, checkpoint_id=str(ckpt))
    resumed.load_state_dict(state)
    out["loaded"] = _full_params(other)
    out["loaded_stats"] = dataclasses.asdict(resumed.stats)
    _train(other, resumed, range(STEPS, STEPS + RESUME_STEPS), rows=rows)
    out["resumed"] = _full_params(other)
    return out


def _scenario(rank: int, name: str, rows: slice) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if name == "fp16_scaler":
        module = _shard(_converted("fp16"))
        trainer = _trainer(module, "fp16")
        stepped = _train(module, trainer, range(STEPS), rows=rows, poison=rank == 1)
    elif name == "bf16_accumulate":
        module = _shard(_converted("bf16"))
        trainer = _trainer(module, "bf16", accumulation=2, clip=CLIP)
        stepped = _train(module, trainer, range(STEPS), rows=rows, accumulation=2)
    else:  # plain_fsdp_o2
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        module = _shard(_encoder(), mp_policy=policy)
        trainer = _trainer(module, "bf16")
        stepped = _train(module, trainer, range(STEPS), rows=rows)
    return {"stepped": stepped, "stats": dataclasses.asdict(trainer.stats), "params": _full_params(module),
            "stored": sorted({str(p.dtype) for p in module.parameters()})}


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # two processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    rows = slice(2 * rank, 2 * rank + 2)
    results = {"converted_bf16": _converted_bf16_with_checkpoint(rank, Path(out_dir) / "ckpt", rows)}
    for name in ("fp16_scaler", "bf16_accumulate", "plain_fsdp_o2"):
        results[name] = _scenario(rank, name, rows)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()  # no rank tears gloo down while a peer still has a collective in flight
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]


def _single_process(module: nn.Module, precision: str, *, accumulation: int = 1, poison: bool = False,
                    master_weights: bool = False, clip: float | None = None) -> tuple[dict[str, torch.Tensor], list[bool], MixedPrecisionTrainer]:
    """The same steps on one process: each rank's rows become one more micro-batch of an accumulation
    window (the converted graph is specialised to batch 2; the mean over the window is FSDP's average)."""
    trainer = _trainer(module, precision, accumulation=accumulation * WORLD, master_weights=master_weights,
                       clip=clip)
    stepped = []
    for step in range(STEPS):
        for micro in range(accumulation):
            x, y = _global_batch(step, micro)
            if master_weights:  # FSDP's param_dtype policy casts the forward inputs (cast_forward_inputs)
                x = x.to(torch.bfloat16)
            for rank in range(WORLD):
                rows = slice(2 * rank, 2 * rank + 2)
                trainer.zero_grad()
                trainer.backward(nn.functional.mse_loss(module(x[rows]).float(), y[rows]))
                if poison and step == INJECT_STEP and micro == accumulation - 1 and rank == WORLD - 1:
                    grads = [p.grad for p in (trainer.master_params or list(module.parameters()))]
                    grads[3].view(-1)[0] = float("inf")
                result = trainer.step()
        stepped.append(result)
    if master_weights:
        names = [name for name, _p in module.named_parameters()]
        return dict(zip(names, (m.detach() for m in trainer.master_params))), stepped, trainer
    return _full_params(module), stepped, trainer


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _assert_ranks_identical(rank0: dict, rank1: dict) -> None:
    assert rank0["stepped"] == rank1["stepped"], (rank0["stepped"], rank1["stepped"])
    assert _max_diff(rank0["params"], rank1["params"]) == 0.0


EXPECTED_SKIP = [step != INJECT_STEP for step in range(STEPS)]


def test_converted_bf16_inf_on_one_rank_skips_everywhere_and_matches_one_process(ranks):
    rank0, rank1 = ranks[0]["converted_bf16"], ranks[1]["converted_bf16"]
    _assert_ranks_identical(rank0, rank1)
    assert rank0["stepped"] == EXPECTED_SKIP, rank0["stepped"]
    assert rank0["stats"]["skipped"] == rank1["stats"]["skipped"] == 1, (rank0["stats"], rank1["stats"])
    reference, stepped, _trainer_ref = _single_process(_converted("bf16"), "bf16", poison=True)
    assert stepped == EXPECTED_SKIP
    diff = _max_diff(rank0["params"], reference)
    print(f"FSDP2 converted bf16 O1 vs one process after {STEPS} steps: max |diff| = {diff:.3g}")
    assert diff < 1e-5, f"FSDP2 differs from the single-process run by {diff}"


def test_checkpoint_through_distributed_state_dict_resumes_bit_identically(ranks):
    for rank in ranks:
        run = rank["converted_bf16"]
        assert _max_diff(run["loaded"], run["params"]) == 0.0, "set_model_state_dict did not restore the weights"
        local = ("loss",)  # per rank; torch.distributed.checkpoint keeps rank 0's Python values
        loaded = {k: v for k, v in run["loaded_stats"].items() if k not in local}
        assert loaded == {k: v for k, v in run["stats"].items() if k not in local}, (run["loaded_stats"], run["stats"])
        diff = _max_diff(run["resumed"], run["continued"])
        assert diff == 0.0, f"resumed run differs from the continued one by {diff}"


def test_fp16_found_inf_is_agreed_across_ranks(ranks):
    rank0, rank1 = ranks[0]["fp16_scaler"], ranks[1]["fp16_scaler"]
    _assert_ranks_identical(rank0, rank1)
    assert rank0["stepped"] == EXPECTED_SKIP, rank0["stepped"]
    for stats in (rank0["stats"], rank1["stats"]):
        assert stats["skipped"] == 1 and stats["overflows"] == 1 and stats["scale"] == 2.0**9, stats
    reference, stepped, trainer = _single_process(_converted("fp16"), "fp16", poison=True)
    assert stepped == EXPECTED_SKIP and trainer.stats.scale == 2.0**9
    diff = _max_diff(rank0["params"], reference)
    print(f"FSDP2 converted fp16 O1 + LossScaler vs one process: max |diff| = {diff:.3g}")
    assert diff < 1e-4, f"FSDP2 fp16 differs from the single-process run by {diff}"


def test_accumulation_and_clipping_under_fsdp_match_one_process(ranks):
    rank0, rank1 = ranks[0]["bf16_accumulate"], ranks[1]["bf16_accumulate"]
    _assert_ranks_identical(rank0, rank1)
    assert rank0["stats"]["steps"] == STEPS and rank0["stepped"] == [True] * STEPS
    assert rank0["stats"]["grad_norm"] == rank1["stats"]["grad_norm"] > CLIP, (rank0["stats"], rank1["stats"])
    reference, _stepped, trainer = _single_process(_converted("bf16"), "bf16", accumulation=2, clip=CLIP)
    norm_diff = abs(trainer.stats.grad_norm - rank0["stats"]["grad_norm"])
    assert norm_diff < 1e-5 * trainer.stats.grad_norm, (trainer.stats.grad_norm, rank0["stats"]["grad_norm"])
    diff = _max_diff(rank0["params"], reference)
    print(f"FSDP2 accumulation x2 + clipping vs one process: max |diff| = {diff:.3g}")
    assert diff < 1e-5, f"FSDP2 accumulation + clipping differs from the single-process run by {diff}"


def test_fsdp_param_dtype_policy_is_o2_for_a_plain_module(ranks):
    rank0, rank1 = ranks[0]["plain_fsdp_o2"], ranks[1]["plain_fsdp_o2"]
    _assert_ranks_identical(rank0, rank1)
    assert rank0["stored"] == ["torch.float32"], rank0["stored"]  # FSDP keeps fp32 shards: the masters
    plain = _encoder()
    plain.meta = {"mp_param_dtypes": {name: torch.bfloat16 for name, _p in plain.named_parameters()}}
    reference, stepped, _trainer_ref = _single_process(plain, "bf16", master_weights=True)
    assert stepped == [True] * STEPS
    diff = _max_diff(rank0["params"], reference)
    fp32 = copy.deepcopy(_encoder())
    moved = _max_diff(rank0["params"], _full_params(fp32))
    print(f"FSDP2 param_dtype=bf16 vs one-process O2 (all bf16): max |diff| = {diff:.3g} (training moved {moved:.3g})")
    assert diff < 0.05 * moved, f"FSDP O2 differs from single-process O2 by {diff} (training moved {moved})"


def test_fsdp_o2_through_the_trainer_is_rejected_with_the_recipe():
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        module = _shard(_encoder())
        with pytest.raises(ValueError, match="MixedPrecisionPolicy\\(param_dtype=torch.bfloat16"):
            MixedPrecisionTrainer(module, torch.optim.SGD(module.parameters(), lr=0.1), precision="bf16",
                                  master_weights=True)
    finally:
        dist.barrier()  # no rank tears gloo down while a peer still has a collective in flight
        dist.destroy_process_group()
