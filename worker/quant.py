"""GGUF quantized blocks -> the executor's matrix formats.

A `RawMatrix` is one [N, K] matrix (rows = output features) as the GGUF file stores it:
blocks of 32 values along K. What each format makes of it:

* Q4_1: fp16 d, fp16 m, 16 bytes; element j = qs[j] & 15, element j + 16 = qs[j] >> 4;
  w = q * d + m. Q4_0: fp16 d, 16 bytes; w = (q - 8) * d. Q8_0: fp16 d, 32 int8; w = q * d.
* `pack_qgemm` -> csrc/qgemm.cpp's layout, keeping every code and fp16 scale exactly
  (Q4_1: u = q, m; Q4_0: u = q, m = -8 d; Q8_0: u = the signed q, m = 0).
* `int4_from_nibbles` -> torch's ``_weight_int4pack_mm_for_cpu`` (weights (q - 8) * scale +
  zero per group of 32): Q4_1 maps exactly with scale = d, zero = m + 8 d, Q4_0 with
  zero = 0, except that the scales are stored in bf16: only bf16 activations and scales
  have a vectorized x86 kernel (fp32 falls back to a loop ~25-60x slower). The packed
  layout depends on the CPU capability torch dispatches to, so it is made on the machine
  that runs it, never cached to disk.
* `int8_rows` -> ``_weight_int8pack_mm``: one scale per output row, re-quantized (lossy).
* Any other block type is dequantized (gguf.quants) and stored dense by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
QGEMM_KINDS = ("Q4_1", "Q4_0", "Q8_0")
# qgemm's activation arithmetic (csrc/qgemm.cpp): part of `--dtype auto`'s cached verdicts,
# so that a verdict on other arithmetic is not reused
QGEMM_ACTIVATIONS = "int16"
NIBBLE_KINDS = ("Q4_1", "Q4_0")


class QuantFormatError(ValueError):
    """A matrix cannot take a format (block type or shape); the caller stores it dense."""


@dataclass(slots=True)
class RawMatrix:
    """A GGUF tensor's raw blocks for an [N, K] matrix."""

    kind: str  # ggml type name: "Q4_1", "Q8_0", "F32", "Q6_K", ...
    n: int
    k: int
    data: np.ndarray  # uint8 [N, row_bytes]

    def blocks(self) -> np.ndarray:
        return self.data.reshape(self.n, self.k // GROUP, -1)

    def permute_rows(self, order: np.ndarray) -> RawMatrix:
        """Rows in another order (each row is whole blocks, so exact for every type)."""
        return RawMatrix(self.kind, self.n, self.k, np.ascontiguousarray(self.data[order]))


def concat_rows(parts: list[RawMatrix]) -> RawMatrix | None:
    """Matrices stacked along N (fused q/k/v, gate/up), or None when their types differ."""
    if len({p.kind for p in parts}) != 1 or len({p.k for p in parts}) != 1:
        return None
    return RawMatrix(parts[0].kind, sum(p.n for p in parts), parts[0].k,
                     np.concatenate([p.data for p in parts], 0))


def dequantize(raw: RawMatrix) -> torch.Tensor:
    """fp32 [N, K], as gguf.quants.dequantize gives it (the loader's own path)."""
    from gguf import GGMLQuantizationType, quants

    arr = quants.dequantize(raw.data, GGMLQuantizationType[raw.kind])
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32).reshape(raw.n, raw.k))


def _f16(b: np.ndarray) -> np.ndarray:
    """fp16 values from [..., 2] bytes."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _check_shape(raw: RawMatrix, what: str) -> None:
    if raw.n % 16 or raw.k % GROUP:
        raise QuantFormatError(f"{what} needs N % 16 == 0 and K % 32 == 0, got [{raw.n}, {raw.k}]")


def pack_qgemm(raw: RawMatrix) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(packed codes uint8, scales fp16 [tiles, G, 2, 16], bits) for csrc qgemm."""
    if raw.kind not in QGEMM_KINDS:
        raise QuantFormatError(f"qgemm has no {raw.kind} blocks")
    _check_shape(raw, "qgemm")
    n, k = raw.n, raw.k
    g = k // GROUP
    b = raw.blocks()
    if raw.kind == "Q4_1":
        bits, d16, m16 = 4, _f16(b[..., 0:2]), _f16(b[..., 2:4])
        qs = b[..., 4:20]
    elif raw.kind == "Q4_0":
        bits, d16 = 4, _f16(b[..., 0:2])
        m16 = (d16.astype(np.float32) * -8).astype(np.float16)  # exact: a power-of-two scaling
        qs = b[..., 2:18]
    else:
        bits, d16 = 8, _f16(b[..., 0:2])
        m16 = np.zeros_like(d16)  # the signed codes are used as they are
    t = n // 16
    if bits == 4:
        u = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # [N, G, 32] codes in k order
        u5 = u.reshape(t, 16, g, 4, 8)  # [tile, column, block, vector z, k - 8z]
        # byte i of a column's 32-bit lane: nibbles (k, k + 2) with k = 8z + 4 (i % 2) + i // 2,
        # so that nibble p of the lane's low / high 16-bit word is k = 8z + 2p / 8z + 2p + 1
        packed = u5[..., [0, 4, 1, 5]] | (u5[..., [2, 6, 3, 7]] << 4)
    else:
        q = np.ascontiguousarray(b[..., 2:34])  # int8 codes as bytes
        u5 = q.reshape(t, 16, g, 8, 4)  # [tile, column, block, vector z, k - 4z]
        packed = u5[..., [0, 2, 1, 3]]  # low bytes of the two words: (4z, 4z+1); high: (4z+2, 4z+3)
    packed = np.ascontiguousarray(packed.transpose(0, 2, 3, 1, 4)).reshape(-1)  # [t, g, z, col, byte]
    sc = np.stack((d16.reshape(t, 16, g), m16.reshape(t, 16, g)), axis=1)  # [t, 2, 16, g]
    sc = np.ascontiguousarray(sc.transpose(0, 3, 1, 2))  # [tile, block, {d, m}, column]
    return (torch.from_numpy(packed), torch.from_numpy(sc.view(np.int16)).view(torch.float16),
            bits)


def nibbles_scales(raw: RawMatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q uint8 [N, K] in 0..15, scale fp32 [N, K/32], zero fp32 [N, K/32]) with
    w = (q - 8) * scale + zero exactly (in real arithmetic), for Q4_1 and Q4_0."""
    b = raw.blocks()
    if raw.kind == "Q4_1":
        d, m, qs = _f16(b[..., 0:2]).astype(np.float32), _f16(b[..., 2:4]).astype(np.float32), b[..., 4:20]
        zero = m + 8.0 * d
    elif raw.kind == "Q4_0":
        d, qs = _f16(b[..., 0:2]).astype(np.float32), b[..., 2:18]
        zero = np.zeros_like(d)
    else:
        raise QuantFormatError(f"{raw.kind} is not a 4-bit GGUF type")
    q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # [N, K/32, 32]: low nibbles first
    return q.reshape(raw.n, raw.k), d, zero


def int4_from_nibbles(q: np.ndarray, scale: np.ndarray, zero: np.ndarray
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weights, scales_and_zeros bf16 [K/32, N, 2]) for _weight_int4pack_mm_for_cpu."""
    n, k = q.shape
    if k % GROUP or n % 16:
        raise QuantFormatError(f"int4 pack needs K % 32 == 0 and N % 16 == 0, got [{n}, {k}]")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.from_numpy(q.astype(np.int32)), 1)
    sz = torch.from_numpy(np.stack((scale, zero), -1)).transpose(0, 1).contiguous()
    return packed, sz.to(torch.bfloat16)


def int4_requantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 per 32 (like Q4_1) of a dense [N, K] matrix (lossy)."""
    n, k = w.shape
    if k % GROUP or n % 16:
        raise QuantFormatError(f"int4 pack needs K % 32 == 0 and N % 16 == 0, got [{n}, {k}]")
    g = w.float().reshape(n, k // GROUP, GROUP)
    mn, mx = g.amin(-1), g.amax(-1)
    d = ((mx - mn) / 15).clamp_min(1e-12)
    q = ((g - mn[..., None]) / d[..., None]).round().clamp(0, 15).to(torch.uint8)
    return int4_from_nibbles(q.reshape(n, k).numpy(), d.numpy(), (mn + 8 * d).numpy())


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], bf16 scales [N]): symmetric per-row int8 of a dense matrix (lossy)."""
    wf = w.float()
    s = (wf.abs().amax(1) / 127).clamp_min(1e-12)
    q = (wf / s[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
    return q, s.to(torch.bfloat16)
