"""Engine configuration shared by `superinfer generate`, the services and the benchmarks.

Plain data and the command-line flags that fill it. The scheduler core turns its part into
its own objects (`scheduler_svc/setup.py`); nothing here knows a policy's internals, only
the names `--policy` accepts.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

GIB = 1 << 30
# The values of --policy (scheduler_svc/policy/__init__.py builds one policy per name).
POLICY_NAMES = ("lvf", "fcfs", "swapped-first", "waiting-first")
# The values of --dtype: the executor's number formats (worker/formats.py says what each
# is and needs; auto: the fastest this machine runs that passes the quality check).
# float16 is kept for old command lines and runs as bfloat16.
DTYPE_NAMES = ("auto", "float32", "bfloat16", "int8", "int4", "gguf", "float16")
KV_DTYPE_NAMES = ("auto", "float32", "bfloat16")  # auto: float32 with float32 weights, else bf16


# LVF's --park-cover (RotationLimits.park_cover): a started request is rotated out only
# where its slack covers this many times the mean time parked requests stay parked. Off:
# at 1 it moved TTFT into TPOT (simulator: as many must-show cells failed, a different
# set; real stack: better in two 2x pairs, worse in one; docs/results/rotasched/).
PARK_COVER: float | None = None
# LVF's --growth-room (RotationLimits.growth_room; policy/rotation.py says why a
# half: the whole growth to the next finish left blocks idle and lengthened LVF's tail).
GROWTH_ROOM = 0.5
# LVF's --memory-margin (RotationLimits.memory_margin): how much more a candidate must lag
# than its victim where the seat it needs is held by memory or --max-num-seqs, not by the
# iteration-time budget. 6: every must-show cell of the simulator passes (0: four fail on
# TPOT), at 1 % of the goodput summed over them; on the real stack at 2x, as good or
# better (docs/results/rotasched/, "A margin where the batch time does not hold the seat").
MEMORY_MARGIN = 6.0


def optional_float(text: str) -> float | None:
    """argparse `type=` for a float flag that 'none' switches off."""
    return None if text.strip().lower() == "none" else float(text)


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    device_blocks: int | None = None  # None: derived from kv_memory_gib
    kv_memory_gib: float = 0.5  # device KV budget when device_blocks is not given
    host_blocks: int | None = None  # None: derived from host_memory_gib
    host_memory_gib: float = 2.0
    block_size: int = 16
    max_batched_tokens: int = 512
    max_num_seqs: int = 256
    # Admission bound of the scheduler service: live requests (waiting + running + rotary)
    # it holds at once; one more is refused with RESOURCE_EXHAUSTED (HTTP 429). 0: no bound.
    max_queued_requests: int = 1024
    max_model_len: int | None = None  # None: the model's context length
    dtype: str = "auto"
    kv_dtype: str = "auto"
    device: str = "auto"  # the worker's: auto (CUDA when torch sees it), cpu or cuda
    # The worker's ranks, one process each, in one torch.distributed group (worker/tp.py).
    tensor_parallel_size: int = 1
    policy: str = "lvf"
    alpha: float = 1.0  # policy/vlt.py VLTParams: slack in equal seconds (measured there)
    beta_b: float = 0.0
    beta_f: float = 0.0
    # LVF: a parked request that has streamed counts its slack only until this share of its
    # TTFT SLO after its last token (policy/vlt.py, measured there; None: no bound).
    max_stall: float | None = None
    xfer_budget_blocks: int | None = None  # B_xfer; None = unlimited
    min_residency: int = 32  # iterations; measured in the simulator (docs/results/simulator/)
    vlt_margin: float = 0.0
    hold_vlt: float | None = -0.5  # LVF stops skipping a new request once its VLT reaches this
    # Iteration-time-aware admission: an iteration may take this share of the tightest TBT
    # SLO (None: the policy's default, LVF 0.9 and the baselines none; 0: off) ...
    iteration_budget: float | None = None
    # ... with decode seats counted so that new prompts are prefilled within this share
    # of their TTFT SLO.
    prefill_within: float = 0.5
    # LVF rotates only where a candidate would miss its deadline waiting for seats that
    # finishing requests free (False: whenever it lags more than a running request).
    lazy_rotation: bool = True
    lazy_margin: float = 0.25  # ... with this share of the candidate's TTFT SLO to spare
    # ... and where none is needed, parked requests go ahead of new ones for as many seats
    # as the new ones can spare (policy/rotation.py; off: measured there).
    parked_first: bool = False
    # LVF rotates a started request out for a candidate only where its slack covers this
    # many times the mean time parked requests have stayed parked (None: off).
    park_cover: float | None = PARK_COVER
    # ... and a parked request coming back early into free blocks leaves this share of
    # what the running ones grow by until the next finish (RotationLimits.growth_room).
    growth_room: float = GROWTH_ROOM
    # LVF: a candidate must lag a victim by this much more where the seat it needs is not
    # one the iteration-time budget holds back (RotationLimits.memory_margin).
    memory_margin: float = MEMORY_MARGIN
    eager_budget_blocks: int = 32
    # Automatic prefix caching (vLLM's flag): requests share the KV of full blocks whose
    # tokens (and all before them) match; freed ones stay cached on the device and, through
    # the eager host copies, in host memory (scheduler_svc/prefix_cache.py).
    enable_prefix_caching: bool = True
    # Plan and copy iteration t+1 while t executes (scheduler_svc/engine_core.py);
    # False: the serial step, the baseline.
    pipeline: bool = True
    ttft_slo: float = 5.0
    tbt_slo: float = 0.1
    trace: str | None = None  # write the iteration timeline here (Chrome/Perfetto JSON)

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICY_NAMES)}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"--block-size must be in [1, 1024], got {self.block_size}")
        if self.device_blocks is not None and self.device_blocks < 1:
            raise ValueError(f"--device-blocks must be at least 1, got {self.device_blocks}")
        if self.max_batched_tokens < 1:
            raise ValueError(f"--max-batched-tokens must be at least 1, got {self.max_batched_tokens}")
        if self.max_queued_requests < 0:
            raise ValueError(
                f"--max-queued-requests must be >= 0 (0: no limit), got {self.max_queued_requests}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype}")
        if self.kv_dtype not in KV_DTYPE_NAMES:
            raise ValueError(
                f"--kv-dtype must be one of {', '.join(KV_DTYPE_NAMES)}, got {self.kv_dtype}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if not self.alpha > 0:
            raise ValueError(f"--alpha must be positive, got {self.alpha}")
        if self.park_cover is not None and not self.park_cover > 0:
            raise ValueError(f"--park-cover must be positive ('none': off), got {self.park_cover}")
        if not self.growth_room >= 0.0:
            raise ValueError(f"--growth-room must be >= 0, got {self.growth_room}")
        if not self.memory_margin >= 0.0:
            raise ValueError(f"--memory-margin must be >= 0, got {self.memory_margin}")
        for flag, v in (("--beta-b", self.beta_b), ("--beta-f", self.beta_f)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{flag} must be in [0, 1], got {v}")
        if self.max_stall is not None and not self.max_stall > 0.0:
            raise ValueError(f"--max-stall must be positive ('none': no bound), got "
                             f"{self.max_stall}")
        if self.iteration_budget is not None and not 0.0 <= self.iteration_budget <= 1.0:
            raise ValueError(f"--iteration-budget must be in [0, 1] (0: off), got "
                             f"{self.iteration_budget}")
        if self.lazy_margin < 0.0:
            raise ValueError(f"--lazy-margin must be >= 0, got {self.lazy_margin}")
        if self.min_residency < 0:
            raise ValueError(f"--min-residency must be >= 0, got {self.min_residency}")
        if self.xfer_budget_blocks is not None and self.xfer_budget_blocks < 0:
            raise ValueError(f"--xfer-budget-blocks must be >= 0 (none: unlimited), got "
                             f"{self.xfer_budget_blocks}")
        if not 0.0 < self.prefill_within <= 1.0:
            raise ValueError(f"--prefill-within must be in (0, 1], got {self.prefill_within}")
        for flag, v in (("--ttft-slo", self.ttft_slo), ("--tbt-slo", self.tbt_slo)):
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{flag} must be a positive number of seconds, got {v}")

    def blocks_for(self, block_bytes: int) -> tuple[int, int]:
        """(device blocks, host blocks) from explicit counts or memory budgets."""
        dev = self.device_blocks or max(1, int(self.kv_memory_gib * GIB) // block_bytes)
        host = self.host_blocks
        if host is None:
            host = int(self.host_memory_gib * GIB) // block_bytes
        return dev, host

    # -- command line ------------------------------------------------------------------
    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("engine")
        g.add_argument("--model", default=None,
                       help="a .gguf file or a Hugging Face model dir (default: bundled SmolLM2)")
        g.add_argument("--device-blocks", type=int, default=None,
                       help="device KV pool size in blocks (default: from --kv-memory-gib)")
        g.add_argument("--kv-memory-gib", type=float, default=0.5)
        g.add_argument("--host-blocks", type=int, default=None,
                       help="host KV pool size in blocks (default: from --host-memory-gib)")
        g.add_argument("--host-memory-gib", type=float, default=2.0)
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--max-batched-tokens", type=int, default=512)
        g.add_argument("--max-num-seqs", type=int, default=256)
        g.add_argument("--max-queued-requests", type=int, default=1024,
                       help="live requests (waiting+running+rotary) the scheduler admits; "
                            "past it clients get 429 / RESOURCE_EXHAUSTED (0: no limit)")
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--dtype", default="auto", choices=list(DTYPE_NAMES),
                       help="weight format: auto (the fastest this CPU runs within 2%% of "
                            "float32's perplexity; logged), float32 (the reference), bfloat16, "
                            "int8, int4, gguf (the file's own quantized blocks)")
        g.add_argument("--kv-dtype", default="auto", choices=list(KV_DTYPE_NAMES),
                       help="KV cache dtype (auto: float32 with --dtype float32, else bfloat16)")
        g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                       help="where the worker computes and keeps its KV pool (auto: the GPU "
                            "when torch sees one; there --dtype auto is bfloat16)")
        g.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="split the model's heads over N worker processes (torch."
                            "distributed, gloo on the CPU); the attention and KV heads "
                            "must divide by N")
        s = p.add_argument_group("scheduling (RotaSched)")
        s.add_argument("--policy", default="lvf", choices=list(POLICY_NAMES))
        s.add_argument("--alpha", type=float, default=1.0,
                       help="LVF: a started request's lag counts alpha times against a new "
                            "one's, its lead 1/alpha times (1: slack in equal seconds)")
        s.add_argument("--beta-b", type=float, default=0.0)
        s.add_argument("--beta-f", type=float, default=0.0)
        s.add_argument("--max-stall", type=optional_float, default=None,
                       help="LVF: a parked request that has streamed outranks new ones once "
                            "it has waited this share of its TTFT SLO since its last token "
                            "('none': only when its TPOT is at risk)")
        s.add_argument("--xfer-budget-blocks", type=int, default=None, help="B_xfer")
        s.add_argument("--min-residency", type=int, default=32,
                       help="iterations a (re)admitted request is safe from rotation")
        s.add_argument("--vlt-margin", type=float, default=0.0)
        s.add_argument("--hold-vlt", type=optional_float, default=-0.5,
                       help="LVF: a new request whose VLT reaches this is no longer skipped "
                            "when it does not fit (anti-starvation; 'none': always skip)")
        s.add_argument("--iteration-budget", type=optional_float, default=None,
                       help="share of the tightest TBT SLO an iteration may take, from the "
                            "executor's measured times (default: the policy's, 0.9 for lvf and "
                            "none for the baselines; 0: off)")
        s.add_argument("--prefill-within", type=float, default=0.5,
                       help="decode seats leave room to prefill new prompts within this share "
                            "of their TTFT SLO (with --iteration-budget)")
        s.add_argument("--lazy-rotation", action=argparse.BooleanOptionalAction, default=True,
                       help="LVF: preempt for a candidate only where it would miss its "
                            "deadline waiting for seats that finishing requests free "
                            "(--no-lazy-rotation: whenever it lags more than a running one)")
        s.add_argument("--lazy-margin", type=float, default=0.25,
                       help="LVF's lazy rotation: preempt once a candidate's slack is under "
                            "that wait plus this share of its TTFT SLO")
        s.add_argument("--parked-first", action=argparse.BooleanOptionalAction, default=False,
                       help="LVF's lazy rotation: where no rotation is needed, parked "
                            "requests go ahead of new ones for as many seats as the new "
                            "ones can spare by the same estimate")
        s.add_argument("--park-cover", type=optional_float, default=PARK_COVER,
                       help="LVF: rotate a started request out only where its slack covers "
                            "this many times the mean time parked requests have stayed "
                            "parked ('none': off)")
        s.add_argument("--growth-room", type=float, default=GROWTH_ROOM,
                       help="LVF: a parked request coming back early into free blocks "
                            "leaves this share of what the running requests grow by until "
                            "the next finish (0: none)")
        s.add_argument("--memory-margin", type=float, default=MEMORY_MARGIN,
                       help="LVF: where memory or --max-num-seqs, not the iteration-time "
                            "budget, holds the seat a candidate needs, it must lag its "
                            "victim by this much more (in TTFT SLOs; 0: off)")
        s.add_argument("--eager-budget-blocks", type=int, default=32)
        s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="reuse the KV of cached prompt prefixes, from device memory or "
                            "(eager host copies) host memory (--no-enable-prefix-caching: off)")
        s.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=True,
                       help="plan and copy the next iteration while this one executes "
                            "(--no-pipeline: the serial step, the baseline)")
        s.add_argument("--ttft-slo", type=float, default=5.0, help="default TTFT SLO, seconds")
        s.add_argument("--tbt-slo", type=float, default=0.1, help="default TBT SLO, seconds")
        o = p.add_argument_group("observability")
        o.add_argument("--trace", default=None, metavar="PATH",
                       help="write a Chrome/Perfetto timeline of every iteration (schedule, "
                            "transfers per direction, execute) and of each request's states")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
