"""`python -m experiments fidelity`: the simulator replays exactly what `python -m experiments policies` sent.

No real stack here: experiments/tests/data/policies_trial.json is a trimmed `python -m experiments policies` output
(2 policies, 0.5 req/s, 10 s; per-request records as bench serve wrote them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from common.config import EngineConfig
from common.scheduling import SETTING_NAMES
from experiments import fidelity
from experiments.__main__ import main as experiments_main
from superinfer.bench.serve import cli as bench_cli
from superinfer.sim.calibrate import _counts, fit_iterations
from superinfer.sim.cost import ExecutionCostModel, TransferCostModel
from superinfer.sim.engine import AUTO, SimConfig
from superinfer.sim.profile import load_hardware, load_model
from superinfer.workload import build_trace

TRIAL = Path(__file__).parent / "data" / "policies_trial.json"


def bench_spec(config: dict[str, object], rps: float) -> object:
    """The WorkloadSpec bench serve builds from the flags `python -m experiments policies` gives it."""
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    args = p.parse_args([
        "--base-url", "http://127.0.0.1:1/v1", "--sweep-rps", str(rps),
        *(["--duration", str(config["duration"])] if config.get("num_prompts") is None
          else ["--num-prompts", str(config["num_prompts"])]),
        "--dataset", str(config["dataset"]),
        "--max-prompt-len", str(config["max_prompt_len"]),
        "--max-output-len", str(config["max_output_len"]),
        "--length-scale", str(config["length_scale"]), "--seed", str(config["seed"]),
    ])
    return bench_cli._spec(args, rps)


@pytest.mark.parametrize(("rps", "num_prompts"), [(0.3, None), (0.5, None), (0.9, None),
                                                 (0.546, 60)])
def test_sim_replays_the_benchs_trace(rps: float, num_prompts: int | None) -> None:
    # --num-prompts (as the real-stack sweeps run) sends exactly that many, duration ignored:
    # the replay once took the duration and simulated 13 requests of 60.
    config = json.loads(TRIAL.read_text())["config"] | {"duration": 40.0, "seed": 3,
                                                        "num_prompts": num_prompts}
    spec, trace = fidelity.trace_for(config, rps)
    assert spec == bench_spec(config, rps)
    bench = build_trace(bench_spec(config, rps))  # type: ignore[arg-type]
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in trace] == [
        (r.arrival_s, r.prompt_len, r.output_len) for r in bench]
    assert len(trace) > 5
    if num_prompts is not None:
        assert len(trace) == num_prompts


def test_a_pipelined_runs_batch_is_the_workers_time_not_the_queued_rpcs() -> None:
    # Pipelined, each Execute waits in the worker behind the batch before it: its wall
    # time (here 196 s over 1,000 batches) is about two batches, the worker's own 98 s one.
    assert fidelity.real_batch_s(98.0, 196.0, 1000, pipelined=True) == pytest.approx(0.098)
    assert fidelity.real_batch_s(98.0, 196.0, 1000, pipelined=False) == pytest.approx(0.196)
    assert fidelity.real_batch_s(98.0, 196.0, 0, pipelined=True) is None


def test_trace_matches_the_benchs_per_request_record() -> None:
    data = json.loads(TRIAL.read_text())
    for row in data["results"]:
        _, trace = fidelity.trace_for(data["config"], row["rps"])
        check = fidelity.check_trace(trace, row["per_request"])
        assert check["identical"], check
        assert check["requests_sim"] == len(row["per_request"]) == 3
    # One request sent at another time, one prompt the server counted differently: caught.
    bad = json.loads(json.dumps(data["results"][0]["per_request"]))
    bad[1]["scheduled_s"] += 0.25
    bad[2]["prompt_tokens"] += 1
    check = fidelity.check_trace(trace, bad)
    assert not check["identical"]
    assert (check["arrival_mismatches"], check["server_prompt_token_mismatches"]) == (1, 1)


def test_bench_prompt_text_is_exactly_the_trace_length_in_bundled_tokens() -> None:
    from common.modelfile import resolve_model
    from common.tokenizer import Tokenizer
    from superinfer.bench.serve.prompts import TextTokenizer, prompt_text

    tok = Tokenizer.from_source(resolve_model(None))
    text_tok = TextTokenizer(encode=lambda t: tok.encode(t, add_special_tokens=False),
                             decode=lambda ids: tok.decode(ids))
    config = json.loads(TRIAL.read_text())["config"] | {"duration": 30.0}
    _, trace = fidelity.trace_for(config, 1.0)
    for r in trace[:20]:
        ids = tok.encode(prompt_text(r, int(config["seed"]), text_tok), add_special_tokens=False)
        assert len(ids) == r.prompt_len


def test_engine_config_is_what_serve_parses() -> None:
    config = json.loads(TRIAL.read_text())["config"] | {
        "serve_args": "--xfer-budget-blocks 8 --tbt-slo 0.25 --log-level debug "
                      "--transfer-mode block-first"}
    ec, transfer = fidelity.engine_config(config, "swapped-first")
    assert (ec.policy, ec.device_blocks, ec.host_blocks, ec.max_num_seqs) == (
        "swapped-first", 64, 4096, 32)
    assert (ec.xfer_budget_blocks, ec.ttft_slo, ec.tbt_slo) == (8, 10.0, 0.25)
    assert transfer == {"layout": "block-first", "duplex": False}
    cfg = SimConfig.from_engine(ec, **transfer)
    assert (cfg.device_blocks, cfg.max_batched_tokens, cfg.eager_budget_blocks,
            cfg.xfer_budget_blocks, cfg.tbt_slo, cfg.duplex) == (64, 512, 32, 8, 0.25, False)


def test_a_variant_is_replayed_with_its_own_flags(tmp_path: Path) -> None:
    data = json.loads(TRIAL.read_text())
    data["config"]["variants"] = {
        "lvf-pf": {"policy": "lvf", "serve_args": "--no-pipeline --xfer-budget-blocks 8"}}
    data["results"].append({**data["results"][0], "policy": "lvf-pf", "base_policy": "lvf"})
    path, out = tmp_path / "results.json", tmp_path / "f.json"
    path.write_text(json.dumps(data))
    assert experiments_main(["fidelity", "--experiment", str(path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["policy"] for r in report["rows"]] == ["lvf", "swapped-first", "lvf-pf"]
    sim = report["sim_config"]
    assert (sim["lvf-pf"]["pipeline"], sim["lvf-pf"]["xfer_budget_blocks"]) == (False, 8)
    assert sim["lvf"]["pipeline"] is True and sim["lvf"]["xfer_budget_blocks"] != 8


def test_sim_defaults_are_the_engines() -> None:
    sim, eng = SimConfig(), EngineConfig()
    shared = {f.name for f in dataclasses.fields(SimConfig)} & {
        f.name for f in dataclasses.fields(EngineConfig)}
    assert shared >= set(SETTING_NAMES)
    assert {k for k in shared if getattr(sim, k) != getattr(eng, k)} == set()
    # The eager budget is sized to the simulated link instead (documented in SimConfig);
    # from_engine takes serve's.
    assert sim.eager_budget_blocks == AUTO
    assert SimConfig.from_engine(eng).eager_budget_blocks == 32


def test_fidelity_command_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "fidelity.json", tmp_path / "fidelity.png"
    assert experiments_main(["fidelity", "--experiment", str(TRIAL), "--json", str(out),
                     "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    for word in ("TTFT% real", "TBT% real", "p99 TTFT s real/sim", "rotations real/sim",
                 "execute ms/batch real/sim", "identical (3 requests)"):
        assert word in text
    report = json.loads(out.read_text())
    assert png.stat().st_size > 10_000
    assert (report["hardware"], report["model"]) == ("cpu-local", "smollm2-135m")
    assert report["traces_identical"] is True
    assert [(r["policy"], r["rps"]) for r in report["rows"]] == [
        ("lvf", 0.5), ("swapped-first", 0.5)]
    for r in report["rows"]:
        for k in ("ttft_attainment", "tbt_attainment", "p50_ttft_s", "p99_ttft_s", "p50_tbt_s",
                  "rotations"):
            assert f"{k}_real" in r and f"{k}_sim" in r
        assert 0.0 <= r["ttft_attainment_sim"] <= 1.0 and 0.0 <= r["tbt_attainment_sim"] <= 1.0
        assert r["ttft_diff_points"] == pytest.approx(
            100 * (r["ttft_attainment_sim"] - r["ttft_attainment_real"]), abs=0.05)
        assert r["completed_sim"] == 3
        assert r["per_iteration"]["iterations_sim"] > 96  # 96 output tokens each
    assert report["sim_config"]["lvf"]["device_blocks"] == 64
    assert report["sim_config"]["lvf"]["max_num_seqs"] == 32


def test_fidelity_flags_a_gap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(TRIAL.read_text())
    data["results"][1]["ttft_attainment"] = 0.5  # the real run missed half its TTFTs
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "f.json"
    assert experiments_main(["fidelity", "--experiment", str(path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rows"][1]["flagged"] == ["ttft"] and report["agree"] is False
    assert "NOT within 10 points" in capsys.readouterr().out


def test_fidelity_refuses_what_it_cannot_compare(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert experiments_main(["fidelity", "--experiment", str(tmp_path / "none.json")]) == 2
    assert "experiments policies" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"config": {"dataset": "sharegpt"}, "results": [{}]}))
    assert experiments_main(["fidelity", "--experiment", str(bad)]) == 2
    assert "config lacks" in capsys.readouterr().err
    eos = json.loads(TRIAL.read_text())
    eos["config"]["bench_args"] = "--no-ignore-eos --max-tokens 512"
    bad.write_text(json.dumps(eos))
    assert experiments_main(["fidelity", "--experiment", str(bad)]) == 2
    assert "not comparable" in capsys.readouterr().err


def test_cpu_cost_terms() -> None:
    hw, model = load_hardware("cpu-local"), load_model("smollm2-135m")
    link = dataclasses.replace(hw.link, plan_overhead_s=0.004)
    cpu = dataclasses.replace(hw, link=link, attention_kv_Bps=1e9)
    gpu_like = dataclasses.replace(cpu, attention_kv_Bps=None)
    from common.contracts import ScheduledChunk, TransferPlan

    def decode(ctx: int) -> list[ScheduledChunk]:
        return [ScheduledChunk(f"r{i}", [1], ctx, [], True) for i in range(4)]

    # The KV pass is added (CPU) rather than hidden under the roofline's max (GPU-like).
    b = ExecutionCostModel(cpu, model).breakdown(decode(1000))
    assert b.attention_s == pytest.approx(4 * 1001 * model.kv_bytes_per_token / 1e9)
    assert b.seconds == pytest.approx(cpu.iteration_overhead_s + max(b.compute_s, b.memory_s)
                                      + b.attention_s)
    g = ExecutionCostModel(gpu_like, model).breakdown(decode(1000))
    assert g.attention_s == 0.0 and g.seconds < b.seconds
    # A transfer batch pays the link's fixed cost once, whatever it moves.
    t = TransferCostModel(cpu, model, 16)
    one = t.plan_time(TransferPlan(1, eager=[(0, 0)]))
    assert one.critical_s == pytest.approx(0.004)
    assert t.plan_time(None).critical_s == 0.0


def test_calibration_fit_recovers_known_parameters() -> None:
    c0, F, B, A = 0.06, 9e10, 2e10, 1.5e9
    points: list[dict[str, Any]] = []
    for name, spec in [("p16", [(0, 16)]), ("p128", [(0, 128)]), ("p512", [(0, 512)]),
                       ("d1", [(64, 1)]), ("d8", [(64, 1)] * 8), ("d8c", [(500, 1)] * 8),
                       ("m", [(64, 1)] * 4 + [(0, 64)]), ("d4c", [(900, 1)] * 4)]:
        f, b, k = _counts(spec)
        points.append({"case": name, "chunks": spec, "seconds": c0 + max(f / F, b / B) + k / A})
    fc0, fF, fB, fA = fit_iterations(points)
    assert max(abs(p["error"]) for p in points) < 0.02
    assert fc0 == pytest.approx(c0, rel=0.1) and fF == pytest.approx(F, rel=0.1)
    assert fA == pytest.approx(A, rel=0.1)


def test_calibration_serves_at_the_rate_asked(capsys: pytest.CaptureFixture[str]) -> None:
    """The serving run is a policies run at --rate (default: the load the experiments
    run at); a rate that is not positive is refused before anything starts."""
    from experiments.calibrate_serving import SERVING_RATE, serving_run

    run = serving_run(2.5)
    assert run[run.index("--rates") + 1] == "2.5" and "--policies" in run
    assert serving_run(SERVING_RATE)[run.index("--rates") + 1] == f"{SERVING_RATE:g}"
    with pytest.raises(SystemExit) as e:
        experiments_main(["calibrate-serving", "--rate", "0", "--out", "/nonexistent/x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--rate" in err and "must be positive" in err
