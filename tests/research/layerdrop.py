"""LayerDrop (Fan et al., ICLR 2020) as fairseq's ``TransformerEncoder`` writes it: in training each of the
6 layers is skipped with probability ``p = 0.3`` drawn from Python's ``random`` module inside the layer loop.
``self.last_ran`` records how many layers ran in the last call (all of them in eval mode).
"""
import random

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, CLASSES, MAX_LEN = 100, 64, 4, 6, 4, 32
PAD = 0


class SelfAttention(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.heads = HEADS
        self.scale = (DIM // HEADS) ** -0.5
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out_proj = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, key_padding_mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        att = ((q @ k.transpose(-2, -1)) * self.scale).masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        y = (self.drop(att.softmax(dim=-1)) @ v).transpose(1, 2).reshape(B, T, C)
        return self.out_proj(y)


class TransformerEncoderLayer(nn.Module):
    """fairseq's pre-norm encoder layer (``encoder_normalize_before=True``)."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(DIM)
        self.self_attn = SelfAttention(dropout)
        self.final_layer_norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, key_padding_mask):
        x = x + self.dropout(self.self_attn(self.self_attn_layer_norm(x), key_padding_mask))
        return x + self.dropout(self.fc2(F.relu(self.fc1(self.final_layer_norm(x)))))


class ClassificationHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(DIM, DIM)
        self.out_proj = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        return self.out_proj(torch.tanh(self.dense(x[:, 0])))


class LayerDropEncoder(nn.Module):
    def __init__(self, layerdrop=0.3):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.embed_positions = nn.Embedding(MAX_LEN, DIM)
        self.layers = nn.ModuleList(TransformerEncoderLayer() for _ in range(LAYERS))
        self.layer_norm = nn.LayerNorm(DIM)
        self.head = ClassificationHead()
        self.p = layerdrop
        self.last_ran = LAYERS

    def forward(self, src_tokens, src_lengths):
        T = src_tokens.shape[1]
        key_padding_mask = torch.arange(T, device=src_tokens.device)[None, :] >= src_lengths[:, None]
        x = self.embed_tokens(src_tokens) + self.embed_positions(torch.arange(T, device=src_tokens.device))
        ran = 0
        for layer in self.layers:
            if self.training and random.random() < self.p:
                continue  # LayerDrop
            x = layer(x, key_padding_mask)
            ran += 1
        self.last_ran = ran
        return self.head(self.layer_norm(x))


def _batch(gen, batch=4, seq=16):
    lengths = torch.randint(4, seq + 1, (batch,), generator=gen)
    tokens = torch.randint(2, VOCAB, (batch, seq), generator=gen)
    tokens[:, 0] = 1  # <s>
    tokens = tokens.masked_fill(torch.arange(seq)[None, :] >= lengths[:, None], PAD)
    labels = tokens[:, 1] % CLASSES
    return tokens, lengths, labels


def build_model():
    torch.manual_seed(0)
    return LayerDropEncoder()


def example_inputs():
    tokens, lengths, _ = _batch(torch.Generator().manual_seed(1))
    return tokens, lengths


def loss_fn(output, batch):
    return F.cross_entropy(output.float(), batch[-1])


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        tokens, lengths, labels = _batch(gen)
        yield (tokens, lengths), (tokens, lengths, labels)
