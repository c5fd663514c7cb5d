"""`--speculative-config`: speculative decoding's one setting, shaped like vLLM's.

A JSON object, as vLLM takes it: `{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}`. `ngram` is prompt lookup: the drafts
are the tokens that followed the latest earlier occurrence of the request's last n tokens
(n from `prompt_lookup_max` down to `prompt_lookup_min`) in its own prompt and output
(scheduler_svc/speculative.py). vLLM's other methods are named so that a command line
written for vLLM fails with a clear message instead of a parse error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram",)
# vLLM's methods that need a draft model or heads this server does not run yet.
NOT_YET = ("suffix", "draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp",
           "ngram_gpu")
MAX_SPECULATIVE_TOKENS = 16
LOOKUP_MIN, LOOKUP_MAX = 2, 4  # prompt_lookup_min / _max when not given


class SpeculativeConfigError(ValueError):
    """A `--speculative-config` this server cannot run; the message says what to change."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: drafts verified per step at most
    prompt_lookup_max: int = LOOKUP_MAX  # the longest suffix n-gram looked up
    prompt_lookup_min: int = LOOKUP_MIN  # ... and the shortest

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            if self.method in NOT_YET:
                raise SpeculativeConfigError(
                    f"speculative method {self.method!r} is not supported yet; this server "
                    f"runs {', '.join(METHODS)} (prompt lookup)")
            raise SpeculativeConfigError(
                f"unknown speculative method {self.method!r}; use one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
            raise SpeculativeConfigError(
                "prompt_lookup_min and prompt_lookup_max must be integers with "
                f"1 <= min <= max <= 64, got min {lo!r}, max {hi!r}")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig | None:
        """The flag's value: a JSON object, or "" / "none" for no speculation."""
        if not text.strip() or text.strip().lower() == "none":
            return None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(
                f"--speculative-config must be a JSON object such as "
                f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}': {e}") from None
        if not isinstance(obj, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> SpeculativeConfig:
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        extra = sorted(set(obj) - known)
        if extra:
            raise SpeculativeConfigError(
                f"--speculative-config: unknown key(s) {', '.join(extra)}; known: "
                f"{', '.join(sorted(known))}")
        if "method" not in obj:
            raise SpeculativeConfigError("--speculative-config needs a \"method\" (ngram)")
        lo, hi = obj.get("prompt_lookup_min"), obj.get("prompt_lookup_max")
        # Only one of the two given: the other keeps its default, bounded by it.
        if lo is None and hi is not None:
            lo = min(hi, LOOKUP_MIN) if isinstance(hi, int) else hi
        if hi is None and lo is not None:
            hi = max(lo, LOOKUP_MAX) if isinstance(lo, int) else lo
        kw: dict[str, Any] = {"method": obj["method"]}
        if "num_speculative_tokens" in obj:
            kw["num_speculative_tokens"] = obj["num_speculative_tokens"]
        if lo is not None:
            kw["prompt_lookup_min"] = lo
        if hi is not None:
            kw["prompt_lookup_max"] = hi
        return cls(**kw)

    def __str__(self) -> str:  # the flag's value again (serve passes it to the scheduler)
        return self.to_json()

    def to_json(self) -> str:
        return json.dumps({"method": self.method,
                           "num_speculative_tokens": self.num_speculative_tokens,
                           "prompt_lookup_max": self.prompt_lookup_max,
                           "prompt_lookup_min": self.prompt_lookup_min})
