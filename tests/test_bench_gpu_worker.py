"""`superinfer bench gpu-worker` (superinfer/bench/gpu_worker.py), the GPU check's core,
run on the CPU: its roofline arithmetic, its verdict table, and a dry run of its decode
and greedy parts through the CUDA runner with the kernels under Triton's interpreter."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from superinfer.bench import gpu_worker
from worker.cuda.random_model import llama3_8b_config


def args(**kw: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    gpu_worker.add_arguments(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_roofline_of_the_8b_shape_on_an_h200() -> None:
    cfg = llama3_8b_config()
    bw, fl = gpu_worker.PEAKS["H200"]
    one = gpu_worker.roofline(cfg, 1, 1024, 2, bw, fl)
    # 7.50e9 matmul parameters (8.03e9 less the 0.53e9 embedding, a gather) in bf16
    assert one["weight_bytes"] == pytest.approx(15.0e9, rel=0.01)
    assert one["kv_bytes"] == 1024 * 32 * 2 * 8 * 128 * 2  # 128 KiB per token
    assert one["bound"] == "memory" and one["roofline_tok_s"] == pytest.approx(317, rel=0.01)
    big = gpu_worker.roofline(cfg, 256, 1024, 2, bw, fl)
    assert big["kv_bytes"] == 256 * one["kv_bytes"]  # 34 GB of KV beside 15 GB of weights
    assert big["bound"] == "memory"
    assert big["roofline_tok_s"] == pytest.approx(256 * bw / (15.0e9 + 34.36e9), rel=0.01)
    assert "roofline_tok_s" not in gpu_worker.roofline(cfg, 1, 1, 2, None, None)


def test_verdicts_and_transfer_merge(tmp_path: Path) -> None:
    def ratio(x: float) -> dict[str, float]:
        return {"median": x, "min": x, "max": x}

    shape = {"block_bytes": 4 << 20, "block_first_d2h_vs_raw": ratio(0.95),
             "block_first_h2d_vs_raw": ratio(0.85), "duplex_vs_block_first": ratio(1.7),
             "block_first_vs_layer_first": ratio(3.2)}
    small = dict(shape, block_bytes=64 << 10)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"shapes": {"qwen2.5-32b": shape, "smollm2-135m": small}}))
    merged = gpu_worker.merge_transfer(str(path))
    assert merged["qwen2.5-32b"]["block_first_vs_raw_h2d"] == 0.85
    result = {"greedy": {"greedy_exact": {"count": 13}, "greedy_exact_first8": {"count": 19}},
              "decode": {"per_batch": {"1": {"roofline_fraction": 0.55}}},
              "transfer": merged, "kill9": {"kill9_streams_exact": 8, "streams": 8}}
    rows = {r[0]: r[3] for r in gpu_worker.verdicts(result)}
    assert rows["greedy exact over 32 tokens (of 24)"] == "yes"
    assert rows["greedy exact over the first 8 (of 24)"] == "NO"
    assert rows["8B decode, batch 256: share of roofline"] == "not run"
    assert rows["8B decode, batch 1: share of roofline"] == "yes"
    assert rows["qwen2.5-32b: block first vs raw h2d"] == "NO"
    assert rows["qwen2.5-32b: layer first slowdown"] == "yes"
    assert not any(k.startswith("smollm2") for k in rows)  # 64 KiB blocks: not the goals'
    assert rows["kill -9 under load: streams exact"] == "yes"


def test_without_cuda_it_refuses_and_points_at_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpu_worker.run(args()) == 2
    assert "--dry-run" in capsys.readouterr().err


# --dry-run runs the kernels on CPU tensors: only under the interpreter, GPU or not.
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton's interpreter is off")


@needs_interpreter
def test_dry_run_of_decode_through_the_cuda_runner(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    out = tmp_path / "gw.json"
    rc = gpu_worker.run(args(dry_run=True, parts="decode,attention", batches="1,3", context=6,
                             steps=2,
                             peak_bw_gbs=1.0, peak_tflops=1.0, json=str(out)))
    assert rc == 0
    r = json.loads(out.read_text())
    assert set(r["decode_tok_s"]) == {"1", "3"} and all(v > 0 for v in r["decode_tok_s"].values())
    assert r["decode"]["random_weights"] and r["roofline_fraction"]["3"] > 0
    assert r["decode"]["per_batch"]["3"]["eager_steps"] == 5  # no graphs on the CPU
    # every tile choice of the decode attention kernel gives the same output
    configs = r["attention"]["configs"]
    assert len(configs) == len(gpu_worker.ATTENTION_CONFIGS) and r["attention"]["batch"] == 3
    assert all(c["max_diff_vs_first"] < 1e-5 and c["gbps"] > 0 for c in configs)


@pytest.mark.slow
@needs_interpreter
def test_dry_run_of_greedy_agrees_with_the_cpu_runner_in_fp32(tmp_path: Path) -> None:
    """The bundled model through the CUDA path's kernels (interpreted, fp32) gives the CPU
    runner's greedy tokens: what the GPU run then measures in bf16. (~1-3 min.)"""
    pytest.importorskip("triton")
    out = tmp_path / "gw.json"
    assert gpu_worker.run(args(dry_run=True, parts="greedy", prompts=2, greedy_tokens=3,
                               json=str(out))) == 0
    r = json.loads(out.read_text())
    assert r["greedy_exact"] == {"count": 2, "total": 2, "tokens": 3}
