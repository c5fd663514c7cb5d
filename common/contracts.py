"""The contracts that cross process boundaries, as plain Python types (no torch).

The scheduler plans with them, kvmem and the worker carry them out, and `common/wire.py`
turns them into proto messages and back:

* `TransferPlan` — block copies between the device and host pools under one fence
  (scheduler → kvmem).
* `ScheduledChunk` — one request's tokens to compute this iteration (scheduler → worker).
* `ExecuteResult` — the tokens a batch sampled (worker → scheduler), and
  `TransferResult` — what a transfer batch cost (kvmem → scheduler).
* `KVShape` — the block-first pool's shape, which the worker's pool handle carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TransferPlan:
    """Block copies one iteration asks for, under one fence."""

    fence: int
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) D2H
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device) H2D
    eager: list[tuple[int, int]] = field(default_factory=list)  # (device, host) D2H, background
    # (host, device) H2D into blocks a batch still in flight may touch: the pipelined step
    # copies them once that batch is done (in a serial step there are none).
    late_swap_in: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.eager or self.late_swap_in)

    @property
    def num_blocks(self) -> int:
        return (len(self.swap_out) + len(self.swap_in) + len(self.eager)
                + len(self.late_swap_in))

    def beside_batch(self) -> TransferPlan:
        """The copies that may run while the batch in flight executes: swap-ins into free
        blocks, eager copies of settled blocks."""
        return TransferPlan(self.fence, swap_in=self.swap_in, eager=self.eager)

    def after_batch(self) -> TransferPlan:
        """The copies that must wait for the batch in flight: rotate-outs (it writes their
        last block) and swap-ins into blocks it may still read."""
        return TransferPlan(self.fence, swap_out=self.swap_out, swap_in=self.late_swap_in)


# A token id the scheduler does not know yet: the one the previous batch sampled for this
# request, still in flight when this batch was planned. Only ever a chunk's last token;
# the worker puts its own sample in its place (worker/batches.py).
PLACEHOLDER = -1


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens of one request to run this iteration (a prefill chunk or one decode token)."""

    request_id: str
    token_ids: list[int]  # tokens whose KV this step computes
    start_pos: int  # position of token_ids[0] (= the request's num_computed_tokens)
    # Device blocks covering positions [0, start_pos + len). The block manager's own list,
    # not a copy (copying every table every iteration was a quarter of the simulator's
    # time); it never changes in place (the block manager replaces a table when a request
    # gains or loses blocks), so the batch may hold it while the next one is planned.
    block_table: list[int]
    sample: bool  # the chunk reaches the request's last token: sample the next one
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    output_index: int = 0  # tokens generated so far; with `seed`, makes sampling repeatable


@dataclass(slots=True)
class ExecuteResult:
    sampled: dict[str, int]  # request_id -> sampled token id (only chunks with sample=True)
    execute_s: float = 0.0


@dataclass(slots=True)
class TransferResult:
    """What a transfer batch cost: busy time per direction, wall time, bytes moved."""

    d2h_s: float = 0.0
    h2d_s: float = 0.0
    total_s: float = 0.0
    bytes_d2h: int = 0
    bytes_h2d: int = 0


@dataclass(slots=True, frozen=True)
class KVShape:
    """[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim] (DESIGN §2)."""

    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads,
                self.head_dim)

    def block_bytes(self, itemsize: int) -> int:
        """Bytes of one block (all layers, K and V) at `itemsize` bytes per element."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize
