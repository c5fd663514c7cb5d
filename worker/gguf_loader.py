"""A GGUF file (llama.cpp's format) as a ModelConfig and standardized tensors.

The file is read through `common.modelfile.read_gguf` (the project's one GGUF reader:
metadata and tensor directory); tensors are dequantized with `gguf.quants`. llama.cpp
stores attn_q/attn_k rows permuted for its interleaved RoPE; they are put back into the
rotate-half order here. `load_gguf_blocks` gives the same matrices as the file's raw
quantized blocks (rows reordered the same way, which is exact: a row is whole blocks),
for the executor formats that keep them quantized (worker/weights.py).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from common.errors import ModelLoadError
from common.modelfile import GGUFTensor, read_gguf
from worker.model_config import (
    HINT,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    check_complete,
    finish,
    first_line,
    llama3_scaling_from_freq_factors,
    unpermute_rows,
)
from worker.quant import RawMatrix

# In GGUF files converted by llama.cpp these have attn_q/attn_k rows permuted for its
# interleaved ("normal") RoPE; qwen2 uses the NeoX (rotate-half) style and is not permuted.
_GGUF_PERMUTED_QK = ("llama", "mistral")


def _gguf_config(meta: dict[str, Any], path: pathlib.Path,
                 tensors: dict[str, GGUFTensor]) -> ModelConfig:
    where = f"file {path}"
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(
            f"model {where}: GGUF metadata has no general.architecture; "
            f"the file is not a model GGUF — {HINT}"
        )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"model {where}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); {HINT}"
        )

    def req(key: str) -> Any:
        v = meta.get(f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(
                f"model {where}: GGUF metadata key {arch}.{key} is missing; "
                "re-convert the model with a current llama.cpp"
            )
        return v

    def one(key: str, v: Any) -> int:
        if isinstance(v, list):  # per-layer values: only uniform ones are supported
            if not v or len(set(v)) != 1:
                raise ModelLoadError(
                    f"model {where}: per-layer {arch}.{key} values are not supported; {HINT}"
                )
            v = v[0]
        return int(v)

    hidden = int(req("embedding_length"))
    heads = one("attention.head_count", req("attention.head_count"))
    kv = meta.get(f"{arch}.attention.head_count_kv")
    kv_heads = heads if kv is None else one("attention.head_count_kv", kv)
    key_len = meta.get(f"{arch}.attention.key_length")
    head_dim = int(key_len) if key_len is not None else hidden // max(heads, 1)
    val_len = meta.get(f"{arch}.attention.value_length")
    if val_len is not None and int(val_len) != head_dim:
        raise ModelLoadError(
            f"model {where}: different key and value head sizes are not supported; {HINT}"
        )
    rot = meta.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ModelLoadError(
            f"model {where}: partial rotary embeddings ({rot} of {head_dim} dims) "
            f"are not supported; {HINT}"
        )
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ModelLoadError(
            f"model {where}: {heads} attention heads cannot be grouped over {kv_heads} KV heads; "
            "the metadata is corrupt — re-download the file"
        )
    emb = tensors.get("token_embd.weight")
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None and emb is not None:
        vocab = int(emb.shape[0])  # [V, D]
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens") or ())
    theta = meta.get(f"{arch}.rope.freq_base")
    ctx = int(req("context_length"))

    rope_scaling: dict | None = None
    stype = meta.get(f"{arch}.rope.scaling.type")
    sfactor = meta.get(f"{arch}.rope.scaling.factor")
    if sfactor is None:
        sfactor = meta.get(f"{arch}.rope.scale_linear")  # older files
        if sfactor is not None and stype is None:
            stype = "linear"
    orig_ctx = meta.get(f"{arch}.rope.scaling.original_context_length")
    if stype not in (None, "none") and sfactor is not None and float(sfactor) != 1.0:
        if stype == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(sfactor)}
        elif stype == "yarn":
            rope_scaling = {"rope_type": "yarn", "factor": float(sfactor)}
            if orig_ctx is not None:
                rope_scaling["original_max_position_embeddings"] = int(orig_ctx)
        else:
            raise ModelLoadError(
                f"model {where}: RoPE scaling type {stype!r} is not supported; {HINT}"
            )

    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(req("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=one("feed_forward_length", req("feed_forward_length")),
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=float(theta) if theta is not None else 10000.0,
        rope_scaling=rope_scaling,
        max_position=ctx,
        tie_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        name=path.stem,
    )


_GGUF_GLOBAL = {"token_embd.weight": "embed_tokens", "output.weight": "lm_head",
                "output_norm.weight": "norm"}
_GGUF_LAYER = {
    "attn_norm.weight": "input_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_output.weight": "o_proj",
    "ffn_norm.weight": "post_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _gguf_std_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _GGUF_LAYER_RE.fullmatch(name)
    if m and m.group(2) in _GGUF_LAYER:
        return f"layers.{int(m.group(1))}.{_GGUF_LAYER[m.group(2)]}"
    return None


def load_gguf(path: pathlib.Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    where = f"file {path}"
    if not path.exists():
        raise ModelLoadError(f"model {where}: not found; {HINT}")
    if not path.is_file():
        raise ModelLoadError(
            f"model {where}: is not a file; a GGUF model is a single .gguf file — {HINT}"
        )
    try:
        gf = read_gguf(path)
    except ModelLoadError as e:
        raise ModelLoadError(
            f"model {where}: not a readable GGUF file ({first_line(e.__cause__ or e)}); "
            "it is corrupt or truncated — re-download it or " + HINT
        ) from e

    tensors = gf.tensors
    try:
        cfg = _gguf_config(gf.metadata, path, tensors)
    except (TypeError, ValueError, OverflowError, ZeroDivisionError) as e:
        raise ModelLoadError(
            f"model {where}: GGUF metadata has a bad value ({first_line(e)}); "
            "the file is corrupt — re-download it"
        ) from e

    from gguf import GGMLQuantizationType, quants

    permute = cfg.architecture in _GGUF_PERMUTED_QK
    jobs: list[tuple[str, str, GGUFTensor]] = []
    rope_freqs = None
    for gname, t in tensors.items():
        if gname == "rope_freqs.weight":
            rope_freqs = t
            continue
        std = _gguf_std_name(gname)
        if std is None:
            raise ModelLoadError(
                f"model {where}: unexpected tensor {gname}; this {cfg.architecture} variant "
                f"is not supported — {HINT}"
            )
        jobs.append((std, gname, t))

    def convert(job: tuple[str, str, GGUFTensor]) -> tuple[str, torch.Tensor]:
        std, gname, t = job
        data = gf.raw(t)
        try:
            arr = quants.dequantize(data, GGMLQuantizationType(t.qtype))
        except Exception as e:
            raise ModelLoadError(
                f"model {where}: tensor {gname} cannot be dequantized "
                f"({_type_name(t.qtype)}: {first_line(e)}); {HINT}"
            ) from e
        ne = t.shape
        if arr.size != math.prod(ne):
            raise ModelLoadError(
                f"model {where}: tensor {gname} has {arr.size} values, expected {ne}; "
                "the file is corrupt — re-download it"
            )
        arr = arr.reshape(ne)
        if permute and std.endswith(("q_proj", "q_bias", "k_proj", "k_bias")):
            heads = cfg.num_heads if std.endswith(("q_proj", "q_bias")) else cfg.num_kv_heads
            try:
                arr = unpermute_rows(arr, heads)
            except ValueError as e:
                raise ModelLoadError(
                    f"model {where}: tensor {gname} shape {ne} does not match the config "
                    f"({first_line(e)}); the file is inconsistent — re-download it"
                ) from e
        if arr.dtype != np.float32:
            arr = arr.astype(np.float32)
        elif np.may_share_memory(arr, data) or not arr.flags.writeable:
            arr = np.array(arr, dtype=np.float32, order="C")  # detach from the file mapping
        arr = np.ascontiguousarray(arr)
        return std, finish(torch.from_numpy(arr), dtype)

    workers = max(1, min(4, os.cpu_count() or 1))
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            weights = dict(pool.map(convert, jobs))
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(
            f"model {where}: reading tensors failed ({first_line(e)}); "
            "the file is corrupt or truncated — re-download it"
        ) from e

    if rope_freqs is not None:
        try:
            freqs = quants.dequantize(gf.raw(rope_freqs), GGMLQuantizationType(rope_freqs.qtype))
            orig = gf.metadata.get(f"{cfg.architecture}.rope.scaling.original_context_length")
            scaling = llama3_scaling_from_freq_factors(
                freqs, cfg.rope_theta, cfg.head_dim, int(orig) if orig else 8192
            )
        except Exception as e:
            raise ModelLoadError(
                f"model {where}: tensor rope_freqs.weight is not a supported RoPE scaling "
                f"({first_line(e)}); {HINT}"
            ) from e
        if scaling is not None:
            if cfg.rope_scaling is not None:
                raise ModelLoadError(
                    f"model {where}: both rope_freqs and {cfg.architecture}.rope.scaling.* are "
                    f"set; this combination is not supported — {HINT}"
                )
            cfg = replace(cfg, rope_scaling=scaling)

    if cfg.tie_embeddings and "embed_tokens" in weights:
        weights["lm_head"] = weights["embed_tokens"]
    reverse = {v: k for k, v in _GGUF_GLOBAL.items()}

    def gguf_name(std: str) -> str:
        if std in reverse:
            return reverse[std]
        _, i, leaf = std.split(".", 2)
        back = {v: k for k, v in _GGUF_LAYER.items()}
        return f"blk.{i}.{back.get(leaf, leaf)}"

    check_complete(cfg, weights, where, gguf_name)
    return cfg, weights


def load_gguf_blocks(path: pathlib.Path, cfg: ModelConfig) -> dict[str, RawMatrix]:
    """Every 2-D tensor of the file as raw blocks, by standardized name ("layers.3.q_proj",
    "embed_tokens", ...), q/k rows in rotate-half order. Call after `load_gguf` (which
    checked the file); the blocks are read from the file mapping."""
    from gguf import GGMLQuantizationType

    gf = read_gguf(path)
    permute = cfg.architecture in _GGUF_PERMUTED_QK
    out: dict[str, RawMatrix] = {}
    for gname, t in gf.tensors.items():
        std = _gguf_std_name(gname)
        if std is None or len(t.shape) != 2:
            continue
        n, k = t.shape
        raw = RawMatrix(GGMLQuantizationType(t.qtype).name, n, k, gf.raw(t))
        if permute and std.endswith(("q_proj", "k_proj")):
            heads = cfg.num_heads if std.endswith("q_proj") else cfg.num_kv_heads
            raw = raw.permute_rows(unpermute_rows(np.arange(n), heads))
        out[std] = raw
    if cfg.tie_embeddings and "embed_tokens" in out:
        out["lm_head"] = out["embed_tokens"]
    return out


def _type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(qtype).name
