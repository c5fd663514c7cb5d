"""Models with random weights, built on the device: no download, for speed figures only.

`llama3_8b_config()` has Llama-3-8B's shapes (32 layers, hidden 4096, 32 query and 8 KV
heads of 128, FFN 14336, vocab 128256, RoPE 5e5 with Llama-3 scaling); with
`random_weights` it is 16 GB of bf16 that decodes at the speed the real model would, and
says nothing about text. Every figure made with it is labelled random-weight. Correctness
is checked with the bundled model instead. `tiny_config()` is the CPU tests' model.
"""

from __future__ import annotations

import torch

from worker.model_config import ModelConfig, expected_shapes

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_8b_config(max_position: int = 8192) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE),
        max_position=max_position, tie_embeddings=False, attention_bias=False,
        name="llama-3-8b-shaped-random-weights")


def tiny_config() -> ModelConfig:
    """2 layers, GQA 4:2, head_dim 16, Llama-3 RoPE scaling that bites within 64 tokens."""
    return ModelConfig(
        architecture="llama", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=96, rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling={**LLAMA3_ROPE, "factor": 4.0, "original_max_position_embeddings": 16},
        max_position=64, tie_embeddings=False, attention_bias=False, name="tiny-random")


def random_weights(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                   seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """The loader's standard tensors (worker/loader.py) for `cfg`, N(0, std) matrices and
    norms around 1, generated on `device` in `dtype`."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, device=device, dtype=torch.float32)
            out[name] = t.to(dtype)
        else:
            out[name] = torch.randn(shape, generator=g, device=device, dtype=dtype) * std
    if cfg.tie_embeddings:
        out["lm_head"] = out["embed_tokens"]
    return out
