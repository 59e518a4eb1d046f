"""DistributedDataParallel: 2 CPU processes over gloo.

* inf injected on rank 1 only (after DDP's all-reduce) -> both ranks skip, parameters stay identical;
  with ``sync_found_inf=False`` the ranks diverge (shows the check can fail);
* O2 under DDP reduces the fp32 master gradients itself and matches a single-process run bit for bit;
* O1 with gradient accumulation (DDP reduces only on the window's last backward) matches a
  single-process run.
"""
from __future__ import annotations

import dataclasses
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from converter.train.scaler import LossScaler
from converter.train.trainer import MixedPrecisionTrainer

WORLD = 2
STEPS = 8
INJECT_STEPS = (2, 5)
SCENARIOS = {
    # name: (precision, master_weights, sync_found_inf, accumulation_steps)
    "o1": ("fp16", False, True, 1),
    "o1_unsynced": ("fp16", False, False, 1),
    "o2": ("fp16", True, True, 1),
    "o1_accumulate": ("fp16", False, True, 2),
    "bf16_o1": ("bf16", False, True, 1),
    "bf16_o2": ("bf16", True, True, 1),
}
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))


def _micro_batch(rank: int, step: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * rank + 10 * step + micro)
    return torch.randn(8, 4, generator=gen).to(dtype), torch.randn(8, 4, generator=gen)


def _trainer(module: nn.Module, *, precision: str, master_weights: bool, sync: bool,
             accumulation: int) -> MixedPrecisionTrainer:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    scaler = LossScaler(init_scale=2.0**10, growth_interval=3, sync_found_inf=sync) if precision == "fp16" else None
    return MixedPrecisionTrainer(module, optimizer, precision=precision, master_weights=master_weights,
                                 loss_scale=scaler, accumulation_steps=accumulation)


def _grads_to_poison(trainer: MixedPrecisionTrainer, model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in (trainer.master_params or list(model.parameters()))]


def _run_scenario(rank: int, name: str) -> dict:
    precision, master_weights, sync, accumulation = SCENARIOS[name]
    model = _model()
    ddp = DistributedDataParallel(model)
    trainer = _trainer(ddp, precision=precision, master_weights=master_weights, sync=sync, accumulation=accumulation)
    dtype = _HALF[precision] if master_weights else torch.float32
    stepped = []
    for step in range(STEPS):
        for micro in range(accumulation):
            x, y = _micro_batch(rank, step, micro, dtype)
            trainer.zero_grad()
            trainer.backward(nn.functional.mse_loss(ddp(x).float(), y))
            if rank == 1 and step in INJECT_STEPS and micro == accumulation - 1:
                _grads_to_poison(trainer, model)[0].view(-1)[0] = float("inf")
            result = trainer.step()
        stepped.append(result)
    return {
        "stepped": stepped,
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for m in trainer.master_params],
        "dtypes": [str(p.dtype) for p in model.parameters()],
        "stats": dataclasses.asdict(trainer.stats),
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # two processes share this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    results = {name: _run_scenario(rank, name) for name in SCENARIOS}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()  # no rank tears gloo down while a peer still has a collective in flight
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]


def _single_process_reference(*, precision: str = "fp16", master_weights: bool,
                              accumulation: int) -> tuple[list[torch.Tensor], list[bool]]:
    """The same training on one process: each step accumulates every rank's micro-batches (mean)."""
    model = _model()
    micro_per_step = WORLD * accumulation
    trainer = _trainer(model, precision=precision, master_weights=master_weights, sync=True,
                       accumulation=micro_per_step)
    dtype = _HALF[precision] if master_weights else torch.float32
    stepped = []
    for step in range(STEPS):
        for rank in range(WORLD):
            for micro in range(accumulation):
                x, y = _micro_batch(rank, step, micro, dtype)
                trainer.zero_grad()
                trainer.backward(nn.functional.mse_loss(model(x).float(), y))
                if step in INJECT_STEPS and rank == WORLD - 1 and micro == accumulation - 1:
                    _grads_to_poison(trainer, model)[0].view(-1)[0] = float("inf")
                result = trainer.step()
        stepped.append(result)
    return [p.detach().clone() for p in model.parameters()], stepped


def test_inf_on_one_rank_makes_every_rank_skip(ranks):
    rank0, rank1 = ranks[0]["o1"], ranks[1]["o1"]
    expected = [step not in INJECT_STEPS for step in range(STEPS)]
    assert rank0["stepped"] == rank1["stepped"] == expected, (rank0["stepped"], rank1["stepped"])
    local = {"loss"}  # each rank reports its own loss
    assert {k: v for k, v in rank0["stats"].items() if k not in local} == {
        k: v for k, v in rank1["stats"].items() if k not in local
    }, (rank0["stats"], rank1["stats"])
    assert rank0["stats"]["skipped"] == len(INJECT_STEPS)
    for a, b in zip(rank0["params"], rank1["params"]):
        assert torch.equal(a, b), f"ranks diverged by {(a - b).abs().max()}"
    reference, stepped = _single_process_reference(master_weights=False, accumulation=1)
    assert stepped == expected
    for a, ref in zip(rank0["params"], reference):
        assert torch.equal(a, ref), f"DDP O1 differs from single-process by {(a - ref).abs().max()}"


def test_without_found_inf_sync_ranks_diverge(ranks):
    rank0, rank1 = ranks[0]["o1_unsynced"], ranks[1]["o1_unsynced"]
    assert rank0["stepped"][INJECT_STEPS[0]] is True and rank1["stepped"][INJECT_STEPS[0]] is False
    assert any(not torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"]))


def test_o2_reduces_fp32_master_grads_and_matches_single_process(ranks):
    rank0, rank1 = ranks[0]["o2"], ranks[1]["o2"]
    expected = [step not in INJECT_STEPS for step in range(STEPS)]
    assert rank0["stepped"] == rank1["stepped"] == expected, (rank0["stepped"], rank1["stepped"])
    assert all(p.dtype == torch.float16 for p in rank0["params"])
    assert all(m.dtype == torch.float32 for m in rank0["masters"]) and len(rank0["masters"]) == 4
    for a, b in zip(rank0["masters"] + rank0["params"], rank1["masters"] + rank1["params"]):
        assert torch.equal(a, b), f"ranks diverged by {(a.float() - b.float()).abs().max()}"
    for param, master in zip(rank0["params"], rank0["masters"]):
        assert torch.equal(param, master.half())
    reference, stepped = _single_process_reference(master_weights=True, accumulation=1)
    assert stepped == expected
    for a, ref in zip(rank0["params"], reference):
        assert torch.equal(a, ref), f"DDP O2 differs from single-process by {(a.float() - ref.float()).abs().max()}"


def test_o1_accumulation_under_ddp(ranks):
    rank0, rank1 = ranks[0]["o1_accumulate"], ranks[1]["o1_accumulate"]
    for a, b in zip(rank0["params"], rank1["params"]):
        assert torch.equal(a, b), f"ranks diverged by {(a - b).abs().max()}"
    assert rank0["stats"]["steps"] == STEPS - len(INJECT_STEPS), rank0["stats"]
    reference, _stepped = _single_process_reference(master_weights=False, accumulation=2)
    for a, ref in zip(rank0["params"], reference):
        assert torch.allclose(a, ref, rtol=1e-5, atol=1e-6), (a - ref).abs().max()


@pytest.mark.parametrize("name", ["bf16_o1", "bf16_o2"])
def test_bf16_under_ddp_skips_together_without_a_scaler(ranks, name):
    rank0, rank1 = ranks[0][name], ranks[1][name]
    expected = [step not in INJECT_STEPS for step in range(STEPS)]
    assert rank0["stepped"] == rank1["stepped"] == expected, (rank0["stepped"], rank1["stepped"])
    half = name == "bf16_o2"
    assert rank0["dtypes"] == (["torch.bfloat16"] * 4 if half else ["torch.float32"] * 4), rank0["dtypes"]
    for a, b in zip(rank0["params"] + rank0["masters"], rank1["params"] + rank1["masters"]):
        assert torch.equal(a, b), f"ranks diverged by {(a.float() - b.float()).abs().max()}"
    reference, stepped = _single_process_reference(precision="bf16", master_weights=half, accumulation=1)
    assert stepped == expected
    for a, ref in zip(rank0["params"], reference):
        assert torch.equal(a, ref), f"DDP {name} differs from single-process by {(a.float() - ref.float()).abs().max()}"
