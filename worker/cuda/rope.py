"""RoPE tables for the CUDA forward: cos/sin [max_position, head_dim / 2] in fp32.

The frequencies (theta, Llama-3 and linear scaling) follow HF's rope_init functions, as
the CPU model's `rope_inv_freq` does; a copy lives here so the CUDA path does not depend on
the CPU executor's module, which is being replaced.
"""

from __future__ import annotations

import math

import torch

from worker.model_config import ModelConfig


def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    sc = cfg.rope_scaling
    kind = (sc or {}).get("rope_type", (sc or {}).get("type"))
    if not sc or kind in (None, "default"):
        return inv.float()
    if kind == "linear":
        return (inv / float(sc["factor"])).float()
    if kind == "llama3":
        factor = float(sc["factor"])
        lo, hi = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        blended = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(mid, blended, scaled).float()
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def rope_tables(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32), inv_freq(cfg))
    return freqs.cos().contiguous().to(device), freqs.sin().contiguous().to(device)
