"""Hardware and model profiles: the simulator's cost-model inputs, kept as data files.

Every profile lives in `profiles/{hardware,models}/NAME.json` and carries a `sources` map
that says where each number comes from (a datasheet, the paper, a published measurement,
an assumption, or `superinfer sim calibrate`). `--hardware`/`--model` also accept a path
to a JSON file of the same shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import SuperInferError

PROFILE_DIR = Path(__file__).parent / "profiles"


class ProfileError(SuperInferError):
    """A profile is unknown, unreadable, or lacks a number or its source."""

    code = "invalid_profile"
    http_status = 400


def available(kind: str) -> list[str]:
    """Names of the bundled profiles of one kind ('hardware' or 'models')."""
    return sorted(p.stem for p in (PROFILE_DIR / kind).glob("*.json"))


def _read(kind: str, name_or_path: str) -> tuple[dict[str, Any], Path]:
    path = Path(name_or_path)
    if not (path.suffix == ".json" and path.is_file()):
        path = PROFILE_DIR / kind / f"{name_or_path}.json"
    if not path.is_file():
        what = "model" if kind == "models" else kind
        raise ProfileError(
            f"unknown {what} profile {name_or_path!r}; bundled: {', '.join(available(kind))} "
            "(or give a path to a .json file)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a profile is a JSON object")
    return data, path


def _number(data: dict[str, Any], key: str, where: Path, *, positive: bool = True) -> float:
    if key not in data:
        raise ProfileError(f"{where}: missing {key!r}")
    v = data[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ProfileError(f"{where}: {key!r} must be a number, got {v!r}")
    if positive and v <= 0:
        raise ProfileError(f"{where}: {key!r} must be positive, got {v}")
    if v < 0:
        raise ProfileError(f"{where}: {key!r} must be >= 0, got {v}")
    return float(v)


def _check_sources(data: dict[str, Any], keys: list[str], where: Path) -> dict[str, str]:
    sources = data.get("sources")
    if not isinstance(sources, dict):
        raise ProfileError(f"{where}: missing the 'sources' map (where each number comes from)")
    missing = [k for k in keys if not str(sources.get(k, "")).strip()]
    if missing:
        raise ProfileError(f"{where}: no source given for {', '.join(missing)}")
    return {str(k): str(v) for k, v in sources.items()}


@dataclass(slots=True, frozen=True)
class BandwidthCurve:
    """Bytes/s of one copy direction as a function of segment size (log-linear between points)."""

    points: tuple[tuple[float, float], ...]  # (segment bytes, bytes/s), sizes increasing

    def __post_init__(self) -> None:
        if not self.points:
            raise ProfileError("a bandwidth curve needs at least one point")
        sizes = [s for s, _ in self.points]
        if sizes != sorted(sizes) or len(set(sizes)) != len(sizes):
            raise ProfileError("bandwidth curve sizes must be strictly increasing")
        if any(s <= 0 or b <= 0 for s, b in self.points):
            raise ProfileError("bandwidth curve points must be positive")

    def __call__(self, segment_bytes: float) -> float:
        pts = self.points
        if segment_bytes <= pts[0][0]:
            return pts[0][1]
        if segment_bytes >= pts[-1][0]:
            return pts[-1][1]
        x = math.log(segment_bytes)
        for (s0, b0), (s1, b1) in zip(pts, pts[1:]):
            if segment_bytes <= s1:
                f = (x - math.log(s0)) / (math.log(s1) - math.log(s0))
                return b0 + f * (b1 - b0)
        return pts[-1][1]  # unreachable

    @classmethod
    def parse(cls, raw: Any, where: str) -> BandwidthCurve:
        try:
            pts = tuple((float(s), float(b)) for s, b in raw)
        except (TypeError, ValueError):
            raise ProfileError(f"{where}: a curve is a list of [segment_bytes, bytes_per_s]") from None
        return cls(pts)


@dataclass(slots=True, frozen=True)
class LinkProfile:
    """The device<->host path: per-direction curves, the duplex limit, per-copy costs."""

    name: str
    d2h: BandwidthCurve
    h2d: BandwidthCurve
    duplex_total_Bps: float  # both directions together cannot beyond this (shared DRAM)
    launch_overhead_s: float  # host cost per copy issued one by one (a cudaMemcpyAsync loop)
    batched_launch_overhead_s: float  # host cost per descriptor of one batched call
    # Fixed cost of one transfer batch on the iteration's critical path, whatever it holds
    # (cpu-local: the Transfer RPC to kvmem and its thread hand-offs). Optional, default 0.
    plan_overhead_s: float = 0.0


@dataclass(slots=True, frozen=True)
class HardwareProfile:
    name: str
    description: str
    peak_flops: float
    mfu: float
    hbm_bandwidth_Bps: float
    hbm_efficiency: float
    iteration_overhead_s: float
    host_kv_bytes: float
    link: LinkProfile
    hbm_bytes: float | None = None  # None: a fixed device KV budget (a CPU's shared memory)
    memory_utilization: float = 0.9
    activation_reserve_bytes: float = 0.0
    device_kv_bytes: float | None = None  # set: the device KV pool, independent of weights
    # Set: attention reads the KV context in a pass of its own at this rate, added to the
    # roofline (superinfer/sim/cost.py); None: KV bytes are part of the roofline's memory side.
    attention_kv_Bps: float | None = None
    sources: dict[str, str] | None = None

    def device_kv_budget(self, weight_bytes: float) -> float:
        """Bytes of device memory left for the KV pool once the model is loaded."""
        if self.device_kv_bytes is not None:
            return self.device_kv_bytes
        assert self.hbm_bytes is not None  # checked at load
        return self.hbm_bytes * self.memory_utilization - weight_bytes - self.activation_reserve_bytes


_HW_KEYS = ["peak_flops", "mfu", "hbm_bandwidth_Bps", "hbm_efficiency", "iteration_overhead_s",
            "host_kv_bytes"]
_LINK_KEYS = ["d2h_curve", "h2d_curve", "duplex_total_Bps", "launch_overhead_s",
              "batched_launch_overhead_s"]


def load_hardware(name_or_path: str) -> HardwareProfile:
    data, where = _read("hardware", name_or_path)
    nums = {k: _number(data, k, where) for k in _HW_KEYS}
    optional = {}
    for k in ("hbm_bytes", "memory_utilization", "activation_reserve_bytes", "device_kv_bytes",
              "attention_kv_Bps"):
        if data.get(k) is not None:
            optional[k] = _number(data, k, where, positive=k != "activation_reserve_bytes")
    if "hbm_bytes" not in optional and "device_kv_bytes" not in optional:
        raise ProfileError(f"{where}: give hbm_bytes or device_kv_bytes")
    for k in ("mfu", "hbm_efficiency", "memory_utilization"):
        v = nums.get(k, optional.get(k))
        if v is not None and v > 1:
            raise ProfileError(f"{where}: {k!r} is a fraction in (0, 1], got {v}")
    raw_link = data.get("link")
    if not isinstance(raw_link, dict):
        raise ProfileError(f"{where}: missing the 'link' object")
    for k in ("d2h_curve", "h2d_curve"):
        if k not in raw_link:
            raise ProfileError(f"{where}: link is missing {k!r}")
    link = LinkProfile(
        name=str(raw_link.get("name", "link")),
        d2h=BandwidthCurve.parse(raw_link["d2h_curve"], f"{where}: link.d2h_curve"),
        h2d=BandwidthCurve.parse(raw_link["h2d_curve"], f"{where}: link.h2d_curve"),
        duplex_total_Bps=_number(raw_link, "duplex_total_Bps", where),
        launch_overhead_s=_number(raw_link, "launch_overhead_s", where, positive=False),
        batched_launch_overhead_s=_number(raw_link, "batched_launch_overhead_s", where,
                                          positive=False),
        plan_overhead_s=(_number(raw_link, "plan_overhead_s", where, positive=False)
                         if raw_link.get("plan_overhead_s") is not None else 0.0),
    )
    link_keys = [*_LINK_KEYS, *(["plan_overhead_s"] if "plan_overhead_s" in raw_link else [])]
    sources = _check_sources(
        data, [*_HW_KEYS, *optional, *(f"link.{k}" for k in link_keys)], where
    )
    return HardwareProfile(
        name=str(data.get("name", where.stem)),
        description=str(data.get("description", "")),
        link=link,
        sources=sources,
        **nums,
        **optional,
    )


@dataclass(slots=True, frozen=True)
class ModelProfile:
    name: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    dtype_bytes: int
    total_params: float
    active_params: float  # non-embedding matmul parameters one token runs
    lm_head_params: float  # run only for tokens that are sampled
    num_experts: int = 1
    experts_per_token: int = 1
    expert_params: float = 0.0  # all experts' parameters (MoE), part of total_params
    sources: dict[str, str] | None = None
    kv_dtype_bytes: int | None = None  # the KV cache's element size, where not dtype_bytes

    @property
    def kv_element_bytes(self) -> int:
        return self.dtype_bytes if self.kv_dtype_bytes is None else self.kv_dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.kv_element_bytes

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.dtype_bytes

    def block_bytes(self, block_size: int) -> int:
        """One KV block, all layers, K and V (the block-first segment, DESIGN 2)."""
        return self.kv_bytes_per_token * block_size


_MODEL_INT_KEYS = ["num_layers", "hidden_size", "num_q_heads", "num_kv_heads", "head_dim",
                   "vocab_size", "max_model_len", "dtype_bytes", "num_experts",
                   "experts_per_token"]
_MODEL_FLOAT_KEYS = ["total_params", "active_params", "lm_head_params", "expert_params"]
# Where the KV cache's element size is not the weights' (a quantized model with a bf16 cache).
_MODEL_OPTIONAL_INT_KEYS = ["kv_dtype_bytes"]


def load_model(name_or_path: str) -> ModelProfile:
    data, where = _read("models", name_or_path)
    optional = [k for k in _MODEL_OPTIONAL_INT_KEYS if k in data]
    ints: dict[str, Any] = {}
    for k in [*_MODEL_INT_KEYS, *optional]:
        v = _number(data, k, where)
        if v != int(v):
            raise ProfileError(f"{where}: {k!r} must be an integer, got {v}")
        ints[k] = int(v)
    floats: dict[str, Any] = {k: _number(data, k, where, positive=k != "expert_params")
              for k in _MODEL_FLOAT_KEYS}
    if ints["experts_per_token"] > ints["num_experts"]:
        raise ProfileError(f"{where}: experts_per_token exceeds num_experts")
    if floats["expert_params"] > floats["total_params"]:
        raise ProfileError(f"{where}: expert_params exceeds total_params")
    sources = _check_sources(data, [*_MODEL_INT_KEYS, *_MODEL_FLOAT_KEYS, *optional], where)
    return ModelProfile(name=str(data.get("name", where.stem)), sources=sources, **ints, **floats)
