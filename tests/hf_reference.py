"""Greedy continuations from Hugging Face transformers on the engine's own GGUF file: the
reference the engine's greedy tokens are compared with (fp32 both sides)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest


@functools.cache
def _model(path: Path) -> Any:
    """transformers' fp32 model of the GGUF file, loaded once per test process (it takes
    tens of seconds: every tensor is dequantized); conftest.py runs the modules that
    compare against it on one xdist worker."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    )
    model.eval()
    # No EOS for the reference: it must run all steps like ours with ignore_eos
    # (min_new_tokens would instead mask EOS out of the logits and change the argmax).
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(path: Path, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Exactly `new_tokens` greedy tokens per prompt, one prompt at a time."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch = pytest.importorskip("torch")
    model = _model(path)
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            g = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0,
            )
            out.append(g[0, len(ids):].tolist())
    assert all(len(o) == new_tokens for o in out)
    return out
