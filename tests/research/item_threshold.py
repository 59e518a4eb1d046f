"""Adaptive depth decided on the host, as conditional-computation research code writes it: an extra block runs only
when ``h.abs().mean().item() > self.threshold``, and per-example mean pooling splits a flat (packed) batch of
frames with ``for chunk in torch.split(h, lengths.tolist())``.
"""
import torch
import torch.nn.functional as F
from torch import nn

DIM_IN, HIDDEN, CLASSES = 40, 128, 6


class FrameEncoder(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(DIM_IN, HIDDEN), nn.GELU(), nn.Dropout(dropout), nn.Linear(HIDDEN, HIDDEN),
                                 nn.GELU(), nn.Linear(HIDDEN, HIDDEN))

    def forward(self, frames):
        return self.mlp(frames)


class ExtraBlock(nn.Module):
    """The residual block spent on hard (high-activation) batches."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))

    def forward(self, pooled):
        return self.fc(pooled)


class AdaptiveDepthClassifier(nn.Module):
    def __init__(self, threshold=0.1):
        super().__init__()
        self.encoder = FrameEncoder()
        self.extra = ExtraBlock()
        self.head = Head()
        self.threshold = threshold
        self.used_extra = False

    def forward(self, frames, lengths):
        h = self.encoder(frames)
        self.used_extra = False
        if h.abs().mean().item() > self.threshold:
            h = self.extra(h)
            self.used_extra = True
        pooled = torch.stack([chunk.mean(dim=0) for chunk in torch.split(h, lengths.tolist())])
        return self.head(pooled)


def _batch(gen, batch=4, max_frames=16, scale=None):
    """Utterances of 4-16 frames concatenated along dim 0; the loudness varies from batch to batch."""
    lengths = torch.randint(4, max_frames + 1, (batch,), generator=gen)
    if scale is None:
        scale = float(torch.empty(1).uniform_(0.3, 3.0, generator=gen))
    frames = torch.randn(int(lengths.sum()), DIM_IN, generator=gen) * scale
    labels = torch.randint(0, CLASSES, (batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    frames[offsets, labels] += 3.0 * scale  # the first frame carries the label
    return frames, lengths, labels


def build_model():
    torch.manual_seed(0)
    return AdaptiveDepthClassifier()


def example_inputs():
    """A loud batch: the extra block runs."""
    frames, lengths, _ = _batch(torch.Generator().manual_seed(1), scale=2.0)
    return frames, lengths


def loss_fn(output, batch):
    return F.cross_entropy(output.float(), batch[-1])


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        frames, lengths, labels = _batch(gen)
        yield (frames, lengths), (frames, lengths, labels)
