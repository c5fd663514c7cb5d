"""A Llama-family decoder (Llama, SmolLM, Qwen2, Mistral) over a paged, block-first KV cache.

The KV pool is ONE tensor [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
(DESIGN §2). A batch is a flat run of tokens from several requests (`PagedMeta`): the
matrices see all of them at once, attention reads each request's context through its
block table where it lies in the pool.

The matrices are held in one or more weight sets (worker/weights.py), built from the
loader's dense weights or the GGUF file's own blocks; the residual stream is fp32 and each
norm emits the dtype the next matmul takes. Two forward paths over the same weights:

* the C++ layer loop (csrc/model.cpp), with the GIL released, when the kernels are built;
* the same steps in plain torch ops otherwise (any machine; no q4/q8 matrices).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from worker.attention import PagedMeta, TorchAttention, sdpa_fresh
from worker.model_config import ModelConfig
from worker.quant import RawMatrix, concat_rows
from worker.weights import LayerWeights, MatrixSource, WeightSet, make_linear


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


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, 0).contiguous()


class LlamaModel:
    """Embeddings, norms and RoPE tables in fp32, and the matrices per weight set."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 blocks: dict[str, RawMatrix] | None = None, ops: Any | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 head: bool = True,
                 gather: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> None:
        """`weights`: the loader's dense fp32 tensors (worker/loader.py names); `blocks`:
        the same matrices as GGUF blocks, when the file has them; `ops`: the C++ kernels
        (worker/kernels.py), None for the pure-torch path.

        Tensor parallel (worker/tp.py): `cfg` and `weights` are one rank's shard, and
        `reduce` (the group's all-reduce) sums the row-parallel o and down outputs; a
        rank with `head=False` stops after the last layer (only rank 0 samples). With a
        vocab-parallel lm_head every rank computes its slice of the vocabulary and
        `gather` returns the whole logits on rank 0 (None on the others)."""
        if reduce is not None and ops is not None:
            raise ValueError("tensor parallel runs the plain-torch forward (ops=None)")
        self.cfg = cfg
        self.ops = ops
        self.reduce = reduce
        self.head = head
        self.gather = gather
        w, raw = weights, blocks or {}
        self.embed = w["embed_tokens"].float().contiguous()  # [V, D]
        self.norm = w["norm"].float().contiguous()
        self.in_norm = [w[f"layers.{i}.input_norm"].float().contiguous() for i in range(cfg.num_layers)]
        self.post_norm = [w[f"layers.{i}.post_norm"].float().contiguous() for i in range(cfg.num_layers)]
        self._sources: list[dict[str, MatrixSource]] | None = [
            self._layer_sources(w, raw, i) for i in range(cfg.num_layers)]
        self._head_source: MatrixSource | None = MatrixSource(
            lambda: w["lm_head"].float(), raw.get("lm_head"))
        freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32), rope_inv_freq(cfg))
        self.cos = freqs.cos().contiguous()  # [P, hd/2]
        self.sin = freqs.sin().contiguous()
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.sets: dict[str, WeightSet] = {}
        self._cpp: dict[str, Any] = {}

    @staticmethod
    def _layer_sources(w: dict[str, torch.Tensor], raw: dict[str, RawMatrix],
                       i: int) -> dict[str, MatrixSource]:
        p = f"layers.{i}."

        def fused(names: tuple[str, ...]) -> MatrixSource:
            parts = [raw.get(p + n) for n in names]
            blocks = None if any(r is None for r in parts) else concat_rows(parts)  # type: ignore[arg-type]
            return MatrixSource(lambda: _cat([w[p + n] for n in names]), blocks)

        qkv = fused(("q_proj", "k_proj", "v_proj"))
        if p + "q_bias" in w:
            qkv.bias = _cat([w[p + b] for b in ("q_bias", "k_bias", "v_bias")]).float()
        return {"qkv": qkv, "o": fused(("o_proj",)), "gate_up": fused(("gate_proj", "up_proj")),
                "down": fused(("down_proj",))}

    # -- weight sets ---------------------------------------------------------------------
    def add_weights(self, name: str, layers: str, head: str,
                    dense_fallback: torch.dtype = torch.float32) -> WeightSet:
        """Build (once) the weight set `name`: every layer matrix in format `layers`, the
        head in `head` (worker/weights.py), dense in `dense_fallback` where a matrix cannot
        take its format."""
        if name in self.sets:
            return self.sets[name]
        if self._sources is None or self._head_source is None:
            raise RuntimeError(f"weight set {name!r}: the source weights were released")
        built = [LayerWeights(*(make_linear(src[k], layers, dense_fallback)
                                for k in ("qkv", "o", "gate_up", "down")))
                 for src in self._sources]
        ws = WeightSet(name, built, make_linear(self._head_source, head, dense_fallback))
        self.sets[name] = ws
        return ws

    def keep_only(self, name: str) -> None:
        """Drop every other weight set and the loader's dense matrices (memory)."""
        for other in [n for n in self.sets if n != name]:
            del self.sets[other]
            self._cpp.pop(other, None)
        self._sources = None
        self._head_source = None

    def _cpp_model(self, name: str) -> Any:
        m = self._cpp.get(name)
        if m is None:
            ws = self.sets[name]
            cfg = self.cfg
            assert self.ops is not None
            m = self.ops.Model(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                               self.cos, self.sin)
            for i, lw in enumerate(ws.layers):
                m.add_layer(self.in_norm[i], self.post_norm[i], [x.cpp_spec() for x in lw.all()])
            m.set_head(self.norm, ws.head.cpp_spec())
            self._cpp[name] = m
        return m

    # -- forward -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, name: str, meta: PagedMeta, kv: torch.Tensor) -> torch.Tensor:
        """Run the flat batch with weight set `name`, write its K/V into `kv`, return fp32
        logits [S, V] of rows meta.logits_index."""
        x = self.embed.index_select(0, meta.input_ids)  # [T, D] fp32
        if self.ops is not None:
            return self._cpp_model(name).forward(
                x, meta.positions, meta.slot_blocks, meta.slot_offsets, kv, meta.tables,
                meta.qrow, meta.ctx, meta.paged_idx, meta.fresh, meta.logits_index)
        return self._forward_torch(self.sets[name], x, meta, kv)

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel matmul's output: this rank's partial sum, summed over the group."""
        return partial if self.reduce is None else self.reduce(partial.contiguous())

    def _forward_torch(self, ws: WeightSet, x: torch.Tensor, meta: PagedMeta,
                       kv: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        T = x.shape[0]
        hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos = self.cos[meta.positions].unsqueeze(1)  # [T, 1, hd/2]
        sin = self.sin[meta.positions].unsqueeze(1)
        paged = TorchAttention(meta, kv, self.scale) if meta.paged_idx.numel() else None
        for li, lw in enumerate(ws.layers):
            h = _rms(x, self.in_norm[li], cfg.rms_norm_eps)
            qkv = lw.qkv(h).float()  # [T, (Hq + 2 Hkv) hd]
            q = _rope(qkv[:, : hq * hd].view(T, hq, hd), cos, sin)
            k = _rope(qkv[:, hq * hd: (hq + hkv) * hd].view(T, hkv, hd), cos, sin)
            v = qkv[:, (hq + hkv) * hd:].view(T, hkv, hd)
            kv[meta.slot_blocks, li, :, meta.slot_offsets] = torch.stack((k, v), 1).to(kv.dtype)
            attn = torch.empty(T, hq, hd)
            if paged is not None:
                paged(q, attn, kv, li)
            if meta.fresh:
                qkv_r = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), 1)
                sdpa_fresh(qkv_r, attn.view(T, hq * hd), meta.fresh, hq, hkv, hd, self.scale)
            x = x + self._sum(lw.o(attn.view(T, hq * hd)).float())
            h = _rms(x, self.post_norm[li], cfg.rms_norm_eps)
            gate, up = lw.gate_up(h).chunk(2, dim=-1)
            x = x + self._sum(lw.down(F.silu(gate) * up).float())
        if not self.head:
            return torch.empty(0, cfg.vocab_size)
        hs = _rms(x.index_select(0, meta.logits_index), self.norm, cfg.rms_norm_eps)
        logits = ws.head(hs).float()
        if self.gather is None:
            return logits
        whole = self.gather(logits.contiguous())  # [S, V] on rank 0
        return whole if whole is not None else torch.empty(0, cfg.vocab_size)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, D] fp32
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, hd], rotate-half convention; cos/sin: [T, 1, hd/2]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
