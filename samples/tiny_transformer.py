"""A tiny decoder-only transformer, written by hand the way many research codebases are.

Token embedding, pre-norm blocks with a hand-written RMSNorm (pow/mean/rsqrt, which autocast
cannot pin to fp32), attention both through F.scaled_dot_product_attention and written out as
softmax(QKᵀ/√d)·V, a SiLU-gated MLP, and an LM head.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, use_sdpa: bool):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.use_sdpa = use_sdpa

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            mask = torch.ones_like(scores, dtype=torch.bool).triu(diagonal=1)
            scores = scores.masked_fill(mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            y = torch.matmul(probs, v)
        y = y.transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, use_sdpa: bool):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, n_heads, use_sdpa)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, n_heads: int = 4, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        # layer 0 uses fused SDPA, layer 1 the explicit softmax(QKᵀ)V
        self.layers = nn.ModuleList([Block(dim, n_heads, use_sdpa=(i % 2 == 0)) for i in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_model():
    torch.manual_seed(0)
    return TinyTransformer()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randint(0, 128, (2, 16)),)


def calibration_inputs():
    gen = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 128, (2, 16), generator=gen),) for _ in range(4)]


def loss_fn(output, batch):
    tokens = batch[0]
    return F.cross_entropy(output[:, :-1].reshape(-1, output.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        tokens = torch.randint(0, 128, (2, 16), generator=gen)
        yield (tokens,), (tokens,)
