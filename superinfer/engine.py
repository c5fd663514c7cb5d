"""In-process engine: scheduler + model runner + local copy engine in one process.

This is the composition `superinfer generate` and the benchmarks use; the services wire
the same scheduler to the worker and kvmem over gRPC instead. Both run the one engine
step (`scheduler_svc/engine_core.py`), here with local objects behind its interfaces.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from common.config import EngineConfig
from common.contracts import (
    ExecuteResult,
    KVShape,
    ScheduledChunk,
    TokenLogprob,
    TransferPlan,
    TransferResult,
)
from common.errors import ContextLengthError, InvalidRequestError
from common.lane import ThreadLane
from common.modelfile import ModelSource
from common.output import OutputTracker
from common.tokenizer import Tokenizer
from kvmem_svc.copy import LocalCopyEngine
from scheduler_svc.engine_core import EngineCore
from scheduler_svc.fork import child_id, child_seed
from scheduler_svc.interfaces import SchedulerInterface
from scheduler_svc.request import SLO, FinishReason, Request, SamplingParams
from scheduler_svc.scheduler import RequestEvent
from scheduler_svc.setup import build_scheduler, default_slo, model_identity
from scheduler_svc.trace import Trace
from worker.batches import BatchRunner
from worker.build import BuiltModel, build_model
from worker.grammar import GrammarBank
from worker.runner import ModelRunner, kv_block_bytes
from worker.sampling_state import SamplingStates


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: dict[str, object] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when asked for
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # echo: tokens 1..


class LLMEngine:
    source: ModelSource
    tokenizer: Tokenizer
    runner: ModelRunner
    built: BuiltModel

    def __init__(self, config: EngineConfig, reuse: LLMEngine | None = None) -> None:
        """Build the engine; `reuse` shares another engine's loaded model, format and
        tokenizer (its dtype wins), so tests and benchmarks can vary pools and policies."""
        self.config = config
        if config.tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size runs in the worker service only "
                             "(`superinfer serve` or `superinfer worker`), not in-process")
        if reuse is not None:
            self.built, self.tokenizer = reuse.built, reuse.tokenizer
        else:
            self.built = build_model(config.model, config.dtype, config.kv_dtype)
            self.tokenizer = Tokenizer.from_source(self.built.source)
        self.source = self.built.source
        model, dtype = self.built.model, self.built.kv_dtype
        mcfg = model.cfg
        dev, host = config.blocks_for(kv_block_bytes(mcfg, config.block_size, dtype))
        shape = KVShape(dev, mcfg.num_layers, config.block_size, mcfg.num_kv_heads, mcfg.head_dim)
        kv = torch.zeros(shape.shape, dtype=dtype)
        tokenizer = self.tokenizer
        sampling = SamplingStates(mcfg.vocab_size,
                                  lambda: GrammarBank(tokenizer, mcfg.vocab_size))
        self.runner = ModelRunner(model, kv, config.block_size, self.built.weights, sampling)
        self.host_pool = torch.zeros((host, *self.runner.kv.shape[1:]), dtype=dtype)
        self.copier = LocalCopyEngine(self.runner.kv, self.host_pool)
        self.max_model_len = min(config.max_model_len or mcfg.max_position, mcfg.max_position)
        self.scheduler: SchedulerInterface = build_scheduler(
            config, dev, host, mcfg.max_position,
            model_id=model_identity(str(self.source.path), self.built.weights))
        self.trackers: dict[str, OutputTracker] = {}
        self.logprobs: dict[str, list[TokenLogprob]] = {}
        self.prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        self._ids = itertools.count()
        self.trace = Trace(config.trace, "superinfer generate") if config.trace else None
        self._traced_finished = 0  # finished_log entries already in the trace
        self.batches = BatchRunner(self.runner.execute, self.runner.release)
        self.copy_lane = ThreadLane("kv-copy")
        self.core = EngineCore(self.scheduler, _LocalExecutor(self.batches),
                               _LocalTransfers(self.copier, self.copy_lane), self.trace,
                               pipeline=config.pipeline,
                               auto_xfer_budget=config.xfer_budget_blocks is None)
        self._loop = asyncio.new_event_loop()

    @property
    def model_name(self) -> str:
        return self.source.name

    # -- requests ------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        if chat:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        slo: SLO | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ContextLengthError(
                f"prompt has {len(prompt_token_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens"
            )
        return self.add_choices(prompt_token_ids, sampling, 1, slo, request_id, arrival_time)[0]

    def add_choices(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        n: int,
        slo: SLO | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> list[str]:
        """n choices of one prompt (n > 1: they share its KV blocks, scheduler_svc/fork.py),
        each with its own seed stream; returns their request ids."""
        rid = request_id or f"req-{next(self._ids)}"
        ids = [rid] if n == 1 else [child_id(rid, i) for i in range(n)]
        reqs = [Request(
            request_id=cid,
            prompt_token_ids=list(prompt_token_ids),
            sampling=dataclasses.replace(sampling, seed=child_seed(sampling.seed, i),
                                         prompt_logprobs=sampling.prompt_logprobs and i == 0),
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            slo=slo or default_slo(self.config),
            eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            max_model_len=self.max_model_len,
        ) for i, cid in enumerate(ids)]
        try:
            self.scheduler.add_group(reqs[0], reqs[1:])
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        for cid in ids:
            self.trackers[cid] = OutputTracker(self.tokenizer, sampling.stop)
        return ids

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.trackers.pop(request_id, None)

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestEvent]:
        sched, trace = self.scheduler, self.trace
        events = self._loop.run_until_complete(self.core.step()).events
        if trace is not None:
            now = sched.clock()
            for req in sched.finished_log[self._traced_finished:]:
                trace.request_done(req, now)
            self._traced_finished = len(sched.finished_log)
        for ev in events:
            tracker = self.trackers.get(ev.request_id)
            if tracker is None:
                continue
            tracker.feed(ev.new_token_ids)
            if ev.logprobs:
                self.logprobs.setdefault(ev.request_id, []).extend(
                    ev.logprobs[: tracker.last_used])
            if ev.prompt_logprobs:
                self.prompt_logprobs.setdefault(ev.request_id, []).extend(ev.prompt_logprobs)
            if ev.finish_reason is None and tracker.stopped:
                # A stop string matched in the text: finish here, like an EOS.
                sched.stop(ev.request_id)
                ev.finish_reason = FinishReason.STOP
            if ev.finish_reason is not None:
                tracker.finish()
        return events

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
        texts: list[str] | None = None,
    ) -> list[GenerationResult]:
        """Submit every prompt at once (so they batch together) and run to completion."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = [self.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
        return self.run_to_completion(ids, texts)

    def run_to_completion(self, ids: list[str], texts: list[str] | None = None,
                          after_step: Callable[[], None] | None = None,
                          ) -> list[GenerationResult]:
        """Step until the requests `ids` finish; their results in that order. `after_step`
        is called after every step (to watch the pools, say)."""
        done: dict[str, FinishReason] = {}
        while len(done) < len(ids):
            for ev in self.step():
                if ev.finish_reason is not None:
                    done[ev.request_id] = ev.finish_reason
            if after_step is not None:
                after_step()
        if not self.scheduler.has_unfinished():
            # A pipelined step may still run a batch for requests that just finished.
            self._loop.run_until_complete(self.core.drain())
        finished = {r.request_id: r for r in self.scheduler.collect_finished()}
        self._traced_finished = 0
        results = []
        for i, rid in enumerate(ids):
            req = finished[rid]
            tracker = self.trackers.pop(rid)
            results.append(GenerationResult(
                request_id=rid,
                prompt=texts[i] if texts else "",
                prompt_token_ids=req.prompt_token_ids,
                text=tracker.text,
                # Up to a stop string's token (a speculative step may land more).
                token_ids=req.output_token_ids[: tracker.num_tokens],
                finish_reason=done[rid].value,
                metrics=req.summary(time.monotonic()),
                logprobs=self.logprobs.pop(rid, []),
                prompt_logprobs=self.prompt_logprobs.pop(rid, []),
            ))
        return results

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if not self._loop.is_closed():
            self._loop.run_until_complete(self.core.drain())
            self._loop.close()
        self.batches.close()
        self.copy_lane.close()
        self.copier.close()

    def stats(self) -> dict[str, object]:
        s: dict[str, object] = dict(self.scheduler.stats.as_dict())
        core = self.core.stats
        s["transfer_s"] = core.transfer_s
        s["execute_s"] = core.execute_s
        s["device_blocks"] = self.scheduler.config.num_device_blocks
        s["host_blocks"] = self.scheduler.config.num_host_blocks
        load = self.scheduler.load()
        s["device_blocks_free"] = int(load["device_blocks_free"])
        s["host_blocks_free"] = int(load["host_blocks_free"])
        st = self.scheduler.stats
        # Prompt tokens served from the prefix cache, both tiers.
        s["prefix_cache_hit_tokens"] = st.prefix_cache_hits + st.prefix_cache_host_hits
        return s


class _LocalExecutor:
    """The model runner in this process as the core's Executor, on its own thread."""

    def __init__(self, batches: BatchRunner) -> None:
        self.batches = batches

    async def execute(
        self, iteration: int, chunks: list[ScheduledChunk], after: int = 0,
        released: Sequence[str] = (),
    ) -> ExecuteResult:
        return await self.batches.run(iteration, after, chunks, released)


class _LocalTransfers:
    """DuplexKV between this process's two pools as the core's TransferEngine."""

    def __init__(self, copier: LocalCopyEngine, lane: ThreadLane) -> None:
        self.copier = copier
        self.lane = lane

    async def transfer(self, plan: TransferPlan) -> TransferResult:
        t = await self.lane.run(self.copier.transfer, plan)
        return TransferResult(t.d2h_s, t.h2d_s, t.total_s, t.bytes_d2h, t.bytes_h2d)
