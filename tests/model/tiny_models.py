"""Tiny random transformers checkpoints for parity and loader tests (seeded, fp32)."""

from __future__ import annotations

import torch

VOCAB = 256
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # Larger than the default 0.02 so attention is peaked and RoPE (and its scaling) matter.
    initializer_range=0.1,
)


def llama_config(**over):
    from transformers import LlamaConfig

    return LlamaConfig(**{**COMMON, "tie_word_embeddings": True, **over})


def qwen2_config(**over):
    from transformers import Qwen2Config

    return Qwen2Config(**{**COMMON, "tie_word_embeddings": False, "rope_theta": 1e6, **over})


def build_hf(config, seed: int = 1234):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    # transformers initialises biases to 0 and norm weights to 1: randomise them so that a
    # dropped bias or a misplaced norm weight changes the logits.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return hf.eval()


def save_hf(hf, path, **kwargs):
    hf.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()  # [len, vocab]
