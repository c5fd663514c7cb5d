"""RoPE tables for the CUDA forward: cos/sin [max_position, head_dim / 2] in fp32.

The frequencies (theta, Llama-3 and linear scaling) are the CPU model's `rope_inv_freq`,
which follows HF's rope_init functions: one definition for both executors.
"""

from __future__ import annotations

import torch

from worker.model import rope_inv_freq
from worker.model_config import ModelConfig


def rope_tables(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32), rope_inv_freq(cfg))
    return freqs.cos().contiguous().to(device), freqs.sin().contiguous().to(device)
