"""The scheduler's gRPC service (proto Scheduler): the engine core behind the gateway.

Thin by design: it validates and translates messages, and `ServingLoop` does the work.
At start it learns everything pool-related from its peers — block size and device blocks
from the worker (which owns the pool), host blocks from kvmem — so the flags that size
memory live in one place each.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
import uuid
from collections.abc import AsyncIterator

import grpc
import structlog

from common.config import EngineConfig
from common.daemon import Daemon, run_daemon
from common.errors import RETRY_PUSHBACK_KEY
from common.grammar import check as check_grammar
from common.kv_events import KVEventsConfig, KVEventsConfigError, parse_kv_events_config
from common.modelfile import resolve_model
from common.tokenizer import Tokenizer
from common.wire import grammar_from_proto
from proto import scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.fork import child_id, child_seed
from scheduler_svc.kv_publisher import KVEventPublisher
from scheduler_svc.loop import EventQueue, ServingLoop, StreamSink
from scheduler_svc.policy.shares import Ledger
from scheduler_svc.remote import RPC_TIMEOUT_S, RemoteKVMem, RemoteWorker, wait_serving
from scheduler_svc.request import SLO, InvalidSamplingParams, Request, SamplingParams
from scheduler_svc.scheduler_config import tenant_key
from scheduler_svc.setup import build_scheduler, default_slo, model_identity
from scheduler_svc.token_stream import Subscription, token_event_fields
from scheduler_svc.trace import Trace

log = structlog.get_logger()

RETRY_AFTER_S = 1  # what a refused client is told to wait; requests finish in seconds
MAX_CHOICES = 32  # n (or best_of) of one request


def service_counters(ledger: Ledger) -> dict[str, float]:
    """Each tenant's service so far (policy/shares.py), once tenants were seen: tokens
    scheduled and device block-seconds held, under `tenant_key`."""
    if not ledger.accounting:
        return {}
    out = {tenant_key("service_tokens", t): v for t, v in ledger.tokens.items()}
    out.update({tenant_key("device_block_seconds", t): v for t, v in ledger.block_s.items()})
    return out


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config: EngineConfig, worker_addr: str, kvmem_addr: str,
                 rpc_timeout_s: float = RPC_TIMEOUT_S,
                 kv_events: KVEventsConfig | None = None,
                 kv_events_host_tier: bool = True) -> None:
        self.config = config
        self.kv_events = kv_events
        self.kv_events_host_tier = kv_events_host_tier
        self.publisher: KVEventPublisher | None = None
        self.worker_addr = worker_addr
        self.kvmem_addr = kvmem_addr
        self.rpc_timeout_s = rpc_timeout_s  # deadline of one Execute / Transfer
        self.worker: RemoteWorker | None = None
        self.kvmem: RemoteKVMem | None = None
        self.loop: ServingLoop | None = None
        self.info = scheduler_pb2.ModelInfo()
        self.eos_token_ids: tuple[int, ...] = ()
        self._task: asyncio.Task[None] | None = None
        self.subscriptions: dict[str, Subscription] = {}  # the gateways' token streams

    async def start(self, connect_timeout_s: float) -> None:
        """Reach the worker and kvmem, build the scheduler from their pools, start the loop."""
        if self.kv_events is not None:
            # Bound first: a port in use fails the start now, not after the peers answer.
            self.publisher = KVEventPublisher(self.kv_events)
            self.publisher.bind()
        # Channels belong to the running event loop: made here, not in __init__.
        self.worker = worker = RemoteWorker(self.worker_addr, self.rpc_timeout_s)
        self.kvmem = kvmem = RemoteKVMem(self.kvmem_addr, self.rpc_timeout_s)
        await wait_serving(worker.channel, f"worker at {worker.addr}", connect_timeout_s)
        await wait_serving(kvmem.channel, f"kvmem at {kvmem.addr}", connect_timeout_s)
        info = await worker.model_info()
        handle = await worker.kv_pool()
        attached = await kvmem.attach(handle)
        # EOS ids come from the tokenizer, read from the same files the worker loaded.
        source = resolve_model(info.source_path)
        tokenizer = await asyncio.to_thread(Tokenizer.from_source, source)
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)

        cfg = dataclasses.replace(self.config, block_size=int(handle.shape[3]))
        scheduler = build_scheduler(cfg, int(handle.shape[0]), attached.host_blocks,
                                    info.max_model_len,
                                    model_id=model_identity(info.source_path, info.dtype))
        sched_cfg = scheduler.config
        self.info = scheduler_pb2.ModelInfo()
        self.info.CopyFrom(info)
        self.info.max_model_len = sched_cfg.max_model_len
        self.info.block_size = sched_cfg.block_size
        if self.publisher is not None and self.kv_events is not None:
            # The prefix index is the publisher's source: names given and taken in both
            # tiers, from the first (scheduler_svc/kv_events.py).
            self.publisher.block_size = sched_cfg.block_size
            scheduler.bm.set_event_sink(self.publisher, self.kv_events_host_tier)
            self.publisher.start()
            self.info.kv_events_endpoint = self.kv_events.endpoint.text
            if self.kv_events.replay_endpoint is not None:
                self.info.kv_events_replay_endpoint = self.kv_events.replay_endpoint.text
            self.info.kv_events_topic = self.kv_events.topic
        # A peer that dies later gets as long to come back as it got to start.
        trace = Trace(cfg.trace, "superinfer scheduler") if cfg.trace else None
        self.loop = ServingLoop(scheduler, worker, kvmem, handle.pool_id,
                                attached.host_pool_id, peer_timeout_s=connect_timeout_s,
                                trace=trace, auto_xfer_budget=cfg.xfer_budget_blocks is None)
        kv_stats = await kvmem.stats()
        self._task = asyncio.create_task(self.loop.run(), name="iteration-loop")
        log.info("connected", model=info.name, device_blocks=sched_cfg.num_device_blocks,
                 host_blocks=sched_cfg.num_host_blocks, block_size=sched_cfg.block_size,
                 max_model_len=sched_cfg.max_model_len, policy=cfg.policy,
                 pool_id=handle.pool_id, eos_token_ids=list(self.eos_token_ids),
                 transfer_mode=kv_stats.mode, trace=cfg.trace)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.loop is not None and self.loop.trace is not None:
            self.loop.trace.close()
        if self.publisher is not None:
            await self.publisher.close()
        for client in (self.worker, self.kvmem):
            if client is not None:
                await client.close()

    async def _serving(self, context: grpc.aio.ServicerContext) -> ServingLoop:
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is still starting")
            raise RuntimeError("not reached: abort raises")
        return self.loop

    # -- gRPC ------------------------------------------------------------------------------
    async def Generate(
        self, request: scheduler_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        loop = await self._serving(context)
        queue = EventQueue()
        rid = await self._start(loop, request, queue, context)
        n_prompt = len(request.prompt_token_ids)
        open_choices = request.n or 1
        try:
            while True:
                ev = await queue.get()
                if ev.error is not None:  # recovery was impossible, or shutdown: say why
                    await context.abort(grpc.StatusCode.UNAVAILABLE, ev.error)
                yield scheduler_pb2.TokenEvent(**token_event_fields(rid, n_prompt, ev))
                if ev.finish_reason:
                    open_choices -= 1
                    if not open_choices:
                        return
        finally:
            # Normal end: a no-op. Client cancelled (CancelledError lands here): abort now,
            # so the request's blocks return to the pool this very moment.
            loop.drop(rid)

    async def Subscribe(
        self, request: scheduler_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenBatch]:
        loop = await self._serving(context)
        sid = request.subscriber_id
        if not sid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "subscriber_id is empty")
        if sid in self.subscriptions:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"subscription {sid!r} is already live")
        sub = self.subscriptions[sid] = Subscription(sid)
        log.info("subscribed", subscriber_id=sid)
        try:
            yield scheduler_pb2.TokenBatch()  # live: Submit may name it from now on
            while (batch := await sub.queue.get()) is not None:
                yield batch
        finally:
            # The gateway went away (or we are shutting down): nobody will read these
            # streams any more, so their blocks return to the pool now.
            del self.subscriptions[sid]
            live = list(sub.live)
            for stream_id in live:
                loop.drop(stream_id)
            log.info("unsubscribed", subscriber_id=sid, dropped=len(live))

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitReply:
        loop = await self._serving(context)
        sub = self.subscriptions.get(request.subscriber_id)
        if sub is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no live subscription {request.subscriber_id!r}: Subscribe first")
            raise RuntimeError("not reached: abort raises")
        m = request.request
        rid = await self._start(loop, m, sub, context)
        sub.add(rid, request.stream, len(m.prompt_token_ids), m.n or 1)
        return scheduler_pb2.SubmitReply(request_id=rid)

    def close_subscriptions(self) -> None:
        """Shutting down: end every subscription once its last events are sent."""
        for sub in self.subscriptions.values():
            sub.close()

    async def _start(self, loop: ServingLoop, request: scheduler_pb2.GenerateRequest,
                     sink: StreamSink, context: grpc.aio.ServicerContext) -> str:
        """Admit and submit a request, its events to `sink`; its id. Aborts the call with
        the status a refusal deserves."""
        if loop.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
        rid = request.request_id or f"req-{uuid.uuid4().hex}"
        if loop.knows(rid):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is in use")
        await self._admit(loop, rid, context)
        n = request.n or 1
        try:
            if not 1 <= n <= MAX_CHOICES:
                raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {n}")
            now = loop.scheduler.clock()
            if n == 1:
                loop.submit(self._request(rid, request, now), sink)
            else:
                choices = [self._request(child_id(rid, i), request, now, i) for i in range(n)]
                loop.submit(choices[0], sink, choices[1:], group_id=rid)
        except (InvalidSamplingParams, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return rid

    async def _admit(self, loop: ServingLoop, rid: str, context: grpc.aio.ServicerContext) -> None:
        """Refuse a request past --max-queued-requests, with a retry hint (RESOURCE_EXHAUSTED).

        Live requests (waiting + running + rotary) are counted, not just waiting ones: each
        holds its stream, its token lists and a seat in every iteration's policy sort, and
        running/rotary ones are only bounded by the pools, so this is the one number that
        bounds the scheduler's memory and per-iteration cost, and a client sees the same
        limit however fast the engine happens to admit.
        """
        limit = self.config.max_queued_requests
        live = len(loop.scheduler.requests)
        if limit and live >= limit:
            log.warning("overloaded", request_id=rid, live=live, limit=limit)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the scheduler is full: {live} live requests, the limit is {limit} "
                f"(--max-queued-requests); retry in {RETRY_AFTER_S} s",
                trailing_metadata=((RETRY_PUSHBACK_KEY, str(RETRY_AFTER_S * 1000)),),
            )

    def _request(self, rid: str, m: scheduler_pb2.GenerateRequest, now: float,
                 index: int = 0) -> Request:
        """A scheduler Request from the message (choice `index` of n), or ValueError saying
        what is wrong."""
        ids = list(m.prompt_token_ids)
        if not ids:
            raise ValueError("prompt is empty: give at least one prompt token")
        vocab = self.info.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        s = m.sampling
        bad_bias = next((t for t in s.logit_bias if not 0 <= t < vocab), None)
        if bad_bias is not None:
            raise ValueError(f"logit_bias token id {bad_bias} is outside the vocabulary [0, {vocab})")
        sampling = SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p or 1.0,  # proto3's 0 means "not set"; top_p=0 is meaningless anyway
            top_k=s.top_k,
            seed=child_seed(s.seed if s.HasField("seed") else None, index),
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty or 1.0,  # proto3's 0: not set
            logit_bias=dict(s.logit_bias),
            logprobs=s.logprobs if s.HasField("logprobs") else None,
            # Echo scores the prompt once, in the first choice.
            prompt_logprobs=s.prompt_logprobs and index == 0,
            grammar=grammar_from_proto(s.grammar),
        )
        if sampling.grammar is not None and index == 0:
            check_grammar(sampling.grammar)  # GrammarError is a ValueError: a clear message
        default = default_slo(self.config)
        ttft, tbt = m.slo.ttft_s or default.ttft_s, m.slo.tbt_s or default.tbt_s
        if not (math.isfinite(ttft) and math.isfinite(tbt)):
            raise ValueError(f"SLOs must be finite, got ttft_s={ttft}, tbt_s={tbt}")
        return Request(
            request_id=rid,
            prompt_token_ids=ids,
            sampling=sampling,
            arrival_time=now,
            slo=SLO(ttft, tbt),
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.info.max_model_len,
            priority=m.priority,
            tenant=m.tenant,
            weight=m.weight if m.weight > 0 else 1.0,
            speculative=not m.no_speculation,
        )

    async def Abort(
        self, request: scheduler_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.AbortReply:
        loop = await self._serving(context)
        reason = request.reason or "abort"
        found = loop.finish(request.request_id, reason)
        log.info("abort", request_id=request.request_id, reason=reason, found=found)
        return scheduler_pb2.AbortReply(found=found)

    async def GetStats(
        self, request: scheduler_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.StatsReply:
        loop = await self._serving(context)
        s = loop.scheduler
        counters = s.stats.counters()
        counters.update(loop.stats_dict())
        counters.update(service_counters(s.shares))
        if s.speculator is not None:
            counters.update(s.speculator.stats.counters())
        now = s.load()
        return scheduler_pb2.StatsReply(
            waiting=len(s.waiting),
            running=len(s.running),
            rotary=len(s.rotary),
            device_blocks_total=s.config.num_device_blocks,
            device_blocks_free=int(now["device_blocks_free"]),
            host_blocks_total=s.config.num_host_blocks,
            host_blocks_free=int(now["host_blocks_free"]),
            counters=counters,
        )

    async def GetModelInfo(
        self, request: scheduler_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ModelInfo:
        await self._serving(context)
        return self.info


class SchedulerDaemon(Daemon):
    name = "scheduler"

    def __init__(self, args: argparse.Namespace) -> None:
        self.connect_timeout_s = args.connect_timeout
        self.shutdown_grace_s = args.shutdown_grace
        self.service = SchedulerService(
            EngineConfig.from_args(args), args.worker_addr, args.kvmem_addr, args.batch_timeout,
            parse_kv_events_config(args.kv_events_config), args.kv_events_tiers == "both",
        )

    def register(self, server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.service, server)

    async def start(self) -> None:
        await self.service.start(self.connect_timeout_s)

    async def drain(self) -> None:
        if self.service.loop is not None:
            await self.service.loop.drain(self.shutdown_grace_s)
        self.service.close_subscriptions()

    async def stop(self) -> None:
        await self.service.stop()


def main(args: argparse.Namespace) -> int:
    try:
        daemon = SchedulerDaemon(args)
    except KVEventsConfigError as e:
        print(f"superinfer scheduler: error: {e}", file=sys.stderr)
        return 2
    return run_daemon(daemon, args)
