"""The CPU attention lowering on a causal decoder: saved activations and step time against autocast.

``convert(device="cpu")`` lowers bf16 ``scaled_dot_product_attention`` to matmul·softmax·matmul
(converter/passes/lower.py: PyTorch's CPU bf16 flash kernel is 2-4x slower). Unfused, autograd
would keep each layer's (B, H, T, T) probability matrix; the lowered ops therefore run inside a
checkpoint region and backward recomputes them, so the step saves what the fused kernel saves.

Model: a pre-norm causal decoder (embedding, ``layers`` blocks of LayerNorm, qkv linear, causal SDPA,
output projection, GELU MLP; LM head), d=128, 4 heads, B×T tokens, train mode, dropout 0.
Variants, all from the same weights and batch, interleaved after warm-up (medians):

* ``autocast``: the original under ``torch.autocast("cpu", bfloat16)`` (the fused SDPA kernel);
* ``cpu``: ``convert(device="cpu")`` (lowered attention; O1, so the cost model recomputes it in backward);
* ``cpu_keep``: the same lowering without the recompute (``recompute_attention=False``);
* ``portable``: ``convert()`` with no device (the fused op kept).

Saved activations: the distinct storages autograd saves in one training forward (parameters and
the batch excluded), ``benchmarks.common.SavedTensorMeter``. A step: forward, ``logits.float()``
cross-entropy, backward, SGD step.

    python benchmarks/cpu_attention.py                 # B8 x T128, 2 layers
    python benchmarks/cpu_attention.py --seq 256 --rounds 30
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import converter  # noqa: E402
from benchmarks.common import SavedTensorMeter, interleaved, machine_info, summarize  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _step_fn(module, ids, targets, *, autocast: bool):
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step(clock):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = module(ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        clock.mark("step")
    return step


def _saved_bytes(module, ids, *, autocast: bool) -> int:
    meter = SavedTensorMeter(exclude=list(module.parameters()) + [ids])
    with meter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        module(ids)
    return meter.bytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="cpu",
                        help="cpu: thread CPU time on one torch thread (robust on a shared machine; default)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cpu_attention.json"))
    args = parser.parse_args(argv)
    if args.clock == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Decoder(layers=args.layers).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    targets = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    models = {"autocast": model}
    models["cpu"] = converter.convert(model, (ids,), device="cpu").module
    models["cpu_keep"] = converter.convert(model, (ids,), device="cpu", recompute_attention=False).module
    models["portable"] = converter.convert(model, (ids,)).module
    # independent weights per variant (the converted modules share the model's storage)
    models = {name: copy.deepcopy(m) for name, m in models.items()}
    saved = {name: _saved_bytes(m, ids, autocast=name == "autocast") for name, m in models.items()}
    steps = {name: _step_fn(m, ids, targets, autocast=name == "autocast") for name, m in models.items()}
    samples = interleaved(steps, rounds=args.rounds, warmup=args.warmup, clock=args.clock)
    times = {name: summarize(s)["total_ms"] for name, s in samples.items()}
    base_t, base_s = times["autocast"], saved["autocast"]
    rows = {name: {"step_ms": times[name], "step_vs_autocast": times[name] / base_t,
                   "saved_bytes": saved[name], "saved_vs_autocast": saved[name] / base_s} for name in models}
    result = {"machine": machine_info(), "config": vars(args), "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    lines = [f"causal decoder d128 h4 x{args.layers}, B{args.batch} x T{args.seq}, train step (median of {args.rounds}, "
             f"{args.clock} clock), {result['machine'].get('cpu', '')}", "",
             "| variant | step ms | × autocast | saved MiB | × autocast |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['step_ms']:.1f} | {row['step_vs_autocast']:.2f} | {row['saved_bytes'] / 2**20:.2f} | "
                     f"{row['saved_vs_autocast']:.2f} |")
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
