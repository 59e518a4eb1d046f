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
            num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1)
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
                      max_position_embeddings=64, hidden_dropout=0.1, attention_dropout=0.1)),
    "falcon": ("decoder", "FalconConfig", "FalconForCausalLM",
               dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                    new_decoder_architecture=True, hidden_dropout=0.1, attention_dropout=0.1)),
    "gpt2": ("decoder", "GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4)),
    # a mixture-of-experts decoder (transformers' grouped_mm_fallback custom op runs the experts)
    "mixtral": ("decoder", "MixtralConfig", "MixtralForCausalLM", dict(_DEC, num_local_experts=4, num_experts_per_tok=2)),
    # soft-capped logits and sliding-window attention; ALiBi; partial rotary
    "gemma2": ("decoder", "Gemma2Config", "Gemma2ForCausalLM",
               dict(_DEC, head_dim=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=8,
                    query_pre_attn_scalar=16)),
    "bloom": ("decoder", "BloomConfig", "BloomForCausalLM",
              dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.1, attention_dropout=0.1)),
    "phi": ("decoder", "PhiConfig", "PhiForCausalLM",
            dict(_DEC, partial_rotary_factor=0.5, resid_pdrop=0.1, embd_pdrop=0.1)),
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
                decoder_start_token_id=0)),
    "bart": ("seq2seq", "BartConfig", "BartForConditionalGeneration",
             dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  dropout=0.1)),
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
    "segformer": ("vision", "SegformerConfig", "SegformerForSemanticSegmentation",
                  dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
                       strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=32,
                       num_labels=4, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, drop_path_rate=0.0)),
    # speech
    "wav2vec2": ("speech", "Wav2Vec2Config", "Wav2Vec2ForCTC",
                 dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                      num_conv_pos_embedding_groups=4, hidden_dropout=0.1, attention_dropout=0.1, mask_time_prob=0.0,
                      do_stable_layer_norm=False, feat_extract_norm="group")),
    "whisper": ("speech", "WhisperConfig", "WhisperForConditionalGeneration",
                dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                     max_source_positions=8, max_target_positions=32, dropout=0.1,
                     decoder_start_token_id=1, pad_token_id=0)),
    # issue 30: multi-head latent attention with a routed + shared mixture of experts (layer 1), a
    # detection transformer on a transformers ResNet backbone (no timm, nothing pretrained; no encoder
    # layer: its train-mode `isfinite().all()` branch freezes the train graph in eval mode, issue 30)
    "deepseek_v3": ("decoder", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                         n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                         kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                         max_position_embeddings=64, attention_dropout=0.1)),
    "detr": ("detection", "DetrConfig", "DetrForObjectDetection",
             dict(use_timm_backbone=False, use_pretrained_backbone=False, num_queries=8, num_labels=4, d_model=32,
                  backbone_config=dict(model_type="resnet", embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                       layer_type="basic", out_features=["stage2"]),
                  encoder_layers=0, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.1)),
}
#: eager attention as an extra variant of a model built with the library's default (SDPA) attention
_EAGER = ("llama", "bert", "t5")
for _name in _EAGER:
    _f, _c, _m, _kw = _HF[_name]
    _HF[f"{_name}_eager"] = (_f, _c, _m, dict(_kw, attn_implementation="eager"))

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


class TopKMoE(nn.Module):
    """Embedding, a top-2 mixture of 4 SiLU experts written the classic way (routing softmax, each
    expert's weighted output index_add_-ed into a zeros_like buffer), an LM head."""

    def __init__(self, dim: int = 32, experts: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
                                     for _ in range(experts))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        h = self.norm(x).flatten(0, 1)
        weights, chosen = self.router(h).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(h)
        tokens = torch.arange(h.shape[0])
        for e, expert in enumerate(self.experts):
            gate = (weights * (chosen == e)).sum(-1, keepdim=True)
            out.index_add_(0, tokens, (expert(h) * gate).to(h.dtype))
        return self.head(x + self.drop(out.view_as(x)))


class ChainGNN(nn.Module):
    """Two message-passing layers over a chain graph of the tokens (each token sends to the next),
    PyG style: a linear message, scatter_add_ per destination into new_zeros, a GRU-free update."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.msg = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.upd = nn.ModuleList(nn.Linear(2 * dim, dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, 8)

    def forward(self, input_ids):
        x = self.embed(input_ids).flatten(0, 1)
        n = x.shape[0]
        src = torch.arange(n - 1)
        dst = src + 1
        for msg, upd in zip(self.msg, self.upd):
            m = msg(x)[src]
            agg = x.new_zeros(x.shape)
            agg.scatter_add_(0, dst.unsqueeze(-1).expand(-1, x.shape[1]), m)
            x = self.norm(x + self.drop(F.gelu(upd(torch.cat([x, agg], -1)))))
        return self.head(x).view(*input_ids.shape, -1)


class ConformerBlock(nn.Module):
    """Conformer: half-step feed-forward, self-attention, a convolution module (pointwise conv, GLU,
    depthwise conv, BatchNorm, SiLU) and a second half-step feed-forward, on embedded tokens."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.ff1 = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Dropout(0.1), nn.Linear(2 * dim, dim))
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, dropout=0.1, batch_first=True)
        self.conv_norm = nn.LayerNorm(dim)
        self.pw1 = nn.Conv1d(dim, 2 * dim, 1)
        self.dw = nn.Conv1d(dim, dim, 5, padding=2, groups=dim)
        self.bn = nn.BatchNorm1d(dim)
        self.pw2 = nn.Conv1d(dim, dim, 1)
        self.ff2 = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Dropout(0.1), nn.Linear(2 * dim, dim))
        self.out_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 8)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        x = x + 0.5 * self.ff1(x)
        h = self.attn_norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        c = self.conv_norm(x).transpose(1, 2)
        c = F.glu(self.pw1(c), dim=1)
        c = self.pw2(F.silu(self.bn(self.dw(c))))
        x = x + c.transpose(1, 2)
        x = x + 0.5 * self.ff2(x)
        return self.head(self.out_norm(x))


class ConvVAE(nn.Module):
    """A convolutional VAE: encoder to (mu, logvar), the reparameterisation noise in train mode only,
    a transposed-conv decoder; returns the reconstruction (the KL term is the loss's business)."""

    def __init__(self, latent: int = 8):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.SiLU(),
                                 nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.SiLU())
        self.mu = nn.Conv2d(32, latent, 1)
        self.logvar = nn.Conv2d(32, latent, 1)
        self.dec = nn.Sequential(nn.ConvTranspose2d(latent, 32, 4, stride=2, padding=1), nn.SiLU(),
                                 nn.ConvTranspose2d(32, 3, 4, stride=2, padding=1))

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        if self.training:
            mu = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.dec(mu))


class TiedLM(nn.Module):
    """A GRU language model whose output layer shares the embedding matrix (``head.weight is embed.weight``)."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.gru = nn.GRU(dim, dim, batch_first=True)
        self.drop = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids):
        x, _ = self.gru(self.drop(self.embed(input_ids)))
        return self.head(self.norm(x))


class CheckpointedStack(nn.Module):
    """Four pre-norm MLP-attention blocks, each run through ``torch.utils.checkpoint`` in train mode
    (as Hugging Face's gradient checkpointing does): the conversion must keep the checkpoints."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(MHABlock(dim, heads) for _ in range(4))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids):
        from torch.utils.checkpoint import checkpoint

        x = self.embed(input_ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.training else block(x)
        return self.head(self.norm(x))


class MHABlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.mlp(self.norm2(x))


class LoraLlama(nn.Module):
    """A Llama decoder wrapped by peft's LoRA on q_proj/v_proj (r=4, dropout 0.1), as fine-tuning
    scripts build it; lora_B is initialised non-zero so that the adapters change the output."""

    def __init__(self):
        super().__init__()
        import peft
        import transformers

        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DEC))
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
        self.model = peft.get_peft_model(base, lora)
        for name, param in self.model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(param, std=0.02)

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


class UNet2D(nn.Module):
    """diffusers' UNet2DConditionModel (cross-attention down/up blocks, GroupNorm, timestep
    embedding), the denoiser of latent diffusion: (latents, timestep, text states) -> noise."""

    def __init__(self):
        super().__init__()
        import diffusers

        self.unet = diffusers.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8, dropout=0.1)

    def forward(self, sample, timestep, encoder_hidden_states):
        return self.unet(sample=sample, timestep=timestep, encoder_hidden_states=encoder_hidden_states).sample



# ---------------------------------------------------------------------------------------------
# issue 30's patterns, hand-written where transformers has no small model


class WSConv2d(nn.Conv2d):
    """A weight-standardised convolution (BiT, NFNet style): the weight is normalised per output channel
    on every call with a functional ``batch_norm(training=True)`` and no running statistics, which is
    a statement about the weight, not about ``self.training``."""

    def forward(self, x):
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0,
                         eps=1e-5).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class MeanStdConv2d(nn.Conv2d):
    """Weight standardisation written with mean and std."""

    def forward(self, x):
        flat = self.weight.flatten(1)
        w = ((flat - flat.mean(1, keepdim=True)) / (flat.std(1, keepdim=True) + 1e-5)).view_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class WSConvNet(nn.Module):
    """Weight-standardised convs with GroupNorm (the BiT ResNet recipe), dropout, a pooled head."""

    def __init__(self):
        super().__init__()
        self.stem = WSConv2d(3, 16, 3, padding=1)
        self.gn1 = nn.GroupNorm(4, 16)
        self.conv = MeanStdConv2d(16, 32, 3, stride=2, padding=1)
        self.gn2 = nn.GroupNorm(8, 32)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        x = F.relu(self.gn1(self.stem(x)))
        x = F.relu(self.gn2(self.conv(x)))
        return self.head(self.drop(x.mean((2, 3))))


class MelFrontend(nn.Module):
    """A log-mel front end under ``torch.autocast(enabled=False)`` (the user's fp32 intent: the power
    spectrum of int16-scaled PCM reaches ~1e10, far past fp16), then a conv + GRU-free encoder."""

    def __init__(self, n_fft: int = 64, hop: int = 16, mels: int = 16, dim: int = 32):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        bins = n_fft // 2 + 1
        centres = torch.linspace(0, bins - 1, mels + 2)
        grid = torch.arange(bins, dtype=torch.float32)
        up = (grid[None] - centres[:-2, None]) / (centres[1:-1, None] - centres[:-2, None])
        down = (centres[2:, None] - grid[None]) / (centres[2:, None] - centres[1:-1, None])
        self.register_buffer("fbank", up.minimum(down).clamp_min(0.0), persistent=False)  # (mels, bins)
        self.conv = nn.Conv1d(mels, dim, 3, padding=1)
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, 8)

    def forward(self, wave):
        with torch.autocast(device_type=wave.device.type, enabled=False):
            spec = torch.stft(wave.float(), self.n_fft, self.hop, window=self.window, return_complex=True)
            power = spec.real.pow(2) + spec.imag.pow(2)
            mel = torch.log(torch.matmul(self.fbank, power) + 1e-6)  # (batch, mels, frames)
        x = F.gelu(self.conv(mel)).transpose(1, 2)
        x = x + self.ff(self.norm(x))
        return self.head(x)


class GradReverse(torch.autograd.Function):
    """The gradient-reversal layer of domain-adversarial training: identity forward, -scale * grad back."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class DomainAdversarial(nn.Module):
    """DANN: a shared feature extractor, a label head and a domain head behind a gradient reversal;
    returns both heads' logits side by side, so that a loss on them trains the extractor both ways."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.features = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(dim))
        self.label = nn.Linear(dim, 6)
        self.domain = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 2))

    def forward(self, input_ids):
        h = self.features(self.embed(input_ids))
        return torch.cat([self.label(h), self.domain(GradReverse.apply(h, 0.5))], -1)


class SafeSqrt(torch.autograd.Function):
    """sqrt whose gradient is 0 (not inf) at 0: a zero vector's norm has no NaN gradient."""

    @staticmethod
    def forward(ctx, x):
        y = x.sqrt()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return torch.where(y > 0, grad / (2 * y).clamp_min(1e-12), torch.zeros_like(grad))


class SafeDistanceAttention(nn.Module):
    """Attention by negative Euclidean distance between token vectors (a kernel / prototype layer):
    the distance of each token to itself is exactly 0, where plain autograd's sqrt gives 0 * inf = NaN
    and the custom SafeSqrt gives 0."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, 8)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        k = self.key(x)
        dist = SafeSqrt.apply((k[:, :, None] - k[:, None]).pow(2).sum(-1))
        h = x + self.drop(torch.softmax(-dist, -1) @ self.value(x))
        return self.head(h)


class ParametrizedConvNet(nn.Module):
    """Convs under ``torch.nn.utils.parametrizations``: weight_norm (vocoders) and spectral_norm (GAN
    discriminators), as registered parametrizations rather than the deprecated hooks."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils import parametrizations

        self.conv1 = parametrizations.weight_norm(nn.Conv2d(3, 16, 3, padding=1))
        self.conv2 = parametrizations.spectral_norm(nn.Conv2d(16, 32, 3, stride=2, padding=1))
        self.drop = nn.Dropout(0.1)
        self.head = parametrizations.weight_norm(nn.Linear(32, 4))

    def forward(self, x):
        x = F.leaky_relu(self.conv1(x), 0.2)
        x = F.leaky_relu(self.conv2(x), 0.2)
        return self.head(self.drop(x.mean((2, 3))))


class SpectralConv1d(nn.Module):
    """A Fourier layer (FNO): rfft, the lowest ``modes`` frequencies times a complex weight, irfft."""

    def __init__(self, channels: int, modes: int, *, complex_param: bool):
        super().__init__()
        self.modes = modes
        scale = 1.0 / channels
        if complex_param:  # a complex64 parameter, as neuraloperator writes it
            self.weight = nn.Parameter(scale * torch.randn(channels, channels, modes, dtype=torch.cfloat))
        else:  # a real parameter viewed as complex
            self.weight = nn.Parameter(scale * torch.randn(channels, channels, modes, 2))

    def forward(self, x):
        w = self.weight if self.weight.is_complex() else torch.view_as_complex(self.weight)
        spec = torch.fft.rfft(x, dim=-1)
        low = torch.einsum("bim,iom->bom", spec[..., : self.modes], w)
        out = torch.zeros(x.shape[0], w.shape[1], spec.shape[-1], dtype=spec.dtype, device=x.device)
        out[..., : self.modes] = low
        return torch.fft.irfft(out, n=x.shape[-1], dim=-1)


class FourierNeuralOperator(nn.Module):
    """A 1-d FNO: lift, two Fourier layers with pointwise skips, project (signals of shape (batch, 3, length))."""

    def __init__(self, width: int = 16, modes: int = 6):
        super().__init__()
        self.lift = nn.Conv1d(3, width, 1)
        self.spectral = nn.ModuleList([SpectralConv1d(width, modes, complex_param=True),
                                       SpectralConv1d(width, modes, complex_param=False)])
        self.skip = nn.ModuleList(nn.Conv1d(width, width, 1) for _ in range(2))
        self.drop = nn.Dropout(0.1)
        self.proj = nn.Conv1d(width, 2, 1)

    def forward(self, x):
        x = self.lift(x)
        for spectral, skip in zip(self.spectral, self.skip):
            x = F.gelu(spectral(x) + skip(x))
        return self.proj(self.drop(x))


_HAND = {
    "lstm_gru": ("hand", RecurrentTagger),
    "mha": ("hand", MHAEncoder),
    "groupnorm_unet": ("hand", GroupNormUNet),
    "einsum_inplace": ("hand", EinsumBlock),
    "topk_moe": ("hand", TopKMoE),
    "chain_gnn": ("hand", ChainGNN),
    "conformer": ("hand", ConformerBlock),
    "conv_vae": ("hand", ConvVAE),
    "tied_lm": ("hand", TiedLM),
    "checkpointed": ("hand", CheckpointedStack),
    "lora_llama": ("peft", LoraLlama),
    "unet2d": ("diffusion", UNet2D),
    "ws_conv": ("hand", WSConvNet),
    "mel_frontend": ("hand", MelFrontend),
    "grad_reversal": ("hand", DomainAdversarial),
    "safe_sqrt": ("hand", SafeDistanceAttention),
    "param_conv": ("hand", ParametrizedConvNet),
    "fno": ("hand", FourierNeuralOperator),
}
#: hand-written models that take images (``x``) rather than token ids
_IMAGE_HAND = ("groupnorm_unet", "conv_vae", "ws_conv", "param_conv")

ZOO = {**{k: v[0] for k, v in _HF.items()}, **{k: v[0] for k, v in _HAND.items()}}
HF_CLASSES = {k: v[2] for k, v in _HF.items()}


def hf_config(name: str):
    """The transformers config of ``name``: the library's defaults (attention implementation, caches)
    except where the kwargs say otherwise (the ``*_eager`` variants)."""
    import transformers

    _family, cfg_cls, _model_cls, kwargs = _HF[name]
    return getattr(transformers, cfg_cls)(**kwargs)


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
    if family == "vision" or name in _IMAGE_HAND:
        return 3, 64 if name in ("resnet", "convnext", "segformer", *_IMAGE_HAND) else 32
    if family == "detection":
        return 3, 48
    if name == "mel_frontend":
        return 3, 560  # audio samples
    if name == "fno":
        return 3, 40  # signal length
    if family == "speech":
        return 3, 1200 if name == "wav2vec2" else 7  # whisper: decoder tokens (the encoder wants 16 frames)
    if family == "diffusion":
        return 3, 16  # latent side
    return 3, 7


def build_inputs(name: str, *, batch: int = 2, length: int | None = None):
    """``(args, kwargs)`` for ``name``: token ids (with padding masks where the model takes them),
    images or audio; ``length`` is tokens, image side or audio samples / mel frames."""
    g = torch.Generator().manual_seed(1000 + batch * 31 + (length or 0))
    family = ZOO[name]
    if family in ("vision", "detection") or name in _IMAGE_HAND:
        side = length or 32
        key = "x" if name in _IMAGE_HAND else "pixel_values"
        return (), {key: torch.randn(batch, 3, side, side, generator=g)}
    if name == "mel_frontend":  # int16-scaled PCM, as read from a WAV file
        return (torch.randn(batch, length or 400, generator=g).mul(8000.0),), {}
    if name == "fno":
        return (torch.randn(batch, 3, length or 32, generator=g),), {}
    if name == "wav2vec2":
        return (), {"input_values": torch.randn(batch, length or 800, generator=g)}
    if name == "whisper":
        # the encoder wants exactly 2 * max_source_positions = 16 frames; ``length`` is decoder tokens
        return (), {"input_features": torch.randn(batch, 16, 16, generator=g),
                    "decoder_input_ids": torch.randint(2, VOCAB, (batch, length or 5), generator=g)}
    if family == "diffusion":
        side = length or 8
        return (torch.randn(batch, 4, side, side, generator=g), torch.randint(0, 1000, (batch,), generator=g),
                torch.randn(batch, 5, 32, generator=g)), {}
    t = length or DEFAULT_LENGTH
    ids = torch.randint(2, VOCAB, (batch, t), generator=g)
    if name == "mha":
        pad = torch.zeros(batch, t, dtype=torch.bool)
        pad[0, -3:] = True
        return (ids, pad), {}
    if family in ("hand", "peft"):
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
