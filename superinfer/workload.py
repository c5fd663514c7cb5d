"""Request traces for `superinfer sim` and `superinfer bench serve` (DESIGN 8).

A trace is a list of `TraceRequest` (arrival time, prompt length, output length and, from
a dataset file, the prompt text), built from a seeded generator so the same arguments give
the same trace.

Lengths come from either
* a ShareGPT JSON file in vLLM's format: a list of entries whose "conversations" list holds
  {"from": "human"|"gpt", "value": text} turns. The first human turn is the prompt and the
  gpt turn right after it gives the output length. Lengths are counted with the tokenizer
  when one is given, else estimated as ceil(characters / 4) (a common rule of thumb for
  English BPE text; only an estimate). As in vLLM's benchmark, pairs whose prompt or output
  is under 4 tokens are dropped. Requests are drawn from the entries with replacement; or
* a synthetic distribution (`sharegpt`, `lmsys`): independent lognormal prompt and output
  lengths. See `SYNTHETIC` for the parameters and where they come from. They are
  approximations of published dataset statistics, not fits to the raw data.

Both are then scaled by `length_scale` and clipped to [min_len, max_prompt_len] and
[min_len, max_output_len] (so a small model's context, or a CPU's pool, fits them).

Arrivals: gamma-distributed gaps with shape = burstiness and scale = 1/(rps · burstiness),
so the mean rate is `rps` and burstiness 1 is a Poisson process (as `vllm bench serve`).
The first request arrives at t = 0. Give either a duration (arrivals until it ends) or a
number of requests. Arrivals, prompt and output lengths use separate random streams, so the i-th request
has the same lengths at every rate of a sweep.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import SuperInferError


class WorkloadError(SuperInferError):
    """The workload cannot be built: unknown dataset, unreadable file, bad parameters."""

    code = "invalid_workload"
    http_status = 400


@dataclass(slots=True, frozen=True)
class LengthDistribution:
    """Lognormal lengths with a given mean; sigma is the spread of log(length)."""

    mean: float
    sigma: float

    @property
    def mu(self) -> float:
        # E[X] = exp(mu + sigma^2 / 2) for a lognormal.
        return math.log(self.mean) - self.sigma**2 / 2

    @property
    def median(self) -> float:
        return math.exp(self.mu)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.lognormal(self.mu, self.sigma, n)


@dataclass(slots=True, frozen=True)
class SyntheticDataset:
    name: str
    prompt: LengthDistribution
    output: LengthDistribution
    source: str


SYNTHETIC: dict[str, SyntheticDataset] = {
    "sharegpt": SyntheticDataset(
        "sharegpt",
        prompt=LengthDistribution(mean=161.0, sigma=1.0),
        output=LengthDistribution(mean=338.0, sigma=1.0),
        source=(
            "means: the vLLM paper (Kwon et al., SOSP 2023, Fig. 11) reports ShareGPT input "
            "161 and output 338 tokens on average; sigma = 1.0 is an assumption giving the "
            "long right tail of its histograms (median 98 / 205 tokens). An approximation."
        ),
    ),
    "lmsys": SyntheticDataset(
        "lmsys",
        prompt=LengthDistribution(mean=69.5, sigma=1.2),
        output=LengthDistribution(mean=214.5, sigma=1.0),
        source=(
            "means: LMSYS-Chat-1M paper (Zheng et al., ICLR 2024, Table 1) reports 69.5 "
            "tokens per prompt and 214.5 per response on average; sigmas are assumptions "
            "(short prompts with a heavy tail). An approximation."
        ),
    ),
}


@dataclass(slots=True, frozen=True)
class SLOClass:
    """A class of requests sharing SLOs: `share` of the trace carries TTFT `ttft_s` and
    TBT `tbt_s` (each request its own, sent with it)."""

    name: str
    ttft_s: float
    tbt_s: float
    share: float

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise WorkloadError(f"an SLO class needs a plain name (letters, digits, - _), "
                                f"got {self.name!r}")
        if not (self.ttft_s > 0 and self.tbt_s > 0 and math.isfinite(self.ttft_s + self.tbt_s)):
            raise WorkloadError(f"SLO class {self.name}: SLOs must be positive seconds, got "
                                f"TTFT {self.ttft_s}, TBT {self.tbt_s}")
        if not self.share > 0:
            raise WorkloadError(f"SLO class {self.name}: share must be positive, got {self.share}")


# Named mixes for --slo-classes. "mixed": an interactive and a batch class, half each.
SLO_MIXES: dict[str, tuple[SLOClass, ...]] = {
    "mixed": (SLOClass("interactive", 1.0, 0.05, 0.5), SLOClass("batch", 20.0, 0.5, 0.5)),
}


def parse_slo_classes(text: str | None) -> tuple[SLOClass, ...]:
    """`mixed`, or `name=TTFT:TBT:SHARE,...` in seconds (shares are normalised), or
    None/'' for one class with the run's SLOs."""
    if not text:
        return ()
    text = text.strip()
    if text in SLO_MIXES:
        return SLO_MIXES[text]
    out = []
    for part in text.split(","):
        name, sep, rest = part.strip().partition("=")
        fields = rest.split(":")
        if not sep or len(fields) != 3:
            raise WorkloadError(
                f"SLO class {part.strip()!r}: expected name=TTFT_S:TBT_S:SHARE (e.g. "
                f"interactive=1:0.05:0.5), or one of: {', '.join(SLO_MIXES)}")
        try:
            ttft, tbt, share = (float(f) for f in fields)
        except ValueError:
            raise WorkloadError(f"SLO class {part.strip()!r}: TTFT, TBT and share must be "
                                "numbers") from None
        out.append(SLOClass(name.strip(), ttft, tbt, share))
    if len({c.name for c in out}) != len(out):
        raise WorkloadError(f"SLO classes {text!r}: two classes have the same name")
    return tuple(out)


@dataclass(slots=True, frozen=True)
class TraceRequest:
    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt: str | None = None  # the prompt text when the trace comes from a dataset file
    slo: SLOClass | None = None  # its own SLOs (None: the run's)
    tenant: str = ""  # whose request it is (several tenants' traces merged; "": none)
    weight: float = 1.0  # that tenant's weight


@dataclass(slots=True)
class WorkloadSpec:
    dataset: str = "sharegpt"  # a SYNTHETIC name or a path to a ShareGPT JSON file
    rps: float = 10.0  # mean request rate; math.inf sends everything at t = 0
    duration_s: float | None = 120.0
    num_prompts: int | None = None  # when set, exactly this many requests (duration ignored)
    burstiness: float = 1.0
    seed: int = 0
    max_prompt_len: int = 1024
    max_output_len: int = 1024
    min_len: int = 4
    length_scale: float = 1.0
    slo_classes: tuple[SLOClass, ...] = ()  # each request drawn into one (seeded); (): none

    def __post_init__(self) -> None:
        if not self.rps > 0:
            raise WorkloadError(f"rps must be positive, got {self.rps}")
        if not self.burstiness > 0:
            raise WorkloadError(f"burstiness must be positive, got {self.burstiness}")
        if self.num_prompts is None and self.duration_s is None:
            raise WorkloadError("give a duration or a number of prompts")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise WorkloadError(f"num_prompts must be at least 1, got {self.num_prompts}")
        if self.num_prompts is None and self.duration_s is not None and not self.duration_s > 0:
            raise WorkloadError(f"duration must be positive, got {self.duration_s}")
        if self.min_len < 1 or self.max_prompt_len < self.min_len or self.max_output_len < self.min_len:
            raise WorkloadError(
                f"need 1 <= min_len <= max_prompt_len, max_output_len; got {self.min_len}, "
                f"{self.max_prompt_len}, {self.max_output_len}"
            )
        if not self.length_scale > 0:
            raise WorkloadError(f"length_scale must be positive, got {self.length_scale}")

    @property
    def trace_duration_s(self) -> float | None:
        """The span goodput is divided by: the duration, or None (then: the arrivals' span)."""
        return self.duration_s if self.num_prompts is None else None


# -- arrivals -----------------------------------------------------------------------------
def gamma_arrivals(
    rng: np.random.Generator,
    rps: float,
    burstiness: float = 1.0,
    num: int | None = None,
    duration_s: float | None = None,
) -> list[float]:
    """Arrival times from t = 0: `num` of them, or all before `duration_s`."""
    if math.isinf(rps):
        if num is None:
            raise WorkloadError("an infinite rate needs a number of prompts")
        return [0.0] * num
    scale = 1.0 / (rps * burstiness)
    if num is not None:
        gaps = rng.gamma(burstiness, scale, max(0, num - 1))
        return [0.0, *np.cumsum(gaps).tolist()][:num]
    if duration_s is None:
        raise WorkloadError("give a number of prompts or a duration")
    times = [0.0]
    t = 0.0
    batch = max(16, int(rps * duration_s * 1.2) + 16)
    while True:
        for g in rng.gamma(burstiness, scale, batch):
            t += float(g)
            if t >= duration_s:
                return times
            times.append(t)


# -- lengths -------------------------------------------------------------------------------
def load_sharegpt(
    path: str | Path, tokenizer: Callable[[str], Sequence[int]] | None = None, min_len: int = 4
) -> list[tuple[str, int, int]]:
    """(prompt text, prompt length, output length) of every usable entry in a ShareGPT file."""
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"dataset file {str(p)!r} not found")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise WorkloadError(f"dataset file {p} is not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise WorkloadError(f"dataset file {p} is not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise WorkloadError(
            f"dataset file {p}: expected a JSON list of entries with a 'conversations' list "
            "(vLLM's ShareGPT format)"
        )

    def count(text: str) -> int:
        if tokenizer is not None:
            return len(tokenizer(text))
        return max(1, math.ceil(len(text) / 4))

    out = []
    for entry in data:
        pair = _first_exchange(entry)
        if pair is None:
            continue
        prompt, completion = pair
        plen, olen = count(prompt), count(completion)
        if plen >= min_len and olen >= min_len:
            out.append((prompt, plen, olen))
    if not out:
        raise WorkloadError(
            f"dataset file {p}: no entry has a human turn followed by a gpt turn of at least "
            f"{min_len} tokens each"
        )
    return out


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations")
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns[:-1]):
        nxt = turns[i + 1]
        if (
            isinstance(turn, dict) and isinstance(nxt, dict)
            and turn.get("from") == "human" and nxt.get("from") == "gpt"
            and isinstance(turn.get("value"), str) and isinstance(nxt.get("value"), str)
        ):
            return turn["value"], nxt["value"]
    return None


def _clip(x: np.ndarray, spec: WorkloadSpec, hi: int) -> list[int]:
    v = np.rint(x * spec.length_scale)
    return np.clip(v, spec.min_len, hi).astype(int).tolist()


def build_trace(
    spec: WorkloadSpec, tokenizer: Callable[[str], Sequence[int]] | None = None
) -> list[TraceRequest]:
    # Separate streams (the first three as before a fourth was added): request i keeps
    # its lengths and its class at every rate.
    arrival_rng, prompt_rng, output_rng, class_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(spec.seed).spawn(4)
    )
    arrivals = gamma_arrivals(
        arrival_rng, spec.rps, spec.burstiness, num=spec.num_prompts, duration_s=spec.duration_s
    )
    n = len(arrivals)
    texts: list[str | None]
    if spec.dataset in SYNTHETIC:
        ds = SYNTHETIC[spec.dataset]
        prompts = _clip(ds.prompt.sample(prompt_rng, n), spec, spec.max_prompt_len)
        outputs = _clip(ds.output.sample(output_rng, n), spec, spec.max_output_len)
        texts = [None] * n
    else:
        p = Path(spec.dataset)
        if not p.is_file():
            raise WorkloadError(
                f"dataset {spec.dataset!r} is neither a synthetic dataset "
                f"({', '.join(SYNTHETIC)}) nor an existing file"
            )
        entries = load_sharegpt(p, tokenizer, spec.min_len)
        picks = prompt_rng.integers(0, len(entries), n)
        chosen = [entries[i] for i in picks.tolist()]
        texts = [e[0] for e in chosen]
        prompts = _clip(np.array([e[1] for e in chosen], dtype=float), spec, spec.max_prompt_len)
        outputs = _clip(np.array([e[2] for e in chosen], dtype=float), spec, spec.max_output_len)
    classes: list[SLOClass | None] = [None] * n
    if spec.slo_classes:
        shares = np.array([c.share for c in spec.slo_classes], dtype=float)
        picks = class_rng.choice(len(shares), size=n, p=shares / shares.sum())
        classes = [spec.slo_classes[i] for i in picks.tolist()]
    return [
        TraceRequest(i, arrivals[i], prompts[i], outputs[i], texts[i], classes[i])
        for i in range(n)
    ]


def trace_stats(trace: list[TraceRequest]) -> dict[str, float]:
    """Summary numbers for logs and docs."""
    if not trace:
        return {"requests": 0}
    p = np.array([r.prompt_len for r in trace])
    o = np.array([r.output_len for r in trace])
    span = trace[-1].arrival_s - trace[0].arrival_s
    return {
        "requests": len(trace),
        "prompt_mean": float(p.mean()),
        "prompt_p50": float(np.percentile(p, 50)),
        "prompt_p99": float(np.percentile(p, 99)),
        "output_mean": float(o.mean()),
        "output_p50": float(np.percentile(o, 50)),
        "output_p99": float(np.percentile(o, 99)),
        "arrival_span_s": span,
    }


def length_counter(name: str | None) -> Callable[[str], list[int]] | None:
    """Token counting for a dataset file's lengths: `name` a model ('bundled', a .gguf or
    a HF dir), or None for the default (characters / 4)."""
    if name is None:
        return None
    from common.modelfile import resolve_model
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_source(resolve_model(None if name == "bundled" else name))
    return lambda text: tok.encode(text, add_special_tokens=False)
