"""B_xfer "auto": the KV blocks the link moves one way in 50 ms, from measured copies.

The paper fixes B_xfer by hand per machine (2,400 blocks on a GH200). The number follows
from the link: rotation that moves more than the link carries in a fraction of an
iteration stalls the batch that waits for it. `LinkRate` measures blocks per second of
each direction from the transfer engine's own busy times (its `TransferResult`), and the
budget is what the slower direction moves in `XFER_WINDOW_S`. With a GH200 and
Qwen2.5-32B's 4 MiB blocks at 175 GB/s that is ~2,090 blocks, near the paper's 2,400; the
simulator computes the same rule from its link profile. Until a copy has been measured
the budget is unlimited (the first rotations are not held back by a guess), and it is
never less than one request at the longest context needs (`floor`): a budget under that
would take several iterations to bring one request back, and on a loaded CPU, where the
copies share the cores with the batch, the measured rate sank that low (the real stack at
2x: TTFT 100 -> 97 %, p99 TTFT 8 -> 87 s against an unlimited budget;
docs/results/rotasched/).
"""

from __future__ import annotations

from common.contracts import TransferPlan, TransferResult

XFER_WINDOW_S = 0.05
# Copies shorter than this are mostly call overhead (a gRPC round trip on the service):
# they would make the link look slow, so they are not measured.
MIN_MEASURED_S = 0.002


def xfer_budget(blocks_per_s: float, floor: int = 1, window_s: float = XFER_WINDOW_S) -> int:
    return max(1, floor, int(blocks_per_s * window_s))


class LinkRate:
    """A moving mean of the blocks per second each copy direction sustains."""

    def __init__(self, floor: int = 1, smoothing: float = 0.8) -> None:
        self.floor = floor  # blocks of one request at the longest context
        self._smoothing = smoothing
        self._rate: dict[str, float] = {}

    def observe(self, plan: TransferPlan, moved: TransferResult) -> None:
        for direction, blocks, busy_s in (
            ("d2h", len(plan.swap_out) + len(plan.eager), moved.d2h_s),
            ("h2d", len(plan.swap_in) + len(plan.late_swap_in), moved.h2d_s),
        ):
            if blocks and busy_s >= MIN_MEASURED_S:
                r = blocks / busy_s
                old = self._rate.get(direction)
                self._rate[direction] = r if old is None else (
                    self._smoothing * old + (1 - self._smoothing) * r)

    def budget(self) -> int | None:
        """B_xfer from the slower direction measured so far (None: nothing measured)."""
        if not self._rate:
            return None
        return xfer_budget(min(self._rate.values()), self.floor)
