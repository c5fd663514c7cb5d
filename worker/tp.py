"""Tensor parallelism over torch.distributed (gloo on a CPU): the model's heads split across
N rank processes, one group per worker.

The split (Megatron-style, per layer):

* q/k/v and gate/up are column-parallel: rank r holds heads [r Hq/N, (r+1) Hq/N) of q, the
  matching KV heads [r Hkv/N, ...) of k and v, and 1/N of the MLP's intermediate rows;
* o and down are row-parallel: rank r holds the columns of its heads (its intermediate
  slice) and adds a partial sum to the residual stream, so each needs ONE all-reduce
  (two per layer);
* embeddings and norms are replicated; lm_head is replicated and computed on rank 0 only
  (the only rank that samples), so it needs no gather (`LM_HEADS`: "vocab" splits it by
  vocabulary rows and gathers the logits on rank 0 instead; `python -m experiments tp`
  measures both, the service runs "replicated").

Each rank holds its shard of the block-first KV pool, `[num_blocks, layers, 2, bs,
Hkv/N, hd]`, with the same block ids (worker/kv_pool.py): the scheduler's block tables do
not change, and kvmem attaches every shard (kvmem_svc/pool.py).

Processes: rank 0 is the worker service the scheduler talks to (worker/service.py). It
starts ranks 1..N-1 (`python -m worker.tp_rank`), rendezvous through a TCPStore on a port the
OS picked, and before every forward broadcasts the batch (its chunks) to them; each rank
builds the batch metadata itself and runs the same forward on its shard. A group lives
and dies together: rank 0 exits when a rank does, or when a batch has run past
`SUPERINFER_TP_STALL_S` (120 s; a stopped or stuck rank, which a collective would wait for
forever) (`watch_ranks`); the ranks die with rank 0 (PR_SET_PDEATHSIG, and gloo errors
when its peer's socket closes). So a dead or hung rank is one dead worker to the
supervisor, which restarts it and with it the whole group.

Covered: the plain-torch forward (`LlamaModel._forward_torch`) with dense or
torch-quantized weights (float32, the tested reference; bfloat16/int8/int4 where this CPU
runs them). Not covered: the C++ layer loop and the GGUF q4/q8 blocks (no all-reduce
hook there), and NCCL (the GPU worker under worker/cuda/ has no TP yet).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from common.contracts import ScheduledChunk
from common.errors import SuperInferError
from common.modelfile import ModelSource, read_gguf_metadata
from worker.model_config import ModelConfig

log = structlog.get_logger()

# A rank waits this long for the next batch (idle workers are normal) and for a peer in a
# collective; a dead peer is noticed at once (closed socket, `watch_ranks`), not by this.
LM_HEADS = ("replicated", "vocab")
GROUP_TIMEOUT = datetime.timedelta(days=7)
JOIN_TIMEOUT_S = 300.0  # ranks loading the model before they join the group
# A batch that has not finished after this long means a rank hangs (stopped, stuck): a
# collective would wait for it forever, so rank 0 takes the group down instead.
STALL_S = float(os.environ.get("SUPERINFER_TP_STALL_S", "120"))


class TensorParallelError(SuperInferError):
    """--tensor-parallel-size that this model (or this path) cannot run."""

    code = "tensor_parallel_error"
    http_status = 400


def check_split(n: int, heads: int, kv_heads: int, intermediate: int, name: str = "the model"
                ) -> None:
    """Refuse a split that does not divide the heads (with what to do instead)."""
    if n < 1:
        raise TensorParallelError(f"--tensor-parallel-size must be at least 1, got {n}")
    if n == 1:
        return
    ok = [d for d in range(1, max(heads, 1) + 1)
          if heads % d == 0 and kv_heads % d == 0 and intermediate % d == 0]
    hint = (f"use a model whose attention and KV heads divide by {n}, or "
            f"--tensor-parallel-size {' / '.join(map(str, ok))}")
    if kv_heads < n:
        raise TensorParallelError(
            f"--tensor-parallel-size {n}: {name} has {kv_heads} KV heads (GQA), fewer than "
            f"{n} ranks; KV heads are not replicated across ranks here — {hint}")
    if heads % n or kv_heads % n:
        raise TensorParallelError(
            f"--tensor-parallel-size {n} does not divide {name}'s {heads} attention heads / "
            f"{kv_heads} KV heads — {hint}")
    if intermediate % n:
        raise TensorParallelError(
            f"--tensor-parallel-size {n} does not divide {name}'s MLP size {intermediate} — "
            f"{hint}")


def source_heads(source: ModelSource) -> tuple[int, int, int]:
    """(attention heads, KV heads, MLP size) from the model's metadata alone (no weights):
    what `superinfer serve` checks before it starts any process."""
    if source.kind == "hf":
        raw = json.loads((source.path / "config.json").read_text(encoding="utf-8"))
        heads = int(raw["num_attention_heads"])
        return heads, int(raw.get("num_key_value_heads") or heads), int(raw["intermediate_size"])
    meta = read_gguf_metadata(source.path)
    arch = meta["general.architecture"]

    def one(key: str, default: Any = None) -> int:
        v = meta.get(f"{arch}.{key}", default)
        return int(v[0] if isinstance(v, list) else v)

    heads = one("attention.head_count")
    return heads, one("attention.head_count_kv", heads), one("feed_forward_length")


def check_source(n: int, source: ModelSource) -> None:
    if n != 1:
        check_split(n, *source_heads(source), name=source.name)


# -- sharding -------------------------------------------------------------------------------
def shard_config(cfg: ModelConfig, rank: int, n: int) -> ModelConfig:
    """This rank's view: its heads and MLP slice (everything else as the model's)."""
    check_split(n, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.name)
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} outside a group of {n}")
    fields = {f: getattr(cfg, f) for f in cfg.__slots__}
    fields.update(num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                  intermediate_size=cfg.intermediate_size // n)
    return ModelConfig(**fields)


def shard_weights(cfg: ModelConfig, w: dict[str, torch.Tensor], rank: int, n: int,
                  lm_head: str = "replicated") -> dict[str, torch.Tensor]:
    """The loader's dense weights (worker/loader.py names) cut to rank `rank` of `n`;
    lm_head whole, or (`lm_head="vocab"`) this rank's 1/n of the vocabulary rows."""
    if lm_head not in LM_HEADS:
        raise ValueError(f"lm_head must be one of {', '.join(LM_HEADS)}, got {lm_head!r}")
    if lm_head == "vocab" and cfg.vocab_size % n:
        raise TensorParallelError(f"a vocab-parallel lm_head needs the vocabulary "
                                  f"({cfg.vocab_size}) to divide by {n}")
    hd = cfg.head_dim
    q, kv, f = cfg.num_heads // n * hd, cfg.num_kv_heads // n * hd, cfg.intermediate_size // n

    def rows(t: torch.Tensor, size: int) -> torch.Tensor:
        return t[rank * size: (rank + 1) * size].contiguous()

    def cols(t: torch.Tensor, size: int) -> torch.Tensor:
        return t[:, rank * size: (rank + 1) * size].contiguous()

    out: dict[str, torch.Tensor] = {}
    for name, t in w.items():
        part = name.rsplit(".", 1)[-1]
        if part in ("q_proj", "q_bias"):
            out[name] = rows(t, q)
        elif part in ("k_proj", "v_proj", "k_bias", "v_bias"):
            out[name] = rows(t, kv)
        elif part in ("gate_proj", "up_proj"):
            out[name] = rows(t, f)
        elif part == "o_proj":
            out[name] = cols(t, q)
        elif part == "down_proj":
            out[name] = cols(t, f)
        elif name == "lm_head" and lm_head == "vocab":
            out[name] = rows(t, cfg.vocab_size // n)
        else:  # embeddings, norms, lm_head: replicated
            out[name] = t
    return out


# -- the group ------------------------------------------------------------------------------
@dataclass(slots=True)
class TPGroup:
    """This process's place in the group; `all_reduce` is the row-parallel matmuls' sum."""

    rank: int
    size: int
    store: Any  # torch.distributed.TCPStore
    busy_since: float = 0.0  # rank 0: monotonic start of the batch in flight (0: none)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x)
        return x

    def send_batch(self, chunks: Sequence[ScheduledChunk] | None) -> None:
        """Rank 0: the next batch to every rank (None: stop)."""
        import torch.distributed as dist

        dist.broadcast_object_list([None if chunks is None else list(chunks)], src=0)

    def lockstep(self, chunks: Sequence[ScheduledChunk],
                 forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Rank 0: send the batch, run this rank's part of it. A failure here would leave
        the other ranks waiting in a collective this rank never joins: the worker exits
        instead, and the supervisor restarts the group (DESIGN §6: batches are replayable)."""
        self.busy_since = time.monotonic()
        try:
            self.send_batch(chunks)
            return forward()
        except BaseException as e:
            log.error("tp_forward_failed", rank=self.rank, error=repr(e),
                      action="worker exits; the supervisor restarts the group")
            os._exit(70)
        finally:
            self.busy_since = 0.0

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Vocab-parallel lm_head: every rank's [S, V/N] slice -> [S, V] on rank 0."""
        import torch.distributed as dist

        if self.rank != 0:
            dist.gather(logits, None, dst=0)
            return None
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, 1)

    def recv_batch(self) -> list[ScheduledChunk] | None:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def join_group(rank: int, size: int, store: Any) -> TPGroup:
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() and os.environ.get(
        "SUPERINFER_TP_BACKEND") == "nccl" else "gloo"  # NCCL: untested here (no GPU)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=GROUP_TIMEOUT)
    return TPGroup(rank, size, store)


def master_store(size: int) -> Any:
    """Rank 0's TCPStore on a port the OS picks (no race for a free port)."""
    from torch.distributed import TCPStore

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
    return TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))


def threads_per_rank(size: int) -> int:
    """Each rank's torch threads: OMP_NUM_THREADS when set, else the cores split N ways."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (os.cpu_count() or 1) // size)


@dataclass(slots=True)
class RankSpec:
    """What rank 0 hands a rank it starts (JSON on its command line)."""

    rank: int
    size: int
    store_port: int
    config: dict[str, Any]  # common.config.EngineConfig fields
    run_dir: str
    log_level: str = "info"
    lm_head: str = "replicated"  # LM_HEADS


def start_ranks(size: int, store: Any, config: dict[str, Any], run_dir: Path,
                log_level: str, lm_head: str = "replicated") -> list[subprocess.Popen[bytes]]:
    """Rank 0 (on its main thread: PR_SET_PDEATHSIG follows the thread that forks): start
    ranks 1..size-1, their console into `<run_dir>/worker.rank<r>.out`."""
    procs = []
    for r in range(1, size):
        spec = RankSpec(r, size, int(store.port), config, str(run_dir), log_level, lm_head)
        out = open(run_dir / f"worker.rank{r}.out", "ab")  # noqa: SIM115 - the child's now
        try:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "worker.tp_rank", json.dumps(_spec_json(spec))],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME",
                                                                        "lo")}))
        finally:
            out.close()
    return procs


def _spec_json(spec: RankSpec) -> dict[str, Any]:
    return {f: getattr(spec, f) for f in spec.__slots__}


def watch_ranks(procs: list[subprocess.Popen[bytes]], stopping: threading.Event,
                busy_since: Callable[[], float] = lambda: 0.0, stall_s: float = STALL_S,
                poll_s: float = 0.1) -> threading.Thread:
    """Rank 0: exit at once when a rank dies, or when a batch (started at `busy_since()`)
    has run past `stall_s` (a stopped or stuck rank), so the supervisor restarts the group."""

    def run() -> None:
        while not stopping.is_set():
            for r, p in enumerate(procs, start=1):
                code = p.poll()
                if code is not None and not stopping.is_set():
                    log.error("tp_rank_died", rank=r, pid=p.pid, code=code,
                              action="worker exits; the supervisor restarts the group")
                    os._exit(70)
            since = busy_since()
            if since and time.monotonic() - since > stall_s and not stopping.is_set():
                log.error("tp_batch_stalled", seconds=round(time.monotonic() - since, 1),
                          limit_s=stall_s, action="worker exits (its ranks with it); the "
                          "supervisor restarts the group")
                os._exit(70)
            time.sleep(poll_s)

    t = threading.Thread(target=run, name="tp-watch", daemon=True)
    t.start()
    return t


def stop_ranks(procs: list[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def die_with_parent() -> None:
    """A rank: SIGKILL when rank 0 dies (Linux). Had it died already, joining the group
    fails instead."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
