"""The scheduler core's boundary types as proto messages, and back.

Block lists travel packed (repeated int32), one message per batch, never one per block:
a gRPC round trip costs ~0.5 ms here (DESIGN §5), so the message count is what matters.
"""

from __future__ import annotations

from collections.abc import Iterable

from common.contracts import (
    ExecuteResult,
    Grammar,
    SamplingState,
    ScheduledChunk,
    TokenLogprob,
    TransferPlan,
)
from proto import common_pb2, kvmem_pb2, worker_pb2


def chunk_to_proto(c: ScheduledChunk) -> worker_pb2.Chunk:
    msg = worker_pb2.Chunk(
        request_id=c.request_id,
        token_ids=c.token_ids,
        start_pos=c.start_pos,
        block_table=c.block_table,
        sample=c.sample,
        temperature=c.temperature,
        top_p=c.top_p,
        top_k=c.top_k,
        output_index=c.output_index,
        presence_penalty=c.presence_penalty,
        frequency_penalty=c.frequency_penalty,
        repetition_penalty=c.repetition_penalty,
        prompt_logprob_targets=c.prompt_logprob_targets,
        stateful=c.stateful,
        num_draft=c.num_draft,
    )
    if c.seed is not None:
        msg.seed = c.seed
    if c.logprobs >= 0:
        msg.logprobs = c.logprobs
    if c.state is not None:
        msg.state.CopyFrom(state_to_proto(c.state))
    return msg


def chunk_from_proto(m: worker_pb2.Chunk) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=m.request_id,
        token_ids=list(m.token_ids),
        start_pos=m.start_pos,
        block_table=list(m.block_table),
        sample=m.sample,
        temperature=m.temperature,
        top_p=m.top_p,
        top_k=m.top_k,
        seed=m.seed if m.HasField("seed") else None,
        output_index=m.output_index,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty,
        logprobs=m.logprobs if m.HasField("logprobs") else -1,
        # () when empty, the contract's default (no list per chunk)
        prompt_logprob_targets=list(m.prompt_logprob_targets) if m.prompt_logprob_targets else (),
        stateful=m.stateful,
        state=state_from_proto(m.state) if m.HasField("state") else None,
        num_draft=m.num_draft,
    )


def grammar_to_proto(g: Grammar | None) -> common_pb2.Grammar:
    return common_pb2.Grammar() if g is None else common_pb2.Grammar(kind=g.kind, spec=g.spec)


def grammar_from_proto(m: common_pb2.Grammar) -> Grammar | None:
    return Grammar(m.kind, m.spec) if m.kind else None


def state_to_proto(s: SamplingState) -> common_pb2.SamplingState:
    return common_pb2.SamplingState(
        logit_bias=s.logit_bias, grammar=grammar_to_proto(s.grammar),
        prompt_token_ids=s.prompt_token_ids, output_token_ids=s.output_token_ids,
    )


def state_from_proto(m: common_pb2.SamplingState) -> SamplingState:
    return SamplingState(
        logit_bias=dict(m.logit_bias), grammar=grammar_from_proto(m.grammar),
        prompt_token_ids=list(m.prompt_token_ids), output_token_ids=list(m.output_token_ids),
    )


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                   top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)


def logprob_from_proto(m: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(m.token_id, m.logprob, list(m.top_ids), list(m.top_logprobs))


def logprobs_to_proto(lps: Iterable[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [logprob_to_proto(lp) for lp in lps]


def result_to_proto(r: ExecuteResult) -> worker_pb2.ExecuteReply:
    reply = worker_pb2.ExecuteReply(
        request_ids=list(r.sampled), token_ids=list(r.sampled.values()), execute_s=r.execute_s,
    )
    for rid, lp in r.logprobs.items():
        reply.logprobs[rid].CopyFrom(logprob_to_proto(lp))
    for rid, lps in r.prompt_logprobs.items():
        reply.prompt_logprobs[rid].tokens.extend(logprobs_to_proto(lps))
    for rid, ids in r.accepted.items():
        reply.accepted[rid].ids.extend(ids)
    for rid, lps in r.accepted_logprobs.items():
        reply.accepted_logprobs[rid].tokens.extend(logprobs_to_proto(lps))
    return reply


def result_from_proto(m: worker_pb2.ExecuteReply) -> ExecuteResult:
    return ExecuteResult(
        sampled=dict(zip(m.request_ids, m.token_ids)), execute_s=m.execute_s,
        logprobs={rid: logprob_from_proto(lp) for rid, lp in m.logprobs.items()},
        prompt_logprobs={rid: [logprob_from_proto(t) for t in p.tokens]
                         for rid, p in m.prompt_logprobs.items()},
        accepted={rid: list(t.ids) for rid, t in m.accepted.items()},
        accepted_logprobs={rid: [logprob_from_proto(t) for t in p.tokens]
                           for rid, p in m.accepted_logprobs.items()},
    )


def _pairs(pairs: list[tuple[int, int]]) -> kvmem_pb2.BlockPairs:
    return kvmem_pb2.BlockPairs(src=[s for s, _ in pairs], dst=[d for _, d in pairs])


def plan_to_proto(plan: TransferPlan, pool_id: str) -> kvmem_pb2.TransferRequest:
    """swap_out/eager pairs are (device, host), swap_in pairs (host, device): src first.
    Late swap-ins travel as swap-ins: a plan on the wire runs whole (the pipelined step
    sends its parts as separate plans, `TransferPlan.before_batch` / `beside_batch` /
    `after_batch`)."""
    return kvmem_pb2.TransferRequest(
        fence=plan.fence,
        pool_id=pool_id,
        swap_out=_pairs(plan.swap_out),
        swap_in=_pairs(plan.swap_in + plan.late_swap_in),
        eager=_pairs(plan.eager),
    )
