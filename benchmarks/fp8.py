"""FP8 training on the CPU: our ``converter.fp8.kernels`` beside torchao's float8 training, same recipe, same model.

Issue 34, deliverable 6. One causal character-level decoder (byte vocabulary) and four measures:

1. **Per-layer SQNR.** The bf16 model runs one forward and backward on one batch; each FP8-selected Linear's
   input ``x`` and output gradient ``dy`` are recorded. Each layer is then run *in isolation* on that ``x``
   and ``dy`` three ways: as the plain ``nn.Linear`` under bf16 autocast (the reference), through our
   ``fp8_linear`` and through torchao's ``Float8Linear`` with the matching recipe (``tensorwise`` ↔
   ``tensorwise``, ``rowwise`` ↔ ``rowwise``, ``rowwise_gw_hp`` ↔ ``rowwise_with_gw_hp``), same weights. SQNR
   (``20·log10(‖ref‖/‖ref−out‖)``) of output, grad_input and grad_weight against the reference. Our
   ``blockwise`` (emulated DeepSeek tiles) has no torchao counterpart on the CPU and is shown alone. The
   whole model's logits and its concatenated parameter gradients get the same comparison (errors compound).
2. **Step time**: ``zero_grad`` + forward + loss + backward + AdamW step, the variants interleaved after
   warm-up (``benchmarks.common.interleaved``), medians of ``time.thread_time`` on one torch thread (the
   robust clock on this shared machine; CPU time, not latency).
3. **Peak memory** of one step: ``benchmarks.common.peak_step_memory`` (torch.profiler allocation events;
   the state — fp32 parameters and AdamW moments — is the same for every variant and listed once).
4. **A char-LM run**: ``--steps`` (300) AdamW steps on real text, the same initial weights, batches and
   order for every variant; validation loss on held-out text at the end, with the relative difference
   against bf16 and against torchao's same recipe (acceptance: within 1 %).

Precision of the variants. Every variant keeps fp32 master weights and AdamW state and runs its forward under
``torch.autocast("cpu", torch.bfloat16)``: that *is* the ``bf16`` variant. The FP8 variants replace the selected
Linears; a replaced Linear casts its input to bf16 when CPU autocast is on, as ``F.linear`` under autocast
and torchao's ``Float8Linear`` under *CUDA* autocast do, so every FP8 GEMM takes bf16 activations and fp32
weights and returns bf16. torchao's own cast checks the CUDA autocast state only, so its modules get the same
cast from a forward pre-hook here: without it, under CPU autocast an fp32 input (after a LayerNorm) gave a
bf16 output and ``rowwise_with_gw_hp``'s backward failed (``torch.mm`` of bf16 and fp32, torchao 0.18.0).
Selection (both libraries): every ``nn.Linear`` except the first and the last (the LM head),
with in/out features multiples of 16 (``misaligned_dims``); the embedding is not a Linear.

The text: the Python standard library's top-level modules (``sysconfig.get_paths()["stdlib"]/*.py``,
sorted by name, concatenated as UTF-8 bytes; the JSON records the Python version, file count, byte count
and SHA-256). The last 5 % is the validation split. Training batches are windows at offsets drawn from a
seeded generator; validation is ``--val-windows`` evenly spaced windows of the validation split.

torchao is optional (``pip install mpconvert[bench]``): when it cannot be imported, or with ``--no-torchao``,
its variants are left out and the rest runs.

    python benchmarks/fp8.py                 # the full run: benchmarks/results/fp8_cpu.{json,md}
    python benchmarks/fp8.py --quick         # fewer steps and rounds
    python benchmarks/fp8.py --tiny --no-torchao --out /tmp/fp8.json    # the smoke test's seconds-long run
    python benchmarks/fp8.py --from-json benchmarks/results/fp8_cpu.json   # rebuild the .md from a .json
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import io
import json
import math
import sys
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import interleaved, machine_info, peak_step_memory, sqnr_db, summarize  # noqa: E402
from converter.fp8.kernels import RECIPES, fp8_linear, misaligned_dims  # noqa: E402

#: our recipe name -> torchao's ``Float8LinearConfig.from_recipe_name`` name
TORCHAO_RECIPE = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}
BF16 = torch.bfloat16


# --------------------------------------------------------------------------------------------- torchao
def load_torchao() -> Optional[dict]:
    """torchao's float8 training entry points, or None when torchao is not importable (it is optional).

    Its import prints warnings about CUDA extension libraries it cannot load on a CPU-only machine; they are
    swallowed here (stdout and stderr of the import only).
    """
    sink = io.StringIO()
    try:
        with contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import logging

            logging.disable(logging.WARNING)
            try:
                import torchao
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training
                from torchao.float8.float8_linear import Float8Linear
            finally:
                logging.disable(logging.NOTSET)
    except ImportError:
        return None
    return {"version": torchao.__version__, "config": Float8LinearConfig, "convert": convert_to_float8_training,
            "linear": Float8Linear}


# ------------------------------------------------------------------------------------------------ model
class Block(nn.Module):
    """Pre-norm decoder block: causal attention and a GELU MLP (4x), four Linears.

    The attention is written out (matmul, mask, softmax, matmul): PyTorch's bf16 CPU flash-attention backward
    is several times slower (benchmarks/README.md) and would dominate every variant's step.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        a = (torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class CharLM(nn.Module):
    """Byte-level causal decoder: embedding + learned positions, ``layers`` blocks, LayerNorm, LM head."""

    def __init__(self, dim: int, heads: int, layers: int, seq: int, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class OursFp8Linear(nn.Module):
    """An ``nn.Linear``'s parameters (shared, not copied) run through ``fp8_linear`` with one recipe.

    Under CPU autocast the input is cast to the autocast dtype first, as ``F.linear`` (and torchao's
    ``Float8Linear`` under CUDA autocast) does.
    """

    def __init__(self, linear: nn.Linear, recipe: str) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.recipe = recipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            x = x.to(torch.get_autocast_dtype("cpu"))
        return fp8_linear(x, self.weight, self.bias, self.recipe)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe}"


def _autocast_input(module: nn.Module, args: tuple) -> Optional[tuple]:
    """Forward pre-hook: under CPU autocast, the input in the autocast dtype (torchao checks CUDA's only)."""
    if torch.is_autocast_enabled("cpu"):
        return (args[0].to(torch.get_autocast_dtype("cpu")),) + tuple(args[1:])
    return None


def torchao_linear(ao: dict, linear: nn.Linear, recipe: str) -> nn.Module:
    """torchao's ``Float8Linear`` for one Linear (a copy), with the CPU autocast input cast."""
    module = ao["linear"].from_float(copy.deepcopy(linear), config=ao["config"].from_recipe_name(TORCHAO_RECIPE[recipe]))
    module.register_forward_pre_hook(_autocast_input)
    return module


def select_linears(model: nn.Module, recipe: str) -> list[str]:
    """FQNs of the Linears to run in FP8: all but the first and the last, with K and N multiples of 16."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    return [name for name, m in linears[1:-1] if not misaligned_dims(m.in_features, m.out_features, recipe)]


def swap_ours(model: nn.Module, fqns: list[str], recipe: str) -> nn.Module:
    """``model`` (in place) with each Linear named in ``fqns`` replaced by an ``OursFp8Linear``."""
    for fqn in fqns:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, OursFp8Linear(getattr(parent, child), recipe))
    return model


def make_variant(base: nn.Module, variant: str, fqns: list[str], ao: Optional[dict]) -> nn.Module:
    """A deep copy of ``base`` for ``variant``: ``bf16``, ``ours_<recipe>`` or ``torchao_<recipe>``."""
    model = copy.deepcopy(base)
    if variant == "bf16":
        return model
    lib, recipe = variant.split("_", 1)
    if lib == "ours":
        return swap_ours(model, fqns, recipe)
    config = ao["config"].from_recipe_name(TORCHAO_RECIPE[recipe])
    wanted = set(fqns)
    model = ao["convert"](model, config=config, module_filter_fn=lambda mod, fqn: fqn in wanted)
    for fqn in fqns:
        model.get_submodule(fqn).register_forward_pre_hook(_autocast_input)
    return model


# ------------------------------------------------------------------------------------------------- data
def load_corpus(limit: Optional[int] = None) -> tuple[torch.Tensor, dict]:
    """The stdlib's top-level ``*.py`` files, sorted, concatenated as bytes (uint8 tensor) and a description."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    data = b"".join(f.read_bytes() for f in files)
    if limit is not None:
        data = data[:limit]
    info = {"what": f"{root}/*.py, sorted by name, concatenated (UTF-8 bytes)", "python": sys.version.split()[0],
            "files": len(files), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long), info


class Batches:
    """Seeded training windows and fixed validation windows over one corpus (last ``val_frac`` held out)."""

    def __init__(self, corpus: torch.Tensor, *, batch: int, seq: int, val_frac: float = 0.05, seed: int = 1234):
        split = int(len(corpus) * (1 - val_frac))
        self.train, self.val = corpus[:split], corpus[split:]
        self.batch, self.seq, self.seed = batch, seq, seed

    def train_batches(self, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``steps`` (input, target) batches, the same list for every variant."""
        g = torch.Generator().manual_seed(self.seed)
        starts = torch.randint(0, len(self.train) - self.seq - 1, (steps, self.batch), generator=g)
        return [self._windows(self.train, s) for s in starts]

    def val_batches(self, windows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``windows`` evenly spaced validation windows, in batches of ``batch``."""
        starts = torch.linspace(0, len(self.val) - self.seq - 1, windows).long()
        return [self._windows(self.val, starts[i:i + self.batch]) for i in range(0, windows, self.batch)]

    def _windows(self, text: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq + 1)
        w = text[idx]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


# ------------------------------------------------------------------------------------------- numerics
def lm_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the forward under bf16 autocast, in fp32."""
    with torch.autocast("cpu", dtype=BF16):
        logits = model(ids)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _db(value: float) -> Any:
    """A finite SQNR rounded for the JSON; ``"inf"`` (bit-equal to the reference) or ``"-inf"`` as strings."""
    return round(value, 2) if math.isfinite(value) else str(value)


def capture_layer_io(model: nn.Module, fqns: list[str], ids, targets) -> dict[str, tuple]:
    """``{fqn: (x, dy)}``: each listed Linear's input and output gradient in one bf16 forward + backward."""
    got: dict[str, list] = {}
    handles = []
    for fqn in fqns:
        def hook(mod, inp, out, fqn=fqn):
            got[fqn] = [inp[0].detach().clone(), None]
            out.register_hook(lambda g, fqn=fqn: got[fqn].__setitem__(1, g.detach().clone()))
        handles.append(model.get_submodule(fqn).register_forward_hook(hook))
    try:
        lm_loss(model, ids, targets).backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return {k: tuple(v) for k, v in got.items()}


def _run_layer(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple:
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=BF16):
        y = module(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, module.weight.grad


def per_layer_accuracy(base: nn.Module, fqns: list[str], io_: dict, recipes: list[str], ao: Optional[dict]) -> list[dict]:
    """One row per (layer, recipe): SQNR of output, grad_input, grad_weight for ours and torchao vs bf16."""
    rows = []
    for fqn in fqns:
        x, dy = io_[fqn]
        lin = base.get_submodule(fqn)
        ref = _run_layer(copy.deepcopy(lin), x, dy)
        for recipe in recipes:
            row: dict[str, Any] = {"layer": fqn, "recipe": recipe, "x_dtype": str(x.dtype).replace("torch.", ""),
                                   "shape_MKN": [x.shape[:-1].numel(), lin.in_features, lin.out_features]}
            ours = _run_layer(OursFp8Linear(copy.deepcopy(lin), recipe), x, dy)
            row["ours"] = dict(zip(("output", "grad_input", "grad_weight"), (_db(sqnr_db(r, o)) for r, o in zip(ref, ours))))
            if ao is not None and recipe in TORCHAO_RECIPE:
                theirs = _run_layer(torchao_linear(ao, lin, recipe), x, dy)
                row["torchao"] = dict(zip(("output", "grad_input", "grad_weight"),
                                          (_db(sqnr_db(r, o)) for r, o in zip(ref, theirs))))
            rows.append(row)
    return rows


def whole_model_accuracy(models: dict[str, nn.Module], ids, targets) -> dict[str, dict]:
    """Whole-model SQNR against ``bf16``: logits, and all parameter gradients concatenated (one batch)."""
    outs = {}
    for name, m in models.items():
        with torch.autocast("cpu", dtype=BF16):
            logits = m(ids)
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        grads = torch.cat([p.grad.reshape(-1).float() for _, p in sorted(m.named_parameters())])
        outs[name] = (logits.detach().float(), grads)
        m.zero_grad(set_to_none=True)
    ref = outs["bf16"]
    return {name: {"logits": _db(sqnr_db(ref[0], o[0])), "grads": _db(sqnr_db(ref[1], o[1]))}
            for name, o in outs.items() if name != "bf16"}


# --------------------------------------------------------------------------------------- time / memory
def _optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def step_fn(model: nn.Module, ids, targets, lr: float) -> Callable:
    """One training step, phases marked for ``interleaved``'s clock."""
    opt = _optimizer(model, lr)

    def step(clock) -> None:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, ids, targets)
        clock.mark("fwd")
        loss.backward()
        clock.mark("bwd")
        opt.step()
        clock.mark("opt")

    return step


def state_bytes(model: nn.Module) -> int:
    """fp32 parameters plus AdamW's two moments (the same for every variant)."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


class _NoClock:
    """A clock that ignores marks (the memory step is not timed)."""

    @staticmethod
    def mark(_phase: str) -> None:
        return None


def time_and_memory(models: dict[str, nn.Module], ids, targets, args) -> dict[str, dict]:
    """Median step time (interleaved rounds) and peak extra memory of one step, per variant."""
    steps = {name: step_fn(m, ids, targets, args.lr) for name, m in models.items()}
    samples = interleaved(steps, rounds=args.rounds, warmup=args.warmup, clock=args.clock)
    rows = {}
    for name in models:
        s = summarize(samples[name])
        mem = peak_step_memory(lambda step=steps[name]: step(_NoClock))
        rows[name] = {"step_ms": s["total_ms"], "fwd_ms": s.get("fwd_ms"), "bwd_ms": s.get("bwd_ms"),
                      "opt_ms": s.get("opt_ms"), "q1_ms": s.get("total_q1_ms"), "q3_ms": s.get("total_q3_ms"),
                      "rounds": s["n"], "peak_extra_bytes": mem["peak_bytes"]}
    base = rows["bf16"]
    for row in rows.values():
        row["step_vs_bf16"] = row["step_ms"] / base["step_ms"]
        row["peak_vs_bf16"] = row["peak_extra_bytes"] / max(base["peak_extra_bytes"], 1)
    return rows


# ---------------------------------------------------------------------------------------------- char-LM
def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(steps - warmup, 1)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def val_loss(model: nn.Module, batches: list) -> float:
    """Mean cross-entropy over the validation batches (the variant's own forward, bf16 autocast)."""
    model.eval()
    total = sum(lm_loss(model, ids, tgt).item() * ids.numel() for ids, tgt in batches)
    model.train()
    return total / sum(ids.numel() for ids, _ in batches)


def train_charlm(model: nn.Module, train: list, val: list, args) -> dict:
    """``len(train)`` AdamW steps; the loss every ``--log-every`` steps and the final validation loss."""
    opt = _optimizer(model, args.lr)
    curve, t0 = [], time.perf_counter()
    for i, (ids, tgt) in enumerate(train):
        for group in opt.param_groups:
            group["lr"] = _lr_at(i, len(train), args.lr, args.lr_warmup)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, ids, tgt)
        loss.backward()
        opt.step()
        if not math.isfinite(loss.item()):
            return {"diverged_at": i, "curve": curve}
        if (i + 1) % args.log_every == 0 or i + 1 == len(train):
            curve.append([i + 1, round(loss.item(), 4)])
    return {"train_loss_curve": curve, "val_loss": val_loss(model, val), "wall_s": round(time.perf_counter() - t0, 1)}


# ------------------------------------------------------------------------------------------------ report
def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    return "exact" if v == "inf" else (str(v) if isinstance(v, str) else f"{v:.1f}")


def markdown(result: dict) -> str:
    """The Markdown tables of one result."""
    cfg, m = result["config"], result["machine"]
    ao = result["torchao"] or "not installed"
    lines = [f"# FP8 training on the CPU: ours vs torchao ({ao})", "",
             f"{m.get('cpu', '')}, {m.get('cores')} cores, torch {m['torch']}, {m['date']}, "
             f"load at start {m.get('loadavg_at_start')}; char decoder d{cfg['dim']} h{cfg['heads']} x{cfg['layers']}, "
             f"B{cfg['batch']} x T{cfg['seq']}, vocab 256 (bytes). FP8 layers: {', '.join(result['fp8_layers'])}.",
             "", "## Per-layer SQNR against the bf16 layer (dB; same x and dy, isolated)", "",
             "Each layer's input as the bf16 model produced it (fp32 after a LayerNorm); all three run it in bf16 "
             "under autocast. `exact`: bit-equal to the bf16 layer (rowwise_gw_hp computes grad_weight in bf16).", "",
             "| layer | M×K×N | x as captured | recipe | ours out | ours dx | ours dW | torchao out | torchao dx | torchao dW |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["layer_sqnr"]:
        o, t = r["ours"], r.get("torchao", {})
        lines.append(f"| {r['layer']} | {'×'.join(map(str, r['shape_MKN']))} | {r['x_dtype']} | {r['recipe']} | "
                     + " | ".join(_fmt(o.get(k)) for k in ("output", "grad_input", "grad_weight")) + " | "
                     + " | ".join(_fmt(t.get(k)) for k in ("output", "grad_input", "grad_weight")) + " |")
    lines += ["", "Whole model against bf16 (one batch; errors compound through the layers):", "",
              "| variant | logits SQNR dB | all grads SQNR dB |", "|---|---:|---:|"]
    for name, r in result["model_sqnr"].items():
        lines.append(f"| {name} | {_fmt(r['logits'])} | {_fmt(r['grads'])} |")
    lines += ["", f"## Step time and peak memory ({cfg['clock']} clock, 1 torch thread, medians of "
              f"{cfg['rounds']} interleaved rounds; AdamW)", "",
              f"State (fp32 params + AdamW moments, all variants): {result['state_bytes'] / 2**20:.2f} MiB.", "",
              "| variant | step ms | q1–q3 | fwd | bwd | opt | × bf16 | peak extra MiB | × bf16 |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in result["timing"].items():
        lines.append(f"| {name} | {r['step_ms']:.1f} | {r['q1_ms'] or 0:.1f}–{r['q3_ms'] or 0:.1f} | "
                     f"{r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} | {r['opt_ms']:.1f} | {r['step_vs_bf16']:.2f} | "
                     f"{r['peak_extra_bytes'] / 2**20:.2f} | {r['peak_vs_bf16']:.2f} |")
    c = result["charlm"]
    lines += ["", f"## Char-LM: {cfg['steps']} steps, validation loss ({cfg['val_windows']} held-out windows)", "",
              f"Text: {c['corpus']['what']}, Python {c['corpus']['python']}, {c['corpus']['files']} files, "
              f"{c['corpus']['bytes']} bytes, sha256 {c['corpus']['sha256'][:16]}…; AdamW lr {cfg['lr']} "
              f"(warm-up {cfg['lr_warmup']}, cosine to 10 %), betas (0.9, 0.95), wd 0.1, seed {cfg['seed']}.", "",
              "| variant | final train loss | val loss | vs bf16 | vs torchao same recipe | within 1 % |",
              "|---|---:|---:|---:|---:|---|"]
    for name, r in c["runs"].items():
        if "val_loss" not in r:
            lines.append(f"| {name} | diverged at step {r['diverged_at']} | | | | ❌ |")
            continue
        vs_b, vs_t = r.get("vs_bf16"), r.get("vs_torchao")
        ok = all(abs(v) <= 0.01 for v in (vs_b, vs_t) if v is not None)
        lines.append(f"| {name} | {r['train_loss_curve'][-1][1]:.4f} | {r['val_loss']:.4f} | "
                     f"{'–' if vs_b is None else f'{100 * vs_b:+.2f} %'} | "
                     f"{'–' if vs_t is None else f'{100 * vs_t:+.2f} %'} | {'' if name == 'bf16' else ('✅' if ok else '❌')} |")
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------------------- main
def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=300, help="char-LM training steps")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lr-warmup", type=int, default=30)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--val-windows", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    p.add_argument("--sqnr-recipes", nargs="+", default=["tensorwise", "rowwise", "rowwise_gw_hp", "blockwise"])
    p.add_argument("--time-recipes", nargs="+", default=["tensorwise", "rowwise"])
    p.add_argument("--train-recipes", nargs="+", default=["tensorwise", "rowwise"])
    p.add_argument("--no-torchao", action="store_true", help="leave torchao's variants out even when installed")
    p.add_argument("--quick", action="store_true", help="100 steps, 5 rounds")
    p.add_argument("--tiny", action="store_true", help="d32 x2, B2 x T16, 4 steps, 2 rounds: a smoke test")
    p.add_argument("--from-json", metavar="JSON", help="rebuild the Markdown next to JSON from it, run nothing")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "fp8_cpu.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.val_windows = 100, 5, 64
    if args.tiny:
        args.dim, args.heads, args.layers, args.seq, args.batch = 32, 2, 2, 16, 2
        args.steps, args.rounds, args.warmup, args.val_windows, args.lr_warmup, args.log_every = 4, 2, 1, 4, 2, 2
    bad = [r for r in args.sqnr_recipes + args.time_recipes + args.train_recipes if r not in RECIPES]
    if bad:
        p.error(f"unknown recipe(s) {bad}; choose from {sorted(RECIPES)}")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    if args.from_json:
        path = Path(args.from_json)
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        return 0
    if args.clock == "cpu":
        torch.set_num_threads(1)
    ao = None if args.no_torchao else load_torchao()
    corpus, corpus_info = load_corpus(limit=200_000 if args.tiny else None)
    data = Batches(corpus, batch=args.batch, seq=args.seq, seed=args.seed + 1)
    torch.manual_seed(args.seed)
    base = CharLM(args.dim, args.heads, args.layers, args.seq).train()
    fqns = select_linears(base, "tensorwise")
    ids, targets = data.train_batches(1)[0]
    log = lambda msg: print(f"[fp8 {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731

    log(f"torchao: {ao['version'] if ao else 'not used'}; FP8 layers: {fqns}")
    io_ = capture_layer_io(copy.deepcopy(base), fqns, ids, targets)
    layers = per_layer_accuracy(base, fqns, io_, args.sqnr_recipes, ao)
    names = ["bf16"] + [f"{lib}_{r}" for r in args.time_recipes for lib in ("ours", "torchao")
                        if lib == "ours" or (ao is not None and r in TORCHAO_RECIPE)]
    models = {n: make_variant(base, n, fqns, ao) for n in names}
    whole = whole_model_accuracy(models, ids, targets)
    log("per-layer SQNR done; timing")
    timing = time_and_memory(models, ids, targets, args)
    del models

    train, val = data.train_batches(args.steps), data.val_batches(args.val_windows)
    runs = {}
    train_names = ["bf16"] + [f"{lib}_{r}" for r in args.train_recipes for lib in ("ours", "torchao")
                              if lib == "ours" or (ao is not None and r in TORCHAO_RECIPE)]
    for name in train_names:
        log(f"char-LM {name}: {args.steps} steps")
        runs[name] = train_charlm(make_variant(base, name, fqns, ao), train, val, args)
        log(f"  {name}: {runs[name]}")
    ref = runs["bf16"].get("val_loss")
    for name, r in runs.items():
        if name != "bf16" and "val_loss" in r and ref:
            r["vs_bf16"] = r["val_loss"] / ref - 1
            twin = runs.get("torchao_" + name.split("_", 1)[1]) if name.startswith("ours_") else None
            if twin and "val_loss" in twin:
                r["vs_torchao"] = r["val_loss"] / twin["val_loss"] - 1

    result = {"schema": 1, "machine": machine_info(), "config": vars(args),
              "torchao": ao["version"] if ao else None, "fp8_layers": fqns, "state_bytes": state_bytes(base),
              "layer_sqnr": layers, "model_sqnr": whole, "timing": timing,
              "charlm": {"corpus": corpus_info, "runs": runs}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str, allow_nan=False))
    text = markdown(result)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
