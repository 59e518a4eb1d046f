"""Time and peak RSS of converting a ~0.3B Llama, against building it and torch.export alone (issue 23).

Each measurement runs in a fresh child process (``python convert_memory.py --child STEP``), which
reports its own peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss`` at its end):

* ``build``: ``AutoModelForCausalLM.from_config(LlamaConfig(hidden 1024, ff 2816, 16 layers, 16
  heads, vocab 32000, use_cache=False))`` (nothing is downloaded) and a 1x32 ``input_ids``;
* ``export``: build, then ``torch.export.export(model, (), {"input_ids": ids}, strict=False)``;
* ``convert``: build, then ``converter.convert(model, ((), {"input_ids": ids}))``.

Times are the child's own, from after the build; W is the model's fp32 parameter bytes. Targets
(issue 23): convert peak RSS <= build peak + 0.3 W; convert time <= 2 x export time + build time.
``--profile`` runs convert under cProfile in the child and prints the top functions.

    PYTHONPATH=. python benchmarks/convert_memory.py [--repeat 1] [--json out.json] [--profile]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

GiB = 2 ** 30


def _build():
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                                      num_attention_heads=16, vocab_size=32000, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (1, 32))
    return model, ids


def _child(step: str, profile: bool) -> None:
    t0 = time.perf_counter()
    model, ids = _build()
    build_s = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    t1 = time.perf_counter()
    extra = {}
    if step == "export":
        import torch

        torch.export.export(model, (), {"input_ids": ids}, strict=False)
    elif step == "convert":
        import converter

        if profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            conv = prof.runcall(converter.convert, model, ((), {"input_ids": ids}))
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
        else:
            conv = converter.convert(model, ((), {"input_ids": ids}))
        extra["timings"] = {k: round(v, 3) for k, v in conv.timings.items()}
        extra["tracer"] = conv.tracer
        own = {name: p.data_ptr() for name, p in model.named_parameters()}
        extra["shared_params"] = sum(own.get(name) == p.data_ptr() for name, p in conv.module.named_parameters())
        extra["params"] = len(own)
    step_s = time.perf_counter() - t1
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # Linux: KiB
    print(json.dumps({"step": step, "build_s": build_s, "step_s": step_s, "weight_bytes": weight_bytes,
                      "peak_rss_gib": peak_gib, **extra}))


def _measure(step: str, profile: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", step] + (["--profile"] if profile else [])
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, stderr=None)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=("build", "export", "convert"))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.profile)
        return
    if args.profile:
        _measure("convert", profile=True)
        return
    # one process per step
    results = {step: _measure(step) for step in ("build", "export", "convert")}
    w = results["build"]["weight_bytes"]
    build_peak = results["build"]["peak_rss_gib"]
    for step, r in results.items():
        print(f"{step:8s} build {r['build_s']:6.2f} s  step {r['step_s']:6.2f} s  peak RSS {r['peak_rss_gib']:6.2f} GiB"
              + (f"  timings {r['timings']}  shared params {r['shared_params']}/{r['params']}" if "timings" in r else ""))
    conv, exp = results["convert"], results["export"]
    print(f"W = {w / GiB:.3f} GiB fp32 parameters")
    print(f"convert peak {conv['peak_rss_gib']:.2f} GiB vs target build peak + 0.3 W = {build_peak + 0.3 * w / GiB:.2f} GiB"
          f"  (convert - build = {(conv['peak_rss_gib'] - build_peak) / (w / GiB):.2f} W)")
    print(f"convert time {conv['step_s']:.2f} s vs target 2 x export + build = "
          f"{2 * exp['step_s'] + conv['build_s']:.2f} s  (export {exp['step_s']:.2f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
