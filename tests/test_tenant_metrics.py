"""Per-tenant statistics: the scheduler counts each request under its tenant's GetStats key
(`<key>@<tenant>`, the plain key for tenant ""), and /metrics shows them with a `tenant`
label whose sum over tenants is the total (docs/metrics.md, "Per tenant")."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from common.contracts import ExecuteResult
from gateway.metrics import GatewayMetrics
from proto import scheduler_pb2
from scheduler_svc.loop import LoopStats
from scheduler_svc.policy import RotationLimits, VLTParams, make_policy
from scheduler_svc.request import SLO, FinishReason, Request, SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.scheduler_config import tenant_key
from superinfer.bench.server_stats import scheduler_stat

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _request(tenant: str, tokens: list[float], *, rid: str = "r", ttft_s: float = 1.0,
             tbt_s: float = 0.1, reason: FinishReason | None = FinishReason.LENGTH) -> Request:
    """A request that arrived at 0 and got a token at each of `tokens`."""
    req = Request(rid, [1, 2], SamplingParams(max_tokens=len(tokens) or 1), arrival_time=0.0,
                  slo=SLO(ttft_s=ttft_s, tbt_s=tbt_s), tenant=tenant)
    for t in tokens:
        req.append_token(5, t)
    req.finish_reason = reason
    return req


def _samples(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_tenants_request_counts_under_its_tenant_key_only() -> None:
    stats = LoopStats()
    stats.count_slo(_request("alpha", [0.5, 0.55, 0.6]), now=0.6)  # met TTFT, both gaps
    d = stats.as_dict()
    assert (d["slo_ttft_met@alpha"], d["slo_tbt_met@alpha"], d["slo_good@alpha"]) == (1, 2, 1)
    assert (d["slo_ttft_met"], d["slo_tbt_met"], d["slo_good"]) == (0, 0, 0)
    assert "slo_ttft_met@beta" not in d  # a tenant has keys once it has requests
    stats.count_slo(_request("", [2.0]), now=2.0)  # no tenants file: today's keys
    d = stats.as_dict()
    assert (d["slo_ttft_missed"], d["slo_ttft_missed@alpha"]) == (1, 0)


def test_goodput_counts_requests_within_ttft_and_tpot() -> None:
    stats = LoopStats()
    # TTFT 0.5 s, gaps 0.05 and 0.25: one gap late, yet TPOT 0.15 > 0.1: not good.
    stats.count_slo(_request("alpha", [0.5, 0.55, 0.8], rid="slow"), now=0.8)
    # Gaps 0.02 and 0.15: one gap late but TPOT 0.085 <= 0.1: good (vLLM's test).
    stats.count_slo(_request("alpha", [0.5, 0.52, 0.67], rid="paced"), now=0.7)
    stats.count_slo(_request("alpha", [0.5], rid="one"), now=0.5)  # TPOT 0 for one token
    stats.count_slo(_request("alpha", [1.5, 1.55], rid="late"), now=1.6)  # TTFT missed
    stats.count_slo(_request("alpha", [0.5, 0.55], rid="gone", reason=FinishReason.ABORT),
                    now=0.6)  # aborted: not goodput however fast
    # Finished by stop, but the loop ended it with an error: not completed.
    stats.count_slo(_request("alpha", [0.5, 0.55], rid="failed", reason=FinishReason.STOP),
                    now=0.6, completed=False)
    d = stats.as_dict()
    assert d["slo_good@alpha"] == 2
    assert (d["slo_ttft_met@alpha"], d["slo_ttft_missed@alpha"]) == (5, 1)


def test_metrics_render_tenants_as_a_label_that_sums_to_the_total() -> None:
    stats = LoopStats()
    stats.count_slo(_request("alpha", [0.5, 0.55]), now=0.6)
    stats.count_slo(_request("alpha", [2.0, 2.3], rid="late"), now=2.3)
    stats.count_slo(_request("", [0.2, 0.25], rid="plain"), now=0.3)
    reply = scheduler_pb2.StatsReply(counters={**stats.as_dict(), "rotations": 1.0,
                                               "rotations@alpha": 2.0})
    metrics = GatewayMetrics()
    metrics.prompt_tokens.inc(7, "alpha")
    metrics.prompt_tokens.inc(3)
    text = metrics.render(reply, "tiny").decode()

    assert 'superinfer_slo_ttft_requests_total{outcome="met",tenant="alpha"} 1.0' in text
    assert 'superinfer_slo_ttft_requests_total{outcome="missed",tenant="alpha"} 1.0' in text
    assert 'superinfer_slo_ttft_requests_total{outcome="met"} 1.0' in text  # tenant ""
    assert 'superinfer_slo_good_requests_total{tenant="alpha"} 1.0' in text
    assert "superinfer_slo_good_requests_total 1.0" in text
    assert 'superinfer_scheduler_rotations_total{tenant="alpha"} 2.0' in text
    assert 'superinfer_prompt_tokens_total{tenant="alpha"} 7.0' in text
    assert "superinfer_prompt_tokens_total 3.0" in text
    # One family each, whose samples add up to the totals; vLLM's names carry the totals.
    families = [f.name for f in text_string_to_metric_families(text)]
    assert families.count("superinfer_slo_ttft_requests") == 1
    m = _samples(text)
    met = sum(v for (n, ls), v in m.items()
              if n == "superinfer_slo_ttft_requests_total" and ("outcome", "met") in ls)
    assert met == 2
    vllm = frozenset({"model_name": "tiny", "engine": "0"}.items())
    assert m[("vllm:prompt_tokens_total", vllm)] == 10
    # bench serve's reader sums the tenants too.
    delta = {"superinfer_scheduler_rotations_total": 1.0,
             "superinfer_scheduler_rotations_total{tenant=alpha}": 2.0,
             "superinfer_slo_ttft_requests_total{outcome=met,tenant=alpha}": 4.0,
             "superinfer_slo_ttft_requests_total{outcome=met}": 1.0,
             "superinfer_slo_ttft_requests_total{outcome=missed}": 9.0}
    assert scheduler_stat(delta, "rotations") == 3
    assert scheduler_stat(delta, "slo_ttft_met") == 4 + 1


def test_rotations_are_counted_for_the_rotated_requests_tenant() -> None:
    """Two seats, three decodes (test_rotasched's): a rotation, exported under the tenant of
    the request rotated out; the global count stays for the simulator and `generate`."""
    clock = [0.0]
    sched = Scheduler(SchedulerConfig(num_device_blocks=128, num_host_blocks=256, block_size=4,
                                      max_num_seqs=2, pipelined=False),
                      make_policy("lvf", VLTParams(), RotationLimits.bare()), clock=lambda: clock[0])
    for i, tenant in enumerate(("", "alpha", "beta")):
        sched.add_request(Request(f"r{i}", [1, 2, 3],
                                  SamplingParams(max_tokens=1000, ignore_eos=True),
                                  arrival_time=0.01 * i, slo=SLO(5.0, 1.0), tenant=tenant))
    for _ in range(400):
        out = sched.schedule()
        if out.transfers is not None:
            sched.complete_transfer(out.transfers.fence)
        sched.update_from_output(out, ExecuteResult(
            {c.request_id: 7 for c in out.chunks if c.sample}, execute_s=0.01))
        clock[0] += 0.01
    assert sched.stats.rotations > 0
    counters = sched.stats.counters()
    assert sched.stats.as_dict()["rotations"] == sched.stats.rotations  # the total
    for tenant in ("", "alpha", "beta"):
        want = sum(r.num_rotations for r in sched.requests.values() if r.tenant == tenant)
        assert counters.get(tenant_key("rotations", tenant), 0.0) == want, tenant
    assert sum(v for k, v in counters.items()
               if k.partition("@")[0] == "rotations") == sched.stats.rotations
