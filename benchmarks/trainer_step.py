"""Trainer step overhead: converted model + MixedPrecisionTrainer vs a plain autocast loop.

Model: ``nn.TransformerEncoder`` d128, 4 heads, ff 256, 2 layers, B2×T16, dropout 0, SGD (lr 1e-4,
momentum 0.9), bf16. Variants, each on its own copy of the same weights:

* ``autocast`` — the original model under ``torch.autocast("cpu", dtype=bfloat16)``, ``loss.backward()``,
  ``optimizer.step()``: the baseline (SGD as torch builds it by default: a per-parameter loop on CPU);
* ``autocast_fe`` — the same with ``SGD(foreach=True)``, which the trainer switches on by default
  (``optimizer_foreach``), so the optimizer's share is compared like for like;
* ``O1`` / ``O2`` — ``converter.convert(..., precision="bf16", opt_level=..., device=...)``.module driven by
  ``MixedPrecisionTrainer(master_weights=False/True)``.

The steps run interleaved in one process (A B C … A B C …, :func:`benchmarks.common.interleaved`)
with one torch thread and the thread CPU clock, so other processes on a shared machine do not
blur the figures. Printed: median ms per phase (fwd, bwd, opt = ``trainer.step()`` or
``optimizer.step()``) and the ratio of each step to autocast's.

Run: ``python benchmarks/trainer_step.py [--rounds 200] [--device-lowering cpu|none] [--compare-ref REF]
[--json out.json]``; ``--compare-ref 50aa920`` adds ``O1@50aa920``/``O2@50aa920``: the trainer as committed
there, timed in the same interleaved rounds.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import encoder, interleaved, machine_info, sgd, summarize
from converter import convert
from converter.train.trainer import MixedPrecisionTrainer

__all__ = ["build", "main", "SMALL", "autocast_step", "trainer_step", "timing_parser", "lowering_of", "time_steps"]

#: the small benchmark encoder: d_model, heads, ff, batch, seq
SMALL = (128, 4, 256, 2, 16)


def autocast_step(model: nn.Module, x: torch.Tensor, *, foreach: bool = False):
    """A step(clock) of a plain autocast loop on a copy of ``model``: the reference every variant is timed against.
    ``foreach``: the same SGD with its multi-tensor kernels (torch's CPU default loops per parameter)."""
    amp = copy.deepcopy(model)
    amp_opt = sgd(amp.parameters(), foreach=True if foreach else None)

    def step(clock) -> None:
        amp_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = amp(x)
        loss = out.float().pow(2).mean()
        clock.mark("fwd")
        loss.backward()
        clock.mark("bwd")
        amp_opt.step()
        clock.mark("opt")

    return step


def trainer_step(module: nn.Module, trainer, x: torch.Tensor):
    """A step(clock) of ``trainer`` training ``module`` on the same loss as :func:`autocast_step`."""

    def step(clock) -> None:
        trainer.zero_grad()
        loss = module(x).float().pow(2).mean()
        clock.mark("fwd")
        trainer.backward(loss)
        clock.mark("bwd")
        trainer.step()
        clock.mark("opt")

    return step


def _trainer_class_at(ref: str) -> type:
    """``MixedPrecisionTrainer`` as committed at git ``ref`` (to time before/after in one process)."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "-C", str(root), "show", f"{ref}:converter/train/trainer.py"],
                            check=True, capture_output=True, text=True).stdout
    folder = Path(tempfile.mkdtemp(prefix="trainer_at_"))
    path = folder / "trainer_at_ref.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"_trainer_at_{ref}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.MixedPrecisionTrainer


def build(*, lowering: str | None, compare_ref: str | None = None) -> dict:
    """name -> step(clock) callables for the variants."""
    model, x = encoder(*SMALL)
    steps = {}

    steps["autocast"] = autocast_step(model, x)

    steps["autocast_fe"] = autocast_step(model, x, foreach=True)
    trainers = {"": MixedPrecisionTrainer}
    if compare_ref is not None:
        trainers[f"@{compare_ref}"] = _trainer_class_at(compare_ref)
    for level, (suffix, trainer_class) in itertools.product(("O1", "O2"), trainers.items()):
        conv = convert(copy.deepcopy(model), (x,), precision="bf16", opt_level=level, device=lowering)
        module = conv.module
        trainer = trainer_class(module, sgd(module.parameters()), precision="bf16", master_weights=level == "O2")
        steps[level + suffix] = trainer_step(module, trainer, x)
    return steps


def timing_parser(description: str) -> argparse.ArgumentParser:
    """The options every step benchmark here takes (graph_step.py adds none, this file ``--compare-ref``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--device-lowering", choices=("cpu", "none"), default="cpu")
    parser.add_argument("--json", type=Path, default=None)
    return parser


def lowering_of(args: argparse.Namespace) -> str | None:
    return None if args.device_lowering == "none" else args.device_lowering


def time_steps(steps: dict, args: argparse.Namespace, *, nodes: dict | None = None) -> dict:
    """Time ``steps`` interleaved, print the medians per phase and the ratio to autocast, write ``--json``."""
    samples = interleaved(steps, rounds=args.rounds, warmup=5, inner=args.inner, clock="cpu")
    result = {"machine": machine_info(), "lowering": args.device_lowering, **({"nodes": nodes} if nodes else {}),
              "variants": {name: summarize(s) for name, s in samples.items()}}
    base = result["variants"]["autocast"]["total_ms"]
    node_header = f" {'nodes':>5s}" if nodes else ""
    print(f"{'variant':14s}{node_header} {'step ms':>8s} {'fwd':>7s} {'bwd':>7s} {'opt':>7s} {'vs autocast':>12s}")
    for name, entry in result["variants"].items():
        entry["vs_autocast"] = entry["total_ms"] / base
        node_cell = f" {nodes.get(name, ''):>5}" if nodes else ""
        print(f"{name:14s}{node_cell} {entry['total_ms']:8.3f} {entry['fwd_ms']:7.3f} {entry['bwd_ms']:7.3f} "
              f"{entry['opt_ms']:7.3f} {entry['vs_autocast']:11.3f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = timing_parser(__doc__.splitlines()[0])
    parser.add_argument("--compare-ref", default=None,
                        help="also time the trainer as committed at this git ref (before/after in one process)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    return time_steps(build(lowering=lowering_of(args), compare_ref=args.compare_ref), args)


if __name__ == "__main__":
    main()
