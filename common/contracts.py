"""The contracts that cross process boundaries, as plain Python types (no torch).

The scheduler plans with them, kvmem and the worker carry them out, and `common/wire.py`
turns them into proto messages and back:

* `TransferPlan` — block copies between the device and host pools under one fence
  (scheduler → kvmem).
* `ScheduledChunk` — one request's tokens to compute this iteration (scheduler → worker),
  with what its sampling needs (`SamplingState`, `Grammar`).
* `ExecuteResult` — the tokens a batch sampled and their `TokenLogprob`s (worker →
  scheduler), and
  `TransferResult` — what a transfer batch cost (kvmem → scheduler).
* `KVShape` — the block-first pool's shape, which the worker's pool handle carries.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    def before_batch(self) -> TransferPlan:
        """The copies the plan's own batch waits for: swap-ins into free blocks (the batch
        in flight does not touch them; the next one reads them)."""
        return TransferPlan(self.fence, swap_in=self.swap_in)

    def beside_batch(self) -> TransferPlan:
        """The copies nothing waits for until the next plan: eager copies of settled
        blocks (no batch writes them again, and their host copies are used only by later
        plans)."""
        return TransferPlan(self.fence, eager=self.eager)

    def after_batch(self) -> TransferPlan:
        """The copies that must wait for the batch in flight: rotate-outs (it writes their
        last block) and swap-ins into blocks it may still read."""
        return TransferPlan(self.fence, swap_out=self.swap_out, swap_in=self.late_swap_in)


# A token id the scheduler does not know yet: the one the previous batch sampled for this
# request, still in flight when this batch was planned. Only ever a chunk's last token;
# the worker puts its own sample in its place (worker/batches.py).
PLACEHOLDER = -1


@dataclass(slots=True, frozen=True)
class Grammar:
    """A constraint on a request's output, in a form no grammar library owns
    (`common/grammar.py` turns it into the library's)."""

    kind: str  # one of GRAMMAR_KINDS
    spec: str  # a JSON schema, a regex, a JSON list of choices or a Lark grammar ("" for json_object)


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


@dataclass(slots=True)
class SamplingState:
    """What the worker needs to (re)build the sampling state of a request whose tokens
    change its logits (penalties, logit bias, a grammar). The worker keeps that state
    between batches as a cache; the scheduler sends this with the request's first sampling
    chunk and again whenever the worker may have lost it (a new worker, a batch that never
    landed), so a restarted worker needs nothing but what the scheduler sends (DESIGN §6)."""

    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: Grammar | None = None
    prompt_token_ids: list[int] = field(default_factory=list)  # only for repetition_penalty
    output_token_ids: list[int] = field(default_factory=list)  # those the scheduler knows


@dataclass(slots=True)
class TokenLogprob:
    """A token's log-probability under the model (before any penalty, bias or grammar
    mask: vLLM's raw logprobs), and the most likely tokens at that position."""

    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


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
    # Penalties as vLLM defines them: presence and frequency over the output tokens,
    # repetition over prompt and output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Logprobs of the sampled token: -1 none; k >= 0: its own and the k most likely.
    logprobs: int = -1
    # Echo: row i of the chunk (position start_pos + i) scores prompt_logprob_targets[i],
    # the prompt token after it (with `logprobs` most likely tokens, at least 0).
    # (A shared empty tuple by default: no list per chunk for the rare echo request.)
    prompt_logprob_targets: Sequence[int] = ()
    # Its logits depend on its own tokens (penalties, logit bias, grammar): the worker keeps
    # per-request state, rebuilt from `state` when given (see SamplingState).
    stateful: bool = False
    state: SamplingState | None = None
    # Speculative decoding: the last `num_draft` token_ids are proposed, not yet known
    # tokens. The worker verifies them greedily (scheduler_svc/speculative.py): the first
    # row after the request's last known token samples as usual (`sampled`), each draft
    # the model agrees with is accepted and the row after it gives one more token
    # (ExecuteResult.accepted).
    num_draft: int = 0


@dataclass(slots=True)
class ExecuteResult:
    sampled: dict[str, int]  # request_id -> sampled token id (only chunks with sample=True)
    execute_s: float = 0.0
    # request_id -> the sampled token's logprobs (chunks with logprobs >= 0)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # request_id -> one entry per prompt_logprob_targets entry of its chunk
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Speculative chunks: request_id -> the tokens after `sampled[request_id]` that
    # verification produced (one per accepted draft; absent: none accepted) ...
    accepted: dict[str, list[int]] = field(default_factory=dict)
    # ... and their logprobs (chunks with logprobs >= 0)
    accepted_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)

    def tokens_of(self, request_id: str) -> list[int]:
        """Every token the request's chunk produced, in order."""
        return [self.sampled[request_id], *self.accepted.get(request_id, ())]


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
