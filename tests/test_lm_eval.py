"""A real client: lm-evaluation-harness through `superinfer serve` (its `local-completions`
model: echo + logprobs for log-likelihoods, greedy completions for generation) against
lm-eval's own `hf` backend on the same GGUF file (transformers dequantizes it to fp32; the
model is loaded once per test process, tests/hf_reference.py, and handed to the backend).

Two tasks defined in the repository on local data (tests/data/lm_eval): a multiple-choice
log-likelihood task and a greedy generation task. Nothing is downloaded: the datasets are
local JSON files, the tokenizer is the GGUF's own, saved to a temporary folder for lm-eval's
API model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.daemon import free_port
from common.modelfile import bundled_model_path
from tests.hf_reference import hf_model

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tests" / "data" / "lm_eval"
LL_TASK, GEN_TASK = "superinfer_capitals", "superinfer_arithmetic"
LL_TOL = 1e-3
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "NO_PROXY": "127.0.0.1,localhost"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(the server's URL, the model name it serves)"""
    run_dir = tmp_path_factory.mktemp("lm-eval-serve")
    port = free_port()
    cmd = [sys.executable, "-m", "superinfer.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--grpc-port", str(free_port()), "--run-dir", str(run_dir),
           "--scheduler-port", str(free_port()), "--worker-port", str(free_port()),
           "--kvmem-port", str(free_port()),
           "--device-blocks", "256", "--host-blocks", "256", "--max-restarts", "0",
           # fp32 weights, as the hf backend's: the comparison is of the serving surface
           # (the quantized formats' quality: `python -m experiments quality`)
           "--dtype", "float32"]
    log = (run_dir / "serve.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **OFFLINE})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("superinfer serve did not start: "
                            + (run_dir / "serve.log").read_text()[-3000:])
            time.sleep(0.5)
        model = httpx.get(f"{url}/v1/models", trust_env=False).json()["data"][0]["id"]
        yield url, model
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _evaluate(model: Any, model_args: dict[str, Any] | None = None) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    # Our two tasks only: indexing lm-eval's thousands of built-in ones takes seconds.
    tasks = TaskManager(include_path=str(TASKS), include_defaults=False)
    return lm_eval.simple_evaluate(  # type: ignore[no-any-return]
        model=model, model_args=model_args, tasks=[LL_TASK, GEN_TASK],
        task_manager=tasks, batch_size=1, log_samples=True,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )


@pytest.fixture(scope="module")
def results(server: tuple[str, str], tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    saved = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    cwd = os.getcwd()
    os.chdir(REPO)  # the task YAMLs name their data files from the repository root
    try:
        import transformers
        from lm_eval.models.huggingface import HFLM

        gguf = bundled_model_path()
        tok_dir = tmp_path_factory.mktemp("tokenizer")
        transformers.AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name).save_pretrained(tok_dir)
        served = _evaluate("local-completions", {
            "base_url": f"{server[0]}/v1/completions", "model": server[1],
            "tokenizer_backend": "huggingface", "tokenizer": str(tok_dir),
            "num_concurrent": 1, "max_retries": 1, "tokenized_requests": True,
        })
        # The hf backend on transformers' fp32 model of the GGUF file, as its
        # {"pretrained": ..., "gguf_file": ..., "dtype": float32, "device": "cpu"} would load
        # it, but loaded once per process.
        hf = _evaluate(HFLM(pretrained=hf_model(gguf), tokenizer=str(tok_dir), batch_size=1))
        yield served, hf
    finally:
        os.chdir(cwd)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _by_doc(res: dict[str, Any], task: str) -> dict[int, Any]:
    return {s["doc_id"]: s for s in res["samples"][task]}


def test_loglikelihood_task_accuracy_and_each_loglikelihood_equal_hf(
        results: tuple[dict[str, Any], dict[str, Any]]) -> None:
    served, hf = results
    acc_s = served["results"][LL_TASK]["acc,none"]
    acc_h = hf["results"][LL_TASK]["acc,none"]
    assert acc_s == acc_h
    s_docs, h_docs = _by_doc(served, LL_TASK), _by_doc(hf, LL_TASK)
    assert len(s_docs) == len(h_docs) == 20
    worst = 0.0
    for doc_id, s in s_docs.items():
        h = h_docs[doc_id]
        s_ll = [float(r[0]) for r in s["filtered_resps"]]
        h_ll = [float(r[0]) for r in h["filtered_resps"]]
        assert len(s_ll) == len(h_ll) == 3
        worst = max(worst, *(abs(a - b) for a, b in zip(s_ll, h_ll, strict=True)))
        assert [bool(r[1]) for r in s["filtered_resps"]] == [bool(r[1]) for r in h["filtered_resps"]]
    print(f"{LL_TASK}: acc served {acc_s} hf {acc_h}; worst log-likelihood gap {worst:.2e}")
    assert worst <= LL_TOL, worst
    assert acc_s > 1 / 3  # the model knows some capitals: the scores are not noise


def test_generation_task_exact_match_equals_hf(
        results: tuple[dict[str, Any], dict[str, Any]]) -> None:
    served, hf = results
    em_s = served["results"][GEN_TASK]["exact_match,none"]
    assert em_s == hf["results"][GEN_TASK]["exact_match,none"]
    s_docs, h_docs = _by_doc(served, GEN_TASK), _by_doc(hf, GEN_TASK)
    assert len(s_docs) == 12
    assert {d: s["filtered_resps"] for d, s in s_docs.items()} == {
        d: h["filtered_resps"] for d, h in h_docs.items()}
    print(f"{GEN_TASK}: exact_match served {em_s} hf {hf['results'][GEN_TASK]['exact_match,none']}")
    assert em_s > 0
