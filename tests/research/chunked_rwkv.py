"""Chunkwise-recurrent linear attention in the style of RWKV / RetNet research code (BlinkDL/RWKV-LM,
torchscale's chunkwise retention): ``T = x.shape[1]; assert T % self.chunk == 0``, then a Python loop over the
chunks that carries a decayed recurrent state between them; the per-chunk mixing lives in Linear submodules.
"""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, LAYERS, CHUNK, GAMMA = 64, 64, 2, 8, 0.9
PAD = 0


class ChunkMix(nn.Module):
    """Time mixing of one chunk: causal decayed attention inside it plus the carried state, gated output."""

    def __init__(self, chunk=CHUNK, gamma=GAMMA):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.receptance = nn.Linear(DIM, DIM, bias=False)
        self.key = nn.Linear(DIM, DIM, bias=False)
        self.value = nn.Linear(DIM, DIM, bias=False)
        self.gate = nn.Linear(DIM, DIM, bias=False)
        self.output = nn.Linear(DIM, DIM, bias=False)
        idx = torch.arange(chunk, dtype=torch.float32)
        diff = idx[:, None] - idx[None, :]
        self.register_buffer("intra_decay", torch.where(diff >= 0, gamma ** diff.clamp(min=0), 0.0), persistent=False)
        self.register_buffer("state_decay", gamma ** (idx + 1), persistent=False)  # state -> position i
        self.register_buffer("key_decay", gamma ** (chunk - 1 - idx), persistent=False)  # position j -> next state
        self.chunk_decay = gamma ** chunk
        self.scale = DIM ** -0.5

    def forward(self, x, state):
        h = self.norm(x)
        r = self.receptance(h) * self.scale
        k = self.key(h)
        v = self.value(h)
        inside = ((r @ k.transpose(-2, -1)) * self.intra_decay) @ v
        carried = (r @ state) * self.state_decay[:, None]
        state = self.chunk_decay * state + (k * self.key_decay[:, None]).transpose(-2, -1) @ v
        y = self.output(F.silu(self.gate(h)) * (inside + carried))
        return x + y, state


class ChannelMix(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.key = nn.Linear(DIM, 4 * DIM, bias=False)
        self.value = nn.Linear(4 * DIM, DIM, bias=False)
        self.receptance = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + torch.sigmoid(self.receptance(h)) * self.value(torch.relu(self.key(h)) ** 2)


class ChunkedRWKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.time_mix = nn.ModuleList(ChunkMix() for _ in range(LAYERS))
        self.channel_mix = nn.ModuleList(ChannelMix() for _ in range(LAYERS))
        self.ln_out = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.chunk = CHUNK

    def forward(self, idx):
        x = self.emb(idx)
        B, T, C = x.shape
        assert T % self.chunk == 0, f"sequence length {T} is not a multiple of the chunk size {self.chunk}"
        for time_mix, channel_mix in zip(self.time_mix, self.channel_mix):
            state = x.new_zeros(B, C, C)
            chunks = []
            for i in range(T // self.chunk):
                y, state = time_mix(x[:, i * self.chunk:(i + 1) * self.chunk], state)
                chunks.append(y)
            x = channel_mix(torch.cat(chunks, dim=1))
        return self.head(self.ln_out(x))


def _batch(gen, batch=2):
    """Documents of random length, right-padded to a multiple of the chunk size (16, 24 or 32)."""
    seq = CHUNK * int(torch.randint(2, 5, (1,), generator=gen))
    lengths = torch.randint(seq - CHUNK + 1, seq + 1, (batch,), generator=gen)
    idx = torch.randint(1, VOCAB, (batch, seq), generator=gen)
    return idx.masked_fill(torch.arange(seq)[None, :] >= lengths[:, None], PAD), lengths


def build_model():
    torch.manual_seed(0)
    return ChunkedRWKV()


def example_inputs():
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(1, VOCAB, (2, 2 * CHUNK), generator=gen)  # T = 16
    return (idx,)


def loss_fn(output, batch):
    idx, lengths = batch
    targets = idx[:, 1:].masked_fill(torch.arange(1, idx.shape[1])[None, :] >= lengths[:, None], -100)
    return F.cross_entropy(output[:, :-1].float().reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        idx, lengths = _batch(gen)
        yield (idx,), (idx, lengths)
