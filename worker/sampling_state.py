"""Per-request sampling state the worker keeps between batches: a cache, never the truth.

Penalties need a request's output tokens so far, a grammar needs a matcher that has
consumed them. The pipelined step plans batch t+1 before the scheduler knows the token t
sampled (the chunk's last token is a placeholder the worker fills, worker/batches.py), so
the scheduler cannot compute this state for t+1; the worker can, from what it sees:

* a request's first sampling chunk (and any chunk after the worker may have lost it: a
  restart, a batch that never landed) carries a `SamplingState` (bias, grammar, prompt,
  the output tokens the scheduler knows), from which the state is rebuilt;
* every sampling chunk carries `output_index` m (tokens sampled before this one) and ends
  with the request's latest token, output token m - 1 when m > 0. The state keeps the
  first m - 1 output tokens it had and puts that token after them: a batch the scheduler
  rolled back (its samples never published) is undone here by the same rule, and a
  grammar matcher rolls back and consumes to match.

So a restarted worker needs nothing but what the scheduler sends (DESIGN §6). The
scheduler names finished requests on the next batch (`ExecuteRequest.released`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from common.contracts import SamplingState, ScheduledChunk
from worker.grammar import GrammarBank
from worker.logits_processing import LogitsParams, pad_rows


class MissingState(RuntimeError):
    """A stateful chunk for a request whose state this worker does not have (and the chunk
    brings none): the scheduler's bookkeeping and the worker's disagree."""


@dataclass(slots=True)
class _State:
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    prompt_ids: list[int]
    output: list[int] = field(default_factory=list)
    matcher: object | None = None  # llguidance.LLMatcher; consumed exactly `output`

    def sync(self, m: int, last: int, rid: str) -> None:
        """Make `output` the request's first m output tokens, the last of them `last`."""
        keep = m - 1 if m else 0
        if len(self.output) < keep:
            raise MissingState(f"{rid}: the worker knows {len(self.output)} output tokens, the "
                               f"chunk needs {keep}")
        tail = [last] if m else []
        if self.output[keep:] == tail:
            return
        if self.matcher is not None:
            drop = len(self.output) - keep
            if drop:
                self.matcher.rollback(drop)  # type: ignore[attr-defined]
            self.matcher.consume_tokens(tail)  # type: ignore[attr-defined]
        self.output[keep:] = tail


class SamplingStates:
    def __init__(self, vocab_size: int,
                 grammars: Callable[[], GrammarBank] | None = None) -> None:
        self.vocab_size = vocab_size
        self._grammar_factory = grammars
        self._bank: GrammarBank | None = None
        self._states: dict[str, _State] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._states.pop(rid, None)

    def _grammars(self) -> GrammarBank:
        if self._bank is None:
            if self._grammar_factory is None:
                raise MissingState("this worker has no tokenizer for grammars")
            self._bank = self._grammar_factory()
        return self._bank

    def _build(self, s: SamplingState) -> _State:
        ids = list(s.logit_bias)
        st = _State(torch.tensor(ids, dtype=torch.long),
                    torch.tensor([s.logit_bias[i] for i in ids], dtype=torch.float32),
                    list(s.prompt_token_ids), list(s.output_token_ids))
        if s.grammar is not None:
            st.matcher = m = self._grammars().matcher(s.grammar)
            if st.output:
                m.consume_tokens(st.output)
        return st

    def params(self, rows: Sequence[ScheduledChunk]) -> LogitsParams:
        """Bring the states of the sampling `rows` (in batch order) up to date and gather
        their parameters for `logits_processing.process`."""
        p = LogitsParams()
        pen_rows: list[int] = []
        outs: list[list[int]] = []
        prompts: list[list[int]] = []
        pres: list[float] = []
        freq: list[float] = []
        rep: list[float] = []
        bias_rows: list[torch.Tensor] = []
        bias_ids: list[torch.Tensor] = []
        bias_vals: list[torch.Tensor] = []
        mask_rows: list[int] = []
        matchers: list[object] = []
        for i, c in enumerate(rows):
            if not c.stateful:
                continue
            rid = c.request_id
            if c.state is not None:
                self._states[rid] = self._build(c.state)
            st = self._states.get(rid)
            if st is None:
                raise MissingState(f"{rid}: no sampling state on this worker and none sent")
            st.sync(c.output_index, c.token_ids[-1], rid)
            if c.presence_penalty or c.frequency_penalty or c.repetition_penalty != 1.0:
                pen_rows.append(i)
                outs.append(st.output)
                prompts.append(st.prompt_ids + st.output if c.repetition_penalty != 1.0 else [])
                pres.append(c.presence_penalty)
                freq.append(c.frequency_penalty)
                rep.append(c.repetition_penalty)
            if len(st.bias_ids):
                bias_rows.append(torch.full_like(st.bias_ids, i))
                bias_ids.append(st.bias_ids)
                bias_vals.append(st.bias_values)
            if st.matcher is not None:
                mask_rows.append(i)
                matchers.append(st.matcher)
        if pen_rows:
            p.penalty_rows = torch.tensor(pen_rows, dtype=torch.long)
            p.output_ids = pad_rows(outs)
            p.prompt_ids = pad_rows(prompts)
            p.presence = torch.tensor(pres, dtype=torch.float32)
            p.frequency = torch.tensor(freq, dtype=torch.float32)
            p.repetition = torch.tensor(rep, dtype=torch.float32)
        if bias_rows:
            p.bias_rows = torch.cat(bias_rows)
            p.bias_ids = torch.cat(bias_ids)
            p.bias_values = torch.cat(bias_vals)
        if matchers:
            p.mask_rows = torch.tensor(mask_rows, dtype=torch.long)
            p.bitmask = self._grammars().bitmask(matchers)  # type: ignore[arg-type]
        return p
