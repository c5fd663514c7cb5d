"""Lossless rotation on the real model: a device pool far too small for the batch gives
token-for-token the same greedy output as an unconstrained pool, under every policy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import EngineConfig
from scheduler_svc.policy import POLICY_NAMES
from scheduler_svc.request import SamplingParams
from superinfer.engine import LLMEngine
from tests.prompts import OPENINGS

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def base() -> LLMEngine:
    return LLMEngine(EngineConfig(device_blocks=256, host_blocks=0))


@pytest.fixture(scope="module")
def reference(base: LLMEngine) -> list[list[int]]:
    prompts = [base.encode_prompt(p) for p in OPENINGS]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in base.generate(prompts, sp)]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_tiny_device_pool_is_lossless(base: LLMEngine, reference: list[list[int]],
                                      policy: str) -> None:
    # 10 requests need ~30 blocks of 16 tokens; 8 blocks force constant preemption.
    eng = LLMEngine(EngineConfig(device_blocks=8, host_blocks=128, policy=policy,
                                 ttft_slo=0.5, tbt_slo=0.05), reuse=base)
    prompts = [eng.encode_prompt(p) for p in OPENINGS]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got = [r.token_ids for r in eng.generate(prompts, sp)]
    assert got == reference
    st = eng.stats()
    assert st["preemptions"] > 0
    if policy == "fcfs":
        assert st["recomputes"] > 0 and st["rotations"] == 0
    else:
        assert st["rotations"] > 0 and st["swap_in_blocks"] > 0
    eng.scheduler.check_integrity()
    assert st["device_blocks_free"] == 8 and st["host_blocks_free"] == 128


def test_cli_generate_json_reports_rotation_stats(tmp_path: Path,
                                                  reference: list[list[int]]) -> None:
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(OPENINGS) + "\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "superinfer.cli", "generate", "--prompts-file", str(f),
           "--device-blocks", "8", "--host-blocks", "128", "--policy", "lvf",
           "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    lines = [json.loads(line) for line in out.splitlines()]
    assert [ln["token_ids"] for ln in lines[:-1]] == reference
    assert [ln["prompt"] for ln in lines[:-1]] == OPENINGS
    stats = lines[-1]["stats"]
    for key in ("rotations", "swap_in_blocks", "swap_out_blocks", "eager_blocks", "recomputes",
                "prefix_cache_hit_tokens"):
        assert key in stats
    assert stats["rotations"] > 0
