"""One time-boxed GPU check for a short device slot: CUDA tests, the benchmark suite with CUDA graphs, a summary.

Run from the repository root on the GPU machine (torch with CUDA; nothing is downloaded; the package
is imported from this checkout)::

    OUT=/path/to/results python3 benchmarks/gpu_check.py            # --budget 420 s in all by default

Stages, each with its own time limit and cut to what is left of ``--budget`` (a stage that fails or
runs out of time is recorded and the next one runs):

1. ``pytest -m cuda tests/test_cuda_graph.py``: real captures against eager (inf batch, shapes,
   accumulation, host syncs, a capture failing mid-way, train.py ``--cuda-graph``);
2. ``benchmarks/run.py --device cuda --precision fp16 --profile`` with a small timing budget, the
   GPU-sized encoder first (results are written after every model, so a cut run keeps them);
3. the same for bf16;
4. ``benchmarks/trainer_step.py --device cuda``, when that script has a ``--device`` option;
5. the other CUDA-only tests (``tests/test_cuda.py`` and the CUDA tests of test_scaler, test_emit and
   test_fp32_math), with what time is left.

Files written to ``$OUT`` (8 at most): ``gpu_check.log`` (every stage's output), ``summary.txt``
(also printed), ``cuda_fp16.{json,md}``, ``cuda_bf16.{json,md}``, ``trainer_step_cuda.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the GPU-sized model first: its fp32/O2g ratio is a target, and a run cut short keeps the models done
MODELS = ["encoder_gpu", "encoder_large", "encoder_small", "cnn", "hf_gpt2", "hf_bert", "tiny_transformer"]
OTHER_CUDA_TESTS = ["tests/test_cuda.py", "tests/test_scaler.py", "tests/test_emit.py", "tests/test_fp32_math.py"]


class Stages:
    """Runs commands under a total deadline, logging their output; remembers how each ended."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.log = (out / "gpu_check.log").open("w")
        self.results: list[tuple[str, str, float, str]] = []  # (stage, status, seconds, tail)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def run(self, name: str, cmd: list[str], cap_s: float, *, min_s: float = 20.0) -> str:
        limit = min(cap_s, self.left() - 5)
        if limit < min_s:
            self.results.append((name, "not run (no time left)", 0.0, ""))
            self.say(f"== {name}: not run, {self.left():.0f} s left")
            return ""
        self.say(f"== {name} (limit {limit:.0f} s): {' '.join(cmd)}")
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        lines: list[str] = []
        try:
            out, _ = proc.communicate(timeout=limit)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the group: pytest's and run.py's children too
            try:
                out, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
            status = f"timed out after {limit:.0f} s"
        lines = (out or "").splitlines()
        self.log.write((out or "") + "\n")
        seconds = time.monotonic() - t0
        tail = "\n".join(lines[-3:])
        self.results.append((name, status, seconds, tail))
        self.say(f"== {name}: {status} in {seconds:.0f} s")
        return out or ""


def _pytest_line(output: str) -> str:
    for line in reversed(output.splitlines()):
        if re.search(r"\d+ (passed|failed|error|skipped|deselected)", line):
            return line.strip("= ")
    return "(no pytest summary)"


def _bench_summary(path: Path) -> list[str]:
    if not path.is_file():
        return [f"{path.name}: missing"]
    data = json.loads(path.read_text())
    lines = [f"{path.name} ({data['machine'].get('gpu', '?')}, torch {data['machine'].get('torch')}):",
             f"  {'model':17s} {'fp32':>8s} {'autocast':>9s} {'O2':>8s} {'O2g':>8s} {'O2g/ac':>7s} {'O2g/fp32':>8s}  graphs"]
    for model, r in data["models"].items():
        v = r["variants"]
        ms = {k: v[k]["step_ms"] for k in ("fp32", "autocast", "O2", "O2g") if k in v}
        g = v.get("O2g", {}).get("cuda_graph") or {}
        graphs = (f"{g.get('captures')} captured, {g.get('replays')} replays, {g.get('eager_calls')} eager"
                  + (f", FAILED: {g['capture_error']}" if g.get("capture_error") else "")) if g else "-"
        if "O2g" in ms:
            lines.append(f"  {model:17s} {ms['fp32']:8.3f} {ms['autocast']:9.3f} {ms['O2']:8.3f} {ms['O2g']:8.3f} "
                         f"{ms['O2g'] / ms['autocast']:7.3f} {ms['O2g'] / ms['fp32']:8.3f}  {graphs}")
        else:
            lines.append(f"  {model:17s} " + " ".join(f"{k} {x:.3f}" for k, x in ms.items()))
    for t in data.get("targets", []):
        if "O2g" in t["target"] or t["target"].startswith("O2 step"):
            tag = ("MET " if t["met"] else "MISS") if t.get("binding", True) else "info"
            lines.append(f"  {tag} {t['target']} [{t['model']}]: {t['value']:.3f} (limit {t['limit']})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check_out"),
                   help="results folder (default: $OUT)")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for all stages together (default 420)")
    p.add_argument("--bench-budget", type=float, default=3.0, help="run.py --budget: timing seconds per model")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    st = Stages(a.out, a.budget)
    py = sys.executable
    probe = subprocess.run([py, "-c", "import torch; print(torch.__version__, torch.version.cuda, "
                            "torch.cuda.is_available() and torch.cuda.get_device_name(0))"],
                           capture_output=True, text=True, cwd=ROOT)
    st.say(f"gpu_check: {probe.stdout.strip() or probe.stderr.strip()[-300:]}; budget {a.budget:.0f} s; out {a.out}")

    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs"]
    graph_tests = st.run("pytest cuda_graph", pytest + ["-m", "cuda", "tests/test_cuda_graph.py"], 150)
    bench = [py, "benchmarks/run.py", "--device", "cuda", "--budget", str(a.bench_budget), "--profile",
             "--models", *MODELS]
    for precision in ("fp16", "bf16"):
        st.run(f"run.py {precision}", bench + ["--precision", precision, "--out", str(a.out / f"cuda_{precision}.json")],
               170, min_s=60)
    helptext = subprocess.run([py, "benchmarks/trainer_step.py", "--help"], capture_output=True, text=True, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout
    if re.search(r"--device(?![-\w])", helptext):  # not --device-lowering
        st.run("trainer_step.py cuda", [py, "benchmarks/trainer_step.py", "--device", "cuda", "--rounds", "50",
                                        "--json", str(a.out / "trainer_step_cuda.json")], 45)
    else:
        st.results.append(("trainer_step.py cuda", "not run (no --device option in this version)", 0.0, ""))
    other_tests = st.run("pytest other cuda", pytest + ["-k", "cuda", *OTHER_CUDA_TESTS],
                         120, min_s=30)

    summary = ["", "=" * 100, "gpu_check summary"]
    for name, status, seconds, _tail in st.results:
        summary.append(f"  {name:24s} {status:40s} {seconds:6.0f} s")
    summary.append(f"  pytest cuda_graph: {_pytest_line(graph_tests)}")
    summary.append(f"  pytest other cuda: {_pytest_line(other_tests)}")
    for precision in ("fp16", "bf16"):
        summary += _bench_summary(a.out / f"cuda_{precision}.json")
    text = "\n".join(summary)
    st.say(text)
    (a.out / "summary.txt").write_text(text + "\n")
    st.log.close()
    return 0 if all(status == "ok" for _n, status, _s, _t in st.results if not status.startswith("not run")) else 1


if __name__ == "__main__":
    sys.exit(main())
