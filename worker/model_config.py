"""A Llama-family model's configuration, and the checks both loaders share.

The loaders (`worker/gguf_loader.py`, `worker/hf_loader.py`) give a `ModelConfig` and a
dict of standardized tensors; `check_complete` holds them to the shapes the config implies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.errors import ModelLoadError

# Architectures whose blocks are exactly: RMSNorm -> (GQA attention, optional q/k/v bias,
# rotate-half RoPE over the full head) -> RMSNorm -> SwiGLU MLP.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
HINT = "pass --model with a valid .gguf file or Hugging Face model directory"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # HF-style dict with "rope_type"; None if none
    max_position: int  # context length
    tie_embeddings: bool
    attention_bias: bool  # q/k/v bias (Qwen2)
    name: str




def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, v, f = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (v, d), "lm_head": (v, d), "norm": (d,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_norm": (d,),
            p + "q_proj": (q, d),
            p + "k_proj": (kv, d),
            p + "v_proj": (kv, d),
            p + "o_proj": (d, q),
            p + "post_norm": (d,),
            p + "gate_proj": (f, d),
            p + "up_proj": (f, d),
            p + "down_proj": (d, f),
        })
        if cfg.attention_bias:
            shapes.update({p + "q_bias": (q,), p + "k_bias": (kv,), p + "v_bias": (kv,)})
    return shapes


def check_complete(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], where: str, source_name: Any
) -> None:
    """Every expected tensor is present with the expected shape (nothing else)."""
    expected = expected_shapes(cfg)
    for name, shape in expected.items():
        t = weights.get(name)
        if t is None:
            raise ModelLoadError(
                f"model {where}: tensor {source_name(name)} is missing; the file is incomplete "
                f"or not a {cfg.architecture} model — re-download or convert it again"
            )
        if tuple(t.shape) != shape:
            raise ModelLoadError(
                f"model {where}: tensor {source_name(name)} has shape {tuple(t.shape)}, "
                f"expected {shape} from the config; the file is inconsistent — "
                "re-download or convert it again"
            )
    extra = sorted(set(weights) - set(expected))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ModelLoadError(
            f"model {where}: unexpected tensor {source_name(extra[0])}{more}; this "
            f"{cfg.architecture} variant or layer count does not match the config — {HINT}"
        )


def finish(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).contiguous()


def first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head q/k row permutation (weights [rows, cols] or bias [rows])."""
    rows = w.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows do not split into {heads} heads of even size")
    rest = w.shape[1:]
    return (
        w.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
    )


def llama3_rope_freq_factors(
    theta: float, head_dim: int, factor: float, low: float, high: float, orig: int
) -> np.ndarray:
    """Per-frequency divisors of llama3 RoPE scaling, as llama.cpp stores in rope_freqs."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = orig / low, orig / high
    smooth = (orig / wavelen - low) / (high - low)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < high_wl, 1.0, out)
    out = np.where(wavelen > low_wl, factor, out)
    return out


def llama3_scaling_from_freq_factors(
    factors: np.ndarray, theta: float, head_dim: int, orig: int
) -> dict | None:
    """Recover HF llama3 ``rope_scaling`` from llama.cpp's ``rope_freqs`` tensor.

    The frequencies depend only on ``orig/low_freq_factor`` and ``orig/high_freq_factor``,
    so ``original_max_position_embeddings`` may be any value (``orig``); the result is
    checked by recomputing the factors. Returns None when all factors are 1.
    """
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.shape[0] != head_dim // 2 or not np.all(np.isfinite(f)) or np.any(f <= 0):
        raise ValueError(f"rope_freqs has {f.shape[0]} entries, expected {head_dim // 2}")
    if np.allclose(f, 1.0, rtol=0, atol=1e-6):
        return None
    factor = float(f.max())
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = inv / (2 * math.pi)  # 1 / wavelength, decreasing with the index
    tol = 1e-4 * factor
    is_one = np.abs(f - 1.0) <= tol
    is_full = np.abs(f - factor) <= tol
    mid = ~is_one & ~is_full
    # smooth = (orig*x - low) / (high - low) is linear in x; 1/f = (1-s)/factor + s
    s = (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor)
    if mid.sum() >= 2:
        a, b = np.polyfit(x[mid], s[mid], 1)
    else:
        # Few or no transition samples: put the s=1 / s=0 boundaries halfway between
        # neighbouring samples (any choice there reproduces the same factors).
        ones, fulls = np.nonzero(is_one)[0], np.nonzero(is_full)[0]
        if not len(ones) or not len(fulls):
            raise ValueError("rope_freqs does not look like llama3 scaling")
        i1, i0 = ones.max(), fulls.min()
        if mid.sum() == 1:
            k = int(np.nonzero(mid)[0][0])
            x_hi = (x[i1] + x[k]) / 2
            a = (1.0 - s[k]) / (x_hi - x[k])
            b = 1.0 - a * x_hi
        else:
            x_hi = x[i1] - (x[i1] - x[i0]) / 3
            x_lo = x[i1] - 2 * (x[i1] - x[i0]) / 3
            a = 1.0 / (x_hi - x_lo)
            b = -a * x_lo
    if a <= 0:
        raise ValueError("rope_freqs does not look like llama3 scaling")
    span = orig / a  # high - low
    low = -b * span
    high = low + span
    if low <= 0 or high <= low:
        raise ValueError("rope_freqs does not look like llama3 scaling")
    check = llama3_rope_freq_factors(theta, head_dim, factor, low, high, orig)
    if not np.allclose(check, f, rtol=1e-3, atol=1e-4):
        raise ValueError("rope_freqs does not match any llama3 scaling")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(high),
        "original_max_position_embeddings": int(orig),
    }
