"""Load a model and choose its executor format: what the worker service and the in-process
engine both start with.

`build_model` reads the weights (dense fp32 from the loader, plus the GGUF file's own
blocks), loads the C++ kernels when they build, resolves `--dtype` (worker/formats.py;
`auto` runs the quality check once per model and machine), builds that weight set and
drops the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from common.config import EngineConfig
from common.contracts import KVShape
from common.modelfile import ModelSource, resolve_model
from worker import kernels
from worker.formats import (
    FORMATS,
    QUALITY_TOLERANCE,
    Capabilities,
    Format,
    candidates,
    dense_fallback,
    kv_dtype,
    read_verdicts,
    verdict_key,
    write_verdict,
)
from worker.gguf_loader import load_gguf_blocks
from worker.loader import load_weights
from worker.model import LlamaModel
from worker.model_config import ModelConfig
from worker.quality import perplexity, text
from worker.quant import QGEMM_ACTIVATIONS
from worker.runner import kv_block_bytes
from worker.weights import WeightSet

log = structlog.get_logger()

CHECK_TOKENS = 1024  # of the shipped text, for --dtype auto's check


@dataclass(slots=True)
class BuiltModel:
    source: ModelSource
    model: LlamaModel
    format: Format
    kv_dtype: torch.dtype
    capabilities: Capabilities

    @property
    def weights(self) -> str:
        """The model's weight set to run (named after the format)."""
        return self.format.name


def load_model(source: ModelSource, ops: object | None) -> LlamaModel:
    cfg, dense = load_weights(source.path, source.kind, torch.float32)
    blocks = load_gguf_blocks(source.path, cfg) if source.kind == "gguf" else None
    return LlamaModel(cfg, dense, blocks, ops)


def build_model(model: str | None, dtype: str = "auto", kv: str = "auto") -> BuiltModel:
    t0 = time.perf_counter()
    source = resolve_model(model)
    ops = kernels.load()
    caps = Capabilities.detect(ops, source.kind)
    lm = load_model(source, ops)
    fmt = choose(dtype, lm, source, caps)
    add_format(lm, fmt, caps)
    lm.keep_only(fmt.name)
    ws = lm.sets[fmt.name]
    built = BuiltModel(source, lm, fmt, kv_dtype(fmt, kv), caps)
    log.info("executor", dtype=fmt.name, requested=dtype, kv_dtype=str(built.kv_dtype),
             matrices=ws.formats(), weights_mib=round(ws.nbytes() / 2**20, 1),
             kernels=caps.kernels, seconds=round(time.perf_counter() - t0, 2))
    return built


def add_format(lm: LlamaModel, fmt: Format, caps: Capabilities) -> WeightSet:
    return lm.add_weights(fmt.name, fmt.layers, fmt.head, dense_fallback(fmt, caps))


def choose(requested: str, lm: LlamaModel, source: ModelSource, caps: Capabilities) -> Format:
    """The format to run: an explicit request (after its fallbacks), or for `auto` the
    first candidate whose perplexity is within QUALITY_TOLERANCE of float32's."""
    chain = candidates(requested, caps)
    if requested != "auto" or len(chain) == 1:
        return chain[0]
    machine = kernels.machine_key()
    check = f"{CHECK_TOKENS}tok-qgemm-{QGEMM_ACTIVATIONS}"
    verdicts = read_verdicts()
    ids: list[int] | None = None
    ref: float | None = None
    for fmt in chain:
        if fmt.name == "float32":
            log.info("dtype_auto", chose="float32", why="no faster format passed the check")
            return fmt
        key = verdict_key(source.path, fmt.name, check, machine)
        verdict = verdicts.get(key)
        cached = verdict is not None
        if verdict is None:
            if ids is None:
                from common.tokenizer import Tokenizer

                ids = Tokenizer.from_source(source).encode(text())[:CHECK_TOKENS]
                add_format(lm, FORMATS["float32"], caps)
                ref = perplexity(lm, "float32", ids, kv_dtype(FORMATS["float32"])).ppl
            add_format(lm, fmt, caps)
            ppl = perplexity(lm, fmt.name, ids, kv_dtype(fmt)).ppl
            verdict = {"format": fmt.name, "ppl": ppl, "float32_ppl": ref,
                       "ok": ppl <= ref * (1 + QUALITY_TOLERANCE), "tokens": len(ids)}  # type: ignore[operator]
            write_verdict(key, verdict)
        log.info("dtype_auto", candidate=fmt.name, passed=verdict["ok"], ppl=round(verdict["ppl"], 4),
                 float32_ppl=round(verdict["float32_ppl"], 4), cached=cached)
        if verdict["ok"]:
            log.info("dtype_auto", chose=fmt.name)
            return fmt
        lm.sets.pop(fmt.name, None)
    return chain[-1]


# -- tensor parallel (worker/tp.py) ----------------------------------------------------------
@dataclass(slots=True)
class Shard:
    """One rank's part of the model: its heads' matrices, on the plain-torch forward."""

    source: ModelSource
    full: ModelConfig  # the whole model's (what the scheduler sees)
    model: LlamaModel  # cfg: this rank's heads
    format: Format
    kv_dtype: torch.dtype

    @property
    def weights(self) -> str:
        return self.format.name


def tp_format(dtype: str, caps: Capabilities) -> Format:
    """The format a TP rank runs: `auto` is float32 (the quality check and the formats it
    prefers need the C++ kernels); an explicit one falls back as usual, past gguf."""
    if dtype == "auto":
        return FORMATS["float32"]
    return candidates(dtype, caps)[0]


def build_shard(config: EngineConfig, rank: int, size: int,
                reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                lm_head: str = "replicated") -> Shard:
    """Load the model and keep rank `rank`'s shard (all ranks agree: same config).
    `reduce`: the group's all-reduce (None only for a shard run alone, in tests);
    `lm_head`: worker/tp.py LM_HEADS (with "vocab", set the model's `gather`)."""
    from worker.tp import check_split, shard_config, shard_weights

    t0 = time.perf_counter()
    source = resolve_model(config.model)
    caps = Capabilities.detect(None, "hf")  # no C++ kernels, no GGUF blocks under TP
    fmt = tp_format(config.dtype, caps)
    full, dense = load_weights(source.path, source.kind, torch.float32)
    check_split(size, full.num_heads, full.num_kv_heads, full.intermediate_size, source.name)
    lm = LlamaModel(shard_config(full, rank, size),
                    shard_weights(full, dense, rank, size, lm_head), None, None, reduce=reduce,
                    head=rank == 0 or lm_head == "vocab")
    del dense
    add_format(lm, fmt, caps)
    lm.keep_only(fmt.name)
    log.info("tp_shard", rank=rank, size=size, dtype=fmt.name, heads=lm.cfg.num_heads,
             kv_heads=lm.cfg.num_kv_heads, mlp=lm.cfg.intermediate_size,
             weights_mib=round(lm.sets[fmt.name].nbytes() / 2**20, 1),
             seconds=round(time.perf_counter() - t0, 2))
    return Shard(source, full, lm, fmt, kv_dtype(fmt, config.kv_dtype))


def shard_pool_shape(config: EngineConfig, shard: Shard) -> tuple[int, ...]:
    """Every rank's pool: the block count of the whole model's KV within --kv-memory-gib
    (so the budget is the group's), each block holding this rank's KV heads."""
    full_bytes = kv_block_bytes(shard.full, config.block_size, shard.kv_dtype)
    num_blocks, _ = config.blocks_for(full_bytes)
    c = shard.model.cfg
    return KVShape(num_blocks, c.num_layers, config.block_size, c.num_kv_heads,
                   c.head_dim).shape
