"""A Hugging Face model directory (config.json + *.safetensors, possibly sharded) as a
ModelConfig and standardized tensors."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import torch

from common.errors import ModelLoadError
from worker.model_config import (
    HINT,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    check_complete,
    finish,
    first_line,
)

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
        raise ModelLoadError(f"model {where}: rope_scaling in config.json is not an object; {HINT}")
    if scaling is not None:
        scaling = dict(scaling)
        rtype = scaling.get("rope_type", scaling.get("type"))
        scaling.pop("type", None)
        if rtype in (None, "default"):
            scaling = None
        else:
            scaling["rope_type"] = rtype
    return float(theta) if theta is not None else 10000.0, scaling


def load_hf(path: pathlib.Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    where = f"directory {path}"
    if not path.exists():
        raise ModelLoadError(f"model {where}: not found; {HINT}")
    if not path.is_dir():
        raise ModelLoadError(
            f"model {where}: is not a directory; a Hugging Face model is a directory with "
            f"config.json and *.safetensors — {HINT}"
        )
    cfg_file = path / "config.json"
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelLoadError(f"model {where}: has no config.json; {HINT}") from e
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"model {where}: config.json is unreadable ({first_line(e)}); re-download it"
        ) from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"model {where}: config.json is not a JSON object; re-download it")
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"model {where}: model_type {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); {HINT}"
        )
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act != "silu":
        raise ModelLoadError(f"model {where}: activation {act!r} is not supported (only silu); {HINT}")
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"model {where}: MLP biases are not supported; {HINT}")

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
                f"model {where}: partial rotary embeddings are not supported; {HINT}"
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
            f"model {where}: config.json has a bad value ({first_line(e)}); re-download it"
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
                f"({first_line(e)}); it is corrupt or truncated — re-download it"
            ) from e
        for name, t in part.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # buffers some old checkpoints carry; recomputed from rope_theta
            std = _hf_std_name(name)
            if std is None:
                raise ModelLoadError(
                    f"model {where}: unexpected tensor {name} in {f.name}; this {arch} "
                    f"variant is not supported — {HINT}"
                )
            if std in weights:
                raise ModelLoadError(f"model {where}: tensor {name} appears twice; re-download it")
            weights[std] = finish(t, dtype)
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

    check_complete(cfg, weights, where, hf_name)
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
                f"({first_line(e)}); re-download it"
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
            f"model {where}: no *.safetensors weights{extra}; {HINT}"
        )
    return files
