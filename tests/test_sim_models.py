"""Simulator inputs: profiles, cost models, workloads and SLO metrics (no scheduler runs)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from common.contracts import ScheduledChunk, TransferPlan
from superinfer.sim.cost import ExecutionCostModel, TransferCostModel, coalesced_runs
from superinfer.sim.profile import (
    PROFILE_DIR,
    BandwidthCurve,
    ProfileError,
    available,
    load_hardware,
    load_model,
)
from superinfer.slo_metrics import RequestRecord, compute_metrics
from superinfer.workload import (
    SYNTHETIC,
    WorkloadError,
    WorkloadSpec,
    build_trace,
    gamma_arrivals,
    load_sharegpt,
)

MIB = 1 << 20


# -- profiles --------------------------------------------------------------------------------
def test_bundled_profiles_load_and_every_number_has_a_source() -> None:
    hw = available("hardware")
    models = available("models")
    assert {"gh200", "h100-pcie", "h200-pcie", "cpu-local"} <= set(hw)
    assert {"llama-3-8b", "qwen2.5-32b", "mixtral-8x7b", "smollm2-135m"} <= set(models)
    for name in hw:
        p = load_hardware(name)
        assert p.sources and all(v.strip() for v in p.sources.values())
    for name in models:
        m = load_model(name)
        assert m.sources and all(v.strip() for v in m.sources.values())
        assert m.active_params <= m.total_params


def test_model_profile_derived_sizes() -> None:
    qwen = load_model("qwen2.5-32b")
    # 64 layers x K,V x 8 heads x 128 x bf16 = 256 KiB a token; a 16-token block is 4 MiB.
    assert qwen.kv_bytes_per_token == 256 * 1024
    assert qwen.block_bytes(16) == 4 * MIB
    assert 64e9 < qwen.weight_bytes < 66e9
    assert load_model("llama-3-8b").kv_bytes_per_token == 128 * 1024
    mix = load_model("mixtral-8x7b")
    assert mix.num_experts == 8 and mix.experts_per_token == 2
    # The bundled model: weights counted at 4 bytes (as the CPU profile was fitted), its KV
    # block as the worker's bf16 pool holds it: 30 layers x K,V x 3 heads x 64 x 2 x 16.
    small = load_model("smollm2-135m")
    assert small.block_bytes(16) == 368_640 and small.weight_bytes == 4 * small.total_params


def test_calibration_warns_where_the_model_profile_counts_other_block_bytes(
        capsys: pytest.CaptureFixture[str]) -> None:
    from superinfer.sim.calibrate import warn_block_bytes

    assert warn_block_bytes(368_640, 16, "bfloat16") and not capsys.readouterr().err
    assert not warn_block_bytes(737_280, 16, "float32")
    err = capsys.readouterr().err
    assert "737,280" in err and "kv_dtype_bytes" in err and "to 4 " in err


def test_a_models_kv_element_size_may_differ_from_its_weights(tmp_path: Path) -> None:
    data = json.loads((PROFILE_DIR / "models" / "llama-3-8b.json").read_text())
    data["kv_dtype_bytes"] = 1  # an fp8 cache beside bf16 weights
    path = tmp_path / "fp8kv.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="no source given for kv_dtype_bytes"):
        load_model(str(path))
    data["sources"]["kv_dtype_bytes"] = "fp8 KV cache"
    path.write_text(json.dumps(data))
    m = load_model(str(path))
    assert m.kv_bytes_per_token == 64 * 1024 and m.weight_bytes == load_model("llama-3-8b").weight_bytes
    data["kv_dtype_bytes"] = 1.5
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="kv_dtype_bytes.*integer"):
        load_model(str(path))


def test_profile_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="unknown hardware profile 'nope'.*gh200"):
        load_hardware("nope")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_hardware(str(bad))
    data = json.loads((PROFILE_DIR / "hardware" / "gh200.json").read_text())
    del data["sources"]["mfu"]
    nosrc = tmp_path / "nosrc.json"
    nosrc.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="no source given for mfu"):
        load_hardware(str(nosrc))
    data = json.loads((PROFILE_DIR / "models" / "qwen2.5-32b.json").read_text())
    data["num_layers"] = -3
    neg = tmp_path / "neg.json"
    neg.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="num_layers"):
        load_model(str(neg))


def test_bandwidth_curve_interpolates_log_linearly() -> None:
    c = BandwidthCurve(((1024.0, 1e9), (4096.0, 3e9)))
    assert c(512) == 1e9 and c(1 << 20) == 3e9  # clamped outside the points
    assert c(2048) == pytest.approx(2e9)  # halfway in log(size)
    with pytest.raises(ProfileError):
        BandwidthCurve(((4096.0, 1e9), (1024.0, 2e9)))


def test_gh200_curve_matches_the_paper_anchors() -> None:
    link = load_hardware("gh200").link
    assert link.d2h(8 * MIB) == pytest.approx(200e9)
    # One-by-one 64 KiB copies (curve + per-copy launch) stay under 10 GB/s (paper, Fig. 5).
    per_copy = 65536 / link.d2h(65536) + link.launch_overhead_s
    assert 65536 / per_copy < 10e9


# -- cost models -------------------------------------------------------------------------------
def _chunk(start: int, n: int, sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk("r", [0] * n, start, [], sample)


def test_execution_cost_roofline() -> None:
    hw, qwen = load_hardware("gh200"), load_model("qwen2.5-32b")
    cost = ExecutionCostModel(hw, qwen)
    decode = cost.breakdown([_chunk(500, 1) for _ in range(64)])
    assert decode.memory_s > decode.compute_s  # small decode batches stream weights
    prefill = cost.breakdown([_chunk(0, 512)])
    assert prefill.compute_s > prefill.memory_s  # a 512-token chunk is compute-bound
    # 2 * 31.2e9 params * 512 tokens at 50% of 989 TFLOP/s: ~65 ms (+ attention, lm_head).
    assert 0.06 < prefill.compute_s < 0.075
    assert prefill.seconds == pytest.approx(hw.iteration_overhead_s + prefill.compute_s)
    assert cost.iteration_s([]) == 0.0
    # Longer contexts read more KV.
    assert cost.breakdown([_chunk(4000, 1)]).memory_s > cost.breakdown([_chunk(10, 1)]).memory_s


def test_moe_reads_more_experts_for_more_tokens() -> None:
    cost = ExecutionCostModel(load_hardware("gh200"), load_model("mixtral-8x7b"))
    one, many = cost.weight_bytes_read(1), cost.weight_bytes_read(256)
    assert one < many
    assert many == pytest.approx(load_model("mixtral-8x7b").weight_bytes, rel=1e-6)


def test_coalesced_runs() -> None:
    assert coalesced_runs([]) == []
    assert coalesced_runs([(3, 7), (1, 5), (2, 6), (9, 1)]) == [3, 1]
    assert coalesced_runs([(1, 5), (2, 9)]) == [1, 1]  # destinations not adjacent


def test_transfer_cost_layout_and_duplex() -> None:
    hw, qwen = load_hardware("gh200"), load_model("qwen2.5-32b")
    scattered = [(2 * i, 2 * i) for i in range(100)]
    plan = TransferPlan(fence=1, swap_out=scattered, swap_in=[(2 * i + 1, 2 * i + 1) for i in range(100)])
    bf = TransferCostModel(hw, qwen, 16, "block-first", duplex=True)
    lf = TransferCostModel(hw, qwen, 16, "layer-first", duplex=True)
    assert lf.segment_bytes == 32 * 1024 and lf.segments_per_block == 128
    t_bf, t_lf = bf.plan_time(plan), lf.plan_time(plan)
    # 400 MiB each way: ~2.4 ms at ~175 GB/s; as 12,800 32 KiB copies each way, >20x longer.
    assert 0.002 < t_bf.d2h_s < 0.003
    assert t_lf.d2h_s > 20 * t_bf.d2h_s
    # Duplex takes the slower direction unless the shared DRAM limit binds.
    assert t_bf.critical_s == pytest.approx(
        max(t_bf.d2h_s, t_bf.h2d_s, (t_bf.d2h_bytes + t_bf.h2d_bytes) / 384e9)
    )
    half = TransferCostModel(hw, qwen, 16, "block-first", duplex=False).plan_time(plan)
    assert half.critical_s == pytest.approx(t_bf.d2h_s + t_bf.h2d_s)
    assert half.critical_s > t_bf.critical_s
    # Adjacent blocks merge into one larger (faster) segment.
    adjacent = TransferPlan(fence=2, swap_out=[(i, i) for i in range(100)])
    assert bf.plan_time(adjacent).d2h_s < t_bf.d2h_s
    # Eager copies are accounted separately from the critical path.
    eager = bf.plan_time(TransferPlan(fence=3, eager=scattered))
    assert eager.critical_s == 0.0 and eager.eager_s == pytest.approx(t_bf.d2h_s)


def test_pcie_both_ways_is_capped_at_83_gbs() -> None:
    hw, qwen = load_hardware("h100-pcie"), load_model("qwen2.5-32b")
    x = TransferCostModel(hw, qwen, 16)
    pairs = [(2 * i, 2 * i) for i in range(200)]
    t = x.plan_time(TransferPlan(fence=1, swap_out=pairs, swap_in=pairs))
    assert (t.d2h_bytes + t.h2d_bytes) / t.critical_s == pytest.approx(83e9, rel=1e-6)


# -- workloads ---------------------------------------------------------------------------------
def test_trace_is_seeded_and_lengths_do_not_depend_on_rate() -> None:
    a = build_trace(WorkloadSpec(rps=5, duration_s=60, seed=3))
    b = build_trace(WorkloadSpec(rps=5, duration_s=60, seed=3))
    c = build_trace(WorkloadSpec(rps=10, duration_s=60, seed=3))
    assert a == b
    assert [(r.prompt_len, r.output_len) for r in a] == [
        (r.prompt_len, r.output_len) for r in c[: len(a)]
    ]
    assert build_trace(WorkloadSpec(rps=5, duration_s=60, seed=4)) != a
    assert a[0].arrival_s == 0.0 and all(r.arrival_s < 60 for r in a)


def test_gamma_arrivals_rate_and_burstiness() -> None:
    rng = np.random.default_rng(0)
    t = np.array(gamma_arrivals(rng, 20.0, 1.0, num=20000))
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # Poisson: CV 1
    bursty = np.diff(gamma_arrivals(np.random.default_rng(0), 20.0, 0.25, num=20000))
    assert bursty.mean() == pytest.approx(1 / 20, rel=0.06)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1/sqrt(shape)
    assert gamma_arrivals(rng, math.inf, num=3) == [0.0, 0.0, 0.0]


def test_synthetic_lengths_follow_the_documented_means() -> None:
    spec = WorkloadSpec(num_prompts=20000, duration_s=None, rps=100, max_prompt_len=10**6,
                        max_output_len=10**6, min_len=1)
    tr = build_trace(spec)
    ds = SYNTHETIC["sharegpt"]
    assert np.mean([r.prompt_len for r in tr]) == pytest.approx(ds.prompt.mean, rel=0.05)
    assert np.mean([r.output_len for r in tr]) == pytest.approx(ds.output.mean, rel=0.05)
    clipped = build_trace(WorkloadSpec(num_prompts=2000, duration_s=None, max_prompt_len=64,
                                       max_output_len=32, dataset="lmsys"))
    assert max(r.prompt_len for r in clipped) <= 64 and max(r.output_len for r in clipped) <= 32
    assert min(r.prompt_len for r in clipped) >= 4
    scaled = build_trace(WorkloadSpec(num_prompts=2000, duration_s=None, length_scale=0.5,
                                      max_prompt_len=10**6, max_output_len=10**6, min_len=1))
    base = build_trace(WorkloadSpec(num_prompts=2000, duration_s=None,
                                    max_prompt_len=10**6, max_output_len=10**6, min_len=1))
    assert sum(r.output_len for r in scaled) == pytest.approx(
        0.5 * sum(r.output_len for r in base), rel=0.01)


def _sharegpt_file(tmp_path: Path) -> Path:
    data = [
        {"id": "a", "conversations": [
            {"from": "human", "value": "x" * 40}, {"from": "gpt", "value": "y" * 400}]},
        {"id": "b", "conversations": [
            {"from": "system", "value": "sys"}, {"from": "human", "value": "q" * 80},
            {"from": "gpt", "value": "z" * 100}, {"from": "human", "value": "more"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "alone, no answer"}]},
        {"id": "d", "conversations": [
            {"from": "human", "value": "hi"}, {"from": "gpt", "value": "too short prompt"}]},
        "not an entry",
    ]
    p = tmp_path / "sharegpt.json"
    p.write_text(json.dumps(data))
    return p


def test_sharegpt_file_first_exchange_and_lengths(tmp_path: Path) -> None:
    p = _sharegpt_file(tmp_path)
    entries = load_sharegpt(p)
    assert [(pl, ol) for _, pl, ol in entries] == [(10, 100), (20, 25)]  # chars / 4
    by_words = load_sharegpt(p, tokenizer=lambda s: s.split() or [""], min_len=1)
    assert len(by_words) == 3  # entry d now passes; c has no gpt turn, the string is skipped
    tr = build_trace(WorkloadSpec(dataset=str(p), rps=50, num_prompts=30, duration_s=None))
    assert len(tr) == 30
    assert {(r.prompt_len, r.output_len) for r in tr} <= {(10, 100), (20, 25)}
    assert all(r.prompt in ("x" * 40, "q" * 80) for r in tr)


def test_workload_errors(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="neither a synthetic dataset"):
        build_trace(WorkloadSpec(dataset="no/such/file.json"))
    broken = tmp_path / "broken.json"
    broken.write_text('[{"conversations": [}')
    with pytest.raises(WorkloadError, match="not valid JSON"):
        build_trace(WorkloadSpec(dataset=str(broken)))
    obj = tmp_path / "obj.json"
    obj.write_text('{"conversations": []}')
    with pytest.raises(WorkloadError, match="expected a JSON list"):
        load_sharegpt(obj)
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(WorkloadError, match="no entry has a human turn"):
        load_sharegpt(empty)
    with pytest.raises(WorkloadError, match="rps must be positive"):
        WorkloadSpec(rps=0)
    with pytest.raises(WorkloadError, match="duration or a number"):
        WorkloadSpec(duration_s=None, num_prompts=None)


# -- SLO metrics -------------------------------------------------------------------------------
def test_slo_metrics_by_hand() -> None:
    recs = [
        # TTFT 1 s, gaps 0.05, 0.05: meets both.
        RequestRecord("a", 0.0, [1.0, 1.05, 1.10], 5.0, 0.1),
        # TTFT 6 s (miss), gaps fine.
        RequestRecord("b", 1.0, [7.0, 7.05], 5.0, 0.1),
        # TTFT 2 s, one gap of 0.3 s (miss), rotated once.
        RequestRecord("c", 2.0, [4.0, 4.3, 4.35], 5.0, 0.1, rotations=1),
        # Never served.
        RequestRecord("d", 3.0, [], 5.0, 0.1, finished=False),
    ]
    m = compute_metrics(recs, duration_s=10.0)
    assert m.requests == 4 and m.completed == 3
    assert m.ttft_attainment == pytest.approx(2 / 4)
    assert m.tbt_attainment == pytest.approx(4 / 5)  # gaps: .05 .05 .05 .3 .05
    assert m.tbt_attainment_rotated == pytest.approx(1 / 2)
    assert m.tpot_attainment == pytest.approx(2 / 3)  # c: mean gap 0.175 s
    # vLLM's goodput (TTFT and TPOT: a only) per second from the first arrival (0) to the
    # last token (7.05); every-gap goodput (a only too) per second of the run.
    assert m.goodput_rps == pytest.approx(1 / 7.05)
    assert m.goodput_every_gap_rps == pytest.approx(1 / 10)
    assert m.p50_ttft_s == pytest.approx(2.0)
    assert m.p99_ttft_s == pytest.approx(float(np.percentile([1.0, 6.0, 2.0], 99)))
    assert m.p50_tbt_s == pytest.approx(0.05)
    assert m.rotations == 1
    assert m.output_tokens == 8
    assert m.max_gap_s == pytest.approx(0.3) and m.stall_s == pytest.approx(0.3)  # the one miss
    assert m.throughput_tok_s == pytest.approx(8 / 7.05)
    d = m.as_dict()
    json.dumps(d)  # JSON-safe
    empty = compute_metrics([]).as_dict()
    assert empty["ttft_attainment"] is None and empty["requests"] == 0
