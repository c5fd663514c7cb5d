"""What serving costs: the REST gateway + services vs `LLMEngine.generate` in-process.

Same workload on both sides: N concurrent greedy requests (the same prompts, EOS
ignored, a fixed number of new tokens). The served side streams SSE through the gateway,
which talks gRPC to the scheduler, which drives the worker and kvmem; the in-process side
runs the same scheduler and model in this process. The ratio of decode throughputs is
the price of the process split, tokenization/detokenization and HTTP. Timings on a
shared CPU are noisy: the two sides run in turn (served, in-process, served, …), each
pair gives a ratio, and the median ratio of `--repeats` pairs is the result. Each run also
records the CPU seconds every process burned (the services, this process as the client;
this process alone in-process): on a few cores, the served side's extra CPU is taken from
the forward's threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from common.daemon import free_port
from experiments.proc_cpu import CPUMeter
from experiments.sse_client import stream_post
from superinfer.bench.engine import PROMPTS
from superinfer.bench.report import table, write_json
from superinfer.probes import grpc_probe, http_probe
from superinfer.supervisor import ServiceSpec, Supervisor


@dataclass(slots=True)
class Measure:
    path: str
    requests: int
    new_tokens: int  # generated tokens, all requests
    wall_s: float  # first submit to last token
    mean_ttft_s: float
    decode_tok_s: float  # tokens after each request's first, over the all-decoding span
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds per process

    @property
    def total_tok_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=32, help="concurrent requests")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--device-blocks", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5,
                   help="pairs of runs (served, then in-process); the median ratio is reported")
    p.add_argument("--url", default=None,
                   help="an already running gateway (default: start a full stack here)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--skip-engine", action="store_true", help="only measure the served path")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads on both sides (the started worker gets OMP_NUM_THREADS); "
                        "on a busy CPU, 1 avoids OpenMP threads waiting on each other")
    p.add_argument("--client", choices=CLIENTS, default="lean",
                   help="the streaming client (experiments/sse_client.py): lean "
                        "(http:// only) takes the least CPU from the server it shares the "
                        "machine with; httpx is what this benchmark used before")
    p.add_argument("--json", default=None, help="write results to this JSON file")


def _decode_rate(n_per_request: list[int], first: list[float], end: float) -> float:
    """Decode tok/s once every request is past its first token (as `bench engine`)."""
    span = end - max(first)
    return sum(n - 1 for n in n_per_request) / span if span > 0 else 0.0


# -- served ------------------------------------------------------------------------------------


CLIENTS = ("lean", "httpx")


async def _served_once(url: str, prompts: list[str], new: int, client: str = "lean") -> Measure:
    """Stream every prompt at once through the gateway; `client`: `lean` (the benchmark's
    default: experiments/sse_client.py, the least CPU taken from the server on a shared
    machine) or `httpx` (what these benchmarks used before)."""
    if client == "lean":
        return await _served_lean(url, prompts, new)
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=None, limits=limits) as c:

        async def one(prompt: str) -> tuple[float, int]:
            first, n = 0.0, 0
            async with c.stream("POST", "/v1/completions", json=_body(prompt, new)) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"gateway answered {r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        raise RuntimeError(f"stream failed: {event['error']}")
                    if event.get("usage"):
                        n = event["usage"]["completion_tokens"]
                    elif not first:
                        first = time.monotonic()
            return first, n

        t0 = time.monotonic()
        results = await asyncio.gather(*(one(p) for p in prompts))
        end = time.monotonic()
    return _measure(results, t0, end)


def _body(prompt: str, new: int) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def _served_lean(url: str, prompts: list[str], new: int) -> Measure:
    t0 = time.monotonic()
    streams = await asyncio.gather(*(stream_post(url, "/v1/completions", _body(p, new))
                                     for p in prompts))
    end = time.monotonic()
    return _measure([(s.first, s.tokens) for s in streams], t0, end)


def _measure(results: list[tuple[float, int]], t0: float, end: float) -> Measure:
    firsts, counts = [f for f, _ in results], [n for _, n in results]
    return Measure("gateway (REST/SSE)", len(results), sum(counts), end - t0,
                   sum(f - t0 for f in firsts) / len(firsts), _decode_rate(counts, firsts, end))



def _start_stack(run_dir: Path, device_blocks: int, timeout_s: float,
                 scheduler_args: list[str] | None = None,
                 host_blocks: int = 0) -> tuple[Supervisor, str]:
    port = {n: free_port() for n in ("worker", "kvmem", "scheduler", "http")}
    addr = {n: f"127.0.0.1:{p}" for n, p in port.items()}
    cli = [sys.executable, "-m", "superinfer.cli"]
    common = ["--run-dir", str(run_dir), "--host", "127.0.0.1"]
    specs = [
        ServiceSpec("worker", [*cli, "worker", *common, "--port", str(port["worker"]),
                               "--device-blocks", str(device_blocks)], grpc_probe(addr["worker"])),
        ServiceSpec("kvmem", [*cli, "kvmem", *common, "--port", str(port["kvmem"]),
                              "--host-blocks", str(host_blocks)], grpc_probe(addr["kvmem"])),
        ServiceSpec("scheduler", [*cli, "scheduler", *common, "--port", str(port["scheduler"]),
                                  "--worker-addr", addr["worker"], "--kvmem-addr", addr["kvmem"],
                                  *(scheduler_args or [])],
                    grpc_probe(addr["scheduler"])),
        ServiceSpec("gateway", [*cli, "gateway", *common, "--port", str(port["http"]),
                                "--grpc-port", "0", "--scheduler-addr", addr["scheduler"]],
                    http_probe(f"http://{addr['http']}/health")),
    ]
    sup = Supervisor(run_dir)
    try:
        for spec in specs:
            print(f"starting {spec.name} …", file=sys.stderr, flush=True)
            sup.start(spec, timeout_s)
    except BaseException:
        sup.stop_all()
        raise
    return sup, f"http://{addr['http']}"


class _Served:
    """A stack (started here, or --url) to measure again and again."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sup: Supervisor | None = None
        self.tmp = tempfile.TemporaryDirectory(prefix="superinfer-overhead-")
        self.url = args.url
        if self.url is None:
            # Caching off on both sides: the repeats send the same prompts.
            self.sup, self.url = _start_stack(Path(self.tmp.name), args.device_blocks,
                                              args.startup_timeout,
                                              scheduler_args=["--no-enable-prefix-caching"])
        children = self.sup.children if self.sup is not None else []
        self.cpu = CPUMeter({**{c.spec.name: c.proc.pid for c in children},
                             "client": os.getpid()})

    def measure(self, prompts: list[str], new: int) -> Measure:
        assert self.url is not None
        self.cpu.start()
        m = asyncio.run(_served_once(self.url, prompts, new, self.args.client))
        m.cpu_s = self.cpu.stop()
        return m

    def close(self) -> None:
        if self.sup is not None:
            self.sup.stop_all()
        self.tmp.cleanup()


# -- in-process --------------------------------------------------------------------------------


class _InProcess:
    """The same scheduler and model in this process."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from common.config import EngineConfig
        from superinfer.engine import LLMEngine

        if args.threads is not None:
            torch.set_num_threads(args.threads)
        self.engine = LLMEngine(EngineConfig(device_blocks=args.device_blocks, host_blocks=0,
                                             enable_prefix_caching=False))
        self.cpu = CPUMeter({"in-process": os.getpid()})

    def measure(self, prompts: list[str], new: int) -> Measure:
        from scheduler_svc.request import SamplingParams

        engine = self.engine
        sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        self.cpu.start()
        t0 = time.monotonic()
        rids = [engine.add_request(engine.encode_prompt(p), sp, arrival_time=t0)
                for p in prompts]
        first: dict[str, float] = {}
        counts = dict.fromkeys(rids, 0)
        while engine.scheduler.has_unfinished():
            for ev in engine.step():
                if ev.new_token_ids:
                    first.setdefault(ev.request_id, time.monotonic())
                    counts[ev.request_id] += len(ev.new_token_ids)
        end = time.monotonic()
        engine.scheduler.collect_finished()
        for rid in rids:
            engine.trackers.pop(rid, None)
        cpu = self.cpu.stop()
        f = [first[r] for r in rids]
        n = [counts[r] for r in rids]
        return Measure("in-process LLMEngine", len(prompts), sum(n), end - t0,
                       sum(x - t0 for x in f) / len(f), _decode_rate(n, f, end), cpu)

    def close(self) -> None:
        self.engine.close()


def run(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.max_tokens < 2 or args.repeats < 1:
        print("superinfer: error: need --requests >= 1, --max-tokens >= 2, --repeats >= 1",
              file=sys.stderr)
        return 2
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the started services
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    sides: list[_Served | _InProcess] = []
    runs: list[list[Measure]] = []
    try:
        sides.append(_Served(args))
        if not args.skip_engine:
            sides.append(_InProcess(args))
        for side in sides:
            side.measure(prompts[:2], 4)  # warm-up
        runs = [[] for _ in sides]
        for i in range(args.repeats):  # in turn, so that both sides see the same machine
            for side, out in zip(sides, runs):
                out.append(side.measure(prompts, args.max_tokens))
                print(f"repeat {i + 1}: {out[-1].path}: {out[-1].decode_tok_s:.1f} decode tok/s",
                      file=sys.stderr, flush=True)
    finally:
        for side in sides:
            side.close()
    medians = [_median_measure(r) for r in runs]
    rows = [[m.path, m.requests, m.new_tokens, m.wall_s, m.mean_ttft_s, m.total_tok_s,
             m.decode_tok_s] for m in medians]
    print(f"medians of {args.repeats} runs per side")
    print(table(["path", "requests", "new tokens", "wall s", "mean TTFT s", "tok/s", "decode tok/s"],
                rows))
    cpu_rows = _cpu_rows(runs)
    if cpu_rows:
        print("CPU seconds per run (median per process) and per 1,000 new tokens")
        print(table(["path", "process", "CPU s", "CPU s / 1k tokens"], cpu_rows))
    result: dict[str, object] = {
        "workload": {"requests": args.requests, "max_tokens": args.max_tokens,
                     "device_blocks": args.device_blocks, "greedy": True, "ignore_eos": True,
                     "threads": args.threads, "repeats": args.repeats, "client": args.client},
        "measures": [{**asdict(m), "total_tok_s": m.total_tok_s} for m in medians],
        "cpu_s_median": {r[0] + "/" + r[1]: r[2] for r in cpu_rows},
        "runs": [[{**asdict(m), "total_tok_s": m.total_tok_s} for m in r] for r in runs],
    }
    if len(runs) == 2:
        ratios = [a.decode_tok_s / b.decode_tok_s for a, b in zip(*runs) if b.decode_tok_s > 0]
        if ratios:
            ratio = statistics.median(ratios)
            result["decode_ratio_gateway_over_in_process"] = ratio
            result["decode_ratios"] = ratios
            print(f"decode throughput, gateway / in-process: median {ratio:.3f} "
                  f"(pairs: {', '.join(f'{r:.3f}' for r in ratios)})")
    write_json(args.json, result)
    return 0


def _cpu_rows(runs: list[list[Measure]]) -> list[list[Any]]:
    """Per side and process: the median CPU seconds of a run, and per 1,000 new tokens."""
    rows: list[list[Any]] = []
    for side in runs:
        names = sorted({n for m in side for n in m.cpu_s})
        for name in [*names, "all"] if len(names) > 1 else names:
            per = [sum(m.cpu_s.values()) if name == "all" else m.cpu_s[name]
                   for m in side if name == "all" or name in m.cpu_s]
            tokens = statistics.median(m.new_tokens for m in side)
            sec = statistics.median(per)
            rows.append([side[0].path, name, sec, 1e3 * sec / tokens if tokens else 0.0])
    return rows


def _median_measure(runs: list[Measure]) -> Measure:
    """The run with the median decode throughput (a real run, not a blend)."""
    ordered = sorted(runs, key=lambda m: m.decode_tok_s)
    return ordered[(len(ordered) - 1) // 2]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m experiments overhead", description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
