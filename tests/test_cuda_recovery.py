"""Worker kill -9 under load on the GPU: the four services with `--device cuda`.

The worker's pool is a GPU tensor that kvmem maps through a CUDA IPC handle; killing the
worker frees it, the restarted worker makes a new pool with a new handle, kvmem re-attaches
and the scheduler resumes every request from its host copies. Every stream must end with
the text of an undisturbed GPU run. With $GPU_CHECK_OUT set the counts are written to
kill9.json there (scripts/gpu_check.sh folds them into gpu_check.json).
The harness is tests/test_recovery.py's (the same check on the CPU).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.prompts import PROMPTS
from tests.test_recovery import Serve, Stream, kill, next_token_after, run_load, serving, until

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    with serving(tmp_path_factory.mktemp("gpu_recovery"), "--device", "cuda",
                 "--dtype", "bfloat16") as s:
        yield s


def test_worker_kill9_under_load_on_the_gpu(gpu_serve: Serve) -> None:
    reference = run_load(gpu_serve, PROMPTS)
    assert all(s.error is None and s.finish_reason == "length" for s in reference)
    times: dict[str, float] = {}

    async def chaos(streams: list[Stream], tasks: list[asyncio.Task[Stream]]) -> None:
        await until(lambda: min(len(s.token_times) for s in streams) >= 16)
        _, t = kill(gpu_serve, "worker")
        times["worker"] = await next_token_after(streams, t)

    streams = run_load(gpu_serve, PROMPTS, chaos)
    exact = sum(s.error is None and s.done and s.text == r.text
                for s, r in zip(streams, reference, strict=True))
    c = gpu_serve.stats().counters
    result = {"kill9_streams_exact": exact, "streams": len(PROMPTS),
              "recovery_s": times.get("worker"), "device_losses": c["device_losses"],
              "resumed_swap_in": c["resumed_swap_in"],
              "resumed_recompute": c["resumed_recompute"], "rotations": c["rotations"]}
    print(f"\nGPU kill -9: {result}")
    if os.environ.get("GPU_CHECK_OUT"):
        Path(os.environ["GPU_CHECK_OUT"], "kill9.json").write_text(json.dumps(result, indent=1))
    assert exact == len(PROMPTS), [(p, s.text, r.text) for p, s, r
                                   in zip(PROMPTS, streams, reference, strict=True)
                                   if s.text != r.text]
    assert c["device_losses"] == 1 and c["resumed_swap_in"] > 0
