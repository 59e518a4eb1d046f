"""A GCN (Kipf & Welling, ICLR 2017) for graph classification written without PyG, as many research repos do:
symmetric-normalised message passing scattered with ``index_add_``, a Linear transform per layer as a submodule,
and global mean pooling over ``num_graphs = int(batch.max()) + 1`` graphs of a disjoint-union mini-batch.
"""
import torch
import torch.nn.functional as F
from torch import nn

F_IN, HIDDEN, LAYERS, CLASSES = 16, 64, 3, 3


class GCNLayer(nn.Module):
    """``D^-1/2 (A + I) D^-1/2 X W``: the transform, then the normalised scatter-add over edges."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, bias=False)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x, src, dst, norm):
        h = self.lin(x)
        messages = h[src] * norm.to(h.dtype)[:, None]
        return torch.zeros_like(h).index_add_(0, dst, messages) + self.bias


class Classifier(nn.Module):
    def __init__(self, dropout=0.2):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Dropout(dropout), nn.Linear(HIDDEN, CLASSES))

    def forward(self, pooled):
        return self.mlp(pooled)


class GCN(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        dims = [F_IN] + [HIDDEN] * LAYERS
        self.convs = nn.ModuleList(GCNLayer(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.classifier = Classifier()
        self.dropout = dropout

    def forward(self, x, edge_index, batch):
        num_nodes = x.shape[0]
        loops = torch.arange(num_nodes, device=x.device)
        src = torch.cat([edge_index[0], loops])
        dst = torch.cat([edge_index[1], loops])
        deg = torch.zeros(num_nodes, device=x.device).index_add_(0, dst, torch.ones(dst.shape[0], device=x.device))
        norm = deg[src].rsqrt() * deg[dst].rsqrt()

        h = x
        for conv in self.convs:
            h = F.dropout(F.relu(conv(h, src, dst, norm)), self.dropout, self.training)

        num_graphs = int(batch.max()) + 1
        pooled = torch.zeros(num_graphs, h.shape[1], dtype=h.dtype, device=h.device).index_add_(0, batch, h)
        counts = torch.bincount(batch, minlength=num_graphs).clamp(min=1).to(h.dtype)
        return self.classifier(pooled / counts[:, None])


def _batch(gen):
    """2-4 random undirected graphs of 6-12 nodes as one disjoint union; label: an edge-density bucket."""
    xs, edges, batch, labels = [], [], [], []
    offset = 0
    for g in range(int(torch.randint(2, 5, (1,), generator=gen))):
        n = int(torch.randint(6, 13, (1,), generator=gen))
        p = float(torch.rand(1, generator=gen)) * 0.5 + 0.1
        adj = torch.rand(n, n, generator=gen) < p
        adj = torch.triu(adj, diagonal=1)
        src, dst = adj.nonzero().t()
        edges.append(torch.stack([torch.cat([src, dst]), torch.cat([dst, src])]) + offset)
        xs.append(torch.randn(n, F_IN, generator=gen))
        batch.append(torch.full((n,), g, dtype=torch.long))
        labels.append(min(int(p * 5), CLASSES - 1))
        offset += n
    return torch.cat(xs), torch.cat(edges, dim=1), torch.cat(batch), torch.tensor(labels)


def build_model():
    torch.manual_seed(0)
    return GCN()


def example_inputs():
    x, edge_index, batch, _ = _batch(torch.Generator().manual_seed(1))
    return x, edge_index, batch


def loss_fn(output, batch):
    return F.cross_entropy(output.float(), batch[-1])


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        x, edge_index, batch, labels = _batch(gen)
        yield (x, edge_index, batch), (x, edge_index, batch, labels)
