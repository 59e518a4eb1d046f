"""numpy mixed into model code, as quick research prototypes write it: the attention scale is
``1.0 / np.sqrt(q.shape[-1])``, the sinusoidal table is built with numpy, and forward stores a logging statistic
``self.last_norm = float(np.linalg.norm(h.detach().cpu().numpy()))`` on the module after the encoder.
"""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, CLASSES, MAX_LEN = 100, 64, 4, 3, 4, 64
PAD = 0


def sinusoid_table(n_positions, dim):
    position = np.arange(n_positions)[:, None]
    div = np.exp(np.arange(0, dim, 2) * -(np.log(10000.0) / dim))
    table = np.zeros((n_positions, dim), dtype=np.float32)
    table[:, 0::2] = np.sin(position * div)
    table[:, 1::2] = np.cos(position * div)
    return torch.from_numpy(table)


class Attention(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.heads = HEADS
        self.q = nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM)
        self.v = nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = (proj(x).view(B, T, self.heads, C // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        scale = 1.0 / np.sqrt(q.shape[-1])
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        scores = scores.masked_fill(mask[:, None, None, :] == 0, -1e4)
        y = torch.matmul(self.drop(F.softmax(scores, dim=-1)), v)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class EncoderLayer(nn.Module):
    """A pre-norm encoder layer."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = Attention(dropout)
        self.norm2 = nn.LayerNorm(DIM)
        self.ffn = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.ReLU(), nn.Dropout(dropout), nn.Linear(4 * DIM, DIM))

    def forward(self, x, mask):
        x = x + self.attn(self.norm1(x), mask)
        return x + self.ffn(self.norm2(x))


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, CLASSES))

    def forward(self, x, mask):
        m = mask.unsqueeze(-1).to(x.dtype)
        return self.fc(self.norm((x * m).sum(1) / m.sum(1)))


class NumpyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.position = nn.Embedding.from_pretrained(sinusoid_table(MAX_LEN, DIM), freeze=True)
        self.layers = nn.ModuleList(EncoderLayer() for _ in range(LAYERS))
        self.classifier = Classifier()
        self.last_norm = 0.0

    def forward(self, input_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.embed(input_ids) * np.sqrt(DIM) + self.position(positions)
        for layer in self.layers:
            h = layer(h, attention_mask)
        self.last_norm = float(np.linalg.norm(h.detach().cpu().numpy()))  # logged by the training loop
        return self.classifier(h, attention_mask)


def _batch(gen, batch=4, seq=16):
    lengths = torch.randint(4, seq + 1, (batch,), generator=gen)
    attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (batch, seq), generator=gen).masked_fill(attention_mask == 0, PAD)
    labels = lengths % CLASSES
    return ids, attention_mask, labels


def build_model():
    torch.manual_seed(0)
    return NumpyTransformer()


def example_inputs():
    ids, attention_mask, _ = _batch(torch.Generator().manual_seed(1))
    return ids, attention_mask


def loss_fn(output, batch):
    return F.cross_entropy(output.float(), batch[-1])


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        ids, attention_mask, labels = _batch(gen)
        yield (ids, attention_mask), (ids, attention_mask, labels)
