"""Top-2 Mixture-of-Experts token dispatch in a small causal transformer, as GShard/Switch-style research code
writes it (fairseq MoE, Mixtral reference code): ``tok, slot = torch.where(sel == e)`` per expert, empty experts
skipped, weighted outputs scattered back with ``out[tok] += ...``; attention and each expert are submodules.
"""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, EXPERTS, TOP_K, MAX_LEN = 64, 64, 4, 2, 4, 2, 32
PAD = 0


class Attention(nn.Module):
    """A pre-norm self-attention sublayer (residual included)."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.heads = HEADS
        self.scale = (DIM // HEADS) ** -0.5
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        att = ((q @ k.transpose(-2, -1)) * self.scale).masked_fill(~mask[:, None], float("-inf"))
        y = (self.drop(att.softmax(dim=-1)) @ v).transpose(1, 2).reshape(B, T, C)
        return x + self.drop(self.proj(y))


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """A pre-norm top-2 MoE FFN sublayer; returns (x + out, Switch load-balancing loss)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x):
        B, T, D = x.shape
        h = self.norm(x).reshape(-1, D)
        probs = self.router(h).float().softmax(dim=-1)
        w, sel = probs.topk(TOP_K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(sel == e)
            if tok.numel() == 0:
                continue
            out[tok] += (w[tok, slot, None] * expert(h[tok])).to(out.dtype)
        load = F.one_hot(sel[:, 0], EXPERTS).float().mean(dim=0)
        aux_loss = EXPERTS * (load * probs.mean(dim=0)).sum()
        return x + out.view(B, T, D), aux_loss


class MoETransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.position = nn.Embedding(MAX_LEN, DIM)
        self.attn_layers = nn.ModuleList(Attention() for _ in range(LAYERS))
        self.moe_layers = nn.ModuleList(MoE() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        causal = positions[None, :] <= positions[:, None]
        mask = causal[None] & attention_mask.bool()[:, None, :]
        x = self.embed(input_ids) + self.position(positions)
        aux_loss = x.new_zeros(())
        for attn, moe in zip(self.attn_layers, self.moe_layers):
            x = attn(x, mask)
            x, layer_aux = moe(x)
            aux_loss = aux_loss + layer_aux
        return self.lm_head(self.norm(x)), aux_loss


def _batch(gen, batch=4, seq=16):
    lengths = torch.randint(4, seq + 1, (batch,), generator=gen)
    attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (batch, seq), generator=gen).masked_fill(attention_mask == 0, PAD)
    return ids, attention_mask


def build_model():
    torch.manual_seed(0)
    return MoETransformer()


def example_inputs():
    return _batch(torch.Generator().manual_seed(1))


def loss_fn(output, batch, aux_weight=0.01):
    logits, aux_loss = output
    ids, attention_mask = batch
    targets = ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
    lm_loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
    return lm_loss + aux_weight * aux_loss.float()


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        ids, attention_mask = _batch(gen)
        yield (ids, attention_mask), (ids, attention_mask)
