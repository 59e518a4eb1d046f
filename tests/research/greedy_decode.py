"""Greedy decoding inside ``forward``, as seq2seq research code writes it (PyTorch seq2seq tutorial,
OpenNMT/Bahdanau-style decoders): a GRU-cell decoder step with Luong attention is called in a Python loop that
feeds back the argmax token and breaks once every sequence has emitted EOS; teacher forcing when ``tgt`` is passed.
"""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, MAX_SRC = 40, 64, 4, 32
PAD, BOS, EOS = 0, 1, 2


class EncoderLayer(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.heads = HEADS
        self.scale = (DIM // HEADS) ** -0.5
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.ffn = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        att = ((q @ k.transpose(-2, -1)) * self.scale).masked_fill(~mask[:, None, None, :], float("-inf"))
        x = x + self.drop(self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.ffn(self.norm2(x)))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.position = nn.Embedding(MAX_SRC, DIM)
        self.layers = nn.ModuleList(EncoderLayer() for _ in range(2))
        self.bridge = nn.Linear(DIM, DIM)

    def forward(self, src, src_mask):
        x = self.embed(src) + self.position(torch.arange(src.shape[1], device=src.device))
        for layer in self.layers:
            x = layer(x, src_mask)
        m = src_mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * m).sum(1) / m.sum(1).clamp(min=1)
        return x, torch.tanh(self.bridge(pooled))


class DecoderStep(nn.Module):
    """One decoding step: embed the previous token, attend over the memory, update the GRU state."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.attn_query = nn.Linear(DIM, DIM, bias=False)
        self.cell = nn.GRUCell(2 * DIM, DIM)
        self.out = nn.Sequential(nn.Linear(2 * DIM, 2 * DIM), nn.Tanh(), nn.Dropout(dropout), nn.Linear(2 * DIM, VOCAB))

    def forward(self, tokens, hidden, memory, src_mask):
        scores = torch.einsum("bd,bsd->bs", self.attn_query(hidden), memory)
        alpha = scores.masked_fill(~src_mask, float("-inf")).softmax(dim=-1)
        context = torch.einsum("bs,bsd->bd", alpha, memory)
        hidden = self.cell(torch.cat([self.embed(tokens), context], dim=-1), hidden)
        return self.out(torch.cat([hidden, context], dim=-1)), hidden


class Seq2Seq(nn.Module):
    def __init__(self, max_len=12, eos_prior=0.5):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = DecoderStep()
        self.max_len = max_len
        with torch.no_grad():  # a length prior on EOS: untrained decodes already end at varied lengths
            self.decoder.out[-1].bias[EOS] += eos_prior

    def forward(self, src, src_lengths, tgt=None):
        src_mask = torch.arange(src.shape[1], device=src.device)[None, :] < src_lengths[:, None]
        memory, hidden = self.encoder(src, src_mask)
        B = src.shape[0]
        tokens = src.new_full((B,), BOS)
        finished = torch.zeros(B, dtype=torch.bool, device=src.device)
        steps = tgt.shape[1] if tgt is not None else self.max_len
        logits = []
        for t in range(steps):
            step_logits, hidden = self.decoder(tokens, hidden, memory, src_mask)
            logits.append(step_logits)
            if tgt is not None:
                tokens = tgt[:, t]  # teacher forcing
                continue
            tokens = step_logits.argmax(dim=-1).masked_fill(finished, EOS)
            finished = finished | (tokens == EOS)
            if (tokens == EOS).all():
                break
        return torch.stack(logits, dim=1)


def _batch(gen, batch=4, seq=10):
    """A reversal task: tgt is src reversed, then EOS, padded."""
    lengths = torch.randint(3, seq + 1, (batch,), generator=gen)
    src = torch.randint(3, VOCAB, (batch, seq), generator=gen)
    src = src.masked_fill(torch.arange(seq)[None, :] >= lengths[:, None], PAD)
    tgt = torch.full((batch, seq + 1), PAD, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        tgt[b, :n] = src[b, :n].flip(0)
        tgt[b, n] = EOS
    return src, lengths, tgt


def build_model():
    torch.manual_seed(0)
    return Seq2Seq()


def example_inputs():
    """Greedy decoding (no target): the loop's length depends on the predictions."""
    src, lengths, _ = _batch(torch.Generator().manual_seed(1))
    return src, lengths


def loss_fn(output, batch):
    tgt = batch[-1]
    steps = min(output.shape[1], tgt.shape[1])  # greedy decoding may stop early
    logits = output[:, :steps].float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), tgt[:, :steps].reshape(-1), ignore_index=PAD)


def train_batches():
    """Teacher-forced batches: the target is passed to forward as its third argument."""
    gen = torch.Generator().manual_seed(3)
    while True:
        src, lengths, tgt = _batch(gen)
        yield (src, lengths, tgt), (src, lengths, tgt)
