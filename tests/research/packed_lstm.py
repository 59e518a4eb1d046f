"""A BiLSTM sequence tagger over padded batches, as NER/POS research code writes it (lample-style taggers,
AllenNLP-era repos): ``pack_padded_sequence(x, lengths.tolist(), batch_first=True, enforce_sorted=False)``, an
``nn.LSTM``, ``pad_packed_sequence``, then an MLP tag classifier. The head is wide so it, not the LSTM, holds most FLOPs.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

VOCAB, EMB, HIDDEN, HEAD, TAGS = 100, 32, 32, 384, 9
PAD = 0


class WordEmbedding(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMB, padding_idx=PAD)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens):
        return self.drop(self.embed(tokens))


class TagHead(nn.Module):
    def __init__(self, dropout=0.2):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(2 * HIDDEN, HEAD), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(HEAD, HEAD), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(HEAD, TAGS),
        )

    def forward(self, h):
        return self.mlp(h)


class BiLSTMTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = WordEmbedding()
        self.lstm = nn.LSTM(EMB, HIDDEN, batch_first=True, bidirectional=True)
        self.head = TagHead()

    def forward(self, tokens, lengths):
        x = self.embedding(tokens)
        packed = pack_padded_sequence(x, lengths.tolist(), batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        h, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        return self.head(h)


def _batch(gen, batch=4, seq=20):
    lengths = torch.randint(3, seq + 1, (batch,), generator=gen)
    valid = torch.arange(seq)[None, :] < lengths[:, None]
    tokens = torch.randint(1, VOCAB, (batch, seq), generator=gen).masked_fill(~valid, PAD)
    tags = (tokens % TAGS).masked_fill(~valid, -100)  # a learnable toy tagging rule
    return tokens, lengths, tags


def build_model():
    torch.manual_seed(0)
    return BiLSTMTagger()


def example_inputs():
    tokens, lengths, _ = _batch(torch.Generator().manual_seed(1))
    return tokens, lengths


def loss_fn(output, batch):
    tags = batch[-1]
    return F.cross_entropy(output.float().reshape(-1, TAGS), tags.reshape(-1), ignore_index=-100)


def train_batches():
    gen = torch.Generator().manual_seed(3)
    while True:
        tokens, lengths, tags = _batch(gen)
        yield (tokens, lengths), (tokens, lengths, tags)
