"""Peak memory of building, converting and saving a ~0.3B-parameter model, and of loading the output.

Each stage runs in its own child process, which prints its own peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) and timing as JSON; this script collects them::

    python benchmarks/save_memory.py                       # Llama-like, 16 layers (~0.27B params), O1
    python benchmarks/save_memory.py --opt-level O2
    python benchmarks/save_memory.py --layers 4 --json out.json

Stages: ``build`` (the fp32 model), ``convert`` (build + ``converter.convert``), ``save`` (build +
convert + ``conv.save``), ``load`` (a fresh process that imports the emitted model.py and calls
``load()``; ``load+forward`` also runs one forward). W is the fp32 parameter bytes. The target of
issue 23: save peak <= build peak + 0.5 W, and load well under 2 s for 0.6B parameters (the
weights are memory-mapped, not read). The save stage also reports the peak of the save phase
alone (``VmHWM`` reset with ``/proc/self/clear_refs`` after converting), since converting has a
peak of its own.

Nothing is downloaded: the model is built from a ``transformers.LlamaConfig``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _status_mib(key: str) -> float:
    """VmRSS (now) or VmHWM (peak since start or since the last reset) from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def _reset_peak() -> None:
    """Linux: writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")


def _build(layers: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=16,
                         vocab_size=32000, use_cache=False)
    model = AutoModelForCausalLM.from_config(config).eval()
    example = ((), {"input_ids": torch.randint(0, 32000, (1, 16))})
    return model, example


def _child(args) -> dict:
    import torch

    torch.set_num_threads(1)
    result: dict = {"stage": args.stage}
    if args.stage.startswith("load"):
        import importlib.util

        start = time.perf_counter()
        spec = importlib.util.spec_from_file_location("emitted_model", str(Path(args.out) / "model.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.load()
        result["load_s"] = time.perf_counter() - start
        if args.stage == "load+forward":
            with torch.no_grad():
                model(torch.randint(0, 32000, (1, 16)))
        result["peak_mib"] = _peak_mib()
        return result
    start = time.perf_counter()
    model, example = _build(args.layers)
    result["build_s"] = time.perf_counter() - start
    result["params"] = sum(p.numel() for p in model.parameters())
    result["W_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    if args.stage in ("convert", "save"):
        import converter

        start = time.perf_counter()
        conv = converter.convert(model, example, precision="bf16", opt_level=args.opt_level)
        result["convert_s"] = time.perf_counter() - start
        gc.collect()
        result["rss_after_convert_mib"] = _status_mib("VmRSS")
        if args.stage == "save":
            _reset_peak()
            start = time.perf_counter()
            conv.save(args.out, force=True)
            result["save_s"] = time.perf_counter() - start
            result["save_phase_peak_mib"] = _status_mib("VmHWM")
            result["files"] = {p.name: p.stat().st_size for p in sorted(Path(args.out).iterdir()) if p.suffix in (".pt", ".safetensors", ".json")}
    result["peak_mib"] = _peak_mib()
    return result


def _run(stage: str, args, out: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, __file__, "--child", stage, "--layers", str(args.layers), "--opt-level", args.opt_level, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"stage {stage} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--opt-level", default="O1", choices=("O1", "O2"))
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.stage = args.child
        print(json.dumps(_child(args)))
        return 0
    work = Path(tempfile.mkdtemp(prefix="save_memory_"))
    try:
        out = work / "out"
        results = {stage: _run(stage, args, out) for stage in ("build", "convert", "save", "load", "load+forward")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    w = results["build"]["W_mib"]
    build = results["build"]["peak_mib"]
    print(f"params {results['build']['params'] / 1e6:.1f}M  W {w:.0f} MiB  opt_level {args.opt_level}")
    for stage, data in results.items():
        extra = "  ".join(f"{k} {v:.2f}" for k, v in data.items() if k.endswith("_s"))
        print(f"{stage:13s} peak {data['peak_mib']:7.0f} MiB  (build + {(data['peak_mib'] - build) / w:5.2f} W)  {extra}")
    save = results["save"]
    if "save_phase_peak_mib" in save:
        after = save["rss_after_convert_mib"]
        print(f"save phase alone: RSS after convert {after:.0f} MiB, peak during save {save['save_phase_peak_mib']:.0f} MiB "
              f"(+{(save['save_phase_peak_mib'] - after) / w:.2f} W over the converted model)")
    print("files:", results["save"].get("files"))
    if args.json:
        Path(args.json).write_text(json.dumps({"opt_level": args.opt_level, "layers": args.layers, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
