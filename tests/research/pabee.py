"""Patience-based early exit (PABEE; Zhou et al., NeurIPS 2020, JetRunner/PABEE ``modeling_pabee_bert.py``).

Every encoder layer has its own classifier. In training the model returns all layers' logits (stacked) for
a layer-weighted loss; at inference the layer loop stops once ``patience`` consecutive exits agree (``torch.equal``).
"""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, CLASSES, MAX_LEN = 100, 64, 4, 6, 3, 32
PAD, CLS = 0, 1


class Embeddings(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.word = nn.Embedding(VOCAB, DIM, padding_idx=PAD)
        self.position = nn.Embedding(MAX_LEN, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.drop = nn.Dropout(dropout)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.norm(self.word(input_ids) + self.position(positions)))


class SelfAttention(nn.Module):
    def __init__(self, dim, heads, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(~mask[:, None, None, :], float("-inf"))
        att = self.drop(att.softmax(dim=-1))
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class Layer(nn.Module):
    """A post-norm BERT layer."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.attn = SelfAttention(DIM, HEADS, dropout)
        self.norm1 = nn.LayerNorm(DIM)
        self.ffn = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.norm2 = nn.LayerNorm(DIM)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask):
        x = self.norm1(x + self.drop(self.attn(x, mask)))
        return self.norm2(x + self.drop(self.ffn(x)))


class Classifier(nn.Module):
    """BERT pooler ([CLS] token) and a linear classifier: one per exit."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.dense = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        return self.out(self.drop(torch.tanh(self.dense(x[:, 0]))))


class PABEEClassifier(nn.Module):
    def __init__(self, patience=2):
        super().__init__()
        self.embeddings = Embeddings()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.classifiers = nn.ModuleList(Classifier() for _ in range(LAYERS))
        self.patience = patience
        self.exit_layer = LAYERS  # the layer the last inference exited at, for logging

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.bool()
        x = self.embeddings(input_ids)
        if self.training:
            all_logits = []
            for layer, classifier in zip(self.layers, self.classifiers):
                x = layer(x, mask)
                all_logits.append(classifier(x))
            return torch.stack(all_logits)

        patient_counter, last = 0, None
        for i, (layer, classifier) in enumerate(zip(self.layers, self.classifiers)):
            x = layer(x, mask)
            logits = classifier(x)
            pred = logits.argmax(dim=-1)
            if last is not None and torch.equal(pred, last):
                patient_counter += 1
            else:
                patient_counter = 0
            last = pred
            self.exit_layer = i + 1
            if patient_counter == self.patience:
                break
        return logits


def _batch(gen, batch=4, seq=16):
    lengths = torch.randint(6, seq + 1, (batch,), generator=gen)
    ids = torch.randint(2, VOCAB, (batch, seq), generator=gen)
    ids[:, 0] = CLS
    attention_mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(attention_mask == 0, PAD)
    labels = ((ids >= VOCAB // 2) & (attention_mask == 1)).sum(1) % CLASSES
    return ids, attention_mask, labels


def build_model():
    torch.manual_seed(0)
    return PABEEClassifier()


def example_inputs():
    ids, attention_mask, _ = _batch(torch.Generator().manual_seed(1))
    return ids, attention_mask


def loss_fn(output, batch):
    """PABEE's weighted average of the exits' losses (layer i weighted by i); one exit's loss in eval."""
    labels = batch[-1]
    logits = output.float()
    if logits.dim() == 2:
        return F.cross_entropy(logits, labels)
    weights = torch.arange(1, logits.shape[0] + 1, dtype=torch.float32)
    losses = torch.stack([F.cross_entropy(layer_logits, labels) for layer_logits in logits])
    return (weights * losses).sum() / weights.sum()


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        ids, attention_mask, labels = _batch(gen)
        yield (ids, attention_mask), (ids, attention_mask, labels)
