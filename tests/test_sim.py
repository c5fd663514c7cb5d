"""`superinfer sim`: the real scheduler on a simulated clock (small, fast configurations)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler_svc.policy import POLICY_NAMES, RotationLimits
from superinfer.sim.cli import main as sim_main
from superinfer.sim.cost import ExecutionCostModel
from superinfer.sim.engine import (
    UNLIMITED,
    PolicyVariant,
    SimConfig,
    SimResult,
    SimulationError,
    Simulator,
    simulate,
)
from superinfer.sim.profile import load_hardware, load_model
from superinfer.workload import TraceRequest, WorkloadSpec, build_trace

GH200 = load_hardware("gh200")
LLAMA = load_model("llama-3-8b")
QWEN = load_model("qwen2.5-32b")


def small_trace(rps: float = 20.0, duration: float = 6.0, seed: int = 0) -> list[TraceRequest]:
    return build_trace(WorkloadSpec(rps=rps, duration_s=duration, seed=seed,
                                    max_prompt_len=256, max_output_len=128))


def run(policy: str, trace: list[TraceRequest], **cfg: object) -> tuple[Simulator, object]:
    variant = PolicyVariant.parse(policy)
    sim = Simulator(GH200, LLAMA, variant.policy, variant.apply(SimConfig(**cfg)),  # type: ignore[arg-type]
                    label=variant.label)
    return sim, sim.run(trace)


def test_pool_sizes_and_auto_budgets_come_from_the_profiles() -> None:
    sim = Simulator(GH200, QWEN, "lvf", SimConfig())
    # (0.9 * 144 GB - 65.5 GB of weights - 4 GB reserve) / 4 MiB blocks
    assert sim.device_blocks == int((0.9 * 144e9 - QWEN.weight_bytes - 4e9) // (4 << 20))
    assert sim.host_blocks == int(400e9 // (4 << 20))
    # B_xfer auto: 50 ms of one direction at the 4 MiB-segment rate, near the paper's 2400.
    assert 1900 < sim.xfer_budget < 2400  # type: ignore[operator]
    assert sim.eager_budget > 0
    fixed = Simulator(GH200, QWEN, "lvf", SimConfig(xfer_budget_blocks=UNLIMITED,
                                                    eager_budget_blocks=0))
    assert fixed.xfer_budget is None and fixed.eager_budget == 0
    with pytest.raises(SimulationError, match="no room"):
        Simulator(load_hardware("h100-pcie"), load_model("mixtral-8x7b"), "lvf", SimConfig())


def test_policy_variants_parse_overrides() -> None:
    v = PolicyVariant.parse("lvf:xfer=300:layout=layer-first:duplex=off:eager=0:label=vllm-offload")
    assert v.policy == "lvf" and v.label == "vllm-offload"
    cfg = v.apply(SimConfig())
    assert (cfg.xfer_budget_blocks, cfg.layout, cfg.duplex, cfg.eager_budget_blocks) == (
        300, "layer-first", False, 0)
    assert PolicyVariant.parse("lvf:xfer=none").apply(SimConfig()).xfer_budget_blocks == UNLIMITED
    assert PolicyVariant.parse("lvf:xfer=auto").apply(SimConfig(xfer_budget_blocks=3)
                                                      ).xfer_budget_blocks is None
    assert PolicyVariant.parse("lvf:alpha=2").apply(SimConfig()).vlt.alpha == 2.0
    assert PolicyVariant.parse("waiting-first").label == "waiting-first"
    for bad, msg in (("nope", "unknown policy"), ("lvf:colour=red", "unknown policy option"),
                     ("lvf:xfer", "not key=value"), ("lvf:alpha=x", "bad value"),
                     ("lvf:duplex=maybe", "on/off")):
        with pytest.raises(SimulationError, match=msg):
            PolicyVariant.parse(bad)
    with pytest.raises(SimulationError, match="layout"):
        PolicyVariant.parse("lvf:layout=diagonal").apply(SimConfig())


def test_one_request_follows_the_cost_model_exactly() -> None:
    trace = [TraceRequest(0, 0.5, prompt_len=100, output_len=4)]
    sim, res = run("lvf", trace)
    (rec,) = res.records  # type: ignore[attr-defined]
    cost = ExecutionCostModel(GH200, LLAMA)
    from common.contracts import ScheduledChunk

    prefill = cost.iteration_s([ScheduledChunk("r", [0] * 100, 0, [], True)])
    assert rec.ttft_s == pytest.approx(prefill)  # arrives on an idle engine: served at once
    steps = [cost.iteration_s([ScheduledChunk("r", [0], 100 + i, [], True)]) for i in range(3)]
    assert rec.gaps() == pytest.approx(steps)
    assert len(rec.token_times) == 4


def test_everything_fits_so_policies_agree_and_nothing_rotates() -> None:
    trace = small_trace()
    results = {p: run(p, trace)[1] for p in POLICY_NAMES}
    first = results["lvf"].metrics  # type: ignore[attr-defined]
    for p, r in results.items():
        m = r.metrics  # type: ignore[attr-defined]
        assert m.rotations == 0 and r.stats["recomputes"] == 0, p  # type: ignore[attr-defined]
        assert m.ttft_attainment == first.ttft_attainment
        assert m.p99_tbt_s == pytest.approx(first.p99_tbt_s)
    recs = results["fcfs"].records  # type: ignore[attr-defined]
    assert len(recs) == len(trace)
    by_id = {f"r{t.index}": t for t in trace}
    assert all(len(r.token_times) == by_id[r.request_id].output_len for r in recs)


@pytest.mark.parametrize("policy", ["lvf", "swapped-first", "waiting-first"])
def test_memory_pressure_rotates_and_returns_every_block(policy: str) -> None:
    trace = small_trace(rps=30.0)
    sim, res = run(policy, trace, device_blocks=120, host_blocks=4000)
    assert res.stats["rotations"] > 0  # type: ignore[attr-defined]
    assert res.stats["transfer_s"] > 0  # type: ignore[attr-defined]
    assert res.metrics.completed == len(trace)  # type: ignore[attr-defined]
    sched = sim.scheduler
    assert sched is not None and not sched.has_unfinished()
    sched.check_integrity()
    assert sched.bm.num_free_device == 120 and sched.bm.num_free_host == 4000


def test_fcfs_recomputes_instead_of_rotating() -> None:
    _, res = run("fcfs", small_trace(rps=30.0), device_blocks=120, host_blocks=4000)
    assert res.stats["rotations"] == 0 and res.stats["recomputes"] > 0  # type: ignore[attr-defined]


def test_slow_transfers_cost_time() -> None:
    trace = small_trace(rps=30.0)
    # What transfers cost needs rotations: no memory margin (at the default 6 LVF rotates
    # a few times here and the variants' clocks differ by their decisions, not their copies).
    kw = dict(device_blocks=120, host_blocks=4000, xfer_budget_blocks=UNLIMITED,
              limits=RotationLimits(memory_margin=0.0))
    _, fast = run("lvf", trace, **kw)
    _, slow = run("lvf:layout=layer-first:duplex=off:eager=0:pipeline=off", trace, **kw)
    assert slow.stats["transfer_s"] > 5 * fast.stats["transfer_s"]  # type: ignore[attr-defined]
    _, piped = run("lvf:layout=layer-first:duplex=off:eager=0:pipeline=on", trace, **kw)
    assert piped.stats["sim_time_s"] < slow.stats["sim_time_s"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("pipeline, iterations", [("off", 6), ("on", 8)])
def test_idle_engine_jumps_to_the_next_arrival(pipeline: str, iterations: int) -> None:
    trace = [TraceRequest(0, 0.0, 50, 3), TraceRequest(1, 1000.0, 50, 3)]
    _, res = run(f"lvf:pipeline={pipeline}", trace)
    a, b = res.records  # type: ignore[attr-defined]
    assert a.ttft_s == pytest.approx(b.ttft_s)
    # 3 batches each (prefill, 2 decodes); pipelined, each request's last batch lands in
    # one more step that plans nothing.
    assert res.stats["iterations"] == iterations  # type: ignore[attr-defined]


def test_oversized_prompt_is_a_miss_not_a_crash() -> None:
    trace = [TraceRequest(0, 0.0, 5000, 3), TraceRequest(1, 0.1, 50, 3)]
    _, res = run("lvf", trace, device_blocks=64)
    assert res.stats["rejected"] == 1  # type: ignore[attr-defined]
    assert res.metrics.requests == 2 and res.metrics.ttft_attainment == 0.5  # type: ignore[attr-defined]


def test_simulate_helper_and_stats() -> None:
    res = simulate(GH200, LLAMA, PolicyVariant.parse("lvf"), SimConfig(xfer_budget_blocks=None),
                   small_trace(duration=2.0), duration_s=2.0)
    assert res.metrics.duration_s == 2.0
    assert res.stats["iterations"] > 0 and res.stats["wall_s"] > 0


# -- CLI ---------------------------------------------------------------------------------------
def test_cli_sweep_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = sim_main(["sim", "--hardware", "gh200", "--model", "llama-3-8b", "--rps", "4,8",
                   "--duration", "3", "--policies", "lvf,swapped-first:label=sf",
                   "--max-output-len", "64", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "RPS 4:" in text and "RPS 8:" in text and "sf " in text
    data = json.loads(out.read_text())
    assert data["config"]["hardware"] == "gh200" and data["config"]["rps"] == [4.0, 8.0]
    assert len(data["results"]) == 4
    row = data["results"][0]
    for k in ("policy", "rps", "ttft_attainment", "tbt_attainment", "p50_ttft_s", "p99_ttft_s",
              "p50_tbt_s", "p99_tbt_s", "goodput_rps", "throughput_tok_s", "rotations"):
        assert k in row
    assert {r["policy"] for r in data["results"]} == {"lvf", "sf"}
    assert png.stat().st_size > 1000
    # Why requests left the device: the split adds up to the preemptions.
    assert "why running requests left the device" in text
    for r in data["results"]:
        st = r["stats"]
        assert 0 <= st["growth_preemptions"] + st["parked_preemptions"] <= st["preemptions"]


@pytest.mark.parametrize("argv, msg", [
    (["--dataset", "no-such.json"], "neither a synthetic dataset"),
    (["--hardware", "tpu9"], "unknown hardware profile"),
    (["--model", "gpt-9"], "unknown model profile"),
    (["--policies", "lvf:warp=9"], "unknown policy option"),
    (["--policies", "lvf,lvf"], "same label"),
])
def test_cli_errors_are_clear(argv: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(["sim", "--duration", "1", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_cli_malformed_dataset_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "d.json"
    bad.write_text("[{")
    assert sim_main(["sim", "--duration", "1", "--dataset", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


# -- findings that reproduce in a small memory-bound setup (docs/results/simulator/ has the full
# runs). Llama-3-8B with a 150-block (2 MiB each) device pool, 30 req/s for 6 s.
def _findings_trace(rps: float = 30) -> list[TraceRequest]:
    return build_trace(WorkloadSpec(rps=rps, duration_s=6, seed=0, max_prompt_len=256,
                                    max_output_len=128))


def _findings_run(policy: str, rps: float = 30) -> SimResult:
    v = PolicyVariant.parse(policy)
    return simulate(GH200, LLAMA, v, SimConfig(device_blocks=150, host_blocks=20000),
                    _findings_trace(rps), 6.0)


def test_waiting_first_wins_ttft_and_loses_tbt_against_swapped_first() -> None:
    sf, wf = _findings_run("swapped-first").metrics, _findings_run("waiting-first").metrics
    assert wf.ttft_attainment > sf.ttft_attainment + 0.3
    assert wf.tbt_attainment < sf.tbt_attainment
    assert wf.tpot_attainment < sf.tpot_attainment - 0.05


VLLM_STYLE = "layout=layer-first:duplex=off:eager=0:pipeline=off"  # vLLM 0.6's swaps
# Fig. 17 needs rotation pressure. Since LVF's parked requests stopped triggering rotation
# , 30 req/s rotates ~150 times and every variant keeps TPOT at 100 %; since a
# parked request in eager mode preempts only near its deadline, 40 req/s no
# longer separates the two budgets (P99 TBT 27 -> 51 ms, TPOT 77.0 -> 78.2 %). At 50 req/s
# LVF rotates ~330 times in 6 s and the directions are clear (they held there also once
# a parked request coming back early left room for growth).
FIG17_RPS = 50
# The cell was sized with α 0.3, LVF's earlier default. With the default α 1 the
# P99 direction holds at a smaller size (50 req/s: 25.0 -> 51.5 ms, DuplexKV 35.7) and the
# TPOT one does not (61.8 -> 62.2 %, DuplexKV 67.1). It was also sized with the full room
# for growth (room 1, LVF's earlier default): at a half the P99
# direction is stronger (25.0 -> 244.9 ms, DuplexKV 19.6) and the TPOT one does not hold
# (60.5 -> 62.2 %, DuplexKV 68.8). And without the memory margin (0, the earlier default; at 6 the seats here are max_num_seqs's and LVF hardly rotates): the figure
# is about what each rotation costs, so it needs the rotations.
FIG17 = "lvf:alpha=0.3:room=1:memory_margin=0"


def test_vllm_style_transfers_with_a_large_budget_cost_tail_tbt() -> None:
    """Fig. 17: layer-first, half-duplex copies with a large B_xfer stall the iteration that
    waits on them (P99 TBT 25 -> 159 ms and TPOT 60.5 -> 58.2 % at seed 0)."""
    small = _findings_run(f"{FIG17}:{VLLM_STYLE}:xfer=20", FIG17_RPS).metrics
    large = _findings_run(f"{FIG17}:{VLLM_STYLE}:xfer=400", FIG17_RPS).metrics
    assert large.p99_tbt_s > 2 * small.p99_tbt_s
    assert large.tpot_attainment < small.tpot_attainment


def test_duplexkv_keeps_tpot_and_tail_tbt_that_vllm_style_transfers_lose() -> None:
    """Fig. 17's other half: with the same large B_xfer, vLLM-style transfers (layer-first,
    half duplex, no eager copies) stall the requests they rotate; DuplexKV does not.
    At seed 0: TPOT 58.2 -> 68.8 %, P99 TBT 159 -> 20 ms, copy time on the critical path
    3.5 s -> 0.12 s. (Its TTFT claim does not hold on this small trace.)"""
    slow = _findings_run(f"{FIG17}:{VLLM_STYLE}:xfer=400", FIG17_RPS)
    fast = _findings_run(f"{FIG17}:xfer=400", FIG17_RPS)
    assert fast.stats["transfer_s"] < slow.stats["transfer_s"] / 10  # type: ignore[operator]
    assert fast.metrics.tpot_attainment > slow.metrics.tpot_attainment + 0.05
    assert fast.metrics.p99_tbt_s * 3 < slow.metrics.p99_tbt_s


def test_clock_cap_counts_every_request() -> None:
    trace = small_trace(rps=30.0, duration=6.0)
    _, res = run("lvf", trace, max_sim_s=1.0)
    assert res.metrics.requests == len(trace)  # type: ignore[attr-defined]
    assert res.stats["unfinished"] > 0  # type: ignore[attr-defined]
    assert res.metrics.completed < len(trace)  # type: ignore[attr-defined]


def test_lvf_keeps_tpot_when_clients_send_no_max_tokens() -> None:
    """An OpenAI client that sends no max_tokens gets the whole context as its bound
    (gateway/conversion.py), and its request ends by EOS. LVF must not order requests by a
    catch-up that bound allows (vlt.tokens_left): counting on it, it parked them for
    catch-ups they never had the tokens for, and on the CPU stack's twin at 2x saturation
    38 % missed TPOT where none did with the lengths known (goodput 1.85 against 2.98
    req/s). Close to the run where the scheduler knows every length (ignore_eos, as
    benchmarks send). Measured at the default memory margin 6 (at 0): TTFT 87
    against 93 % (96 against 100), TPOT 97 against 98 % (94 against 98), goodput 2.49
    against 2.71 req/s (2.66 against 2.91)."""
    hw, model = load_hardware("cpu-local"), load_model("smollm2-135m")
    trace = build_trace(WorkloadSpec(rps=5.76, duration_s=None, num_prompts=100, seed=0,
                                     max_prompt_len=384, max_output_len=64))
    cfg = {"device_blocks": 64, "host_blocks": 4096, "max_num_seqs": 32, "ttft_slo": 10.0,
           "tbt_slo": 0.3}
    runs = {lengths: simulate(hw, model, PolicyVariant.parse("lvf"),
                              SimConfig(**cfg, lengths=lengths), trace).metrics
            for lengths in ("known", "unknown")}
    known, unknown = runs["known"], runs["unknown"]
    assert unknown.ttft_attainment >= known.ttft_attainment - 0.1
    assert unknown.tpot_attainment >= 0.9
    assert unknown.goodput_rps >= 0.9 * known.goodput_rps


def test_a_client_max_tokens_bounds_requests_whose_length_is_unknown() -> None:
    """With lengths unknown, `SimConfig.max_tokens` is the bound a client sends (`bench
    serve --no-ignore-eos --max-tokens N`, as the real-stack chat passes run): a reply
    the trace makes longer stops at it, a shorter one still ends by EOS at its length."""
    hw, model = load_hardware("cpu-local"), load_model("smollm2-135m")
    trace = [TraceRequest(0, 0.0, 40, 100), TraceRequest(1, 0.1, 40, 12)]
    records = simulate(hw, model, PolicyVariant.parse("lvf"),
                       SimConfig(device_blocks=64, host_blocks=256, lengths="unknown",
                                 max_tokens=30), trace).records
    assert sorted(len(r.token_times) for r in records) == [12, 30]
    with pytest.raises(SimulationError, match="max_tokens"):
        SimConfig(lengths="unknown", max_tokens=0)
