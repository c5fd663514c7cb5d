"""The scheduler core's boundary types as proto messages, and back.

Block lists travel packed (repeated int32), one message per batch, never one per block:
a gRPC round trip costs ~0.5 ms here (DESIGN §5), so the message count is what matters.
"""

from __future__ import annotations

from common.contracts import ExecuteResult, ScheduledChunk, TransferPlan
from proto import kvmem_pb2, worker_pb2


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
    )
    if c.seed is not None:
        msg.seed = c.seed
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
    )


def result_from_proto(m: worker_pb2.ExecuteReply) -> ExecuteResult:
    return ExecuteResult(sampled=dict(zip(m.request_ids, m.token_ids)), execute_s=m.execute_s)


def _pairs(pairs: list[tuple[int, int]]) -> kvmem_pb2.BlockPairs:
    return kvmem_pb2.BlockPairs(src=[s for s, _ in pairs], dst=[d for _, d in pairs])


def plan_to_proto(plan: TransferPlan, pool_id: str) -> kvmem_pb2.TransferRequest:
    """swap_out/eager pairs are (device, host), swap_in pairs (host, device): src first.
    Late swap-ins travel as swap-ins: a plan on the wire runs whole (the pipelined step
    sends its halves as two plans, `TransferPlan.beside_batch` / `after_batch`)."""
    return kvmem_pb2.TransferRequest(
        fence=plan.fence,
        pool_id=pool_id,
        swap_out=_pairs(plan.swap_out),
        swap_in=_pairs(plan.swap_in + plan.late_swap_in),
        eager=_pairs(plan.eager),
    )
