"""A Llama-family decoder (Llama, Mistral, Qwen2) for the GPU: torch GEMMs + Triton kernels.

Weights in the model's dtype (bf16 on the GPU) on one device; the KV pool is the one
block-first tensor [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (DESIGN
§2) and every layer reads and writes it in place through `pool[:, layer, 0/1]`. Per layer:
fused residual-add + RMSNorm, one qkv GEMM, RoPE + KV write, paged attention over every
sequence of the batch at once (worker/cuda/kernels.py; a decode batch too small to fill the
GPU splits each context over several programs and combines them), o GEMM, add + norm, one gate_up GEMM,
SiLU-mul, down GEMM: nine launches, no host synchronisation, so the decode step can be
captured in a CUDA graph (worker/cuda/graphs.py).

The same code runs on CPU tensors with the kernels under Triton's interpreter: that is how
the CPU tests check it against a reference model. On a GPU it is UNTESTED here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from worker.cuda.batch import DeviceBatch
from worker.cuda.kernels import (
    decode_splits,
    paged_attention,
    paged_decode_attention,
    rms_norm,
    rope_and_cache,
    silu_mul,
)
from worker.cuda.rope import rope_tables
from worker.model_config import ModelConfig


class CudaLlama:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                 decode_block_n: int = 64) -> None:
        """`weights`: the loader's standard tensors (worker/loader.py), on any device; they
        are moved, cast and fused (qkv, gate_up) layer by layer, and removed from the dict
        as they go, so host memory is released while device memory fills.
        `decode_block_n`: key tile of the split decode kernel (tests use small ones)."""
        self.cfg = cfg
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" == the pool's
            self.device = torch.device("cuda", torch.cuda.current_device())  # cuda:N
        self.dtype = dtype
        self.decode_block_n = decode_block_n
        # Decode splits its context over programs until the SMs are full (flash-decoding).
        self.sm_count = (torch.cuda.get_device_properties(self.device).multi_processor_count
                         if self.device.type == "cuda" else 132)

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(self.device, dtype).contiguous()

        tied = weights.get("lm_head") is weights.get("embed_tokens")
        self.embed = take("embed_tokens")
        lm_head = weights.pop("lm_head")
        self.lm_head = self.embed if tied else lm_head.to(self.device, dtype).contiguous()
        self.norm = take("norm")
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            q, k, v = take(p + "q_proj"), take(p + "k_proj"), take(p + "v_proj")
            layer = {
                "input_norm": take(p + "input_norm"), "post_norm": take(p + "post_norm"),
                "qkv": torch.cat((q, k, v)), "o_proj": take(p + "o_proj"),
                "down_proj": take(p + "down_proj"),
            }
            del q, k, v
            layer["gate_up"] = torch.cat((take(p + "gate_proj"), take(p + "up_proj")))
            if p + "q_bias" in weights:
                layer["qkv_bias"] = torch.cat([take(p + s) for s in ("q_bias", "k_bias", "v_bias")])
            self.layers.append(layer)
        self.cos, self.sin = rope_tables(cfg, self.device)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    @property
    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in [self.embed, self.lm_head, self.norm,
                  *(t for layer in self.layers for t in layer.values())]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    @torch.inference_mode()
    def forward(self, b: DeviceBatch, pool: torch.Tensor) -> torch.Tensor:
        """Run the flat batch, write its K/V into `pool`, return fp32 logits [N, V] of the
        rows in `b.logits_index`."""
        cfg = self.cfg
        hq, hkv = cfg.num_heads, cfg.num_kv_heads
        x = F.embedding(b.input_ids, self.embed)  # [T, D]
        residual: torch.Tensor | None = None
        S, W = b.block_tables.shape
        # Shapes only (fixed per CUDA graph bucket): how many ways decode splits its context.
        splits = (decode_splits(S, hkv, W, pool.shape[3], self.sm_count, self.decode_block_n)
                  if b.max_q_len == 1 else 1)
        for li, w in enumerate(self.layers):
            h, residual = rms_norm(x, w["input_norm"], cfg.rms_norm_eps, residual)
            qkv = F.linear(h, w["qkv"], w.get("qkv_bias"))  # [T, (Hq + 2 Hkv) hd]
            k_cache, v_cache = pool[:, li, 0], pool[:, li, 1]  # [nb, bs, Hkv, hd], strided
            q = rope_and_cache(qkv, self.cos, self.sin, b.positions, b.slots, k_cache,
                               v_cache, hq, hkv)  # [T, Hq, hd]
            if splits > 1:
                attn = paged_decode_attention(q, k_cache, v_cache, b.block_tables, b.q_start,
                                              b.ctx_start, self.scale, splits,
                                              block_n=self.decode_block_n)
            else:
                attn = paged_attention(q, k_cache, v_cache, b.block_tables, b.q_start,
                                       b.q_len, b.ctx_start, b.max_q_len, self.scale)
            x = F.linear(attn.view(attn.shape[0], -1), w["o_proj"])
            h, residual = rms_norm(x, w["post_norm"], cfg.rms_norm_eps, residual)
            x = F.linear(silu_mul(F.linear(h, w["gate_up"])), w["down_proj"])
        if residual is None:
            raise ValueError("a model needs at least one layer")
        rows = b.logits_index
        h, _ = rms_norm(x.index_select(0, rows), self.norm, cfg.rms_norm_eps,
                        residual.index_select(0, rows))
        return F.linear(h, self.lm_head).float()
