"""A Gumbel-softmax discrete bottleneck whose temperature is annealed from a call counter kept on the module,
as dVAE / NAS research code does it (Jang et al. 2017 schedules): forward does ``self.calls += 1`` in train mode,
``tau = max(0.5, math.exp(-self.anneal * self.calls))``, and passes ``tau`` to the quantizer as a Python float.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

DIM_IN, HIDDEN, GROUPS, CODES, CODE_DIM = 64, 128, 4, 32, 32


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(DIM_IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                                 nn.Linear(HIDDEN, GROUPS * CODES))

    def forward(self, x):
        return self.mlp(x).view(x.shape[0], GROUPS, CODES)


class GumbelQuantizer(nn.Module):
    def __init__(self):
        super().__init__()
        self.codebook = nn.Linear(CODES, CODE_DIM, bias=False)

    def forward(self, logits, tau):
        if self.training:
            probs = F.gumbel_softmax(logits, tau=tau, hard=False, dim=-1)
        else:
            probs = F.softmax(logits / tau, dim=-1)
        return self.codebook(probs).flatten(1)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(GROUPS * CODE_DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                                 nn.Linear(HIDDEN, DIM_IN))

    def forward(self, z):
        return self.mlp(z)


class GumbelAutoencoder(nn.Module):
    def __init__(self, anneal=1e-3):
        super().__init__()
        self.encoder = Encoder()
        self.quantizer = GumbelQuantizer()
        self.decoder = Decoder()
        self.anneal = anneal
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
        tau = max(0.5, math.exp(-self.anneal * self.calls))
        logits = self.encoder(x)
        return self.decoder(self.quantizer(logits, tau)), logits


def _batch(gen, batch=4):
    centers = torch.randn(8, DIM_IN, generator=torch.Generator().manual_seed(7))
    x = centers[torch.randint(0, 8, (batch,), generator=gen)] + 0.1 * torch.randn(batch, DIM_IN, generator=gen)
    return x


def build_model():
    torch.manual_seed(0)
    return GumbelAutoencoder()


def example_inputs():
    return (_batch(torch.Generator().manual_seed(1)),)


def loss_fn(output, batch, kl_weight=0.01):
    recon, logits = output
    log_probs = logits.float().log_softmax(dim=-1)
    kl_to_uniform = (log_probs.exp() * (log_probs + math.log(CODES))).sum(-1).mean()
    return F.mse_loss(recon.float(), batch) + kl_weight * kl_to_uniform


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        x = _batch(gen)
        yield (x,), x
