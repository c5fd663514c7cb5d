"""Greedy tokens of the engine equal Hugging Face transformers' on the same GGUF file.

transformers is the reference (fp32 both sides). The same prompts then run batched and
with a tiny token budget (many prefill chunks): the ids must not change. Prefix caching is
on (the default): the second and third passes find the prompts' blocks cached.
"""

from __future__ import annotations

import pytest

from common.config import EngineConfig
from scheduler_svc.request import SamplingParams
from superinfer.engine import LLMEngine
from tests.hf_reference import hf_greedy_from

NEW_TOKENS = 32

PROMPTS: list[tuple[str, bool]] = [
    ("Hello", False),
    ("The capital of France is", False),
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("Once upon a time, in a land far away, there lived a", False),
    ("1, 2, 3, 4, 5,", False),
    ("Translate to French: I love reading books in the evening.", False),
    ("Le renard brun rapide saute par-dessus le chien paresseux. Ensuite,", False),
    ("机器学习是人工智能的一个分支，它", False),
    ("東京は日本の首都です。", False),
    ("Die Katze sitzt auf der Matte und", False),
    ("Q: What is 12 * 7?\nA:", False),
    ("<html>\n  <body>\n    <h1>", False),
    ("  leading spaces and\ttabs\n\nand blank lines", False),
    ("A" * 3 + " very long prompt. " + "The quick brown fox jumps over the lazy dog. " * 25,
     False),
    ("What is the capital of France?", True),
    ("Write a haiku about the sea.", True),
    ("Explain photosynthesis to a five year old.", True),
    ("List three prime numbers.", True),
    ("¿Cuál es el río más largo del mundo?", True),
    ("Summarize: The meeting was moved from Monday to Wednesday because the room was booked.",
     True),
]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(device_blocks=512, host_blocks=0, dtype="float32"))


@pytest.fixture(scope="module")
def prompt_ids(engine: LLMEngine) -> list[list[int]]:
    return [engine.encode_prompt(p, chat=chat) for p, chat in PROMPTS]


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(prompts, _greedy())]


@pytest.fixture(scope="module")
def one_at_a_time(engine: LLMEngine, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Our greedy tokens, one prompt at a time."""
    return [_run(engine, [ids])[0] for ids in prompt_ids]


@pytest.fixture(scope="module")
def hf_reference(engine: LLMEngine, prompt_ids: list[list[int]],
                 one_at_a_time: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens, found by teacher forcing ours (tests/hf_reference.py):
    one forward per prompt where they agree, and transformers' own tokens where not."""
    return hf_greedy_from(engine.source.path, prompt_ids, one_at_a_time, NEW_TOKENS)


def test_one_at_a_time_equals_transformers(
    one_at_a_time: list[list[int]], hf_reference: list[list[int]]
) -> None:
    ours = one_at_a_time
    mismatches = [i for i, (a, b) in enumerate(zip(ours, hf_reference, strict=True)) if a != b]
    assert not mismatches, f"prompts differing from transformers: {mismatches}"


def test_batched_and_chunked_equal_one_at_a_time(
    engine: LLMEngine, prompt_ids: list[list[int]], hf_reference: list[list[int]]
) -> None:
    batched = _run(engine, prompt_ids)
    assert batched == hf_reference
    old = engine.scheduler.config.max_batched_tokens
    engine.scheduler.config.max_batched_tokens = 7  # many prefill chunks per prompt
    try:
        chunked = _run(engine, prompt_ids)
    finally:
        engine.scheduler.config.max_batched_tokens = old
    assert chunked == hf_reference
    # Those passes reused cached blocks: caching on equals transformers.
    assert engine.stats()["prefix_cache_hit_tokens"] > sum(map(len, prompt_ids)) // 2
    engine.scheduler.check_integrity()
    assert engine.scheduler.bm.num_free_device == 512
