"""One real stack (worker + kvmem + scheduler + gateway processes) for the test session.

test_gateway, test_openai_features and test_bench_serve all ask what a client of the four
services notices; they share one stack (`shared_stack` in conftest.py) instead of
starting one each. Its reference, computed in a separate process while the services
load, is the in-process engine's greedy output for every prompt those modules compare.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from common.daemon import free_port
from superinfer.probes import grpc_probe, http_probe
from superinfer.supervisor import ServiceSpec, Supervisor

DEVICE_BLOCKS = 512
HOST_BLOCKS = 512
MAX_TOKENS = 16
STARTUP_TIMEOUT_S = 240.0
# One torch thread per process: the reference and the worker run side by side on a small
# shared CPU, where OpenMP threads that wait on each other make every step many times
# slower. Same setting on both sides, so the greedy tokens are computed alike.
CHILD_ENV = {"OMP_NUM_THREADS": "1"}

PLAIN_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3, 4, 5,",
    "def add(a, b):",
    "The quick brown fox",
    "Water boils at a temperature of",
    "My favourite colour is",
    "In the beginning",
]
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
FEATURES_PROMPT = "The capital of France is Paris. The capital of Germany is"

# The reference: `superinfer generate`'s engine, in its own process, greedy: the plain and
# chat prompts' outputs, and the features prompt's logprobs, echo and penalized output.
_REFERENCE_SCRIPT = """
import json, sys
from scheduler_svc.request import SamplingParams
from common.config import EngineConfig
from superinfer.engine import LLMEngine
spec = json.load(sys.stdin)
engine = LLMEngine(EngineConfig(device_blocks=512, host_blocks=0))
out = {}
for kind, chat in (("plain", False), ("chat", True)):
    ids = [engine.encode_prompt(p, chat=chat) for p in spec[kind]]
    res = engine.generate(ids, SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0))
    out[kind] = [{"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                  "prompt_ids": r.prompt_token_ids, "prompt_tokens": len(r.prompt_token_ids)}
                 for r in res]
ids = engine.encode_prompt(spec["features"])
sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, prompt_logprobs=True)
r = engine.generate([ids], sp)[0]
pen = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.5,
                                            presence_penalty=0.5, repetition_penalty=1.2))[0]
lps = lambda xs: [[x.token_id, x.logprob, x.top_ids, x.top_logprobs] for x in xs]
out["features"] = {"prompt_ids": ids, "token_ids": r.token_ids, "text": r.text,
                   "logprobs": lps(r.logprobs), "prompt_logprobs": lps(r.prompt_logprobs),
                   "penalized": pen.token_ids, "penalized_text": pen.text}
print(json.dumps(out))
"""
REFERENCE_SPEC = {"plain": PLAIN_PROMPTS, "chat": CHAT_PROMPTS, "max_tokens": MAX_TOKENS,
                  "features": FEATURES_PROMPT}


@dataclass
class Stack:
    run_dir: Path
    http_url: str
    grpc_addr: str
    scheduler_addr: str
    model: str
    reference: dict[str, Any]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.http_url}/v1", api_key="unused", max_retries=0,
                             http_client=httpx.Client(trust_env=False, timeout=120))

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.http_url}/v1", api_key="unused", max_retries=0,
                                  http_client=httpx.AsyncClient(trust_env=False, timeout=300))

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.http_url, trust_env=False, timeout=120)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with self.http() as h:
            text = h.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def start_stack(run_dir: Path, device_blocks: int = DEVICE_BLOCKS,
                host_blocks: int = HOST_BLOCKS, trace: bool = True) -> Iterator[Stack]:
    """worker + kvmem + scheduler + gateway under a Supervisor, and beside them (started
    first, so that it runs while the services load) the in-process reference."""
    ports = {name: free_port() for name in ("worker", "kvmem", "scheduler", "http", "grpc")}
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    ref_out, ref_err = run_dir / "reference-out.json", run_dir / "reference.err"
    with ref_out.open("w") as stdout, ref_err.open("w") as stderr:
        reference_proc = subprocess.Popen([sys.executable, "-c", _REFERENCE_SCRIPT],
                                          stdin=subprocess.PIPE, stdout=stdout, stderr=stderr,
                                          env={**os.environ, **CHILD_ENV}, text=True)
        assert reference_proc.stdin is not None
        reference_proc.stdin.write(json.dumps(REFERENCE_SPEC))
        reference_proc.stdin.close()
    cli = [sys.executable, "-m", "superinfer.cli"]
    common = ["--run-dir", str(run_dir), "--host", "127.0.0.1"]
    traced = ["--trace", str(run_dir / "scheduler.trace.json")] if trace else []
    specs = [
        ServiceSpec("worker", [*cli, "worker", *common, "--port", str(ports["worker"]),
                               "--device-blocks", str(device_blocks)], grpc_probe(addr["worker"])),
        ServiceSpec("kvmem", [*cli, "kvmem", *common, "--port", str(ports["kvmem"]),
                              "--host-blocks", str(host_blocks)], grpc_probe(addr["kvmem"])),
        ServiceSpec("scheduler", [*cli, "scheduler", *common, "--port", str(ports["scheduler"]),
                                  "--worker-addr", addr["worker"], "--kvmem-addr", addr["kvmem"],
                                  *traced],
                    grpc_probe(addr["scheduler"])),
        ServiceSpec("gateway", [*cli, "gateway", *common, "--port", str(ports["http"]),
                                "--grpc-port", str(ports["grpc"]),
                                "--scheduler-addr", addr["scheduler"]],
                    http_probe(f"http://{addr['http']}/health")),
    ]
    sup = Supervisor(run_dir)
    try:
        with environment(CHILD_ENV):  # the Supervisor hands its own environment on
            for spec in specs:
                sup.start(spec, STARTUP_TIMEOUT_S)
        assert reference_proc.wait(timeout=STARTUP_TIMEOUT_S) == 0, ref_err.read_text()[-3000:]
        reference = json.loads(ref_out.read_text().strip().splitlines()[-1])
        with httpx.Client(trust_env=False) as h:
            model = h.get(f"http://{addr['http']}/v1/models").json()["data"][0]["id"]
        yield Stack(run_dir, f"http://{addr['http']}", addr["grpc"], addr["scheduler"], model,
                    reference)
    finally:
        if reference_proc.poll() is None:
            reference_proc.kill()
            reference_proc.wait()
        sup.stop_all()
