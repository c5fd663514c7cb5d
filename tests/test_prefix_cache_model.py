"""Prefix caching on the real model: greedy outputs with caching on equal caching off, and
caching off equals transformers, for repeated prompts and prompts sharing long prefixes,
also with a device pool so small that LVF rotates constantly."""

from __future__ import annotations

import pytest

from common.config import EngineConfig
from scheduler_svc.request import SamplingParams
from superinfer.engine import LLMEngine
from tests.hf_reference import hf_greedy_from

SYSTEM = ("You are a careful assistant for a library. Answer in one short sentence, cite no "
          "sources, and never invent a book that does not exist. The library opens at nine "
          "and closes at six, except on Sundays, when it is closed all day.")
QUESTIONS = [
    "When does the library open?",
    "Is the library open on Sunday?",
    "Can I borrow ten books at once?",
    "What time does it close?",
]
OTHER = [
    "The history of the Roman Empire begins",
    "def quicksort(arr):",
    "Ten facts about octopuses:",
    "A short poem about autumn leaves:",
]
MAX_TOKENS = 16


def _prompts(eng: LLMEngine) -> list[list[int]]:
    """A long shared system prompt with four questions, a two-turn conversation (its
    second turn's prompt is the first turn's history), unrelated prompts, and repeats."""
    tok = eng.tokenizer
    shared = [tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": q}]) for q in QUESTIONS]
    turn2 = tok.apply_chat_template([
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": "It opens at nine."},
        {"role": "user", "content": "And on Saturday?"},
    ])
    texts = shared + [turn2] + OTHER
    ids = [tok.encode(t) for t in texts]
    return ids + [ids[0], ids[5], ids[2]]  # the same prompts sent again


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base() -> LLMEngine:
    # fp32: the caching-off reference is checked against transformers' fp32 forward.
    return LLMEngine(EngineConfig(device_blocks=256, host_blocks=0, dtype="float32",
                                  enable_prefix_caching=False))


@pytest.fixture(scope="module")
def reference(base: LLMEngine) -> list[list[int]]:
    """Caching off, one prompt at a time."""
    return [base.generate([p], _greedy())[0].token_ids for p in _prompts(base)]


def test_the_shared_prefix_is_long(base: LLMEngine) -> None:
    p = _prompts(base)
    common = next(i for i, (a, b) in enumerate(zip(p[0], p[1], strict=False)) if a != b)
    assert common >= 48  # three blocks of 16 or more shared by the four questions


def test_caching_off_equals_transformers(base: LLMEngine,
                                         reference: list[list[int]]) -> None:
    """The reference below is the true continuation, not only caching off's.
    transformers' greedy tokens are found by teacher forcing caching off's
    (tests/hf_reference.py): they are transformers' own wherever the two differ."""
    prompts = _prompts(base)
    unique = [i for i, p in enumerate(prompts) if p not in prompts[:i]]
    hf = hf_greedy_from(base.source.path, [prompts[i] for i in unique],
                        [reference[i] for i in unique], MAX_TOKENS)
    assert [reference[i] for i in unique] == hf


def test_caching_on_one_at_a_time_equals_caching_off(base: LLMEngine,
                                                     reference: list[list[int]]) -> None:
    eng = LLMEngine(EngineConfig(device_blocks=256, host_blocks=0), reuse=base)
    assert eng.scheduler.config.enable_prefix_caching  # the default
    got = [eng.generate([p], _greedy())[0].token_ids for p in _prompts(eng)]
    assert got == reference
    st = eng.stats()
    # Every prompt after the first finds at least the system prompt's blocks.
    assert st["prefix_cache_hit_tokens"] >= 48 * (len(got) - 1 - len(OTHER))
    eng.scheduler.check_integrity()
    assert eng.scheduler.bm.num_free_device == 256


def test_caching_on_batched_equals_caching_off(base: LLMEngine,
                                               reference: list[list[int]]) -> None:
    eng = LLMEngine(EngineConfig(device_blocks=256, host_blocks=0, max_batched_tokens=64),
                    reuse=base)
    prompts = _prompts(eng)
    first = [r.token_ids for r in eng.generate(prompts, _greedy())]
    again = [r.token_ids for r in eng.generate(prompts, _greedy())]  # now all cached
    assert first == reference and again == reference
    assert eng.stats()["prefix_cache_hit_tokens"] > 0


def test_tiny_device_pool_with_caching_is_lossless(base: LLMEngine,
                                                   reference: list[list[int]]) -> None:
    """LVF rotates requests through the host pool while they share blocks, and later
    prompts find their prefixes on the device or, evicted there, in host memory."""
    eng = LLMEngine(EngineConfig(device_blocks=14, host_blocks=256, policy="lvf",
                                 ttft_slo=0.5, tbt_slo=0.05, max_batched_tokens=64),
                    reuse=base)
    prompts = _prompts(eng)
    got = [r.token_ids for r in eng.generate(prompts, _greedy())]
    assert got == reference
    again = [r.token_ids for r in eng.generate(prompts, _greedy())]
    assert again == reference
    st = eng.stats()
    assert st["rotations"] > 0 and st["preemptions"] > 0
    assert st["prefix_cache_hits"] > 0 and st["prefix_cache_host_hits"] > 0
    eng.scheduler.check_integrity()
    assert st["device_blocks_free"] == 14 and st["host_blocks_free"] == 256
