"""Model runner: owns the model and the device KV pool, executes scheduled batches.

Stateless about requests: every chunk carries its tokens, positions and block table, so a
restarted worker can pick up any request the scheduler still knows (DESIGN §6). The one
exception is a cache the scheduler can always rebuild: the sampling state of requests with
penalties, logit bias or a grammar (`worker/sampling_state.py`).

Sampling, in `execute`: the forward pass returns the logits of each sampled row (and, for
echo, of every row whose prompt logprobs were asked for); `logits_processing.process`
applies penalties, bias and grammar masks to the sampled rows; the sampler chooses; the
raw logits give the logprobs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from common.contracts import ExecuteResult, KVShape, ScheduledChunk, TokenLogprob
from worker.loader import ModelConfig
from worker.logits_processing import process, token_logprobs
from worker.model import AttentionGroup, BatchMeta, LlamaModel
from worker.sampler import sample_tokens
from worker.sampling_state import SamplingStates


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return KVShape(1, cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim).block_bytes(itemsize)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_pool: torch.Tensor, block_size: int,
                 sampling: SamplingStates | None = None) -> None:
        if kv_pool.shape[3] != block_size:
            raise ValueError("KV pool block size does not match")
        self.model = model
        self.kv = kv_pool
        self.block_size = block_size
        self.sampling = sampling if sampling is not None else SamplingStates(model.cfg.vocab_size)

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
        starts: dict[str, int] = {}
        for c in chunks:
            start = starts[c.request_id] = len(ids)
            n = len(c.token_ids)
            ids.extend(c.token_ids)
            for p in range(c.start_pos, c.start_pos + n):
                pos.append(p)
                blk.append(c.block_table[p // bs])
                off.append(p % bs)
            if c.sample:
                logits_rows.append(start + n - 1)
            (decodes if n == 1 else prefills).append((start, c))
        # Echo: after the sampled rows, every row whose prompt logprob is asked for, in
        # chunk order.
        for c in chunks:
            if c.prompt_logprob_targets:
                start = starts[c.request_id]
                logits_rows.extend(range(start, start + len(c.prompt_logprob_targets)))
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

    def release(self, request_ids: Iterable[str]) -> None:
        """Finished requests: drop their sampling state."""
        self.sampling.release(request_ids)

    def execute(self, chunks: list[ScheduledChunk]) -> ExecuteResult:
        t0 = time.perf_counter()
        if not chunks:
            return ExecuteResult(sampled={}, execute_s=0.0)
        input_ids, meta = self.build_meta(chunks)
        samplers = [c for c in chunks if c.sample]
        # Before the forward pass: it needs only the tokens, and a state that cannot be
        # brought up to date fails the batch before it writes any KV.
        params = self.sampling.params(samplers)
        logits = self.model.forward(input_ids, meta, self.kv)
        raw = logits[: len(samplers)]
        tokens = sample_tokens(process(raw, params), samplers)
        sampled = {c.request_id: t for c, t in zip(samplers, tokens, strict=True)}
        return ExecuteResult(
            sampled=sampled, execute_s=time.perf_counter() - t0,
            logprobs=_sampled_logprobs(raw, samplers, tokens),
            prompt_logprobs=_prompt_logprobs(logits[len(samplers):], chunks),
        )


def _rows(lp_ids: torch.Tensor, lps: torch.Tensor, top_ids: torch.Tensor, top_lps: torch.Tensor,
          ks: list[int]) -> list[TokenLogprob]:
    ids, own, tids, tlps = lp_ids.tolist(), lps.tolist(), top_ids.tolist(), top_lps.tolist()
    return [TokenLogprob(ids[i], own[i], tids[i][:k], tlps[i][:k]) for i, k in enumerate(ks)]


def _sampled_logprobs(raw: torch.Tensor, samplers: list[ScheduledChunk],
                      tokens: list[int]) -> dict[str, TokenLogprob]:
    want = [i for i, c in enumerate(samplers) if c.logprobs >= 0]
    if not want:
        return {}
    ks = [samplers[i].logprobs for i in want]
    lp = token_logprobs(raw[want], torch.tensor([tokens[i] for i in want]), max(ks))
    rows = _rows(lp.token_ids, lp.logprobs, lp.top_ids, lp.top_logprobs, ks)
    return {samplers[i].request_id: r for i, r in zip(want, rows, strict=True)}


def _prompt_logprobs(extra: torch.Tensor, chunks: list[ScheduledChunk]
                     ) -> dict[str, list[TokenLogprob]]:
    out: dict[str, list[TokenLogprob]] = {}
    row = 0
    for c in chunks:
        n = len(c.prompt_logprob_targets)
        if not n:
            continue
        k = max(c.logprobs, 0)
        lp = token_logprobs(extra[row : row + n], torch.tensor(c.prompt_logprob_targets), k)
        out[c.request_id] = _rows(lp.token_ids, lp.logprobs, lp.top_ids, lp.top_logprobs,
                                  [k] * n)
        row += n
    return out
