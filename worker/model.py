"""A Llama-family decoder (Llama, SmolLM, Qwen2, Mistral) over a paged, block-first KV cache.

The KV pool is ONE tensor [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
(DESIGN §2). A batch is a flat run of tokens from several requests: linear layers see all
of them at once; attention runs per group (all decode tokens together, each prefill chunk
on its own) and reads each request's cached prefix through its block table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.loader import ModelConfig


@dataclass(slots=True)
class AttentionGroup:
    """Tokens [q_start, q_end) of the flat batch that attend with one layout."""

    q_start: int
    q_end: int
    # Decode group: one query per request, block_tables [B, max_blocks] (padded with 0).
    # Prefill group (B = 1): one chunk, start_pos = its first position.
    block_tables: torch.Tensor
    start_pos: int
    is_decode: bool
    mask: torch.Tensor | None = None  # [B, 1, Lq, Lk] boolean, True = attend
    # Fresh prompts (no cached prefix) padded into one batch: pad_index [n] maps each of
    # the group's rows to its slot in a [B * max_len] padded layout.
    pad_index: torch.Tensor | None = None
    pad_shape: tuple[int, int] = (0, 0)  # (B, max_len)


@dataclass(slots=True)
class BatchMeta:
    positions: torch.Tensor  # [T] position of every token
    slot_blocks: torch.Tensor  # [T] device block each token's K/V is written to
    slot_offsets: torch.Tensor  # [T] offset inside that block
    groups: list[AttentionGroup]
    logits_index: torch.Tensor  # [S] rows of the flat batch whose next token is sampled


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with the model's theta and (Llama-3 / linear) scaling."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    sc = cfg.rope_scaling
    if not sc:
        return inv.float()
    kind = sc.get("rope_type", sc.get("type"))
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
    if kind in (None, "default"):
        return inv.float()
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


class LlamaModel:
    """Weights plus a forward pass; no nn.Module machinery is needed for inference."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.w = weights
        self.layers = [self._fuse(weights, i) for i in range(cfg.num_layers)]
        for key in [k for k in weights if k.startswith("layers.")]:
            del weights[key]  # the fused copies above replace them
        inv = rope_inv_freq(cfg)
        t = torch.arange(cfg.max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [P, hd/2]
        self.cos = freqs.cos()
        self.sin = freqs.sin()
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    @staticmethod
    def _fuse(weights: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        """One layer's weights with q/k/v and gate/up each fused into one matrix: two
        matmuls fewer per layer, which matters at small batch on a CPU."""
        w = {k.split(".", 2)[2]: v for k, v in weights.items() if k.startswith(f"layers.{i}.")}
        out = {k: w[k] for k in ("input_norm", "post_norm", "o_proj", "down_proj")}
        out["qkv"] = torch.cat((w["q_proj"], w["k_proj"], w["v_proj"]), 0).contiguous()
        if "q_bias" in w:
            out["qkv_bias"] = torch.cat((w["q_bias"], w["k_bias"], w["v_bias"]), 0)
        out["gate_up"] = torch.cat((w["gate_proj"], w["up_proj"]), 0).contiguous()
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.w["embed_tokens"].dtype

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementations, whatever the weight dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return xf.to(x.dtype) * w

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, hd]; rotate-half convention; cos/sin: [T, 1, hd/2]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMeta, kv: torch.Tensor) -> torch.Tensor:
        """Run the flat batch, write its K/V into `kv`, return logits [S, V] of sampled rows."""
        cfg = self.cfg
        T = input_ids.shape[0]
        hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = F.embedding(input_ids, self.w["embed_tokens"])  # [T, D]
        cos = self.cos[meta.positions].unsqueeze(1).to(x.dtype)  # [T, 1, hd/2]
        sin = self.sin[meta.positions].unsqueeze(1).to(x.dtype)
        for li, lw in enumerate(self.layers):
            h = self._rms(x, lw["input_norm"])
            qkv = F.linear(h, lw["qkv"], lw.get("qkv_bias"))  # [T, (Hq + 2 Hkv) hd]
            q = qkv[:, : hq * hd].view(T, hq, hd)
            k = qkv[:, hq * hd : (hq + hkv) * hd].view(T, hkv, hd)
            v = qkv[:, (hq + hkv) * hd :].view(T, hkv, hd)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            # Write this step's K/V into the pool: kv[block, layer, {K,V}, offset] = ...
            kv[meta.slot_blocks, li, :, meta.slot_offsets] = torch.stack((k, v), 1).to(kv.dtype)
            attn = torch.empty(T, hq, hd, dtype=x.dtype)
            for g in meta.groups:
                attn[g.q_start : g.q_end] = self._attend(q[g.q_start : g.q_end], k, v, g, kv, li)
            x = x + F.linear(attn.view(T, hq * hd), lw["o_proj"])
            h = self._rms(x, lw["post_norm"])
            gate, up = F.linear(h, lw["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lw["down_proj"])
        x = self._rms(x[meta.logits_index], self.w["norm"])
        return F.linear(x, self.w["lm_head"]).float()

    def _attend(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        g: AttentionGroup,
        kv: torch.Tensor,
        layer: int,
    ) -> torch.Tensor:
        # q: [n, Hq, hd] -> returns [n, Hq, hd]
        if g.pad_index is not None:
            # Fresh prompts: their own K/V is their whole context. Pad them into one batch
            # [B, L] and run causal attention once for all of them.
            B, L = g.pad_shape

            def pad(t: torch.Tensor) -> torch.Tensor:
                out = t.new_zeros(B * L, *t.shape[1:])
                out[g.pad_index] = t
                return out.view(B, L, *t.shape[1:]).transpose(1, 2)  # [B, H, L, hd]

            o = F.scaled_dot_product_attention(
                pad(q), pad(k_new[g.q_start : g.q_end]).to(q.dtype),
                pad(v_new[g.q_start : g.q_end]).to(q.dtype),
                attn_mask=g.mask, scale=self.scale, enable_gqa=True,
            )  # [B, Hq, L, hd]
            return o.transpose(1, 2).reshape(B * L, *q.shape[1:])[g.pad_index]
        if not g.is_decode and g.start_pos == 0:
            # A fresh prompt chunk: its own K/V is the whole context, plain causal attention.
            kk = k_new[g.q_start : g.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, hd]
            vv = v_new[g.q_start : g.q_end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), kk.to(q.dtype), vv.to(q.dtype),
                is_causal=True, scale=self.scale, enable_gqa=True,
            )
            return o[0].transpose(0, 1)
        # Gather each request's cached K and V of this layer through its block table:
        # [B, nb, bs, Hkv, hd], contiguous, so the reshape below is free.
        # (index_select, not advanced indexing: 2.4x faster here for the same gather.)
        B, nb = g.block_tables.shape
        flat = g.block_tables.reshape(-1)
        k = kv[:, layer, 0].index_select(0, flat).view(B, nb * kv.shape[3], *kv.shape[4:])
        v = kv[:, layer, 1].index_select(0, flat).view(B, nb * kv.shape[3], *kv.shape[4:])
        k = k.transpose(1, 2).to(q.dtype)  # [B, Hkv, L, hd]
        v = v.transpose(1, 2).to(q.dtype)
        hkv = k.shape[1]
        grp = q.shape[1] // hkv
        n = 1 if g.is_decode else q.shape[0]
        # Fold the query heads that share a KV head into the query axis, so attention runs
        # per KV head with no copies of K/V for grouped-query attention.
        if g.is_decode:
            qq = q.view(B, hkv, grp, -1)  # [B, Hkv, grp, hd]: row j of group = head h*grp+j
            mask = g.mask  # [B, 1, 1, L], the same for every folded row
        else:
            # [n, Hq, hd] -> [1, Hkv, grp*n, hd]; rows ordered (head-in-group, position)
            qq = q.view(n, hkv, grp, -1).permute(1, 2, 0, 3).reshape(1, hkv, grp * n, -1)
            mask = None if g.mask is None else g.mask.repeat(1, 1, grp, 1)
        o = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=self.scale)
        if g.is_decode:
            return o.reshape(B, hkv * grp, -1)  # [B, Hq, hd]
        return o.view(hkv, grp, n, -1).permute(2, 0, 1, 3).reshape(n, hkv * grp, -1)

