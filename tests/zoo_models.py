"""Small-config model builders for the zoo test (nothing is downloaded).

``build(name, batch=2, length=None)`` returns ``(model, (args, kwargs))`` with the model in eval
mode and example inputs of the given batch size and sequence length (or spatial size / audio length
for vision and speech models); the weights depend only on ``name`` (fixed seeds), so two calls give
the same model. ``ZOO`` lists every name with its family; ``HF_CLASSES`` gives the transformers class
of each HF model, for the weights round-trip test.

Configs are tiny (hidden 32-64, 1-2 layers) and every model keeps some dropout, so that ``train()``
and ``eval()`` differ.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ZOO", "HF_CLASSES", "build", "build_model", "hf_config", "second_size", "DEFAULT_LENGTH"]

VOCAB = 96
DEFAULT_LENGTH = 12

_DEC = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attention_dropout=0.1)
_ENC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)

#: name -> (family, transformers config class, model class, config kwargs); hand-written models have None classes
_HF = {
    # decoders with rotary embeddings and grouped-query attention
    "llama": ("decoder", "LlamaConfig", "LlamaForCausalLM", _DEC),
    "qwen2": ("decoder", "Qwen2Config", "Qwen2ForCausalLM", _DEC),
    "mistral": ("decoder", "MistralConfig", "MistralForCausalLM", dict(_DEC, head_dim=16)),
    "gemma": ("decoder", "GemmaConfig", "GemmaForCausalLM", dict(_DEC, head_dim=16)),
    "phi3": ("decoder", "Phi3Config", "Phi3ForCausalLM", dict(_DEC, pad_token_id=0, resid_pdrop=0.1)),
    "gpt_neox": ("decoder", "GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=64, use_cache=False, hidden_dropout=0.1, attention_dropout=0.1)),
    "falcon": ("decoder", "FalconConfig", "FalconForCausalLM",
               dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                    new_decoder_architecture=True, use_cache=False, hidden_dropout=0.1, attention_dropout=0.1)),
    "gpt2": ("decoder", "GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, use_cache=False)),
    # encoders
    "bert": ("encoder", "BertConfig", "BertForSequenceClassification", _ENC),
    "roberta": ("encoder", "RobertaConfig", "RobertaForSequenceClassification", dict(_ENC, pad_token_id=1)),
    "distilbert": ("encoder", "DistilBertConfig", "DistilBertForSequenceClassification",
                   dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64,
                        dropout=0.1, attention_dropout=0.1)),
    "electra": ("encoder", "ElectraConfig", "ElectraForSequenceClassification", dict(_ENC, embedding_size=32)),
    "albert": ("encoder", "AlbertConfig", "AlbertForSequenceClassification",
               dict(_ENC, embedding_size=16, hidden_dropout_prob=0.1, classifier_dropout_prob=0.1)),
    "deberta_v2": ("encoder", "DebertaV2Config", "DebertaV2ForSequenceClassification",
                   dict(_ENC, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"])),
    # encoder-decoder
    "t5": ("seq2seq", "T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.1,
                use_cache=False, decoder_start_token_id=0)),
    "bart": ("seq2seq", "BartConfig", "BartForConditionalGeneration",
             dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  dropout=0.1, use_cache=False)),
    # vision
    "resnet": ("vision", "ResNetConfig", "ResNetForImageClassification",
               dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=4)),
    "convnext": ("vision", "ConvNextConfig", "ConvNextForImageClassification",
                 dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=4, drop_path_rate=0.5,
                      layer_scale_init_value=0.5)),
    "swin": ("vision", "SwinConfig", "SwinForImageClassification",
             dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
                  num_labels=4, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)),
    "vit": ("vision", "ViTConfig", "ViTForImageClassification",
            dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, num_labels=4, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)),
    # speech
    "wav2vec2": ("speech", "Wav2Vec2Config", "Wav2Vec2ForCTC",
                 dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                      num_conv_pos_embedding_groups=4, hidden_dropout=0.1, attention_dropout=0.1, mask_time_prob=0.0,
                      do_stable_layer_norm=False, feat_extract_norm="group")),
    "whisper": ("speech", "WhisperConfig", "WhisperForConditionalGeneration",
                dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                     max_source_positions=8, max_target_positions=32, dropout=0.1, use_cache=False,
                     decoder_start_token_id=1, pad_token_id=0)),
}

# ---------------------------------------------------------------------------------------------
# hand-written models


class RecurrentTagger(nn.Module):
    """Embedding -> bidirectional LSTM -> GRU -> linear head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.lstm = nn.LSTM(32, 32, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(64, 32, batch_first=True)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, 8)

    def forward(self, input_ids):
        x, _ = self.lstm(self.embed(input_ids))
        x, _ = self.gru(self.drop(x))
        return self.head(x)


class MHAEncoder(nn.Module):
    """nn.MultiheadAttention with a key-padding mask, pre-norm, a GELU MLP."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.norm1 = nn.LayerNorm(32)
        self.attn = nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
        self.norm2 = nn.LayerNorm(32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 32))
        self.head = nn.Linear(32, 4)

    def forward(self, input_ids, padding_mask):
        x = self.embed(input_ids)
        h = self.norm1(x)
        a, _ = self.attn(h, h, h, key_padding_mask=padding_mask, need_weights=False)
        x = x + a
        x = x + self.mlp(self.norm2(x))
        return self.head(x.mean(1))


class GroupNormUNet(nn.Module):
    """Conv + GroupNorm + SiLU down path, F.interpolate up path with a skip connection."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Conv2d(3, 16, 3, padding=1)
        self.gn1 = nn.GroupNorm(4, 16)
        self.down = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.gn2 = nn.GroupNorm(8, 32)
        self.drop = nn.Dropout2d(0.1)
        self.up = nn.Conv2d(32, 16, 3, padding=1)
        self.out = nn.Conv2d(16, 3, 1)

    def forward(self, x):
        h1 = F.silu(self.gn1(self.inp(x)))
        h2 = self.drop(F.silu(self.gn2(self.down(h1))))
        u = F.interpolate(h2, size=h1.shape[-2:], mode="bilinear", align_corners=False)
        return self.out(self.up(u) + h1)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class EinsumBlock(nn.Module):
    """Hand-written attention with einsum, an RMSNorm, a causal mask filled with finfo(fp32).min and in-place ops."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.norm = RMSNorm(32)
        self.qkv = nn.Linear(32, 96, bias=False)
        self.proj = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        t = x.shape[1]
        q, k, v = self.qkv(self.norm(x)).view(x.shape[0], t, 3, 4, 8).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 8 ** -0.5
        causal = torch.ones_like(scores[0, 0], dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, torch.finfo(torch.float32).min)
        probs = self.drop(scores.softmax(-1))
        h = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(x.shape)
        x = x + self.proj(h)
        x.mul_(0.5)
        y = F.relu(x) * 2.0  # relu saves its output for backward: the in-place add goes on the product
        y.add_(1.0)
        return self.head(y)


_HAND = {
    "lstm_gru": ("hand", RecurrentTagger),
    "mha": ("hand", MHAEncoder),
    "groupnorm_unet": ("hand", GroupNormUNet),
    "einsum_inplace": ("hand", EinsumBlock),
}

ZOO = {**{k: v[0] for k, v in _HF.items()}, **{k: v[0] for k, v in _HAND.items()}}
HF_CLASSES = {k: v[2] for k, v in _HF.items()}


def hf_config(name: str):
    import transformers

    _family, cfg_cls, _model_cls, kwargs = _HF[name]
    cfg = getattr(transformers, cfg_cls)(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


def build_model(name: str) -> nn.Module:
    """The model ``name`` in eval mode, with weights fixed by the name."""
    torch.manual_seed(sum(map(ord, name)))
    if name in _HAND:
        return _HAND[name][1]().eval()
    import transformers

    model = getattr(transformers, _HF[name][2])(hf_config(name))
    return model.eval()


def second_size(name: str) -> tuple[int, int]:
    """A second (batch, length) that differs from the example's in both dimensions."""
    family = ZOO[name]
    if family == "vision" or name == "groupnorm_unet":
        return 3, 64 if name in ("resnet", "convnext", "groupnorm_unet") else 32
    if family == "speech":
        return 3, 1200 if name == "wav2vec2" else 7  # whisper: decoder tokens (the encoder wants 16 frames)
    return 3, 7


def build_inputs(name: str, *, batch: int = 2, length: int | None = None):
    """``(args, kwargs)`` for ``name``: token ids (with padding masks where the model takes them),
    images or audio; ``length`` is tokens, image side or audio samples / mel frames."""
    g = torch.Generator().manual_seed(1000 + batch * 31 + (length or 0))
    family = ZOO[name]
    if family == "vision" or name == "groupnorm_unet":
        side = length or 32
        return (), {"pixel_values" if family == "vision" else "x": torch.randn(batch, 3, side, side, generator=g)}
    if name == "wav2vec2":
        return (), {"input_values": torch.randn(batch, length or 800, generator=g)}
    if name == "whisper":
        # the encoder wants exactly 2 * max_source_positions = 16 frames; ``length`` is decoder tokens
        return (), {"input_features": torch.randn(batch, 16, 16, generator=g),
                    "decoder_input_ids": torch.randint(2, VOCAB, (batch, length or 5), generator=g)}
    t = length or DEFAULT_LENGTH
    ids = torch.randint(2, VOCAB, (batch, t), generator=g)
    if name == "mha":
        pad = torch.zeros(batch, t, dtype=torch.bool)
        pad[0, -3:] = True
        return (ids, pad), {}
    if family == "hand":
        return (ids,), {}
    kwargs = {"input_ids": ids}
    if family in ("encoder", "seq2seq"):
        mask = torch.ones(batch, t, dtype=torch.long)
        mask[0, -3:] = 0  # padding in the first row
        kwargs["attention_mask"] = mask
    if family == "seq2seq":
        kwargs["decoder_input_ids"] = torch.randint(2, VOCAB, (batch, max(t // 2, 3)), generator=g)
    return (), kwargs


def build(name: str, *, batch: int = 2, length: int | None = None):
    return build_model(name), build_inputs(name, batch=batch, length=length)
