"""Tensor parallel (worker/tp.py): a model split over 2 ranks (gloo, 2 processes) computes
what the whole model computes.

* the shards' greedy tokens (and logits, to fp32 rounding) equal TP=1's for a varied
  prompt set over 32 tokens, in one batch, prefilled in chunks: a tiny random Llama with
  4 attention / 2 KV heads (tests/tiny_models.py) on 2 ranks, and the bundled SmolLM2
  (9 / 3 heads, which does not split by 2) on 3;
* a split that does not divide the heads is refused with a clear error, before any process
  starts (`superinfer serve`, `superinfer worker`).

The served stack (rotation, kill -9 of a rank) is tests/test_tensor_parallel_stack.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from common.config import EngineConfig
from common.contracts import ScheduledChunk
from tests.tiny_models import tiny_hf, with_tokenizer
from worker.build import build_shard
from worker.runner import ModelRunner
from worker.threads import ThreadTuner
from worker.tp import (
    TensorParallelError,
    check_split,
    join_group,
    master_store,
    start_ranks,
    stop_ranks,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

BS = 4  # tokens per KV block
NEW = 32
BLOCKS = 256  # per prompt (41 + 32) / 4 + 2 blocks
CHUNK = 7  # prefill chunk: prompts longer than this take several steps
# Varied lengths (1 .. 41 tokens) over the tiny vocabulary (160).
PROMPTS = [[(7 * i + 13 * j + 5) % 160 for j in range(n)]
           for i, n in enumerate((1, 3, 9, 16, 17, 24, 30, 41))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = tiny_hf("llama", tmp_path_factory.mktemp("tp"))
    return with_tokenizer(path)


def greedy(runner: ModelRunner, prompts: list[list[int]], new: int = NEW, chunk: int = CHUNK
           ) -> list[list[int]]:
    """All prompts in one batch per step (prefill in `chunk`-token pieces, then decodes),
    greedy, through the runner the worker uses."""
    per = (max(map(len, prompts)) + new) // BS + 2
    ids = [list(p) for p in prompts]
    done = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    while any(len(o) < new for o in out):
        chunks = []
        for i in range(len(prompts)):
            if len(out[i]) < new:
                part = ids[i][done[i]: done[i] + chunk]
                chunks.append(ScheduledChunk(f"r{i}", part, done[i], tables[i],
                                             done[i] + len(part) == len(ids[i]),
                                             temperature=0.0))
        sampled = runner.execute(chunks).sampled
        for c in chunks:
            i = int(c.request_id[1:])
            done[i] += len(c.token_ids)
            if c.sample:
                out[i].append(sampled[c.request_id])
                ids[i].append(sampled[c.request_id])
    return out


def _runner(shard, blocks: int) -> ModelRunner:  # type: ignore[no-untyped-def]
    c = shard.model.cfg
    kv = torch.zeros((blocks, c.num_layers, 2, BS, c.num_kv_heads, c.head_dim),
                     dtype=shard.kv_dtype)
    return ModelRunner(shard.model, kv, BS, shard.weights, tuner=ThreadTuner((1,)))


def split_greedy(cfg: EngineConfig, prompts: list[list[int]], run_dir: Path,
                 probe: list[ScheduledChunk] | None = None, lm_head: str = "replicated"
                 ) -> tuple[list[list[int]], torch.Tensor | None]:
    """Greedy tokens of `prompts` on cfg.tensor_parallel_size ranks: this process is rank
    0 (as the worker service is), ranks 1.. are real `python -m worker.tp_rank` processes
    started the way the worker starts them. With `probe`: also its logits."""
    n = cfg.tensor_parallel_size
    store = master_store(n)
    procs = start_ranks(n, store, asdict(cfg), run_dir, "info", lm_head)
    group = None
    logits = None
    try:
        shard = build_shard(cfg, 0, n, lm_head=lm_head)
        c = shard.model.cfg
        assert (c.num_heads * n, c.num_kv_heads * n) == (shard.full.num_heads,
                                                          shard.full.num_kv_heads)
        group = join_group(0, n, store)
        shard.model.reduce = group.all_reduce
        if lm_head == "vocab":
            shard.model.gather = group.gather_vocab
        runner = _runner(shard, BLOCKS)
        runner.group = group
        got = greedy(runner, prompts)
        if probe is not None:
            logits = runner.forward(probe)
        group.send_batch(None)
    finally:
        if group is not None:
            group.close()
        stop_ranks(procs)
    assert [p.returncode for p in procs] == [0] * (n - 1)  # each stopped cleanly ...
    for r in range(1, n):  # ... and freed its pool: no segment of its record is left
        assert not (run_dir / f"worker.rank{r}.shm").exists()
    return got, logits


@pytest.mark.parametrize("lm_head", ["replicated", "vocab"])
def test_two_ranks_equal_one(tiny: Path, tmp_path: Path, lm_head: str) -> None:
    cfg = EngineConfig(model=str(tiny), dtype="float32", block_size=BS, device_blocks=BLOCKS,
                       tensor_parallel_size=2)
    whole = build_shard(cfg, 0, 1)
    ref = greedy(_runner(whole, BLOCKS), PROMPTS)
    probe = [ScheduledChunk("p", PROMPTS[-1], 0, list(range(12)), True, temperature=0.0)]
    got, tp_logits = split_greedy(cfg, PROMPTS, tmp_path, probe, lm_head)
    # The logits themselves: the same to fp32 rounding of the all-reduce's sum order.
    assert tp_logits is not None
    assert (tp_logits - _runner(whole, BLOCKS).forward(probe)).abs().max().item() < 1e-4
    differing = [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b]
    assert not differing, f"prompts {differing} differ: {got} vs {ref}"
    assert len({tuple(o) for o in ref}) == len(ref)  # the prompts really are different


def test_bundled_model_three_ways_equals_one(tmp_path: Path) -> None:
    """SmolLM2-135M (9 / 3 heads: 3 ranks of 3 heads over 1 KV head each), dequantized to
    fp32, as `--tensor-parallel-size 3` runs it."""
    from common.modelfile import resolve_model
    from common.tokenizer import Tokenizer
    from tests.prompts import PROMPTS as TEXTS

    tok = Tokenizer.from_source(resolve_model(None))
    prompts = [tok.encode(t) for t in TEXTS[:4]]
    cfg = EngineConfig(dtype="float32", block_size=BS, device_blocks=BLOCKS,
                       tensor_parallel_size=3)
    ref = greedy(_runner(build_shard(cfg, 0, 1), BLOCKS), prompts)
    got, _ = split_greedy(cfg, prompts, tmp_path)
    assert got == ref


def test_split_must_divide_the_heads() -> None:
    check_split(3, 9, 3, 1536)  # SmolLM2 by 3: fine
    with pytest.raises(TensorParallelError, match=r"does not divide .*9 attention heads / 3 KV"):
        check_split(2, 9, 3, 1536)
    with pytest.raises(TensorParallelError, match=r"2 KV heads \(GQA\), fewer than 4 ranks"):
        check_split(4, 8, 2, 1536)
    with pytest.raises(TensorParallelError, match="MLP size 1537"):
        check_split(2, 8, 2, 1537)


@pytest.mark.parametrize("service", ["serve", "worker"])
def test_bundled_model_by_two_is_refused_before_any_process(tmp_path: Path, service: str) -> None:
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "superinfer.cli", service, "--tensor-parallel-size", "2",
         "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--tensor-parallel-size 2 does not divide SmolLM2-135M-Instruct" in r.stderr
    assert "9 attention heads / 3 KV heads" in r.stderr
    assert "--tensor-parallel-size 1 / 3" in r.stderr
    # nothing was started: no child's console, pid or log file
    assert not run_dir.exists() or not any(
        p.suffix in (".out", ".pid") for p in run_dir.iterdir())


def test_in_process_engine_refuses_tensor_parallel() -> None:
    from superinfer.engine import LLMEngine

    with pytest.raises(ValueError, match="worker service only"):
        LLMEngine(EngineConfig(tensor_parallel_size=2))
