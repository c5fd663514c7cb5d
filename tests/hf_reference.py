"""Greedy continuations from Hugging Face transformers on the engine's own GGUF file: the
reference the engine's greedy tokens are compared with (fp32 both sides).

`hf_greedy_from` checks candidate continuations (the engine's own greedy tokens) by
teacher forcing: one forward over prompt + candidate gives transformers' next-token argmax
at every position at once. Where each argmax is the candidate's next token, transformers'
greedy sequence is the candidate itself (that is the definition of greedy decoding); at the
first position where they differ, transformers' greedy sequence is the candidate's prefix
plus that argmax, and the rest is generated from there token by token. So it always returns
transformers' own greedy tokens, whatever the candidate, in one forward per prompt when the
engine agrees (instead of one per token).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@functools.cache
def hf_model(path: Path) -> Any:
    """transformers' fp32 model of the GGUF file, as `from_pretrained` gives it, loaded once
    per test process (it takes tens of seconds: the file is parsed twice and every tensor is
    dequantized): the greedy reference here and lm-eval's hf backend (tests/test_lm_eval.py)
    run it; conftest.py runs the modules that use it on one xdist worker."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    # Greedy `generate` is the plain argmax of the logits, as the teacher-forced check in
    # hf_greedy_from takes it: no logits processor may change that argmax.
    gc = model.generation_config
    assert gc.repetition_penalty in (None, 1.0) and not gc.no_repeat_ngram_size
    assert not gc.bad_words_ids and not gc.suppress_tokens and not gc.begin_suppress_tokens
    assert not gc.forced_bos_token_id and not gc.forced_eos_token_id
    return model


@contextlib.contextmanager
def _no_eos(model: Any) -> Iterator[None]:
    """No EOS for the reference: it must run all steps like ours with ignore_eos
    (min_new_tokens would instead mask EOS out of the logits and change the argmax). The
    model's own setting comes back after: lm-eval's hf backend stops at EOS."""
    gc = model.generation_config
    eos = gc.eos_token_id
    gc.eos_token_id = None
    try:
        yield
    finally:
        gc.eos_token_id = eos


def _generate(model: Any, ids: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy tokens after `ids`, one incremental forward per token."""
    torch = pytest.importorskip("torch")
    if new_tokens == 0:
        return []
    x = torch.tensor([ids])
    with _no_eos(model):
        g = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )
    out: list[int] = g[0, len(ids):].tolist()
    return out


def hf_greedy(path: Path, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Exactly `new_tokens` greedy tokens per prompt, one prompt at a time, one forward per
    token (what hf_greedy_from returns in one forward per prompt where the guess is right)."""
    torch = pytest.importorskip("torch")
    model = hf_model(path)
    with torch.inference_mode():
        out = [_generate(model, ids, new_tokens) for ids in prompt_ids]
    assert all(len(o) == new_tokens for o in out)
    return out


def hf_greedy_from(path: Path, prompt_ids: list[list[int]], candidates: list[list[int]],
                   new_tokens: int) -> list[list[int]]:
    """Exactly `new_tokens` greedy tokens per prompt from transformers, as `hf_greedy`, found
    by teacher forcing `candidates` (a guess per prompt, e.g. the engine's greedy tokens):
    the result is transformers' greedy sequence, equal to the candidate only where the
    candidate is transformers' greedy choice at every step."""
    torch = pytest.importorskip("torch")
    assert len(candidates) == len(prompt_ids)
    model = hf_model(path)
    out = []
    with torch.inference_mode():
        for ids, cand in zip(prompt_ids, candidates, strict=True):
            cand = list(cand[:new_tokens])
            argmax: list[int] = []
            if cand:
                # The logits after prompt + cand[:i] predict token i: one forward over
                # prompt + cand[:-1] predicts every token of cand.
                x = torch.tensor([ids + cand[:-1]])
                logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits
                argmax = logits[0, len(ids) - 1:].argmax(dim=-1).tolist()
            agree = next((i for i, (a, c) in enumerate(zip(argmax, cand, strict=True))
                          if a != c), len(cand))
            seq = cand[:agree]
            if agree < len(cand):
                seq.append(argmax[agree])  # transformers' own choice where they differ
            # From the first difference (or past a short candidate), token by token.
            seq += _generate(model, ids + seq, new_tokens - len(seq))
            out.append(seq)
    assert all(len(o) == new_tokens for o in out)
    return out
