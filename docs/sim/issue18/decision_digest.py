"""Digest of every schedule() output on bench-sched-like loads: the decision identity check
of docs/sim/issue18/README.md (decision cost). Run from each checkout's root with its own
venv and diff the outputs:

    (cd /work/main && .venv/bin/python $OLDPWD/docs/sim/issue18/decision_digest.py) > a.txt
    .venv/bin/python docs/sim/issue18/decision_digest.py > b.txt && diff a.txt b.txt

4 policies x 256/4,096 seats x prefix caching off/on x serial/pipelined (x shared
prompts with caching), 1,000 live requests (n = 2 groups among them), 160 iterations:
chunks, block tables, transfers, rotations, events and stats hashed per configuration."""

from __future__ import annotations

import hashlib
import random
import zlib

from common.contracts import ExecuteResult
from scheduler_svc.policy import RotationLimits, VLTParams, make_policy
from scheduler_svc.policy.iteration_cost import OnlineIterationCost
from scheduler_svc.request import SLO, Request, SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig


def run(live: int, policy: str, seats: int, pc: bool, iters: int, pipelined: bool,
        shared_prompts: bool, seed: int = 0) -> str:
    rng, tokens, clock = random.Random(seed), random.Random(seed + 1), [0.0]
    pol = make_policy(policy, VLTParams(), RotationLimits(2400, 32))
    cost = OnlineIterationCost() if pol.iteration_target_s(0.1) is not None else None
    sched = Scheduler(SchedulerConfig(
        num_device_blocks=live * 2, num_host_blocks=live * 8, block_size=16,
        max_batched_tokens=8192, max_num_seqs=seats, eager_budget_blocks=256,
        enable_prefix_caching=pc, pipelined=pipelined), pol, clock=lambda: clock[0], cost=cost)
    prefixes = [[tokens.randrange(49152) for _ in range(64)] for _ in range(5)]
    for i in range(live):
        p = [tokens.randrange(49152) for _ in range(rng.randint(16, 160))]
        if shared_prompts:
            p = prefixes[i % 5] + p
        slo = SLO(5.0, 0.1) if i % 3 else SLO(2.0, 0.05)
        req = Request(f"r{i}", p, SamplingParams(max_tokens=rng.randint(20, 400)),
                      arrival_time=clock[0] - rng.random() * 5, slo=slo)
        if i % 7 == 0 and i > 0:
            follower = Request(f"r{i}f", list(p), SamplingParams(max_tokens=50),
                               arrival_time=req.arrival_time, slo=slo)
            sched.add_group(req, [follower])
        else:
            sched.add_request(req)
    h = hashlib.sha256()
    inflight = []
    for it in range(iters):
        out = sched.schedule()
        h.update(repr([(c.request_id, c.token_ids, c.start_pos, list(c.block_table), c.sample)
                       for c in out.chunks]).encode())
        h.update(repr((out.transfers, out.rotated_out, out.rotated_in, out.recomputed,
                       out.num_running)).encode())
        if out.transfers is not None:
            sched.complete_transfer(out.transfers.fence)
        execute_s = 0.005 + 1e-4 * out.num_tokens
        inflight.append(out)
        if not pipelined or len(inflight) > 1:
            o = inflight.pop(0)
            sampled = {c.request_id: (zlib.crc32(c.request_id.encode()) + it) % 1000
                       for c in o.chunks if c.sample}
            ev = sched.update_from_output(o, ExecuteResult(sampled, execute_s=execute_s))
            h.update(repr([(e.request_id, e.new_token_ids, e.finish_reason) for e in ev]).encode())
        clock[0] += execute_s
    h.update(repr(sched.stats.as_dict() | {"decision_s_total": 0, "decision_s_max": 0}).encode())
    return h.hexdigest()[:16]


if __name__ == "__main__":
    for policy in ("lvf", "swapped-first", "waiting-first", "fcfs"):
        for seats in (256, 4096):
            for pc in (False, True):
                for pipelined in (False, True):
                    for shared in ((False, True) if pc else (False,)):
                        print(policy, seats, pc, pipelined, shared,
                              run(1000, policy, seats, pc, 160, pipelined, shared), flush=True)
