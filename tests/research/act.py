"""Adaptive Computation Time (Graves 2016, arXiv:1603.08983), written like the Universal Transformer / ACT
re-implementations in research repos: a ``while (halt < 1 - eps).any() and n < max_steps`` ponder loop over
a shared step cell, halting probabilities from a sigmoid unit, remainders, and a ponder cost returned with the output.
"""
import torch
import torch.nn.functional as F
from torch import nn

DIM_IN, DIM, CLASSES = 32, 128, 4


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM_IN, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        return self.norm(torch.tanh(self.proj(x)))


class StepCell(nn.Module):
    """The transition applied at every ponder step (weights shared across steps)."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.inp = nn.Linear(DIM_IN + 1, DIM)  # the input plus Graves' first-step flag
        self.rec = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * DIM, DIM))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, state, x):
        h = torch.tanh(self.inp(x) + self.rec(state))
        return self.norm(h + self.mlp(h))


class ACTClassifier(nn.Module):
    def __init__(self, max_steps=8, eps=0.01):
        super().__init__()
        self.encoder = Encoder()
        self.cell = StepCell()
        self.halt = nn.Linear(DIM, 1)
        nn.init.constant_(self.halt.bias, -1.0)  # start by pondering a few steps
        self.readout = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, CLASSES))
        self.max_steps = max_steps
        self.eps = eps
        self.last_steps = 0

    def forward(self, x):
        B = x.shape[0]
        state = self.encoder(x)
        halting = x.new_zeros(B)
        remainders = x.new_zeros(B)
        n_updates = x.new_zeros(B)
        weighted = x.new_zeros(B, DIM)
        n = 0
        while (halting < 1 - self.eps).any() and n < self.max_steps:
            flag = x.new_full((B, 1), 1.0 if n == 0 else 0.0)
            state = self.cell(state, torch.cat([x, flag], dim=-1))
            p = torch.sigmoid(self.halt(state)).squeeze(-1).float()
            if n == self.max_steps - 1:
                p = torch.ones_like(p)  # force every example to halt at the last step
            running = (halting < 1 - self.eps).float()
            new_halted = ((halting + p * running) >= 1 - self.eps).float() * running
            still_running = ((halting + p * running) < 1 - self.eps).float() * running
            halting = halting + p * still_running
            remainders = remainders + new_halted * (1 - halting)
            halting = halting + new_halted * remainders
            n_updates = n_updates + still_running + new_halted
            update_weights = p * still_running + new_halted * remainders
            weighted = weighted + update_weights[:, None] * state
            n += 1
        self.last_steps = n
        ponder_cost = (n_updates + remainders).mean()
        return self.readout(weighted), ponder_cost


def _batch(gen, batch=4):
    x = torch.randn(batch, DIM_IN, generator=gen) * (0.5 + torch.rand(batch, 1, generator=gen))
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return x, y


def build_model():
    torch.manual_seed(0)
    return ACTClassifier()


def example_inputs():
    x, _ = _batch(torch.Generator().manual_seed(1))
    return (x,)


def loss_fn(output, batch, time_penalty=0.01):
    logits, ponder_cost = output
    return F.cross_entropy(logits.float(), batch[1]) + time_penalty * ponder_cost.float()


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        x, y = _batch(gen)
        yield (x,), (x, y)
