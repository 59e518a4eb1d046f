"""A small CNN with BatchNorm, pooling and a cross-entropy loss computed inside the model."""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class SmallCNN(nn.Module):
    """conv-BN-ReLU ×3 with max pooling, global average pooling, a linear classifier and the loss."""

    def __init__(self, n_classes: int = 10):
        super().__init__()
        self.b1 = Block(3, 16)
        self.b2 = Block(16, 32)
        self.b3 = Block(32, 32)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(32, n_classes)

    def forward(self, x, target):
        x = self.pool(self.b1(x))
        x = self.pool(self.b2(x))
        x = self.b3(x)
        x = x.mean(dim=(2, 3))
        logits = self.fc(x)
        return F.cross_entropy(logits, target)


def build_model():
    torch.manual_seed(0)
    return SmallCNN()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))


def loss_fn(output, batch):
    return output  # the model returns its loss


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        x = torch.randn(4, 3, 16, 16, generator=gen)
        y = (x.mean(dim=(1, 2, 3)) > 0).long()
        yield (x, y), None
