"""Tensor-parallel ranks 1..N-1 (worker/tp.py): `python -m worker.tp_rank SPEC`, started
by rank 0 (the worker service). A rank loads its shard, maps its pool, joins the group and
runs every batch rank 0 broadcasts, until rank 0 says stop (or dies: then so does it)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import structlog
import torch
from torch.distributed import TCPStore

from common.config import EngineConfig
from common.logging import configure_logging
from common.shm import SegmentRecord
from worker.attention import build_meta
from worker.build import build_shard, shard_pool_shape
from worker.kv_pool import DevicePool
from worker.tp import JOIN_TIMEOUT_S, RankSpec, die_with_parent, join_group, threads_per_rank

log = structlog.get_logger()


def rank_main(spec: RankSpec) -> int:
    """Load this rank's shard, join the group, run every batch rank 0 broadcasts."""
    die_with_parent()
    run_dir = Path(spec.run_dir)
    configure_logging(f"worker.rank{spec.rank}", run_dir / f"worker.rank{spec.rank}.log",
                      spec.log_level)
    torch.set_grad_enabled(False)
    torch.set_num_threads(threads_per_rank(spec.size))
    cfg = EngineConfig(**spec.config)
    store = TCPStore("127.0.0.1", spec.store_port, spec.size, is_master=False,
                     timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    shard = build_shard(cfg, spec.rank, spec.size, lm_head=spec.lm_head)
    record = SegmentRecord(run_dir / f"worker.rank{spec.rank}.shm")
    record.reap()
    pool = DevicePool.create(shard_pool_shape(cfg, shard), shard.kv_dtype, "cpu")
    name = pool.handle().shm_name
    record.add(name)
    try:
        group = join_group(spec.rank, spec.size, store)
        shard.model.reduce = group.all_reduce
        if spec.lm_head == "vocab":
            shard.model.gather = group.gather_vocab
        store.set(f"shm/{spec.rank}", name)
        log.info("tp_rank_ready", rank=spec.rank, size=spec.size, pool=name,
                 heads=shard.model.cfg.num_heads, kv_heads=shard.model.cfg.num_kv_heads,
                 threads=torch.get_num_threads())
        kv = pool.tensor
        while True:
            chunks = group.recv_batch()
            if chunks is None:
                break
            shard.model.forward(shard.weights, build_meta(chunks, cfg.block_size), kv)
        log.info("tp_rank_stopped", rank=spec.rank)
        group.close()
    finally:
        kv = torch.empty(0)
        pool.close()
        record.remove(name)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.tp_rank",
                                description="one tensor-parallel rank (rank 0 starts these)")
    p.add_argument("spec", help="RankSpec as JSON")
    args = p.parse_args(argv)
    return rank_main(RankSpec(**json.loads(args.spec)))


if __name__ == "__main__":
    sys.exit(main())
