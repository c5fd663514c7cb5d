"""A batch of ScheduledChunks as the CUDA kernels read it, built on the host in numpy.

Tokens are flat, in chunk order ([T]); sequences are the chunks ([S]). Every int array is
int32 and the whole batch is packed into ONE int32 buffer, so moving it to the GPU is one
host->device copy (from pinned memory), and a CUDA graph reads it from fixed addresses.
Padding rows (for a graph's batch-size bucket) write no KV (slot -1) and attend to one
position of block 0; their outputs are never sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.contracts import ScheduledChunk

FIELDS_T = ("input_ids", "positions", "slots")  # one entry per token
FIELDS_S = ("q_start", "q_len", "ctx_start")  # one entry per sequence (chunk)


@dataclass(slots=True)
class HostBatch:
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T] block * block_size + offset; -1: write nothing
    q_start: np.ndarray  # [S] first row of the sequence in the flat batch
    q_len: np.ndarray  # [S]
    ctx_start: np.ndarray  # [S] position of the sequence's first query (cached prefix length)
    block_tables: np.ndarray  # [S, W], 0-padded
    logits_index: np.ndarray  # [N] rows whose next token is sampled, then echo's rows
    max_q_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.q_len.shape[0])

    @property
    def width(self) -> int:
        return int(self.block_tables.shape[1])

    @property
    def is_decode(self) -> bool:
        """One token per sequence: the shape CUDA graphs are captured for."""
        return self.max_q_len == 1

    def pack(self) -> np.ndarray:
        """Every array in one int32 buffer, in the order `DeviceBatch.unpack` reads."""
        return np.concatenate([self.input_ids, self.positions, self.slots, self.q_start,
                               self.q_len, self.ctx_start, self.block_tables.reshape(-1),
                               self.logits_index]).astype(np.int32, copy=False)


def build_batch(chunks: Sequence[ScheduledChunk], block_size: int,
                width: int | None = None) -> HostBatch:
    """The chunks' tokens, positions, KV slots and block tables (width: table columns,
    at least the longest table; None: exactly that)."""
    n = [len(c.token_ids) for c in chunks]
    need = max((len(c.block_table) for c in chunks), default=0)
    w = need if width is None else width
    if w < need:
        raise ValueError(f"a block table has {need} blocks, more than the width {w}")
    T, S = sum(n), len(chunks)
    ids = np.empty(T, np.int32)
    pos = np.empty(T, np.int32)
    slots = np.empty(T, np.int32)
    tables = np.zeros((S, max(w, 1)), np.int32)
    q_start = np.zeros(S, np.int32)
    logits: list[int] = []
    t = 0
    for i, c in enumerate(chunks):
        k = n[i]
        table = np.asarray(c.block_table, np.int64)
        p = np.arange(c.start_pos, c.start_pos + k, dtype=np.int64)
        ids[t:t + k] = c.token_ids
        pos[t:t + k] = p
        slots[t:t + k] = table[p // block_size] * block_size + p % block_size
        tables[i, :len(table)] = table
        q_start[i] = t
        t += k
        if c.sample:
            logits.append(t - 1)
    # Echo, as the CPU executor's batch (worker/attention.py): after the sampled rows,
    # every row whose prompt logprob is asked for, in chunk order.
    for i, c in enumerate(chunks):
        logits += range(int(q_start[i]), int(q_start[i]) + len(c.prompt_logprob_targets))
    return HostBatch(ids, pos, slots, q_start, np.asarray(n, np.int32),
                     np.asarray([c.start_pos for c in chunks], np.int32), tables,
                     np.asarray(logits, np.int32), max(n, default=0))


def pad_decode(b: HostBatch, size: int) -> HostBatch:
    """A decode batch padded to `size` sequences; every row's logits are computed (the
    caller samples the first rows). Padding: token 0 at position 0, slot -1, table of 0s."""
    if not b.is_decode or b.num_seqs > size:
        raise ValueError(f"cannot pad a batch of {b.num_seqs} (max_q_len {b.max_q_len}) "
                         f"to a decode batch of {size}")
    extra = size - b.num_seqs

    def pad(a: np.ndarray, value: int) -> np.ndarray:
        return np.concatenate([a, np.full(extra, value, np.int32)])

    return HostBatch(pad(b.input_ids, 0), pad(b.positions, 0), pad(b.slots, -1),
                     np.arange(size, dtype=np.int32), np.ones(size, np.int32),
                     pad(b.ctx_start, 0),
                     np.concatenate([b.block_tables, np.zeros((extra, b.width), np.int32)]),
                     np.arange(size, dtype=np.int32), 1)


@dataclass(slots=True)
class DeviceBatch:
    """Views of one packed int32 buffer on the model's device."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    ctx_start: torch.Tensor
    block_tables: torch.Tensor
    logits_index: torch.Tensor
    max_q_len: int

    @classmethod
    def unpack(cls, buf: torch.Tensor, T: int, S: int, W: int, N: int,
               max_q_len: int) -> DeviceBatch:
        sizes = [T, T, T, S, S, S, S * W, N]
        if buf.numel() != sum(sizes):
            raise ValueError(f"packed batch of {buf.numel()} ints, expected {sum(sizes)}")
        ids, pos, slots, q0, ql, cs, bt, li = torch.split(buf, sizes)
        return cls(ids, pos, slots, q0, ql, cs, bt.view(S, W), li, max_q_len)

    @classmethod
    def from_host(cls, b: HostBatch, device: torch.device) -> DeviceBatch:
        """One host->device copy of the packed batch (pinned on a GPU)."""
        host = torch.from_numpy(b.pack())
        if device.type == "cuda":
            host = host.pin_memory()
        buf = host.to(device, non_blocking=True)
        return cls.unpack(buf, b.num_tokens, b.num_seqs, b.width, len(b.logits_index),
                          b.max_q_len)
