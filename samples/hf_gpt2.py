"""Hugging Face GPT-2 from a small config (nothing is downloaded). symbolic_trace fails on it;
mpconvert falls back to torch.export automatically. use_cache stays as shipped (True): capture leaves the
key/value cache out of the training graph and says so in the report."""
import torch


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config).eval()
    return model


def example_inputs():
    torch.manual_seed(1)
    return (), {"input_ids": torch.randint(0, 128, (2, 16))}
