"""Real-size models: time and peak RSS of every stage on Llama-shaped models, as ratios to torch.export and to W.

Each stage runs in a child process of its own (``python benchmarks/scale.py --stage STAGE --size SIZE``), and
its peak RSS is that process's own ``ru_maxrss`` (one process, no grandchildren), so a stage's figure includes
importing torch and building the model, exactly what a user's process would hold. Times are measured inside
the child around the stage itself (build is timed separately and reported on its own).

Stages:

* ``build``   build the model from its config (random weights; ``meta`` sizes on the meta device);
* ``export``  build + ``torch.export.export`` (the floor a graph pass cannot go under);
* ``convert`` build + ``converter.convert`` (bf16, defaults);
* ``save``    build + convert + ``Conversion.save`` (model.py, weights, train.py, reports);
* ``cli``     ``mpconvert FOLDER`` (the default command: convert, measure against fp32 and autocast, save,
  check) on a ``save_pretrained`` folder written beforehand;
* ``cli_nomeasure``  the same with ``--no-measure`` (no measurement; what the ``cli`` row showed before
  2026-11-26);
* ``apply``   build + ``converter.apply`` (in place);
* ``load``    a fresh process that imports the model.py written by ``save`` and calls ``load()`` (for the
  meta sizes nothing: their weights would come from ``load(weights=CHECKPOINT)``).

W is the fp32 parameter bytes. Sizes ``0.06b``, ``0.3b``, ``0.6b``, ``1.1b`` are built with real (random)
weights; ``8b`` and ``70b`` are Llama-3-8B/70B shapes built with ``converter.empty_weights()`` (parameters
on the meta device; no weights exist), and their ``cli`` stages convert a config-only folder (nothing to
measure there, so ``cli`` and ``cli_nomeasure`` do the same work). Nothing is downloaded.

    python benchmarks/scale.py --sizes 0.06b 0.3b --out benchmarks/results/scale.json
    python benchmarks/scale.py --sizes 8b 70b --stages build export convert save
    python benchmarks/scale.py --sizes 1.1b --stages build cli cli_nomeasure --merge   # update those rows only

The Markdown table goes to ``--out`` with ``.md``; docs/scale.md's table is pasted from it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GiB = 1024 ** 3

#: Llama configs by size name: (config fields, on meta)
SIZES = {
    "0.06b": (dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=8, vocab_size=32000), False),
    "0.3b": (dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000), False),
    "0.6b": (dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000), False),
    "1.1b": (dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, vocab_size=32000), False),  # TinyLlama-1.1B's shape
    "8b": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0), True),  # Llama-3-8B's shape
    "70b": (dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0), True),  # Llama-3-70B's shape
}
STAGES = ("build", "export", "convert", "save", "cli", "cli_nomeasure", "apply", "load")
BATCH, SEQ = 1, 32


def _config(size: str):
    import transformers

    fields, _ = SIZES[size]
    return transformers.LlamaConfig(**fields, use_cache=False, tie_word_embeddings=False)


def _build(size: str):
    import torch
    import transformers

    import converter

    config = _config(size)
    on_meta = SIZES[size][1]
    torch.manual_seed(0)
    with converter.empty_weights() if on_meta else torch.device("cpu"):  # parameters on meta, buffers real
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.eval()


def _inputs(size: str):
    import torch

    ids = torch.randint(0, SIZES[size][0]["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return (ids,), {}


def _child(stage: str, size: str, work: Path) -> dict:
    """Run one stage in this process; return its figures (the parent adds the peak RSS)."""
    import torch

    out: dict = {}
    t0 = time.perf_counter()
    if stage == "load":
        import importlib.util

        spec = importlib.util.spec_from_file_location("scaled_model", work / "save" / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        t0 = time.perf_counter()
        model = module.load()
        out["stage_s"] = time.perf_counter() - t0
        out["params"] = sum(p.numel() for p in model.parameters())
        return out
    if stage in ("cli", "cli_nomeasure"):
        from converter.cli.main import main

        t0, c0 = time.perf_counter(), time.process_time()
        code = main([str(work / "pretrained"), "--out", str(work / "cli_out"), "--force"]
                    + (["--no-measure"] if stage == "cli_nomeasure" else []))
        out["stage_s"] = time.perf_counter() - t0
        out["stage_cpu_s"] = time.process_time() - c0
        out["exit"] = code
        report = work / "cli_out" / "report.json"
        if code == 0 and report.is_file():  # the measurement's own time and method, as report.json has them
            data = json.loads(report.read_text())
            measure_s = (data.get("timings") or {}).get("measure_s")
            if measure_s is not None:
                out["measure_s"] = measure_s
            if (data.get("memory") or {}).get("measure_method"):
                out["measure_method"] = data["memory"]["measure_method"]
        return out
    model = _build(size)
    out["build_s"] = time.perf_counter() - t0
    out["params"] = sum(p.numel() for p in model.parameters())
    out["W_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    example = _inputs(size)
    t1, c1 = time.perf_counter(), time.process_time()
    if stage == "export":
        ep = torch.export.export(model, example[0], example[1], strict=False)
        out["nodes"] = len(ep.graph.nodes)
    elif stage in ("convert", "save"):
        import converter

        conv = converter.convert(model, example)
        out["nodes"] = len(conv.module.graph.nodes)
        if stage == "save":
            out["convert_s"] = time.perf_counter() - t1
            t1, c1 = time.perf_counter(), time.process_time()
            target = work / "save"
            conv.save(target, force=True)
            out["saved_bytes"] = sum(p.stat().st_size for p in target.iterdir() if p.is_file())
    elif stage == "apply":
        import converter

        converter.apply(model, example)
    elif stage == "pretrained":  # not a measured stage: writes the folder the cli stage reads (config only on meta)
        if SIZES[size][1]:
            model.config.save_pretrained(work / "pretrained")
        else:
            model.save_pretrained(work / "pretrained")
    out["stage_s"] = time.perf_counter() - t1
    out["stage_cpu_s"] = time.process_time() - c1
    return out


def _run_stage(stage: str, size: str, work: Path) -> dict:
    """One stage in a child process: its figures, with the ``peak_rss`` (bytes) the child reports of itself."""
    cmd = [sys.executable, __file__, "--stage", stage, "--size", size, "--work", str(work)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, text=True)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    try:
        figures = json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": (stderr.strip().splitlines() or ["no output"])[-1][:300], "wall_s": wall}
    figures["wall_s"] = wall
    if proc.returncode != 0:
        figures["error"] = (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
    return figures


def _child_main(args) -> None:
    import resource

    work = Path(args.work)
    try:
        out = _child(args.stage, args.size, work)
        status = 0
    except Exception as exc:  # reported as the stage's error in the table
        out = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
        status = 1
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))
    sys.exit(status)


def _fmt_ratio(value, base) -> str:
    return "—" if value is None or not base else f"{value / base:.2f}×"


def _table(results: dict) -> str:
    lines = ["| size | params | W | stage | time s | CPU s | × export | peak RSS GiB | × W | × build RSS | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for size, stages in results.items():
        build = stages.get("build", {})
        export_s = stages.get("export", {}).get("stage_s")
        W = build.get("W_bytes")
        for stage in STAGES:
            row = stages.get(stage)
            if row is None:
                continue
            seconds = row.get("build_s") if stage == "build" else row.get("stage_s")
            cpu = None if stage == "build" else row.get("stage_cpu_s")
            rss = row.get("peak_rss")
            note = row.get("error", "")
            if stage.startswith("cli") and row.get("exit") not in (None, 0):
                note = note or f"exit {row['exit']}"
            if row.get("measure_s") is not None:
                note = note or f"measure {row['measure_s']:.1f} s"
            lines.append(
                f"| {size} | {build.get('params', 0) / 1e9:.2f}B | {(W or 0) / GiB:.2f} GiB | {stage} | "
                f"{'—' if seconds is None else f'{seconds:.1f}'} | {'' if cpu is None else f'{cpu:.1f}'} | "
                f"{_fmt_ratio(seconds, export_s) if stage != 'build' else ''} | "
                f"{'—' if rss is None else f'{rss / GiB:.2f}'} | {_fmt_ratio(rss, W)} | "
                f"{_fmt_ratio(rss, build.get('peak_rss')) if stage != 'build' else ''} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["0.06b", "0.3b"], choices=sorted(SIZES))
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scale.json"))
    parser.add_argument("--merge", action="store_true",
                        help="update the rows this run measures in an existing --out, keeping its other rows")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage:
        _child_main(args)
        return 0
    results: dict = {}
    for size in args.sizes:
        work = Path(tempfile.mkdtemp(prefix=f"scale_{size}_"))
        try:
            stages = {}
            for stage in args.stages:
                if stage.startswith("cli") and not (work / "pretrained").is_dir():
                    _run_stage("pretrained", size, work)
                if stage == "load" and (SIZES[size][1] or not (work / "save" / "model.py").is_file()):
                    stages[stage] = {"error": "no weights (meta)" if SIZES[size][1] else "needs the save stage"}
                    continue
                stages[stage] = _run_stage(stage, size, work)
                print(f"{size:>6} {stage:>8}: {json.dumps(stages[stage])}", flush=True)
            results[size] = stages
        finally:
            shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge and out.is_file():
        merged = json.loads(out.read_text()).get("results", {})
        for size, stages in results.items():
            merged.setdefault(size, {}).update(stages)
        results = merged
    out.write_text(json.dumps({"machine": os.uname().nodename, "results": results}, indent=1))
    table = _table(results)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
