"""The executor's number formats (`--dtype`), what each needs, and `--dtype auto`.

| --dtype | layer matrices | lm_head | needs |
|---|---|---|---|
| ``float32`` | fp32 | fp32 | nothing: the correctness reference |
| ``bfloat16`` | bf16 | bf16 | native bf16 matmuls (avx512_bf16 or AMX) |
| ``int8`` | int8 per row | int8 | native bf16 (torch's kernel takes bf16 activations) |
| ``int4`` | int4 per 32 (Q4_x nibbles kept) | int8 | native bf16, torch's int4pack ops |
| ``gguf`` | the file's Q4_1/Q4_0/Q8_0 blocks | the same | a GGUF file, the C++ kernels, AVX2 or AVX-512 |

A matrix whose block type or shape a format cannot hold is stored dense (bf16 where the
CPU has native bf16, else fp32): a GGUF with any quant type loads. ``float16`` is accepted
for old command lines and runs as ``bfloat16`` (no fast fp16 CPU kernels here).

``auto`` (the default) takes the first of `AUTO_ORDER` this machine runs whose perplexity
on the shipped text (worker/quality.py) is within `QUALITY_TOLERANCE` of float32's, and
logs the choice. The order is measured (docs/results/executor/): ``gguf`` is the fastest
at batch 1, 8 and 32 on the 2-core AVX-512 and AVX2 machines measured; where its SIMD qgemm
is missing, bf16 beats int4 from ~8 tokens per step on (DESIGN §1c), so ``bfloat16`` is
next. The verdict is cached per model file, format, qgemm arithmetic and machine
(`verdict_cache`), so only the first start pays the check (~3-6 s). An explicit format
the machine cannot run falls back along `FALLBACK` with a logged warning; it is not
quality-checked (it was asked for).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

log = structlog.get_logger()

QUALITY_TOLERANCE = 0.02  # perplexity at most 2 % above float32's


@dataclass(frozen=True, slots=True)
class Format:
    name: str  # the --dtype value
    layers: str  # matrix format of every layer matrix (worker/weights.py)
    head: str  # ... of lm_head
    needs: tuple[str, ...]  # Capabilities fields that must be true


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("float32", "fp32", "fp32", ()),
    Format("bfloat16", "bf16", "bf16", ("bf16",)),
    Format("int8", "int8", "int8", ("bf16",)),
    Format("int4", "int4", "int8", ("bf16", "int4pack")),
    Format("gguf", "gguf", "gguf", ("gguf_source", "kernels", "qgemm")),
)}
AUTO_ORDER = ("gguf", "bfloat16", "float32")
FALLBACK = {"gguf": "int4", "int4": "bfloat16", "int8": "bfloat16", "bfloat16": "float32",
            "float16": "bfloat16"}


@dataclass(frozen=True, slots=True)
class Capabilities:
    kernels: bool  # the C++ kernels built and loaded
    qgemm: bool  # ... with a SIMD qgemm (AVX2 or AVX-512; else only its scalar reference)
    bf16: bool  # native bf16 matmuls
    int4pack: bool  # torch has the int4 weight-only CPU ops
    gguf_source: bool  # the model is a GGUF file (its blocks can be kept)

    @classmethod
    def detect(cls, ops: Any | None, source_kind: str) -> Capabilities:
        aten = torch.ops.aten
        return cls(
            kernels=ops is not None,
            qgemm=qgemm_isa(ops) not in ("none", "scalar"),
            bf16=native_bf16(),
            int4pack=hasattr(aten, "_weight_int4pack_mm_for_cpu")
            and hasattr(aten, "_convert_weight_to_int4pack_for_cpu"),
            gguf_source=source_kind == "gguf",
        )

    def missing(self, fmt: Format) -> list[str]:
        return [n for n in fmt.needs if not getattr(self, n)]


_NEED_TEXT = {
    "bf16": "this CPU has no native bf16 matmuls (avx512_bf16 or AMX)",
    "int4pack": "this torch has no int4 weight-only CPU kernels",
    "gguf_source": "the model is not a GGUF file",
    "kernels": "the C++ kernels are not available (see the kernels_unavailable warning)",
    "qgemm": "the C++ qgemm has no SIMD path for this CPU (it needs AVX2 with FMA and F16C, "
             "or AVX-512BW)",
}


def qgemm_isa(ops: Any | None) -> str:
    """The SIMD path the kernels' qgemm was built with (csrc/qgemm.cpp): ``avx512-vnni``,
    ``avx512``, ``avx2-vnni``, ``avx2``; ``scalar`` (its slow reference) or ``none``."""
    return "none" if ops is None else str(ops.qgemm_isa())


def native_bf16() -> bool:
    try:
        cpu: Any = torch.cpu
        return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
    except AttributeError:  # another torch: read the CPU flags ourselves
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
        return any(f in text.split() for f in ("avx512_bf16", "amx_bf16", "bf16"))


def dense_fallback(fmt: Format, caps: Capabilities) -> torch.dtype:
    """The dtype of matrices `fmt` cannot hold (and of float32's, trivially)."""
    return torch.bfloat16 if fmt.name != "float32" and caps.bf16 else torch.float32


def kv_dtype(fmt: Format, requested: str = "auto") -> torch.dtype:
    """The KV pool's dtype: float32 with float32 weights (the reference), else bf16 (half
    the memory and transfer bytes; attention reads it as fp32, measured +0.0x % ppl)."""
    if requested == "float32":
        return torch.float32
    if requested == "bfloat16":
        return torch.bfloat16
    return torch.float32 if fmt.name == "float32" else torch.bfloat16


def candidates(requested: str, caps: Capabilities) -> list[Format]:
    """Formats to try, best first. Logs each fallback of an explicit request."""
    if requested == "auto":
        return [FORMATS[n] for n in AUTO_ORDER if not caps.missing(FORMATS[n])]
    name = requested
    while True:
        fmt = FORMATS.get(name)
        why = (["float16 has no fast CPU kernels here"] if name == "float16"
               else caps.missing(fmt) if fmt is not None else None)
        if why is None:
            raise ValueError(f"unknown --dtype {requested!r}; choose from auto, "
                             f"{', '.join(FORMATS)}, float16")
        if fmt is not None and not why:
            return [fmt]
        nxt = FALLBACK[name]
        log.warning("dtype_fallback", requested=name, using=nxt,
                    why="; ".join(_NEED_TEXT.get(w, w) for w in why))
        name = nxt


# -- the verdict cache ---------------------------------------------------------------
def verdict_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "superinfer" / "quality.json"


def verdict_key(model_path: Path, fmt: str, check: str, machine: str) -> str:
    st = model_path.stat() if model_path.is_file() else None
    ident = f"{model_path}|{st.st_size if st else ''}|{st.st_mtime_ns if st else ''}"
    text = "|".join((ident, fmt, check, machine, torch.__version__))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def read_verdicts() -> dict[str, Any]:
    try:
        data = json.loads(verdict_cache().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_verdict(key: str, value: dict[str, Any]) -> None:
    """Merge one verdict into the cache file (atomic replace; a lost race loses a cache
    entry, never the file)."""
    path = verdict_cache()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = read_verdicts()
        data[key] = value
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".quality.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("quality_cache_unwritable", path=str(path), error=str(e))
