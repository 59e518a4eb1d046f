"""torch.compile of converted models: compiled-converted vs compiled-autocast step time.

Models: the benchmark encoders (``nn.TransformerEncoder``, dropout 0, train mode, bf16, SGD lr 1e-4
momentum 0.9): ``small`` d128 h4 ff256 ×2, B2×T16; ``large`` d512 h8 ff2048 ×2, B8×T128. Variants,
each on its own copy of the same weights and timed interleaved in one process
(:func:`benchmarks.common.interleaved`, medians):

* ``autocast`` / ``autocast_compiled`` — the original model under ``torch.autocast("cpu", bf16)``,
  eager and ``torch.compile``-d (the autocast region inside the compiled function);
* ``O1`` / ``O1_compiled`` — ``converter.convert(..., opt_level="O1", device=...)``.module, eager
  and compiled; fp32 parameters, the optimizer steps them directly;
* ``O2`` / ``O2_compiled`` — the O2 conversion driven by ``MixedPrecisionTrainer(master_weights=True)``
  (half parameters, fp32 masters), its module eager and compiled.

A step is zero_grad + forward + loss (``out.float().pow(2).mean()``) + backward + optimizer step;
only the model's forward (and so its backward) is compiled, as a user would ``torch.compile(model)``.
Compilation (inductor, CPU) happens in the warm-up, before timing, and its time is reported.
Also reported: the graph breaks ``torch._dynamo.explain`` finds in each module, and the SQNR of
the compiled output against the eager output of the same module.

Run: ``python benchmarks/compile.py [--models small large] [--rounds 60] [--clock cpu|wall]
[--device-lowering cpu|none] [--json benchmarks/results/compile_cpu.json]`` (Markdown next to the JSON).
``--clock cpu`` (default) runs one torch thread timed with the thread CPU clock: robust on a shared
machine. Inductor's generated C++ kernels then also run on that one thread.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import encoder, interleaved, machine_info, sgd, sqnr_db, summarize  # noqa: E402
from converter import convert  # noqa: E402
from converter.train.trainer import MixedPrecisionTrainer  # noqa: E402

__all__ = ["MODELS", "build", "graph_breaks", "main"]

#: name -> (d_model, heads, ff, batch, seq)
MODELS = {"small": (128, 4, 256, 2, 16), "large": (512, 8, 2048, 8, 128)}


def graph_breaks(module: nn.Module, *args) -> int:
    """Graph breaks ``torch._dynamo.explain`` counts when tracing ``module(*args)``."""
    torch._dynamo.reset()
    return int(torch._dynamo.explain(module)(*args).graph_break_count)


def _autocast_step(model: nn.Module, x: torch.Tensor, compiled: bool) -> Callable:
    opt = sgd(model.parameters())

    def forward(inp):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(inp)

    fwd = torch.compile(forward) if compiled else forward

    def step(clock) -> None:
        opt.zero_grad(set_to_none=True)
        loss = fwd(x).float().pow(2).mean()
        clock.mark("fwd")
        loss.backward()
        clock.mark("bwd")
        opt.step()
        clock.mark("opt")

    step.forward = fwd
    return step


def _converted_step(model: nn.Module, x: torch.Tensor, level: str, lowering: str | None, compiled: bool) -> Callable:
    module = convert(copy.deepcopy(model), (x,), precision="bf16", opt_level=level, device=lowering).module
    opt = sgd(module.parameters())
    trainer = MixedPrecisionTrainer(module, opt, precision="bf16", master_weights=True) if level == "O2" else None
    fwd = torch.compile(module) if compiled else module

    def step(clock) -> None:
        if trainer is not None:
            trainer.zero_grad()
        else:
            opt.zero_grad(set_to_none=True)
        loss = fwd(x).float().pow(2).mean()
        clock.mark("fwd")
        trainer.backward(loss) if trainer is not None else loss.backward()
        clock.mark("bwd")
        trainer.step() if trainer is not None else opt.step()
        clock.mark("opt")

    step.forward, step.module = fwd, module
    return step


def build(name: str, *, lowering: str | None) -> tuple[dict[str, Callable], torch.Tensor]:
    """variant name -> step(clock), and the input."""
    model, x = encoder(*MODELS[name])
    steps: dict[str, Callable] = {}
    for compiled in (False, True):
        suffix = "_compiled" if compiled else ""
        steps["autocast" + suffix] = _autocast_step(copy.deepcopy(model), x, compiled)
        for level in ("O1", "O2"):
            steps[level + suffix] = _converted_step(model, x, level, lowering, compiled)
    return steps, x


class _NullClock:
    def mark(self, phase: str) -> None:
        pass


def _check(steps: dict[str, Callable], x: torch.Tensor) -> dict[str, Any]:
    """Compile (first call, timed), graph breaks, and compiled-vs-eager output SQNR, before any step."""
    info: dict[str, Any] = {}
    for name in ("O1", "O2", "autocast"):
        eager, comp = steps[name], steps[name + "_compiled"]
        with torch.no_grad():
            ref = eager.forward(x).float()
        t0 = time.perf_counter()
        comp(_NullClock())  # compiles forward and backward
        compile_s = time.perf_counter() - t0
        with torch.no_grad():
            out = comp.forward(x).float()
        entry = {"compile_s": compile_s, "sqnr_vs_eager_db": sqnr_db(ref, out)}
        if hasattr(eager, "module"):
            entry["graph_breaks"] = graph_breaks(eager.module, x)
        info[name + "_compiled"] = entry
    return info


def _num(x: Any) -> str:
    return "–" if x is None else f"{x:.1f}"


def _markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"Measured with `python benchmarks/compile.py {' '.join(result['argv'])}` on {m['cpu']}, {m['cores']} cores "
             f"({m['torch_threads']} torch thread(s)), {m['date']}, torch {m['torch']}, bf16, SGD; clock "
             f"{result['clock']}; lowering {result['lowering']}. Median of interleaved rounds. Compile s: the first "
             "step (forward and backward), with inductor's on-disk cache as it was (a variant whose graph an "
             "earlier one compiled hits it).", "",
             "| model | variant | step ms | × autocast (eager) | × autocast_compiled | fwd / bwd / opt ms | compile s | "
             "graph breaks | SQNR vs eager dB |", "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for model, r in result["models"].items():
        v = r["variants"]
        for name, e in v.items():
            c = r["compile"].get(name, {})
            lines.append(f"| {model} | {name} | {e['total_ms']:.3f} | {e['total_ms'] / v['autocast']['total_ms']:.2f} | "
                         f"{e['total_ms'] / v['autocast_compiled']['total_ms']:.2f} | {e['fwd_ms']:.2f} / "
                         f"{e['bwd_ms']:.2f} / {e['opt_ms']:.2f} | {_num(c.get('compile_s'))} | "
                         f"{c.get('graph_breaks', '–')} | {_num(c.get('sqnr_vs_eager_db'))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["small"])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--inner", type=int, default=0, help="steps per block (0: about 20 ms per block)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--device-lowering", choices=("cpu", "none"), default="cpu")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.clock == "cpu":
        torch.set_num_threads(1)
    lowering = None if a.device_lowering == "none" else a.device_lowering
    result: dict[str, Any] = {"machine": machine_info(), "argv": argv, "clock": a.clock,
                              "lowering": a.device_lowering, "models": {}}
    for name in a.models:
        steps, x = build(name, lowering=lowering)
        info = _check(steps, x)
        t0 = time.perf_counter()
        steps["autocast"](_NullClock())
        inner = a.inner or max(1, round(0.02 / max(time.perf_counter() - t0, 1e-6)))
        samples = interleaved(steps, rounds=a.rounds, warmup=3, inner=inner, clock=a.clock)
        variants = {k: summarize(s) for k, s in samples.items()}
        result["models"][name] = {"variants": variants, "compile": info, "inner": inner}
        base = variants["autocast_compiled"]["total_ms"]
        for k, e in variants.items():
            print(f"[{name}] {k:18s} {e['total_ms']:8.3f} ms  ({e['total_ms'] / base:.2f}× autocast_compiled)  "
                  f"{info.get(k, '')}", flush=True)
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
        a.json.with_suffix(".md").write_text(_markdown(result))
        print(f"wrote {a.json} and its .md")
    return result


if __name__ == "__main__":
    main()
