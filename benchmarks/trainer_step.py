"""Trainer step overhead: converted model + MixedPrecisionTrainer vs a plain autocast loop (and GradScaler).

Model: ``nn.TransformerEncoder`` d128, 4 heads, ff 256, 2 layers, B2×T16, dropout 0, SGD (lr 1e-4,
momentum 0.9). Variants, each on its own copy of the same weights:

* ``autocast`` — the original model under ``torch.autocast("cpu", dtype=bfloat16)``, ``loss.backward()``,
  ``optimizer.step()``: the baseline (SGD as torch builds it by default: a per-parameter loop on CPU);
* ``autocast_fe`` — the same with ``SGD(foreach=True)``, which the trainer switches on by default
  (``optimizer_foreach``), so the optimizer's share is compared like for like: bf16's ``opt`` baseline;
* ``O1`` / ``O2`` — ``converter.convert(..., precision="bf16", opt_level=..., device=...)``.module driven by
  ``MixedPrecisionTrainer(master_weights=False/True)``;
* ``amp16`` — fp16 autocast with ``torch.amp.GradScaler("cpu")``: ``scaler.scale(loss).backward()``, then
  ``scaler.unscale_(opt)``, ``scaler.step(opt)``, ``scaler.update()``, SGD as torch builds it (what the
  trainer's ``step()`` replaces in a user's loop); ``amp16_fe`` — the same with ``SGD(foreach=True)``;
* ``O1_fp16`` / ``O2_fp16`` — the fp16 conversions driven by the trainer (dynamic loss scale);
* with ``--fused``: ``autocast_fused``, ``amp16_fused`` (``SGD(fused=True)``, which GradScaler drives
  through its fused-optimizer path) and ``O2_fused``, ``O2_fp16_fused`` (``optimizer_fused=True``).

Each trainer's ``opt`` phase is compared with two baselines of its precision: ``opt/same`` with the same
optimizer kernels (``autocast_fe``/``amp16_fe``, or the ``_fused`` ones), and ``opt/user`` with the loop a
user writes with torch's default SGD (``autocast``/``amp16``; on CUDA torch's default is foreach already).

The steps run interleaved in one process (A B C … A B C …, :func:`benchmarks.common.interleaved`)
with one torch thread and the thread CPU clock, so other processes on a shared machine do not
blur the figures (``--device cuda``: on the GPU, CUDA-event clock, the conversion lowered for CUDA).
Printed: median ms per phase (fwd, bwd, opt = ``trainer.step()``, or ``optimizer.step()`` with the
GradScaler calls), the ratio of each step to autocast's, and each trainer's two ``opt`` ratios.

Run: ``python benchmarks/trainer_step.py [--rounds 200] [--device cpu|cuda] [--device-lowering cpu|cuda|none]
[--compare-ref REF] [--fused] [--only NAME,...] [--json out.json]``; ``--compare-ref main`` adds ``O1@main``,
``O2@main``, ``O1_fp16@main``, ``O2_fp16@main``: the trainer (the whole ``converter/train`` package) as committed
there, timed in the same interleaved rounds.
"""
from __future__ import annotations

import argparse
import copy
import importlib
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

__all__ = ["build", "main", "SMALL", "autocast_step", "amp_step", "trainer_step", "timing_parser", "lowering_of",
           "time_steps"]

#: the small benchmark encoder: d_model, heads, ff, batch, seq
SMALL = (128, 4, 256, 2, 16)

_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _optimizer(params, path: str) -> torch.optim.Optimizer:
    """The benchmark SGD with torch's default path (``"default"``), ``"foreach"`` or ``"fused"`` kernels."""
    if path == "fused":
        return torch.optim.SGD(list(params), lr=1e-4, momentum=0.9, fused=True)
    return sgd(params, foreach=True if path == "foreach" else None)


def amp_step(model: nn.Module, x: torch.Tensor, *, precision: str = "bf16", path: str = "default",
             grad_scaler: bool = False):
    """A step(clock) of a plain autocast loop on a copy of ``model``; with ``grad_scaler``, the loss is scaled
    and the optimizer driven by ``torch.amp.GradScaler`` (unscale_, step, update), timed as the ``opt`` phase."""
    amp = copy.deepcopy(model)
    amp_opt = _optimizer(amp.parameters(), path)
    scaler = torch.amp.GradScaler(x.device.type) if grad_scaler else None
    dtype = _PRECISION[precision]

    def step(clock) -> None:
        amp_opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=dtype):
            out = amp(x)
        loss = out.float().pow(2).mean()
        clock.mark("fwd")
        (loss if scaler is None else scaler.scale(loss)).backward()
        clock.mark("bwd")
        if scaler is None:
            amp_opt.step()
        else:
            scaler.unscale_(amp_opt)
            scaler.step(amp_opt)
            scaler.update()
        clock.mark("opt")

    step.scaler = scaler
    return step


def autocast_step(model: nn.Module, x: torch.Tensor, *, foreach: bool = False):
    """A step(clock) of a plain bf16 autocast loop on a copy of ``model``: the reference every variant is timed
    against. ``foreach``: the same SGD with its multi-tensor kernels (torch's CPU default loops per parameter)."""
    return amp_step(model, x, path="foreach" if foreach else "default")


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

    step.trainer = trainer
    return step


def _train_package_at(ref: str) -> str:
    """The whole ``converter/train`` package as committed at git ``ref``, imported under a name of its own
    (its ``converter.train`` imports rewritten to it); returns that name. Everything the step runs (the
    trainer, the loss scaler, the master weights, the kernels) is then the ref's, so before/after are timed
    in one process."""
    root = Path(__file__).resolve().parent.parent
    tag = "_train_at_" + "".join(c if c.isalnum() else "_" for c in ref)
    if tag in sys.modules:
        return tag
    names = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", f"{ref}:converter/train"],
                           check=True, capture_output=True, text=True).stdout.split()
    folder = Path(tempfile.mkdtemp(prefix="trainer_at_")) / tag
    folder.mkdir()
    for name in names:
        if not name.endswith(".py"):
            continue
        source = subprocess.run(["git", "-C", str(root), "show", f"{ref}:converter/train/{name}"],
                                check=True, capture_output=True, text=True).stdout
        (folder / name).write_text(source.replace("converter.train", tag))
    sys.path.insert(0, str(folder.parent))
    importlib.import_module(tag)
    return tag


def _trainer_class_at(ref: str) -> type:
    """``MixedPrecisionTrainer`` as committed at git ``ref``, with the rest of ``converter/train`` committed there
    (the loss scaler's unscale and update and the master weights' copy are part of ``step()``)."""
    return importlib.import_module(_train_package_at(ref) + ".trainer").MixedPrecisionTrainer


def build(*, lowering: str | None, compare_ref: str | None = None, fused: bool = False,
          device: str = "cpu", only: set[str] | None = None) -> tuple[dict, dict]:
    """name -> step(clock) callables for the variants, and trainer variant -> its two ``opt`` baselines
    (same kernels, the user's default loop). ``only``: those trainer variants, their baselines and autocast."""
    model, x = encoder(*SMALL)
    model, x = model.to(device), x.to(device)
    trainers = {"": MixedPrecisionTrainer}
    if compare_ref is not None:
        trainers[f"@{compare_ref}"] = _trainer_class_at(compare_ref)
    plan = [(p, level, s, cls, False) for p in ("bf16", "fp16") for level in ("O1", "O2") for s, cls in trainers.items()]
    if fused:
        plan += [(p, "O2", "", MixedPrecisionTrainer, True) for p in ("bf16", "fp16")]
    base: dict[str, tuple[str, str]] = {}
    named = []
    for precision, level, suffix, trainer_class, use_fused in plan:
        name = level + ("_fp16" if precision == "fp16" else "") + ("_fused" if use_fused else "") + suffix
        if only is None or name in only:
            user = "amp16" if precision == "fp16" else "autocast"
            base[name] = (user + ("_fused" if use_fused else "_fe"), user)
            named.append((name, precision, level, trainer_class, use_fused))
    baselines = {  # name -> (precision, optimizer path, GradScaler)
        "autocast": ("bf16", "default", False), "autocast_fe": ("bf16", "foreach", False),
        "amp16": ("fp16", "default", True), "amp16_fe": ("fp16", "foreach", True),
        **({"autocast_fused": ("bf16", "fused", False), "amp16_fused": ("fp16", "fused", True)} if fused else {}),
    }
    wanted = {"autocast", *(b for pair in base.values() for b in pair)} if only is not None else set(baselines)
    steps = {name: amp_step(model, x, precision=p, path=path, grad_scaler=gs)
             for name, (p, path, gs) in baselines.items() if name in wanted}
    for name, precision, level, trainer_class, use_fused in named:
        conv = convert(copy.deepcopy(model), (x,), precision=precision, opt_level=level, device=lowering)
        module = conv.module
        kwargs = {"optimizer_fused": True} if use_fused else {}
        trainer = trainer_class(module, sgd(module.parameters()), precision=precision, master_weights=level == "O2",
                                **kwargs)
        steps[name] = trainer_step(module, trainer, x)
    return steps, base


def timing_parser(description: str) -> argparse.ArgumentParser:
    """The options every step benchmark here takes (graph_step.py adds none, this file ``--device``,
    ``--compare-ref``, ``--fused`` and ``--only``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--device-lowering", choices=("cpu", "cuda", "none"), default=None,
                        help="the device the graph is converted for (default: the device it runs on; none: portable)")
    parser.add_argument("--json", type=Path, default=None)
    return parser


def lowering_of(args: argparse.Namespace) -> str | None:
    if args.device_lowering == "none":
        return None
    return args.device_lowering or getattr(args, "device", "cpu")


def time_steps(steps: dict, args: argparse.Namespace, *, nodes: dict | None = None,
               opt_base: dict | None = None) -> dict:
    """Time ``steps`` interleaved, print the medians per phase and the ratio to autocast, write ``--json``.

    ``opt_base``: name -> the variants whose ``opt`` phases are that variant's baselines, (same kernels,
    the user's default loop): printed as ``opt/same`` and ``opt/user``.
    Skipped optimizer steps are reported (a trainer's count; a GradScaler's final scale, which backs off on
    every skip): a skipped step does no optimizer work and would flatter its variant.
    """
    device = getattr(args, "device", "cpu")
    samples = interleaved(steps, rounds=args.rounds, warmup=5, inner=args.inner,
                          clock="cuda" if device == "cuda" else "cpu")
    result = {"machine": machine_info(device), "lowering": lowering_of(args) or "none",
              **({"nodes": nodes} if nodes else {}), "variants": {name: summarize(s) for name, s in samples.items()}}
    base = result["variants"]["autocast"]["total_ms"]
    node_header = f" {'nodes':>5s}" if nodes else ""
    print(f"{'variant':18s}{node_header} {'step ms':>8s} {'fwd':>7s} {'bwd':>7s} {'opt':>7s} {'vs autocast':>12s}"
          + (f" {'opt/same':>9s} {'opt/user':>9s}  bases" if opt_base else ""))
    for name, entry in result["variants"].items():
        entry["vs_autocast"] = entry["total_ms"] / base
        trainer = getattr(steps[name], "trainer", None)
        scaler = getattr(steps[name], "scaler", None)
        if trainer is not None:
            entry["skipped"] = trainer.stats.skipped + trainer.stats.spike_skips
            entry["final_scale"] = trainer.stats.scale
        elif scaler is not None:  # GradScaler keeps no skip count: a scale still at its start means none
            entry["final_scale"] = scaler.get_scale()
        ratio = ""
        if opt_base and name in opt_base:
            same, user = opt_base[name]
            entry["opt_base"] = {"same": same, "user": user}
            entry["opt_vs_same"] = entry["opt_ms"] / result["variants"][same]["opt_ms"]
            entry["opt_vs_user"] = entry["opt_ms"] / result["variants"][user]["opt_ms"]
            ratio = f" {entry['opt_vs_same']:8.3f}x {entry['opt_vs_user']:8.3f}x  {same}, {user}"
        node_cell = f" {nodes.get(name, ''):>5}" if nodes else ""
        print(f"{name:18s}{node_cell} {entry['total_ms']:8.3f} {entry['fwd_ms']:7.3f} {entry['bwd_ms']:7.3f} "
              f"{entry['opt_ms']:7.3f} {entry['vs_autocast']:11.3f}x{ratio}")
    skipped = {name: e["skipped"] for name, e in result["variants"].items() if e.get("skipped")}
    if skipped:
        print(f"skipped optimizer steps: {skipped}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = timing_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the steps run (cuda: CUDA-event clock; cpu: thread CPU time, one thread)")
    parser.add_argument("--compare-ref", default=None,
                        help="also time the trainer as committed at this git ref (before/after in one process)")
    parser.add_argument("--fused", action="store_true",
                        help="also time SGD(fused=True) under autocast/GradScaler and the trainer's optimizer_fused")
    parser.add_argument("--only", default=None,
                        help="comma-separated trainer variants to time (with autocast and their opt baselines)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps, opt_base = build(lowering=lowering_of(args), compare_ref=args.compare_ref, fused=args.fused,
                            device=args.device, only=set(args.only.split(",")) if args.only else None)
    return time_steps(steps, args, opt_base=opt_base)


if __name__ == "__main__":
    main()
