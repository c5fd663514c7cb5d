"""`superinfer serve --tensor-parallel-size 2` (worker/tp.py) on the real stack: a worker
group of 2 gloo ranks, kvmem attached to both ranks' pools, the scheduler, the gateway.

* greedy streams through a small device pool (requests rotate through kvmem's host pools
  of both ranks) equal TP=1's tokens, computed in this process over the same weights;
* kill -9 of rank 1 (or rank 0) under load: the group goes down, the supervisor restarts
  it, and every stream finishes with the same tokens; so does a rank stopped with
  SIGSTOP (rank 0 gives up on the stalled batch);
* SIGTERM stops everything; no shared-memory segment of either rank is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.config import EngineConfig
from common.daemon import CHANNEL_OPTIONS
from common.shm import SHM_DIR
from proto import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.test_recovery import Serve, serving
from tests.test_tensor_parallel import BS, PROMPTS, _runner, greedy
from tests.tiny_models import tiny_hf, with_tokenizer
from worker.build import build_shard

DEVICE_BLOCKS = 12  # 16-token blocks: 8 prompts of 1-41 tokens + 32 (or 96) need ~40 (~60)
LONG = 96  # tokens per stream in the kill test: the load outlasts the restart
STALL_S = 5.0


def rank_record(s: Serve, rank: int) -> dict:
    """What rank `rank` (> 0) wrote about itself: pid and pool segment (common/shm.py)."""
    return json.loads((s.run_dir / f"worker.rank{rank}.shm").read_text())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = tiny_hf("llama", tmp_path_factory.mktemp("tp-model"))
    return with_tokenizer(path)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    """TP=1: the whole model in this process, LONG greedy tokens per prompt."""
    cfg = EngineConfig(model=str(model_dir), dtype="float32", block_size=BS)
    return greedy(_runner(build_shard(cfg, 0, 1), 512), PROMPTS, new=LONG)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Serve]:
    # A batch stalled this long means a rank hangs (worker/tp.py); the tiny model's take ms.
    old = os.environ.get("SUPERINFER_TP_STALL_S")
    os.environ["SUPERINFER_TP_STALL_S"] = str(STALL_S)
    try:
        with serving(tmp_path_factory.mktemp("tp-serve"), "--model", str(model_dir),
                     "--dtype", "float32", "--tensor-parallel-size", "2",
                     "--device-blocks", str(DEVICE_BLOCKS)) as s:
            yield s
    finally:
        if old is None:
            os.environ.pop("SUPERINFER_TP_STALL_S", None)
        else:
            os.environ["SUPERINFER_TP_STALL_S"] = old


def _request(i: int, max_tokens: int) -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(
        request_id=f"tp-{max_tokens}-{i}", prompt_token_ids=PROMPTS[i],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True))


async def _stream(stub: scheduler_pb2_grpc.SchedulerStub, req: scheduler_pb2.GenerateRequest,
                  got: list[int]) -> list[int]:
    async for ev in stub.Generate(req, timeout=300):
        got.extend(ev.token_ids)
    return got


def run_streams(s: Serve, max_tokens: int, during=None) -> list[list[int]]:  # type: ignore[no-untyped-def]
    async def main() -> list[list[int]]:
        got: list[list[int]] = [[] for _ in PROMPTS]
        async with grpc.aio.insecure_channel(s.scheduler_addr, options=CHANNEL_OPTIONS) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            tasks = [asyncio.create_task(_stream(stub, _request(i, max_tokens), got[i]))
                     for i in range(len(PROMPTS))]
            if during is not None:
                await during(got)
            return list(await asyncio.gather(*tasks))

    return asyncio.run(main())


def test_tp2_streams_equal_tp1_under_rotation(serve: Serve, reference: list[list[int]]) -> None:
    before = serve.stats().counters
    got = run_streams(serve, 32)
    after = serve.stats().counters
    assert got == [r[:32] for r in reference]
    # kvmem mapped both ranks' pools, and requests rotated through the host pools.
    [engine] = serve.log_events("kvmem", "transfer_engine")
    assert engine["engine"].endswith("x2 ranks")
    for k in ("swap_out_blocks", "swap_in_blocks"):
        assert after[k] > before.get(k, 0), k


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie nobody reaped yet is gone too


@pytest.mark.parametrize("victim", [1, 0])
def test_kill_a_rank_restarts_the_group_and_streams_finish(
        serve: Serve, reference: list[list[int]], victim: int) -> None:
    worker, rank1 = serve.pid("worker"), rank_record(serve, 1)["pid"]
    old_segments = set(rank_record(serve, 1)["segments"])
    recoveries = serve.stats().counters.get("recoveries", 0)

    async def kill_when_streaming(got: list[list[int]]) -> None:
        deadline = time.monotonic() + 120
        while sum(map(len, got)) < 4 * len(got) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert sum(map(len, got)) < LONG * len(got) - 8, "the load ended before the kill"
        os.kill(rank1 if victim == 1 else worker, signal.SIGKILL)

    got = run_streams(serve, LONG, kill_when_streaming)
    assert got == reference
    assert not _alive(rank1) and not _alive(worker)  # the whole group went down
    assert serve.pid("worker") != worker  # the group restarted: a new rank 0 ...
    assert rank_record(serve, 1)["pid"] != rank1  # ... and a new rank 1
    assert any(e["service"] == "worker" for e in serve.log_events("supervisor", "service_exited"))
    if victim == 1:  # rank 0 saw it go: its watcher, or mid-batch gloo's closed socket
        assert (serve.log_events("worker", "tp_rank_died")
                or serve.log_events("worker", "tp_forward_failed"))
    # the killed rank's pool segment was reaped by the new group
    assert not any((Path(SHM_DIR) / n).exists() for n in old_segments)
    counters = serve.stats().counters
    assert counters["recoveries"] == recoveries + 1
    print(f"\nkill -9 rank {victim}: recoveries {counters['recoveries']:g}, "
          f"device losses {counters['device_losses']:g}, "
          f"last outage {counters.get('last_outage_s', 0):.2f} s")


def test_stopped_rank_takes_the_group_down_and_streams_finish(
        serve: Serve, reference: list[list[int]]) -> None:
    """SIGSTOP: rank 1 is alive but answers no collective; rank 0 gives up on the batch
    after SUPERINFER_TP_STALL_S and exits, its ranks (the stopped one too) with it."""
    rank1 = rank_record(serve, 1)["pid"]

    async def stop_when_streaming(got: list[list[int]]) -> None:
        deadline = time.monotonic() + 120
        while sum(map(len, got)) < 4 * len(got) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        os.kill(rank1, signal.SIGSTOP)

    try:
        got = run_streams(serve, LONG, stop_when_streaming)
    finally:
        if _alive(rank1):
            os.kill(rank1, signal.SIGKILL)  # never leave a stopped process behind
    assert got == reference
    [stalled] = serve.log_events("worker", "tp_batch_stalled")
    assert stalled["seconds"] >= STALL_S
    assert not _alive(rank1) and rank_record(serve, 1)["pid"] != rank1


def test_sigterm_leaves_no_segment_of_any_rank(serve: Serve) -> None:
    names = {*rank_record(serve, 1)["segments"],
             *json.loads((serve.run_dir / "worker.shm").read_text())["segments"]}
    assert len(names) == 2
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.proc.wait(60) == 0
    assert not any((Path(SHM_DIR) / n).exists() for n in names)
    assert not list(serve.run_dir.glob("*.pid"))
