"""worker, kvmem and scheduler as real processes, talking gRPC over loopback.

Two stacks: a roomy one (everything fits on the "device") and a tight one (24 device
blocks) that must rotate requests through kvmem's host pool and still produce the same
tokens. What a user would notice is asserted: tokens, finish reasons, status codes,
blocks back in the pool, and no shared memory or pid file left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from common.daemon import CHANNEL_OPTIONS, free_port
from common.modelfile import resolve_model
from common.tokenizer import Tokenizer
from proto import (
    common_pb2,
    kvmem_pb2,
    kvmem_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from superinfer.probes import grpc_probe
from superinfer.supervisor import ServiceSpec, Supervisor
from tests.prompts import PROMPTS

START_TIMEOUT_S = 240.0

# Two model-loading stacks plus an in-process engine: minutes on a 2-core machine.
pytestmark = pytest.mark.slow




@dataclass
class Stack:
    """One worker + kvmem + scheduler, with its run dir and addresses."""

    run_dir: Path
    sup: Supervisor
    addr: dict[str, str]

    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        return scheduler_pb2_grpc.SchedulerStub(
            grpc.insecure_channel(self.addr["scheduler"], options=CHANNEL_OPTIONS)
        )

    def stats(self) -> scheduler_pb2.StatsReply:
        return self.stub().GetStats(scheduler_pb2.StatsRequest(), timeout=10)

    def pool(self) -> worker_pb2.KVPoolHandle:
        ch = grpc.insecure_channel(self.addr["worker"], options=CHANNEL_OPTIONS)
        return worker_pb2_grpc.WorkerStub(ch).GetKVPool(worker_pb2.KVPoolRequest(), timeout=10)

    def kvmem_stats(self) -> kvmem_pb2.KVMemStats:
        ch = grpc.insecure_channel(self.addr["kvmem"], options=CHANNEL_OPTIONS)
        return kvmem_pb2_grpc.KVMemStub(ch).GetStats(kvmem_pb2.KVMemStatsRequest(), timeout=10)


def start_stack(run_dir: Path, worker: list[str], kvmem: list[str], scheduler: list[str]) -> Stack:
    addr = {name: f"127.0.0.1:{free_port()}" for name in ("worker", "kvmem", "scheduler")}
    base = [sys.executable, "-m", "superinfer.cli"]
    flags = {name: ["--port", addr[name].rsplit(":", 1)[1], "--run-dir", str(run_dir)]
             for name in addr}
    specs = [
        ServiceSpec("worker", [*base, "worker", *flags["worker"], *worker],
                    grpc_probe(addr["worker"]), run_dir / "worker.pid"),
        ServiceSpec("kvmem", [*base, "kvmem", *flags["kvmem"], *kvmem],
                    grpc_probe(addr["kvmem"]), run_dir / "kvmem.pid"),
        ServiceSpec("scheduler", [*base, "scheduler", *flags["scheduler"],
                                  "--worker-addr", addr["worker"], "--kvmem-addr", addr["kvmem"],
                                  *scheduler],
                    grpc_probe(addr["scheduler"]), run_dir / "scheduler.pid"),
    ]
    sup = Supervisor(run_dir)
    try:
        for spec in specs:
            sup.start(spec, START_TIMEOUT_S)
    except BaseException:
        sup.stop_all()
        raise
    return Stack(run_dir, sup, addr)


@pytest.fixture(scope="module")
def roomy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("roomy"), ["--device-blocks", "256"],
                        ["--host-blocks", "64"], ["--policy", "lvf"])
    yield stack
    stack.sup.stop_all()


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("tight"), ["--device-blocks", "24"],
                        ["--host-blocks", "256"], ["--policy", "lvf"])
    yield stack
    stack.sup.stop_all()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_source(resolve_model(None))


def _request(ids: list[int], max_tokens: int, rid: str = "", **sampling: object
             ) -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=ids,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling),
    )


async def _stream(stub: scheduler_pb2_grpc.SchedulerStub, req: scheduler_pb2.GenerateRequest
                  ) -> tuple[list[int], list[scheduler_pb2.TokenEvent]]:
    events = [ev async for ev in stub.Generate(req, timeout=300)]
    return [t for ev in events for t in ev.token_ids], events


def generate_all(addr: str, requests: list[scheduler_pb2.GenerateRequest]
                 ) -> list[tuple[list[int], list[scheduler_pb2.TokenEvent]]]:
    """All requests as concurrent streams; (tokens, events) of each, in order."""

    async def run() -> list[tuple[list[int], list[scheduler_pb2.TokenEvent]]]:
        async with grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            return list(await asyncio.gather(*(_stream(stub, r) for r in requests)))

    return asyncio.run(run())


def wait_idle(stack: Stack, timeout_s: float = 20.0) -> scheduler_pb2.StatsReply:
    """Stats once nothing is queued and every block is back (an abort lands within an
    iteration; the blocks of a request aborted while its batch runs come back when the
    batch lands), or at the deadline."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        s = stack.stats()
        idle = (s.waiting, s.running, s.rotary) == (0, 0, 0)
        back = (s.device_blocks_free == s.device_blocks_total
                and s.host_blocks_free == s.host_blocks_total)
        if (idle and back) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def assert_all_free(s: scheduler_pb2.StatsReply) -> None:
    assert (s.waiting, s.running, s.rotary) == (0, 0, 0)
    assert s.device_blocks_free == s.device_blocks_total
    assert s.host_blocks_free == s.host_blocks_total


# -- tests ---------------------------------------------------------------------------------------
def test_greedy_tokens_match_in_process_engine(roomy: Stack, tokenizer: Tokenizer) -> None:
    from common.config import EngineConfig
    from scheduler_svc.request import SamplingParams
    from superinfer.engine import GenerationResult, LLMEngine

    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    got = generate_all(roomy.addr["scheduler"], [_request(p, 12) for p in prompts])

    def in_process() -> list[GenerationResult]:
        engine = LLMEngine(EngineConfig(device_blocks=64, host_blocks=0))
        return engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))

    # In a thread, as the worker runs it: on an oversubscribed CPU, torch's OpenMP waits
    # made main-thread forward passes ~5-10x slower here (OMP_WAIT_POLICY=ACTIVE spinning).
    with ThreadPoolExecutor(1) as pool:
        want = pool.submit(in_process).result()
    assert [tokens for tokens, _ in got] == [r.token_ids for r in want]
    for (tokens, events), r in zip(got, want):
        final = events[-1]
        assert final.finish_reason == r.finish_reason
        assert final.prompt_tokens == len(r.prompt_token_ids)
        assert final.output_tokens == len(tokens)
        summary = json.loads(final.summary_json)
        assert summary["output_tokens"] == len(tokens) and summary["ttft_s"] > 0
        assert all(ev.finish_reason == "" and ev.summary_json == "" for ev in events[:-1])


def test_32_concurrent_streams_complete_and_free_every_block(roomy: Stack, tokenizer: Tokenizer) -> None:
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)] + f" ({i})") for i in range(32)]
    lens = [4 + i % 9 for i in range(32)]
    got = generate_all(roomy.addr["scheduler"],
                       [_request(p, n, ignore_eos=True) for p, n in zip(prompts, lens)])
    for (tokens, events), n in zip(got, lens):
        assert len(tokens) == n
        assert events[-1].finish_reason == "length"
    s = wait_idle(roomy)
    assert_all_free(s)
    assert s.counters["finished"] >= 32


def test_rotation_under_pressure_is_lossless(roomy: Stack, tight: Stack, tokenizer: Tokenizer) -> None:
    # 16 requests of ~3 blocks each against 24 device blocks: rotation or bust.
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)] + f" #{i}") for i in range(16)]
    reqs = [_request(p, 24, ignore_eos=True) for p in prompts]
    want = generate_all(roomy.addr["scheduler"], reqs)
    got = generate_all(tight.addr["scheduler"], reqs)
    assert [t for t, _ in got] == [t for t, _ in want]
    s = wait_idle(tight)
    assert_all_free(s)
    assert s.counters["rotations"] > 0
    assert s.counters["transfers"] > 0 and s.counters["swap_in_blocks"] > 0
    k = tight.kvmem_stats()
    assert k.transfers > 0 and k.blocks_d2h > 0 and k.blocks_h2d > 0
    assert sum(json.loads(ev[-1].summary_json)["rotations"] for _, ev in got) > 0


def test_cancelled_stream_frees_its_blocks(roomy: Stack, tokenizer: Tokenizer) -> None:
    before = roomy.stats().counters["aborted"]

    async def run() -> int:
        async with grpc.aio.insecure_channel(roomy.addr["scheduler"],
                                             options=CHANNEL_OPTIONS) as ch:
            call = scheduler_pb2_grpc.SchedulerStub(ch).Generate(
                _request(tokenizer.encode(PROMPTS[1]), 500, ignore_eos=True))
            n = 0
            async for _ in call:
                n += 1
                if n == 3:
                    call.cancel()
                    break
            return n

    assert asyncio.run(run()) == 3
    s = wait_idle(roomy)
    assert_all_free(s)
    assert s.counters["aborted"] == before + 1


def test_abort_with_stop_ends_the_stream_as_stopped(roomy: Stack, tokenizer: Tokenizer) -> None:
    async def run() -> list[scheduler_pb2.TokenEvent]:
        async with grpc.aio.insecure_channel(roomy.addr["scheduler"],
                                             options=CHANNEL_OPTIONS) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            events = []
            async for ev in stub.Generate(_request(tokenizer.encode(PROMPTS[2]), 500,
                                                   rid="stop-me", ignore_eos=True)):
                events.append(ev)
                if len(events) == 2:
                    reply = await stub.Abort(scheduler_pb2.AbortRequest(request_id="stop-me",
                                                                        reason="stop"))
                    assert reply.found
            return events

    events = asyncio.run(run())
    assert events[-1].finish_reason == "stop" and events[-1].summary_json
    assert 2 <= len(events) < 500
    assert not roomy.stub().Abort(scheduler_pb2.AbortRequest(request_id="stop-me")).found
    assert_all_free(wait_idle(roomy))


class Subscriber:
    """A gateway's view of the scheduler: one Subscribe stream, requests by Submit."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, subscriber_id: str) -> None:
        self.stub = stub
        self.id = subscriber_id
        self.call = stub.Subscribe(scheduler_pb2.SubscribeRequest(subscriber_id=subscriber_id))
        self.batches: list[scheduler_pb2.TokenBatch] = []

    async def open(self) -> None:
        first = await self.call.read()
        assert first == scheduler_pb2.TokenBatch()  # the empty "live" message

    async def submit(self, stream: int, req: scheduler_pb2.GenerateRequest) -> str:
        reply = await self.stub.Submit(
            scheduler_pb2.SubmitRequest(request=req, subscriber_id=self.id, stream=stream))
        return str(reply.request_id)

    async def read_until_done(self, choices: dict[int, int]
                              ) -> dict[tuple[int, int], list[scheduler_pb2.TokenEvent]]:
        """Events by (stream, choice) until every stream's `choices[stream]` choices ended."""
        got: dict[tuple[int, int], list[scheduler_pb2.TokenEvent]] = {}
        open_ = dict(choices)
        while any(open_.values()):
            batch = await asyncio.wait_for(self.call.read(), 120)
            assert batch is not grpc.aio.EOF
            self.batches.append(batch)
            for ev in batch.events:
                got.setdefault((ev.stream, ev.index), []).append(ev)
                if ev.finish_reason:
                    open_[ev.stream] -= 1
        return got


def test_subscription_carries_every_stream_batched_as_generate_would(
        roomy: Stack, tokenizer: Tokenizer) -> None:
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)] + f" [{i}]") for i in range(8)]
    lens = [6 + i for i in range(8)]
    reqs = [_request(p, n, rid=f"sub-{i}", ignore_eos=True, temperature=0.0)
            for i, (p, n) in enumerate(zip(prompts, lens))]
    # Choice-sharing and logprobs travel too: n=2 sampled choices with their logprobs.
    fork = scheduler_pb2.GenerateRequest(
        request_id="sub-n2", prompt_token_ids=prompts[0], n=2,
        sampling=common_pb2.SamplingParams(max_tokens=5, temperature=0.8, seed=7, logprobs=2,
                                           ignore_eos=True))
    want = generate_all(roomy.addr["scheduler"], reqs)

    async def run() -> tuple[dict[tuple[int, int], list[scheduler_pb2.TokenEvent]], Subscriber]:
        async with grpc.aio.insecure_channel(roomy.addr["scheduler"], options=CHANNEL_OPTIONS) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            sub = Subscriber(stub, "test-gateway")
            await sub.open()
            # A second live subscription under the same id, or a Submit naming none, is refused.
            dup = stub.Subscribe(scheduler_pb2.SubscribeRequest(subscriber_id="test-gateway"))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await dup.read()
            assert e.value.code() is grpc.StatusCode.ALREADY_EXISTS
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Submit(scheduler_pb2.SubmitRequest(request=reqs[0], subscriber_id="nobody"))
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            ids = await asyncio.gather(*(sub.submit(i + 1, r) for i, r in enumerate(reqs)),
                                       sub.submit(100, fork))
            assert ids == [r.request_id for r in reqs] + ["sub-n2"]
            got = await sub.read_until_done({**{i + 1: 1 for i in range(8)}, 100: 2})
            sub.call.cancel()
            return got, sub

    got, sub = asyncio.run(run())
    for i, ((tokens, _), r) in enumerate(zip(want, reqs)):
        evs = got[(i + 1, 0)]
        assert [t for ev in evs for t in ev.token_ids] == tokens
        assert {ev.request_id for ev in evs} == {r.request_id}
        final = evs[-1]
        assert final.finish_reason == "length" and final.output_tokens == len(tokens)
        assert final.prompt_tokens == len(r.prompt_token_ids)
        assert json.loads(final.summary_json)["output_tokens"] == len(tokens)
    for index in (0, 1):
        evs = got[(100, index)]
        tokens = [t for ev in evs for t in ev.token_ids]
        assert len(tokens) == 5 and evs[-1].finish_reason == "length"
        assert [lp.token_id for ev in evs for lp in ev.logprobs] == tokens
        assert all(len(lp.top_ids) == 2 for ev in evs for lp in ev.logprobs)
    # Batched: the 10 streams' ~80 events came in far fewer messages, each naming its streams.
    events = sum(len(b.events) for b in sub.batches)
    assert events == sum(len(v) for v in got.values())
    assert len(sub.batches) < events / 3
    assert_all_free(wait_idle(roomy))


def test_ending_a_subscription_aborts_its_requests_and_frees_their_blocks(
        roomy: Stack, tokenizer: Tokenizer) -> None:
    before = roomy.stats().counters["aborted"]

    async def run() -> int:
        async with grpc.aio.insecure_channel(roomy.addr["scheduler"], options=CHANNEL_OPTIONS) as ch:
            sub = Subscriber(scheduler_pb2_grpc.SchedulerStub(ch), "gone-gateway")
            await sub.open()
            for i in range(3):
                await sub.submit(i + 1, _request(tokenizer.encode(PROMPTS[i]), 500, ignore_eos=True))
            tokens = 0
            while tokens < 6:
                batch = await sub.call.read()
                tokens += sum(len(ev.token_ids) for ev in batch.events)
            sub.call.cancel()  # the gateway went away mid-stream
            return tokens

    assert asyncio.run(run()) >= 6
    s = wait_idle(roomy)
    assert_all_free(s)
    assert s.counters["aborted"] == before + 3


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (_request([], 4), "prompt is empty"),
        (_request([1, 2, 3], 0), "max_tokens"),
        (_request([1, 2, 3], 4, temperature=-1.0), "temperature"),
        (_request([1, 2, 3], 4, top_p=1.5), "top_p"),
        (_request([1, 2, 3], 4, top_k=-2), "top_k"),
        (_request([1, 10**6], 4), "outside the vocabulary"),
        # 256 blocks of 16 tokens: the pool, not the model's 8192, bounds the context.
        (_request([1] * 9000, 4), "limit is 4095 (the device pool holds 4096 tokens"),
        (scheduler_pb2.GenerateRequest(prompt_token_ids=[1, 2], slo=common_pb2.SLO(ttft_s=-1),
                                       sampling=common_pb2.SamplingParams(max_tokens=2)),
         "SLOs must be positive"),
    ],
)
def test_bad_input_is_invalid_argument(roomy: Stack, req: scheduler_pb2.GenerateRequest,
                                       message: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        list(roomy.stub().Generate(req, timeout=30))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


def test_scheduler_keeps_serving_after_bad_input(roomy: Stack, tokenizer: Tokenizer) -> None:
    [(tokens, events)] = generate_all(roomy.addr["scheduler"],
                                      [_request(tokenizer.encode(PROMPTS[0]), 3, ignore_eos=True)])
    assert len(tokens) == 3 and events[-1].finish_reason == "length"
    assert_all_free(wait_idle(roomy))


def test_peers_refuse_orders_for_another_pool(roomy: Stack) -> None:
    worker = worker_pb2_grpc.WorkerStub(
        grpc.insecure_channel(roomy.addr["worker"], options=CHANNEL_OPTIONS))
    with pytest.raises(grpc.RpcError) as e:
        worker.Execute(worker_pb2.ExecuteRequest(pool_id="not-this-pool"), timeout=10)
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    kvmem = kvmem_pb2_grpc.KVMemStub(
        grpc.insecure_channel(roomy.addr["kvmem"], options=CHANNEL_OPTIONS))
    with pytest.raises(grpc.RpcError) as e:
        kvmem.Transfer(kvmem_pb2.TransferRequest(pool_id="not-this-pool"), timeout=10)
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    handle = roomy.pool()
    with pytest.raises(grpc.RpcError) as e:  # a block outside the pool: refused, no crash
        kvmem.Transfer(kvmem_pb2.TransferRequest(
            pool_id=handle.pool_id, swap_out=kvmem_pb2.BlockPairs(src=[10**6], dst=[0])),
            timeout=10)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_stopping_leaves_no_shared_memory_or_pid_files(roomy: Stack, tight: Stack) -> None:
    segments = [stack.pool().shm_name for stack in (roomy, tight)]
    assert all(os.path.exists(f"/dev/shm/{name}") for name in segments)
    for stack in (roomy, tight):
        procs = [c.proc for c in stack.sup.children]
        stack.sup.stop_all()
        assert [p.returncode for p in procs] == [0, 0, 0]  # each stopped cleanly on SIGTERM
        assert not list(stack.run_dir.glob("*.pid"))
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in segments)
