"""Load the weights of a Llama-family model into one standard in-memory form.

Two sources are supported:

* a GGUF file (llama.cpp format, any quantization ``gguf.quants`` can dequantize), and
* a Hugging Face model directory (``config.json`` + ``*.safetensors``, possibly sharded
  with ``model.safetensors.index.json``).

Both give a :class:`ModelConfig` and a dict of tensors with standardized names, all in
the requested dtype and contiguous, in the HF/PyTorch ``Linear`` convention
(``[out_features, in_features]``), with q/k rows in the HF rotate-half RoPE order:

``embed_tokens`` [V, D], ``lm_head`` [V, D] (the same tensor object as ``embed_tokens``
when tied), ``norm`` [D], and per layer ``i``: ``layers.{i}.input_norm`` [D],
``layers.{i}.q_proj`` [Hq*hd, D], ``layers.{i}.k_proj`` / ``v_proj`` [Hkv*hd, D],
optional ``layers.{i}.q_bias`` / ``k_bias`` / ``v_bias``, ``layers.{i}.o_proj``
[D, Hq*hd], ``layers.{i}.post_norm`` [D], ``layers.{i}.gate_proj`` / ``up_proj`` [F, D],
``layers.{i}.down_proj`` [D, F].

Nothing is cached between calls.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from common.errors import ModelLoadError

__all__ = ["ModelConfig", "ModelLoadError", "load_weights", "SUPPORTED_ARCHITECTURES"]

# Architectures whose blocks are exactly: RMSNorm -> (GQA attention, optional q/k/v bias,
# rotate-half RoPE over the full head) -> RMSNorm -> SwiGLU MLP.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
# In GGUF files converted by llama.cpp these have attn_q/attn_k rows permuted for its
# interleaved ("normal") RoPE; qwen2 uses the NeoX (rotate-half) style and is not permuted.
_GGUF_PERMUTED_QK = ("llama", "mistral")

_HINT = "pass --model with a valid .gguf file or Hugging Face model directory"


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


def load_weights(
    path: pathlib.Path, kind: str, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a model's config and standardized weights from a GGUF file or HF directory.

    ``kind`` is ``"gguf"`` or ``"hf"``. Raises :class:`ModelLoadError` with a one-line
    message for a missing path, a corrupt file, an unsupported architecture or a
    missing/mis-shaped tensor.
    """
    path = pathlib.Path(path).expanduser()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ModelLoadError(f"load_weights: dtype must be a floating torch dtype, got {dtype!r}")
    if kind == "gguf":
        return _load_gguf(path, dtype)
    if kind == "hf":
        return _load_hf(path, dtype)
    raise ModelLoadError(f"load_weights: unknown model kind {kind!r}; use 'gguf' or 'hf'")


# --------------------------------------------------------------------------- helpers


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
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


def _check_complete(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], where: str, source_name: Any
) -> None:
    """Every expected tensor is present with the expected shape (nothing else)."""
    expected = _expected_shapes(cfg)
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
            f"{cfg.architecture} variant or layer count does not match the config — {_HINT}"
        )


def _finish(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).contiguous()


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head q/k row permutation (weights [rows, cols] or bias [rows])."""
    rows = w.shape[0]
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows do not split into {heads} heads of even size")
    rest = w.shape[1:]
    return (
        w.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
    )


def _llama3_rope_freq_factors(
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


def _llama3_scaling_from_freq_factors(
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
    check = _llama3_rope_freq_factors(theta, head_dim, factor, low, high, orig)
    if not np.allclose(check, f, rtol=1e-3, atol=1e-4):
        raise ValueError("rope_freqs does not match any llama3 scaling")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(high),
        "original_max_position_embeddings": int(orig),
    }


# --------------------------------------------------------------------------- GGUF


def _open_gguf(path: pathlib.Path) -> Any:
    """A gguf.GGUFReader over ``path``, built quickly.

    The stock reader makes one ``np.memmap`` slice per metadata item, including each of
    the ~100k vocabulary/merge strings, which takes about 3 s. The loader needs no long
    string arrays, so this subclass slices a plain ndarray view of the mapping (much
    cheaper than memmap slices); arrays of more than 1024 items are read whole (numbers,
    as one part) or skipped with ``struct`` (strings: only their byte span is kept, so
    such fields, e.g. the vocabulary, read back as empty lists). If that shortcut fails for any reason (e.g. changed gguf
    internals), the stock reader is used, so a corrupt file is judged by it alone.
    """
    import struct

    from gguf import GGUFReader, GGUFValueType

    class _FastReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_si_plain")
            if plain is None:
                plain = self._si_plain = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = plain[offset:end].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype = GGUFValueType(int(raw_itype[0]))
            nptype = self.gguf_scalar_to_np.get(itype)
            if alen[0] <= 1024 or (nptype is None and itype != GGUFValueType.STRING):
                return super()._get_field_parts(orig_offs, raw_type)
            start = orig_offs + 12
            if nptype is not None:  # one part holding all the numbers
                vals = self._get(start, nptype, int(alen[0]))
                if len(vals) != alen[0]:
                    raise ValueError("array runs past the end of the file")
                return 12 + int(vals.nbytes), [raw_itype, alen, vals], [2], [
                    GGUFValueType.ARRAY, itype]
            buf = self._si_plain
            if int(alen[0]) * 8 > len(buf) - start:
                raise ValueError("string array runs past the end of the file")
            fmt = ">Q" if self.byte_order == "S" and sys.byteorder == "little" else "<Q"
            offs = start
            for _ in range(int(alen[0])):
                offs += 8 + struct.unpack_from(fmt, buf, offs)[0]
            if offs > len(buf):
                raise ValueError("string array runs past the end of the file")
            blob = self._get(start, np.uint8, offs - start)
            return offs - orig_offs, [raw_itype, alen, blob], [], [
                GGUFValueType.ARRAY, GGUFValueType.STRING]

    try:
        return _FastReader(str(path), "r")
    except (AttributeError, TypeError, NameError):  # gguf internals changed
        return GGUFReader(str(path), "r")


def _field(reader: Any, key: str) -> Any:
    """Plain Python value of a GGUF metadata field, or None when absent."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.types:
        return None

    def text(part: Any) -> str:
        return bytes(part.tobytes()).decode("utf-8", errors="replace")

    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [text(field.parts[i]) for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if main == GGUFValueType.STRING:
        return text(field.parts[-1])
    return field.parts[-1].tolist()[0]


def _gguf_config(reader: Any, path: pathlib.Path, tensors: dict[str, Any]) -> ModelConfig:
    where = f"file {path}"
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(
            f"model {where}: GGUF metadata has no general.architecture; "
            f"the file is not a model GGUF — {_HINT}"
        )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"model {where}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); {_HINT}"
        )

    def req(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
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
                    f"model {where}: per-layer {arch}.{key} values are not supported; {_HINT}"
                )
            v = v[0]
        return int(v)

    hidden = int(req("embedding_length"))
    heads = one("attention.head_count", req("attention.head_count"))
    kv = _field(reader, f"{arch}.attention.head_count_kv")
    kv_heads = heads if kv is None else one("attention.head_count_kv", kv)
    key_len = _field(reader, f"{arch}.attention.key_length")
    head_dim = int(key_len) if key_len is not None else hidden // max(heads, 1)
    val_len = _field(reader, f"{arch}.attention.value_length")
    if val_len is not None and int(val_len) != head_dim:
        raise ModelLoadError(
            f"model {where}: different key and value head sizes are not supported; {_HINT}"
        )
    rot = _field(reader, f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ModelLoadError(
            f"model {where}: partial rotary embeddings ({rot} of {head_dim} dims) "
            f"are not supported; {_HINT}"
        )
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ModelLoadError(
            f"model {where}: {heads} attention heads cannot be grouped over {kv_heads} KV heads; "
            "the metadata is corrupt — re-download the file"
        )
    emb = tensors.get("token_embd.weight")
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None and emb is not None:
        vocab = int(emb.shape[-1])  # ne order: [D, V]
    if vocab is None:
        toks = reader.fields.get("tokenizer.ggml.tokens")
        vocab = int(toks.parts[1][0]) if toks is not None else 0  # the array length
    theta = _field(reader, f"{arch}.rope.freq_base")
    ctx = int(req("context_length"))

    rope_scaling: dict | None = None
    stype = _field(reader, f"{arch}.rope.scaling.type")
    sfactor = _field(reader, f"{arch}.rope.scaling.factor")
    if sfactor is None:
        sfactor = _field(reader, f"{arch}.rope.scale_linear")  # older files
        if sfactor is not None and stype is None:
            stype = "linear"
    orig_ctx = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if stype not in (None, "none") and sfactor is not None and float(sfactor) != 1.0:
        if stype == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(sfactor)}
        elif stype == "yarn":
            rope_scaling = {"rope_type": "yarn", "factor": float(sfactor)}
            if orig_ctx is not None:
                rope_scaling["original_max_position_embeddings"] = int(orig_ctx)
        else:
            raise ModelLoadError(
                f"model {where}: RoPE scaling type {stype!r} is not supported; {_HINT}"
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


def _load_gguf(path: pathlib.Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    where = f"file {path}"
    if not path.exists():
        raise ModelLoadError(f"model {where}: not found; {_HINT}")
    if not path.is_file():
        raise ModelLoadError(
            f"model {where}: is not a file; a GGUF model is a single .gguf file — {_HINT}"
        )
    try:
        reader = _open_gguf(path)
    except Exception as e:  # any parse failure means the file is unusable
        raise ModelLoadError(
            f"model {where}: not a readable GGUF file ({_first_line(e)}); "
            "it is corrupt or truncated — re-download it or " + _HINT
        ) from e

    tensors = {t.name: t for t in reader.tensors}
    try:
        cfg = _gguf_config(reader, path, tensors)
    except (TypeError, ValueError, OverflowError, ZeroDivisionError) as e:
        raise ModelLoadError(
            f"model {where}: GGUF metadata has a bad value ({_first_line(e)}); "
            "the file is corrupt — re-download it"
        ) from e

    from gguf import quants

    permute = cfg.architecture in _GGUF_PERMUTED_QK
    jobs: list[tuple[str, str, Any]] = []
    rope_freqs = None
    for gname, t in tensors.items():
        if gname == "rope_freqs.weight":
            rope_freqs = t
            continue
        std = _gguf_std_name(gname)
        if std is None:
            raise ModelLoadError(
                f"model {where}: unexpected tensor {gname}; this {cfg.architecture} variant "
                f"is not supported — {_HINT}"
            )
        jobs.append((std, gname, t))

    def convert(job: tuple[str, str, Any]) -> tuple[str, torch.Tensor]:
        std, gname, t = job
        try:
            arr = quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(
                f"model {where}: tensor {gname} cannot be dequantized "
                f"({t.tensor_type.name}: {_first_line(e)}); {_HINT}"
            ) from e
        ne = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dims reversed
        if arr.size != math.prod(ne):
            raise ModelLoadError(
                f"model {where}: tensor {gname} has {arr.size} values, expected {ne}; "
                "the file is corrupt — re-download it"
            )
        arr = arr.reshape(ne)
        if permute and std.endswith(("q_proj", "q_bias", "k_proj", "k_bias")):
            heads = cfg.num_heads if std.endswith(("q_proj", "q_bias")) else cfg.num_kv_heads
            try:
                arr = _unpermute_rows(arr, heads)
            except ValueError as e:
                raise ModelLoadError(
                    f"model {where}: tensor {gname} shape {ne} does not match the config "
                    f"({_first_line(e)}); the file is inconsistent — re-download it"
                ) from e
        if arr.dtype != np.float32:
            arr = arr.astype(np.float32)
        elif np.may_share_memory(arr, t.data) or not arr.flags.writeable:
            arr = np.array(arr, dtype=np.float32, order="C")  # detach from the file mapping
        arr = np.ascontiguousarray(arr)
        return std, _finish(torch.from_numpy(arr), dtype)

    workers = max(1, min(4, os.cpu_count() or 1))
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            weights = dict(pool.map(convert, jobs))
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(
            f"model {where}: reading tensors failed ({_first_line(e)}); "
            "the file is corrupt or truncated — re-download it"
        ) from e

    if rope_freqs is not None:
        try:
            freqs = quants.dequantize(rope_freqs.data, rope_freqs.tensor_type)
            orig = _field(reader, f"{cfg.architecture}.rope.scaling.original_context_length")
            scaling = _llama3_scaling_from_freq_factors(
                freqs, cfg.rope_theta, cfg.head_dim, int(orig) if orig else 8192
            )
        except Exception as e:
            raise ModelLoadError(
                f"model {where}: tensor rope_freqs.weight is not a supported RoPE scaling "
                f"({_first_line(e)}); {_HINT}"
            ) from e
        if scaling is not None:
            if cfg.rope_scaling is not None:
                raise ModelLoadError(
                    f"model {where}: both rope_freqs and {cfg.architecture}.rope.scaling.* are "
                    f"set; this combination is not supported — {_HINT}"
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

    _check_complete(cfg, weights, where, gguf_name)
    return cfg, weights


# --------------------------------------------------------------------------- HF


_HF_GLOBAL = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head",
              "model.norm.weight": "norm"}
_HF_LAYER = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _hf_std_name(name: str) -> str | None:
    if name in _HF_GLOBAL:
        return _HF_GLOBAL[name]
    m = _HF_LAYER_RE.fullmatch(name)
    if m and m.group(2) in _HF_LAYER:
        return f"layers.{int(m.group(1))}.{_HF_LAYER[m.group(2)]}"
    return None


def _hf_rope(raw: dict[str, Any], where: str) -> tuple[float, dict | None]:
    """rope_theta and an HF-style rope_scaling dict (or None) from a config.json.

    Understands both the classic keys (``rope_theta`` + ``rope_scaling``) and the
    ``rope_parameters`` dict written by transformers >= 5.
    """
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    if isinstance(params, dict):
        if "rope_theta" in params and theta is None:
            theta = params["rope_theta"]
        if scaling is None:
            scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling is not None and not isinstance(scaling, dict):
        raise ModelLoadError(f"model {where}: rope_scaling in config.json is not an object; {_HINT}")
    if scaling is not None:
        scaling = dict(scaling)
        rtype = scaling.get("rope_type", scaling.get("type"))
        scaling.pop("type", None)
        if rtype in (None, "default"):
            scaling = None
        else:
            scaling["rope_type"] = rtype
    return float(theta) if theta is not None else 10000.0, scaling


def _load_hf(path: pathlib.Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    where = f"directory {path}"
    if not path.exists():
        raise ModelLoadError(f"model {where}: not found; {_HINT}")
    if not path.is_dir():
        raise ModelLoadError(
            f"model {where}: is not a directory; a Hugging Face model is a directory with "
            f"config.json and *.safetensors — {_HINT}"
        )
    cfg_file = path / "config.json"
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelLoadError(f"model {where}: has no config.json; {_HINT}") from e
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"model {where}: config.json is unreadable ({_first_line(e)}); re-download it"
        ) from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"model {where}: config.json is not a JSON object; re-download it")
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"model {where}: model_type {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); {_HINT}"
        )
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act != "silu":
        raise ModelLoadError(f"model {where}: activation {act!r} is not supported (only silu); {_HINT}")
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"model {where}: MLP biases are not supported; {_HINT}")

    def req(key: str) -> Any:
        v = raw.get(key)
        if v is None:
            raise ModelLoadError(f"model {where}: config.json lacks {key}; re-download it")
        return v

    try:
        hidden = int(req("hidden_size"))
        heads = int(req("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        theta, scaling = _hf_rope(raw, where)
        if isinstance(raw.get("rope_parameters"), dict):
            prf = raw["rope_parameters"].get("partial_rotary_factor", 1.0)
        else:
            prf = raw.get("partial_rotary_factor", 1.0)
        if prf not in (None, 1, 1.0):
            raise ModelLoadError(
                f"model {where}: partial rotary embeddings are not supported; {_HINT}"
            )
        base: dict[str, Any] = dict(
            architecture=str(arch),
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            num_layers=int(req("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(req("intermediate_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=int(req("max_position_embeddings")),
            name=path.resolve().name,
        )
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(
            f"model {where}: config.json has a bad value ({_first_line(e)}); re-download it"
        ) from e
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ModelLoadError(
            f"model {where}: {heads} attention heads cannot be grouped over {kv_heads} KV heads; "
            "config.json is inconsistent"
        )

    files = _hf_weight_files(path, where)
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f), device="cpu")
        except Exception as e:
            raise ModelLoadError(
                f"model {where}: {f.name} is not a readable safetensors file "
                f"({_first_line(e)}); it is corrupt or truncated — re-download it"
            ) from e
        for name, t in part.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # buffers some old checkpoints carry; recomputed from rope_theta
            std = _hf_std_name(name)
            if std is None:
                raise ModelLoadError(
                    f"model {where}: unexpected tensor {name} in {f.name}; this {arch} "
                    f"variant is not supported — {_HINT}"
                )
            if std in weights:
                raise ModelLoadError(f"model {where}: tensor {name} appears twice; re-download it")
            weights[std] = _finish(t, dtype)
        del part

    tie = bool(raw.get("tie_word_embeddings", False)) or "lm_head" not in weights
    if tie and "embed_tokens" in weights:
        weights["lm_head"] = weights["embed_tokens"]
    cfg = ModelConfig(**base, tie_embeddings=tie, attention_bias="layers.0.q_bias" in weights)

    reverse = {v: k for k, v in _HF_GLOBAL.items()}
    back = {v: k for k, v in _HF_LAYER.items()}

    def hf_name(std: str) -> str:
        if std in reverse:
            return reverse[std]
        _, i, leaf = std.split(".", 2)
        return f"model.layers.{i}.{back.get(leaf, leaf)}"

    _check_complete(cfg, weights, where, hf_name)
    return cfg, weights


def _hf_weight_files(path: pathlib.Path, where: str) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(wmap.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(
                f"model {where}: model.safetensors.index.json is unreadable "
                f"({_first_line(e)}); re-download it"
            ) from e
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"model {where}: shard {missing[0]} listed in model.safetensors.index.json "
                "is missing; download all shards"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth"))
        extra = (
            " (only PyTorch .bin/.pt weights found: convert them to safetensors)" if other else ""
        )
        raise ModelLoadError(
            f"model {where}: no *.safetensors weights{extra}; {_HINT}"
        )
    return files
