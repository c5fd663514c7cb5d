"""Small random transformers checkpoints, saved as Hugging Face model directories.

`tiny_hf` is the one place tests build them (no download): the loader's tests compare
their logits with transformers', the tensor-parallel tests serve one (`with_tokenizer`:
plus the bundled model's tokenizer, so the scheduler and gateway can load the directory).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch

# 4 attention heads over 2 KV heads: splits 2 ways (tensor parallel), unlike SmolLM2's 9/3.
TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2, tie_word_embeddings=False, rms_norm_eps=1e-5)


def tiny_hf(kind: str, tmp: pathlib.Path, seed: int = 1234, **overrides: Any
            ) -> tuple[pathlib.Path, torch.nn.Module]:
    """A small random transformers model saved to ``tmp / kind``: qwen2 (biases) or llama3
    rope (head_dim 32); `overrides` change TINY's sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = {**TINY, **overrides}
    torch.manual_seed(seed)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(
            Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, **common)
        )
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    else:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        common.setdefault("head_dim", 32)
        model = LlamaForCausalLM(LlamaConfig(rope_parameters=rope, **common))
    out = tmp / kind
    model.save_pretrained(out, safe_serialization=True)
    return out, model.eval()


def with_tokenizer(directory: pathlib.Path) -> pathlib.Path:
    """Give a tiny model directory the bundled SmolLM2's tokenizer (tokenizer.json and
    its EOS), so that every service can load it; its token ids above the tiny vocabulary
    are never produced."""
    from common.modelfile import resolve_model
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_source(resolve_model(None))
    tok.backend.save(str(directory / "tokenizer.json"))
    eos = tok.backend.id_to_token(tok.eos_token_ids[0])
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return directory
