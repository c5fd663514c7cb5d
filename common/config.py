"""Engine configuration shared by `superinfer generate`, the services and the benchmarks.

Plain data and the command-line flags that fill it. The scheduler core turns its part into
its own objects (`scheduler_svc/setup.py`); nothing here knows a policy's internals, only
the names `--policy` accepts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from common.scheduling import POLICY_NAMES, SchedulingSettings, add_setting_flags
from common.speculative import SpeculativeConfig

__all__ = ["DTYPE_NAMES", "GIB", "KV_DTYPE_NAMES", "POLICY_NAMES", "EngineConfig", "optional_float"]

GIB = 1 << 30
# The values of --dtype: the executor's number formats (worker/formats.py says what each
# is and needs; auto: the fastest this machine runs that passes the quality check).
# float16 is kept for old command lines and runs as bfloat16.
DTYPE_NAMES = ("auto", "float32", "bfloat16", "int8", "int4", "gguf", "float16")
KV_DTYPE_NAMES = ("auto", "float32", "bfloat16")  # auto: float32 with float32 weights, else bf16


def _speculative(text: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def optional_float(text: str) -> float | None:
    """argparse `type=` for a float flag that 'none' switches off."""
    return None if text.strip().lower() == "none" else float(text)


@dataclass(slots=True)
class EngineConfig(SchedulingSettings):
    """The scheduling settings (common/scheduling.py, their one home) and the engine's."""

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    device_blocks: int | None = None  # None: derived from kv_memory_gib
    kv_memory_gib: float = 0.5  # device KV budget when device_blocks is not given
    host_blocks: int | None = None  # None: derived from host_memory_gib
    host_memory_gib: float = 2.0
    block_size: int = 16
    # Admission bound of the scheduler service: live requests (waiting + running + rotary)
    # it holds at once; one more is refused with RESOURCE_EXHAUSTED (HTTP 429). 0: no bound.
    max_queued_requests: int = 1024
    max_model_len: int | None = None  # None: the model's context length
    dtype: str = "auto"
    kv_dtype: str = "auto"
    device: str = "auto"  # the worker's: auto (CUDA when torch sees it), cpu or cuda
    # The worker's ranks, one process each, in one torch.distributed group (worker/tp.py).
    tensor_parallel_size: int = 1
    trace: str | None = None  # write the iteration timeline here (Chrome/Perfetto JSON)
    # Speculative decoding (common/speculative.py): None, off.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        self.check()
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"--block-size must be in [1, 1024], got {self.block_size}")
        if self.device_blocks is not None and self.device_blocks < 1:
            raise ValueError(f"--device-blocks must be at least 1, got {self.device_blocks}")
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
        if self.device == "cuda" and self.speculative_config is not None:
            raise ValueError("--speculative-config runs on the CPU executor only so far: "
                             "drop it, or serve with --device cpu")

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
        g.add_argument("--speculative-config", type=_speculative, default=None, metavar="JSON",
                       help="speculative decoding, as vLLM's flag: '{\"method\": \"ngram\", "
                            "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                            "\"prompt_lookup_min\": 2}' (prompt lookup; greedy requests; a "
                            "request turns it off with \"speculative\": false). Default: off")
        add_setting_flags(p.add_argument_group(
            "scheduling (RotaSched; everything else is computed or adapted: docs/rotasched.md)"))
        o = p.add_argument_group("observability")
        o.add_argument("--trace", default=None, metavar="PATH",
                       help="write a Chrome/Perfetto timeline of every iteration (schedule, "
                            "transfers per direction, execute) and of each request's states")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
