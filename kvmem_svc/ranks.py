"""One transfer plan on every tensor-parallel rank's pool (worker/tp.py).

Each rank holds its shard of the device pool (its KV heads) with the same block ids, and
kvmem keeps one host pool per rank beside it: a plan's block pairs mean the same blocks
on every rank, so `RankedEngine` submits the plan to one DuplexEngine per rank (all
running at once) and returns only when every rank's copies are done — the fence the
scheduler completes then covers all ranks. With one rank it is that rank's engine.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from common.contracts import TransferPlan
from kvmem_svc.duplex import DuplexEngine, Mode, TransferError, TransferTiming


class RankedEngine:
    def __init__(self, devices: list[torch.Tensor], hosts: list[torch.Tensor],
                 mode: Mode | str = Mode.DUPLEX, strict: bool = True) -> None:
        if not devices or len(devices) != len(hosts):
            raise ValueError(f"{len(devices)} device pools for {len(hosts)} host pools")
        self.engines = [DuplexEngine(d, h, mode, strict=strict)
                        for d, h in zip(devices, hosts, strict=True)]

    @property
    def ranks(self) -> int:
        return len(self.engines)

    def describe(self) -> str:
        one = self.engines[0].describe()
        return one if self.ranks == 1 else f"{one}, x{self.ranks} ranks"

    def transfer(self, plan: TransferPlan) -> TransferTiming:
        """Every rank's copies of the plan are done on return. Block counts and seconds
        are the plan's (the slowest rank's); bytes and copies add up over the ranks."""
        # Every rank checks the plan against the same block counts: if one refuses it
        # (TransferConflict), the first does, before anything was submitted.
        handles = [e.submit(plan) for e in self.engines]
        timings: list[TransferTiming] = []
        failed: TransferError | None = None
        for e, h in zip(self.engines, handles, strict=True):
            try:
                timings.append(e.wait(h))
            except TransferError as err:  # wait for the other ranks' copies first
                failed = failed or err
        if failed is not None:
            raise failed
        first = timings[0]
        if self.ranks == 1:
            return first
        return replace(first, block_bytes=sum(t.block_bytes for t in timings),
                       copies=sum(t.copies for t in timings),
                       d2h_s=max(t.d2h_s for t in timings), h2d_s=max(t.h2d_s for t in timings),
                       eager_s=max(t.eager_s for t in timings),
                       total_s=max(t.total_s for t in timings))

    def close(self) -> None:
        for e in self.engines:
            e.close()
