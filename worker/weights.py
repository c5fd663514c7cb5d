"""A model's matrices in one executor format: per layer qkv, o, gate_up, down, and lm_head.

Matrix formats (`Linear.fmt`):

| fmt | weights | activations | kernel |
|---|---|---|---|
| ``fp32`` / ``bf16`` | dense | the same dtype | at::linear |
| ``int8`` | int8 per row, bf16 scales | bf16 | ``_weight_int8pack_mm`` |
| ``int4`` | int4 per 32, bf16 scale/zero | bf16 | ``_weight_int4pack_mm_for_cpu`` |
| ``q4`` / ``q8`` | the GGUF file's own blocks | fp32 -> int16 per 32 | csrc qgemm |

A matrix asks for a format and takes the nearest one its source allows
(`make_linear`): ``q4``/``q8`` need GGUF Q4_1, Q4_0 or Q8_0 blocks; a block type the fast
path lacks, or a shape it cannot tile, is stored dense (dequantized), so any GGUF loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.quant import (
    NIBBLE_KINDS,
    QuantFormatError,
    RawMatrix,
    int4_from_nibbles,
    int4_requantize,
    int8_rows,
    nibbles_scales,
    pack_qgemm,
)

# The C++ Model's codes for the matrix formats (csrc/model.cpp Fmt).
CPP_CODE = {"fp32": 0, "bf16": 0, "int8": 1, "int4": 2, "q4": 3, "q8": 4}
# What a layer format asks of each matrix: "gguf" is the file's blocks (q4 or q8).
LAYER_FORMATS = ("fp32", "bf16", "int8", "int4", "gguf")
_EMPTY = torch.empty(0)


@dataclass(slots=True)
class Linear:
    """One weight matrix in one format; y = x @ W^T (+ bias)."""

    fmt: str
    w: torch.Tensor  # dense [N, K] | int8 [N, K] | int4-packed | qgemm codes
    aux: torch.Tensor | None  # int8: scales [N]; int4: scales_and_zeros; q4/q8: fp16 scales
    n: int
    k: int
    bias: torch.Tensor | None = None  # fp32 [N]

    @property
    def in_dtype(self) -> torch.dtype:
        if self.fmt in ("q4", "q8"):
            return torch.float32
        return self.w.dtype if self.fmt in ("fp32", "bf16") else torch.bfloat16

    def __call__(self, x: torch.Tensor, ops: object | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] (fp32 for fp32/q4/q8, else bf16); `ops` = the C++ kernels."""
        x = x.to(self.in_dtype)
        if self.fmt in ("q4", "q8"):
            if ops is None:
                raise QuantFormatError("q4/q8 matrices need the C++ kernels")
            y = ops.qgemm(x, self.w, self.aux, 4 if self.fmt == "q4" else 8, self.n)  # type: ignore[attr-defined]
        elif self.fmt in ("fp32", "bf16"):
            y = F.linear(x, self.w)
        elif self.fmt == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.w, self.aux)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.w, 32, self.aux)
        return y if self.bias is None else y.add_(self.bias)

    def cpp_spec(self) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(format code, N, weight, aux, bias) as csrc/model.cpp's MatSpec."""
        aux = self.aux if self.aux is not None else _EMPTY
        bias = self.bias if self.bias is not None else _EMPTY
        return CPP_CODE[self.fmt], self.n, self.w, aux, bias

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.aux, self.bias)
                   if t is not None)


@dataclass(slots=True)
class MatrixSource:
    """One matrix as the loader has it: dense fp32 [N, K] (always, dequantized) and the
    GGUF blocks when the file has them (q/k rows already in rotate-half order)."""

    dense: Callable[[], torch.Tensor]
    raw: RawMatrix | None = None
    bias: torch.Tensor | None = None


def make_linear(src: MatrixSource, fmt: str, dense_fallback: torch.dtype) -> Linear:
    """The matrix in `fmt`, or dense in `dense_fallback` where `fmt` cannot hold it."""
    raw = src.raw
    try:
        if fmt == "gguf":
            if raw is None:
                raise QuantFormatError("no GGUF blocks")
            w, sc, bits = pack_qgemm(raw)
            return Linear("q4" if bits == 4 else "q8", w, sc, raw.n, raw.k, src.bias)
        if fmt == "int4":
            if raw is not None and raw.kind in NIBBLE_KINDS:
                w, sz = int4_from_nibbles(*nibbles_scales(raw))
                return Linear("int4", w, sz, raw.n, raw.k, src.bias)
            dense = src.dense()
            w, sz = int4_requantize(dense)
            return Linear("int4", w, sz, dense.shape[0], dense.shape[1], src.bias)
        if fmt == "int8":
            dense = src.dense()
            q, s = int8_rows(dense)
            return Linear("int8", q, s, dense.shape[0], dense.shape[1], src.bias)
    except QuantFormatError:
        return _dense(src, dense_fallback)
    if fmt in ("fp32", "bf16"):
        return _dense(src, torch.float32 if fmt == "fp32" else torch.bfloat16)
    raise ValueError(f"unknown matrix format {fmt!r}")


def _dense(src: MatrixSource, dtype: torch.dtype) -> Linear:
    w = src.dense().to(dtype).contiguous()
    bias = None if src.bias is None else src.bias.to(dtype)
    return Linear("fp32" if dtype == torch.float32 else "bf16", w, None, w.shape[0], w.shape[1], bias)


@dataclass(slots=True)
class LayerWeights:
    qkv: Linear  # [(Hq + 2 Hkv) hd, D]
    o: Linear  # [D, Hq hd]
    gate_up: Linear  # [2 F, D]
    down: Linear  # [D, F]

    def all(self) -> tuple[Linear, Linear, Linear, Linear]:
        return self.qkv, self.o, self.gate_up, self.down


@dataclass(slots=True)
class WeightSet:
    """One format's matrices (the norms and embeddings stay fp32, in the model)."""

    name: str
    layers: list[LayerWeights]
    head: Linear  # lm_head [V, D]

    def nbytes(self) -> int:
        return sum(m.nbytes() for lw in self.layers for m in lw.all()) + self.head.nbytes()

    def formats(self) -> dict[str, int]:
        """How many matrices ended up in each matrix format (a fallback shows here)."""
        out: dict[str, int] = {}
        for m in [*(m for lw in self.layers for m in lw.all()), self.head]:
            out[m.fmt] = out.get(m.fmt, 0) + 1
        return out
