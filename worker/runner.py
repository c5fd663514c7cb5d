"""Model runner: owns the model and the device KV pool, executes scheduled batches.

Stateless about requests: every chunk carries its tokens, positions and block table, so a
restarted worker can pick up any request the scheduler still knows (DESIGN §6).
"""

from __future__ import annotations

import time

import torch

from common.contracts import ExecuteResult, KVShape, ScheduledChunk
from worker.loader import ModelConfig
from worker.model import AttentionGroup, BatchMeta, LlamaModel
from worker.sampler import sample_tokens


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return KVShape(1, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim).block_bytes(itemsize)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_pool: torch.Tensor, block_size: int) -> None:
        if kv_pool.shape[3] != block_size:
            raise ValueError("KV pool block size does not match")
        self.model = model
        self.kv = kv_pool
        self.block_size = block_size

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    def build_meta(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, BatchMeta]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        blk: list[int] = []
        off: list[int] = []
        logits_rows: list[int] = []
        groups: list[AttentionGroup] = []
        decodes: list[tuple[int, ScheduledChunk]] = []
        prefills: list[tuple[int, ScheduledChunk]] = []
        for c in chunks:
            start = len(ids)
            n = len(c.token_ids)
            ids.extend(c.token_ids)
            for p in range(c.start_pos, c.start_pos + n):
                pos.append(p)
                blk.append(c.block_table[p // bs])
                off.append(p % bs)
            if c.sample:
                logits_rows.append(start + n - 1)
            (decodes if n == 1 else prefills).append((start, c))
        # Decode tokens attend as one padded group; keep them contiguous in the flat batch
        # by ordering the group's rows through an index (attention writes back by slice).
        order: list[int] = []
        if decodes:
            max_blocks = max(len(c.block_table) for _, c in decodes)
            tables = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
            lens = torch.empty(len(decodes), dtype=torch.long)
            for i, (_, c) in enumerate(decodes):
                tables[i, : len(c.block_table)] = torch.tensor(c.block_table)
                lens[i] = c.start_pos + 1
            mask = torch.arange(max_blocks * bs)[None, :] < lens[:, None]
            groups.append(AttentionGroup(0, len(decodes), tables, 0, True,
                                         mask[:, None, None, :]))
            order.extend(s for s, _ in decodes)
        fresh = [(s, c) for s, c in prefills if c.start_pos == 0]
        if len(fresh) > 1:
            prefills = [(s, c) for s, c in prefills if c.start_pos != 0]
            groups.append(self._fresh_group(fresh, len(order)))
            for s, c in fresh:
                order.extend(range(s, s + len(c.token_ids)))
        for s, c in prefills:
            n = len(c.token_ids)
            q0 = len(order)
            nb = len(c.block_table)
            pmask: torch.Tensor | None = None
            if c.start_pos > 0:
                qpos = torch.arange(c.start_pos, c.start_pos + n)[:, None]
                pmask = (torch.arange(nb * bs)[None, :] <= qpos)[None, None]
            groups.append(AttentionGroup(q0, q0 + n, torch.tensor([c.block_table]),
                                         c.start_pos, False, pmask))
            order.extend(range(s, s + n))
        perm = torch.tensor(order, dtype=torch.long)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(len(order))
        meta = BatchMeta(
            positions=torch.tensor(pos)[perm],
            slot_blocks=torch.tensor(blk)[perm],
            slot_offsets=torch.tensor(off)[perm],
            groups=groups,
            logits_index=inv[torch.tensor(logits_rows, dtype=torch.long)],
        )
        return torch.tensor(ids)[perm], meta

    @staticmethod
    def _fresh_group(fresh: list[tuple[int, ScheduledChunk]], q0: int) -> AttentionGroup:
        """Prompts with no cached prefix, attended together as one padded, causal batch."""
        lens = [len(c.token_ids) for _, c in fresh]
        B, L = len(fresh), max(lens)
        pad_index = torch.cat([torch.arange(n) + b * L for b, n in enumerate(lens)])
        lens_t = torch.tensor(lens)
        ar = torch.arange(L)
        # Row i attends to keys j <= i of its own prompt; padded rows still see key 0 (no
        # all-masked row, which would give NaN) and are dropped afterwards.
        mask = (ar[None, :] <= ar[:, None])[None] & (ar[None, None, :] < lens_t[:, None, None])
        return AttentionGroup(q0, q0 + sum(lens), torch.empty(0), 0, False,
                              mask[:, None], pad_index, (B, L))

    def execute(self, chunks: list[ScheduledChunk]) -> ExecuteResult:
        t0 = time.perf_counter()
        if not chunks:
            return ExecuteResult(sampled={}, execute_s=0.0)
        input_ids, meta = self.build_meta(chunks)
        logits = self.model.forward(input_ids, meta, self.kv)
        samplers = [c for c in chunks if c.sample]
        tokens = sample_tokens(logits, samplers)
        sampled = {c.request_id: t for c, t in zip(samplers, tokens, strict=True)}
        return ExecuteResult(sampled=sampled, execute_s=time.perf_counter() - t0)
