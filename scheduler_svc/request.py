"""A request's state as the scheduler sees it: tokens, sampling, SLOs, history.

Pure Python: the service, the simulator and the tests all build these.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from common.contracts import Grammar, SamplingState

MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI's chat API allows
MAX_LOGIT_BIAS = 300  # tokens a logit_bias may name (OpenAI's limit)

# Where a request's time goes, for SLO-miss attribution: queued with no KV on the device
# (waiting: before admission, or to recompute), parked in host memory (rotary), on the
# device with the worker busy on its batches (computing: its own tokens, or a batch made
# long by others'), or on the device with the worker idle for its KV copies (transfer).
PHASES = ("waiting", "rotary", "computing", "transfer")


class RequestState(enum.Enum):
    WAITING = "waiting"  # no KV anywhere usable; (re)computes from scratch when admitted
    RUNNING = "running"  # holds device blocks, scheduled every iteration
    ROTARY = "rotary"  # paused, KV parked in the host pool
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away or asked to abort
    ERROR = "error"


class InvalidSamplingParams(ValueError):
    """Raised for sampling parameters no request may carry; services map it to HTTP 400."""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; matched on detokenized text by the frontend
    ignore_eos: bool = False
    # vLLM's definitions (worker/logits_processing.py): presence and frequency in [-2, 2]
    # over the output tokens, repetition in (0, 2] over prompt and output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> [-100, 100]
    logprobs: int | None = None  # per sampled token: its logprob and this many top ones
    prompt_logprobs: bool = False  # echo: every prompt token's logprob (top `logprobs`)
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise InvalidSamplingParams(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidSamplingParams(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidSamplingParams(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise InvalidSamplingParams(f"{name} must be in [-2, 2], got {v}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidSamplingParams(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidSamplingParams(
                f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        bad = next((v for v in self.logit_bias.values()
                    if not (math.isfinite(v) and -100.0 <= v <= 100.0)), None)
        if bad is not None:
            raise InvalidSamplingParams(f"logit_bias values must be in [-100, 100], got {bad}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidSamplingParams(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def stateful(self) -> bool:
        """Do the request's own tokens change its logits? Then the worker keeps state."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.grammar)


@dataclass(slots=True, frozen=True)
class SLO:
    """Latency targets of one request, in seconds: TTFT (S_B) and TBT (S_F)."""

    ttft_s: float = 5.0
    tbt_s: float = 0.1

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tbt_s <= 0:
            raise InvalidSamplingParams(f"SLOs must be positive, got {self}")


@dataclass(slots=True, eq=False)  # identity: queues compare requests by object
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    slo: SLO = field(default_factory=SLO)
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    # vLLM's request priority: lower is served first (policy/priority.py); the gateway
    # bounds it by the tenant's own.
    priority: int = 0
    tenant: str = ""  # from the API key ("": no tenants file); labels per-tenant statistics
    weight: float = 1.0  # the tenant's weight: its share when tenants contend (policy/shares.py)
    # May it speculate where the server does (--speculative-config)? A request turns it off.
    speculative: bool = True

    output_token_ids: list[int] = field(default_factory=list)
    # KV of tokens [0, num_computed_tokens) is in the cache (device, or host when rotary),
    # or is being written by an execute in flight: a chunk counts as computed once it is
    # scheduled (so the next iteration can be planned while it runs). Of those,
    # `num_inflight_tokens` are still being written; the rest are settled.
    num_computed_tokens: int = 0
    num_inflight_tokens: int = 0
    # Tokens sampled by executes in flight whose ids are not known yet; they count in
    # num_tokens, so the next decode can be planned (the worker fills in the id).
    num_placeholders: int = 0
    # Bumped whenever the request's KV is dropped (recompute, lost pool): chunks in flight
    # from before that wrote KV that no longer counts.
    kv_epoch: int = 0
    # The worker holds this request's sampling state (SamplingParams.stateful): sent with a
    # chunk whose batch may still land. Cleared when the worker may have lost it.
    worker_state_sent: bool = False
    prompt_logprobs_sent: int = 0  # echo: prompt tokens whose logprobs were published
    # n > 1: a choice waiting for the leader's prompt blocks (scheduler_svc/fork.py); it is
    # not admitted while this names the leader.
    fork_of: str | None = None
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None

    # Timestamps (scheduler clock) that VLT and the statistics read.
    first_token_time: float | None = None
    last_token_time: float | None = None
    run_start_time: float | None = None  # last (re)admission to RUNNING
    admitted_iteration: int = -1  # iteration of the last (re)admission
    token_times: list[float] = field(default_factory=list)

    # History for observability: (time, state) transitions and counters.
    transitions: list[tuple[float, str]] = field(default_factory=list)
    num_rotations: int = 0
    num_recomputes: int = 0
    # Prompt tokens found in the prefix cache at its first admission (None: not admitted).
    num_cached_tokens: int | None = None
    time_in_state: dict[str, float] = field(default_factory=dict)
    _state_since: float = 0.0

    # SLO-miss attribution (PHASES): where the time of the interval since the last token
    # (since arrival, before the first) went, and the totals over the intervals that
    # missed: the TTFT interval when it took longer than S_B, every gap longer than S_F.
    transfer_stall_s: float = 0.0  # the worker idled for this request's copies
    ttft_phases: dict[str, float] | None = None  # set at the first token
    missed_gap_phases: dict[str, float] = field(default_factory=dict)
    num_missed_gaps: int = 0
    _open: dict[str, float] = field(default_factory=dict)  # state -> s, this interval
    _open_stall: float = 0.0
    _mark: float = 0.0
    # Blame (policy/shares.py): of its time queued (waiting or rotary) in the missed
    # intervals, the seconds each tenant held the device (by its share of the blocks in
    # use); kept only while tenants contend.
    missed_blame: dict[str, float] = field(default_factory=dict)
    open_blame: dict[str, float] = field(default_factory=dict)  # this interval's

    # Its chunks carry more than the plain sampling fields (logprobs, echo, penalties,
    # bias, grammar): set once here, as the scheduler asks for every chunk of every batch.
    chunk_extras: bool = field(init=False, default=False, repr=False)
    # Nothing but max_tokens (or the context) can end it: no EOS that counts, no stop
    # token, stop string or grammar. Then its output length is known from the start
    # (a benchmark's ignore_eos requests); else max_tokens only bounds it, and an OpenAI
    # request without max_tokens gets the whole context as its bound (gateway/conversion.py).
    length_known: bool = field(init=False, default=False, repr=False)

    def __post_init__(self) -> None:
        self._state_since = self._mark = self.arrival_time
        self.transitions.append((self.arrival_time, self.state.value))
        s = self.sampling
        self.chunk_extras = s.logprobs is not None or s.prompt_logprobs or s.stateful
        self.length_known = ((s.ignore_eos or not self.eos_token_ids) and not s.stop_token_ids
                             and not s.stop and s.grammar is None)

    # -- token accounting ---------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, including those still being sampled (placeholders)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_placeholders

    @property
    def num_settled_tokens(self) -> int:
        """Computed tokens whose KV no execute in flight is still writing."""
        return self.num_computed_tokens - self.num_inflight_tokens

    @property
    def finishes_when_outputs_land(self) -> bool:
        """With tokens in flight: does it reach max_tokens or the context then? (Nothing to
        schedule for it; it finishes when they land.)"""
        return self.num_placeholders > 0 and (
            len(self.output_token_ids) + self.num_placeholders >= self.sampling.max_tokens
            or self.num_tokens >= self.max_model_len
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_id_at(self, index: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < p else self.output_token_ids[index - p]

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def state_since(self) -> float:
        """When the request entered its current state."""
        return self._state_since

    # -- state changes -----------------------------------------------------------------
    def set_state(self, state: RequestState, now: float) -> None:
        if state is self.state:
            return
        spent = max(0.0, now - self._state_since)
        key = self.state.value
        self.time_in_state[key] = self.time_in_state.get(key, 0.0) + spent
        self._account(now)
        self.state = state
        self._state_since = now
        self.transitions.append((now, state.value))

    def append_token(self, token_id: int, now: float) -> None:
        """A sampled token landed: it takes the place of its placeholder, if it has one."""
        if self.num_placeholders:
            self.num_placeholders -= 1
        self.output_token_ids.append(token_id)
        self._account(now)
        phases = self._close_interval()
        blame, self.open_blame = self.open_blame, {}
        if self.first_token_time is None:
            self.first_token_time = now
            self.ttft_phases = phases
            if now - self.arrival_time > self.slo.ttft_s:
                self._add_blame(blame)
        elif self.last_token_time is not None and now - self.last_token_time > self.slo.tbt_s:
            self.num_missed_gaps += 1
            missed = self.missed_gap_phases
            for k, v in phases.items():
                missed[k] = missed.get(k, 0.0) + v
            self._add_blame(blame)
        self.last_token_time = now
        self.token_times.append(now)

    def _add_blame(self, blame: dict[str, float]) -> None:
        for k, v in blame.items():
            self.missed_blame[k] = self.missed_blame.get(k, 0.0) + v

    def close_blame(self, now: float) -> None:
        """It ends: a first token that never came, after its TTFT ran out, is a missed
        interval too."""
        if self.first_token_time is None and now - self.arrival_time > self.slo.ttft_s:
            self._add_blame(self.open_blame)
        self.open_blame = {}

    def sampling_state(self) -> SamplingState:
        """What the worker rebuilds this request's sampling state from."""
        s = self.sampling
        return SamplingState(
            logit_bias=dict(s.logit_bias), grammar=s.grammar,
            prompt_token_ids=self.prompt_token_ids if s.repetition_penalty != 1.0 else [],
            output_token_ids=list(self.output_token_ids),
        )

    def charge_transfer_stall(self, seconds: float) -> None:
        """The worker idled `seconds` before a batch of this request, for its copies."""
        self.transfer_stall_s += seconds
        self._open_stall += seconds

    def _account(self, now: float) -> None:
        seg = now - self._mark
        if seg > 0.0:
            key = self.state.value
            self._open[key] = self._open.get(key, 0.0) + seg
            self._mark = now

    def _phases(self, o: dict[str, float]) -> dict[str, float]:
        running = o.get("running", 0.0)
        stall = min(self._open_stall, running)
        return {"waiting": o.get("waiting", 0.0), "rotary": o.get("rotary", 0.0),
                "computing": running - stall, "transfer": stall}

    def _close_interval(self) -> dict[str, float]:
        """The open interval's time by phase (see PHASES), and start the next one."""
        phases = self._phases(self._open)
        self._open = {}
        self._open_stall = 0.0
        return phases

    def open_phases(self, now: float) -> dict[str, float]:
        """The interval since the last token (or arrival) up to `now`, by phase: for a
        request that never got its first token."""
        o = dict(self._open)
        if self.state is not RequestState.FINISHED and now > self._mark:
            o[self.state.value] = o.get(self.state.value, 0.0) + now - self._mark
        return self._phases(o)

    def check_stop(self) -> FinishReason | None:
        """Finish reason after the last appended token, if any (stop strings live upstream)."""
        if not self.output_token_ids:
            return None
        last = self.output_token_ids[-1]
        if not self.sampling.ignore_eos and last in self.eos_token_ids:
            return FinishReason.STOP
        if last in self.sampling.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.sampling.max_tokens:
            return FinishReason.LENGTH
        # Known tokens only: one still being sampled (a placeholder) has not landed.
        if len(self.prompt_token_ids) + len(self.output_token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def summary(self, now: float) -> dict[str, object]:
        """Per-request record for logs and `--json` output."""
        times = dict(self.time_in_state)
        if not self.is_finished:
            times[self.state.value] = times.get(self.state.value, 0.0) + now - self._state_since
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]
        return {
            "request_id": self.request_id,
            "prompt_tokens": self.num_prompt_tokens,
            "cached_tokens": self.num_cached_tokens or 0,
            "output_tokens": self.num_output_tokens,
            "ttft_s": ttft,
            "max_tbt_s": max(gaps) if gaps else None,
            "rotations": self.num_rotations,
            "recomputes": self.num_recomputes,
            "time_waiting_s": times.get("waiting", 0.0),
            "time_rotary_s": times.get("rotary", 0.0),
            "time_running_s": times.get("running", 0.0),
            "transfer_stall_s": self.transfer_stall_s,
            "slo_miss_cause": slo_miss_cause(self, ttft, gaps),
            "ttft_phases_s": self.ttft_phases,
            "missed_gaps": self.num_missed_gaps,
            "missed_gap_phases_s": self.missed_gap_phases,
        }


def slo_miss_cause(req: Request, ttft: float | None, gaps: list[float]) -> str | None:
    """Which phase made a request miss its SLO: 'waiting', 'rotary', 'running' or None.

    TTFT misses are blamed on the queue when the request waited longer than it ran before
    its first token, else on execution. A TBT miss is blamed on rotation when the request
    was ever rotary (a parked request produces no tokens), else on execution.
    """
    if ttft is not None and ttft > req.slo.ttft_s:
        first = req.first_token_time or 0.0
        waited = sum(
            min(b_t, first) - a_t
            for (a_t, a_s), (b_t, _) in zip(req.transitions, req.transitions[1:], strict=False)
            if a_s == "waiting" and a_t < first
        )
        return "waiting" if waited >= ttft / 2 else "running"
    if any(g > req.slo.tbt_s for g in gaps):
        return "rotary" if req.num_rotations else "running"
    return None
