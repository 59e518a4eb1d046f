"""A small MLP classifier: Linear → GELU → LayerNorm → Linear, with a cross-entropy loss."""
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, d_hidden: int = 64, n_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.head = nn.Linear(d_hidden, n_classes)

    def forward(self, x):
        h = self.norm(self.act(self.fc1(x)))
        h = h + torch.relu(self.fc2(h))
        return self.head(h)


def build_model():
    torch.manual_seed(0)
    return MLP()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(8, 32),)


def calibration_inputs():
    gen = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 32, generator=gen),) for _ in range(4)]


def loss_fn(output, batch):
    _, target = batch
    return nn.functional.cross_entropy(output.float(), target)


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        x = torch.randn(8, 32, generator=gen)
        yield (x,), (x, (x[:, :10].argmax(dim=1)))
