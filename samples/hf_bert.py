"""Hugging Face BERT from a small config (nothing is downloaded). symbolic_trace fails on it;
mpconvert falls back to torch.export automatically."""
import torch


def build_model():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=32, num_labels=3)
    config._attn_implementation = "eager"
    return BertForSequenceClassification(config).eval()


def example_inputs():
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 16))
    return (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
