"""`superinfer bench serve`: arguments, one pass per rate, table, JSON and plot."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.errors import SuperInferError
from superinfer.argtypes import positive, rate, rates
from superinfer.bench.serve.prompts import (
    TRACE_LENGTH,
    BodyOptions,
    Conversations,
    TextTokenizer,
    prompt_text,
    system_prompt,
)
from superinfer.bench.serve.runner import (
    BenchError,
    Target,
    metric_deltas,
    metrics_url,
    probe,
    progress_bar,
    replay,
    scrape,
)
from superinfer.bench.serve.stream import StreamOutcome
from superinfer.bench.serve.summary import format_pass, format_sweep, result_row
from superinfer.bench.serve.tenants import TENANT_HELP, parse_tenant, run_tenants
from superinfer.workload import (
    SYNTHETIC,
    WorkloadSpec,
    build_trace,
    parse_slo_classes,
    trace_stats,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"  # `superinfer serve`'s gateway
DEFAULT_NUM_PROMPTS = 100  # when neither --num-prompts nor --duration is given


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Load benchmark against any OpenAI-compatible server: replays a trace with gamma "
        "arrivals, streams every request, and reports TTFT/TBT/TPOT/E2E latency, SLO "
        "attainment, goodput and throughput (DESIGN 8; vLLM's `bench serve` names)."
    )
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default=DEFAULT_BASE_URL,
                   help=f"the OpenAI API root (default {DEFAULT_BASE_URL})")
    s.add_argument("--model", default=None, help="model name (default: the first of GET /models)")
    s.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY, else none)")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    s.add_argument("--label", default=None,
                   help="name of this run in the results and plot (default: the model name)")
    s.add_argument("--metrics-url", default=None,
                   help="Prometheus endpoint read before/after each pass (default: the base "
                        "URL's root + /metrics; 'none' to skip); behind a router, the "
                        "replicas' endpoints, comma-separated: their counters are summed")
    s.add_argument("--timeout", type=positive(float), default=600.0,
                   help="seconds to wait for the next chunk of a stream before failing it")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", default="sharegpt",
                   help=f"synthetic ({', '.join(SYNTHETIC)}) or a ShareGPT JSON file (vLLM's format)")
    w.add_argument("--tokenizer", default="auto",
                   help="counts dataset lengths and sizes prompt text: 'auto' (the bundled "
                        "model's when the server serves it, else none), 'bundled', 'none' "
                        "(~1 token per word, 4 characters per token), a .gguf or a HF dir")
    w.add_argument("--rps", type=rate, default=math.inf,
                   help="mean request rate (default inf: every request at t = 0)")
    w.add_argument("--sweep-rps", type=rates, default=None, metavar="A,B,C",
                   help="one pass per rate (instead of --rps)")
    w.add_argument("--burstiness", type=positive(float), default=1.0,
                   help="gamma shape of the gaps; 1 = Poisson")
    w.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests per pass (default {DEFAULT_NUM_PROMPTS} unless --duration)")
    w.add_argument("--duration", type=float, default=None, help="seconds of arrivals per pass")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--max-prompt-len", type=int, default=1024)
    w.add_argument("--max-output-len", type=int, default=1024)
    w.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply sampled lengths before clipping")
    w.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (default: no cap)")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly the trace's output length (default on)")
    w.add_argument("--max-tokens", type=_max_tokens, default=TRACE_LENGTH, metavar="N|none",
                   help="each request's max_tokens: 'trace' (default: the trace's output "
                        "length), a number N (the same cap for all, as a client with a "
                        "generous bound sends) or 'none' (no max_tokens: the server's bound, "
                        "the model's context). Other than 'trace' it needs --no-ignore-eos: "
                        "the model's EOS then ends each request, and the trace's output "
                        "lengths are not used")
    w.add_argument("--system-prompt-len", type=int, default=0, metavar="TOKENS",
                   help="a system prompt of about this many tokens shared by every request")
    w.add_argument("--multi-turn", type=int, default=1, metavar="TURNS",
                   help="replay conversations of this many turns: the trace's requests are "
                        "their user turns (request i is turn i // C of conversation i %% C, "
                        "C = requests / TURNS), and each turn's prompt is the conversation so "
                        "far, the server's replies included; a turn is sent at its arrival or "
                        "--think-time after the previous reply, whichever is later")
    w.add_argument("--tenant", action="append", default=None, metavar="SPEC", help=TENANT_HELP)
    w.add_argument("--think-time", type=float, default=0.0, metavar="S",
                   help="multi-turn: seconds between a reply and the next turn")
    b = p.add_argument_group(
        "baseline mode (superinfer/bench/serve/baseline.py): the same streamed workload "
        "against --base-url and --baseline-url at each of --streams, interleaved, with ratios")
    b.add_argument("--baseline-url", default=None,
                   help="the other server's OpenAI API root, e.g. llama-server's "
                        "http://127.0.0.1:8090/v1 (turns baseline mode on)")
    b.add_argument("--baseline-off-url", default=None,
                   help="with --speculative: the anchor's server without speculation (its "
                        "lookup speedup is --baseline-url's tok/s over this one's)")
    b.add_argument("--baseline-label", default="baseline")
    b.add_argument("--baseline-model", default=None,
                   help="model name there (default: the first of its GET /models)")
    b.add_argument("--baseline-api-key", default=None)
    b.add_argument("--streams", type=_counts, default=[1, 8, 32], metavar="A,B,C",
                   help="concurrent streams per pass (default 1,8,32)")
    b.add_argument("--repeats", type=int, default=2, help="passes per server and concurrency")
    b.add_argument("--requests-per-stream", type=int, default=1)
    b.add_argument("--prompt-len", default="111-194", help="prompt tokens, N or LO-HI")
    b.add_argument("--output-len", type=int, default=128)
    b.add_argument("--note", default=None, help="free text stored in the JSON config")
    b.add_argument("--speculative", action="store_true",
                   help="speculation on vs off in one run (the server runs with "
                        "--speculative-config): the committed input-grounded and open-chat "
                        "prompts (or --dataset FILE.jsonl of that shape) at --streams, "
                        "--repeats times; --baseline-url: llama-server with its n-gram "
                        "speculation beside it")
    o = p.add_argument_group("SLOs and output")
    o.add_argument("--ttft-slo", type=positive(float), default=5.0, help="S_B, seconds")
    o.add_argument("--tbt-slo", type=positive(float), default=0.1, help="S_F, seconds")
    o.add_argument("--slo-classes", default=None,
                   help="heterogeneous SLOs: 'mixed' (interactive 1 s/50 ms and batch 20 s/500 "
                        "ms, half each) or name=TTFT:TBT:SHARE,... in seconds; each request "
                        "sends its class's SLOs and attainment is reported per class")
    o.add_argument("--no-send-slo", action="store_true",
                   help="do not send the SLOs in the request's `slo` field")
    o.add_argument("--json", default=None, metavar="PATH", help="write config and results")
    o.add_argument("--plot", default=None, metavar="PATH.png",
                   help="TTFT and TBT attainment vs RPS (matplotlib)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def _counts(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1,8,32, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive counts, got {text!r}")
    return vals


def _die(msg: str) -> int:
    print(f"superinfer bench serve: error: {msg}", file=sys.stderr)
    return 2


def _tokenizer(choice: str, model: str) -> tuple[TextTokenizer | None, str]:
    """The tokenizer that sizes prompts, and what to call it in the results."""
    from common.modelfile import resolve_model
    from common.tokenizer import Tokenizer

    if choice == "none":
        return None, "none"
    if choice == "auto":
        try:
            bundled = resolve_model(None)
        except SuperInferError:
            return None, "none"
        if bundled.name != model:
            return None, "none"
        source = bundled
    else:
        source = resolve_model(None if choice == "bundled" else choice)
    tok = Tokenizer.from_source(source)
    return TextTokenizer(encode=lambda t: tok.encode(t, add_special_tokens=False),
                         decode=lambda ids: tok.decode(ids)), str(source.path)


def _spec(args: argparse.Namespace, rps: float) -> WorkloadSpec:
    num = args.num_prompts
    if num is None and args.duration is None:
        num = DEFAULT_NUM_PROMPTS
    return WorkloadSpec(
        dataset=args.dataset, rps=rps, duration_s=None if num is not None else args.duration,
        num_prompts=num, burstiness=args.burstiness, seed=args.seed,
        max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len,
        length_scale=args.length_scale, slo_classes=parse_slo_classes(args.slo_classes),
    )


def _max_tokens(text: str) -> int | str | None:
    if text in (TRACE_LENGTH, "none"):
        return None if text == "none" else text
    n = int(text)  # argparse turns the ValueError into a usage error
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, 'trace' or 'none', got {n}")
    return n


def _check(args: argparse.Namespace) -> None:
    """Problems that need no server, reported before contacting one."""
    if args.max_tokens != TRACE_LENGTH and args.ignore_eos:
        raise BenchError("--max-tokens other than 'trace' needs --no-ignore-eos: with "
                         "ignore_eos every request would run to that cap")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not 0 <= args.temperature <= 100:
        raise BenchError(f"--temperature must be in [0, 100], got {args.temperature}")
    if args.num_prompts is not None and args.duration is not None:
        raise BenchError("give --num-prompts or --duration, not both")
    if args.multi_turn < 1:
        raise BenchError(f"--multi-turn must be at least 1, got {args.multi_turn}")
    if args.think_time < 0 or args.system_prompt_len < 0:
        raise BenchError("--think-time and --system-prompt-len must be >= 0")
    if args.duration is not None and math.isinf(args.rps) and not args.sweep_rps:
        raise BenchError("--duration needs a finite --rps (or --sweep-rps); "
                         "with the default infinite rate give --num-prompts")
    if args.dataset not in SYNTHETIC and not Path(args.dataset).is_file():
        raise BenchError(
            f"dataset {args.dataset!r} is neither a synthetic dataset "
            f"({', '.join(SYNTHETIC)}) nor an existing file"
        )
    for rps in args.sweep_rps or [args.rps]:
        _spec(args, rps)  # WorkloadError on bad lengths, rates, durations


def _ticker(bar: Any) -> Callable[[StreamOutcome], None]:
    return lambda _: bar.update(1)


def _finite(v: Any) -> Any:
    """JSON has no inf/NaN: an infinite rate or a missing value is written as null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v


def _run_tenants(args: argparse.Namespace) -> int:
    loads = [parse_tenant(t, args) for t in args.tenant]
    if args.sweep_rps or args.multi_turn > 1 or args.baseline_url:
        raise BenchError("--tenant runs one pass of each tenant's own rate: not with "
                         "--sweep-rps, --multi-turn or --baseline-url")
    models = asyncio.run(probe(Target(args.base_url, args.endpoint, loads[0].key, args.timeout)))
    model = args.model or (models[0] if models else None)
    if model is None:
        raise BenchError(f"{args.base_url}/models lists no model; pass --model")
    tok, tok_name = _tokenizer(args.tokenizer, model)
    murl = None if args.metrics_url == "none" else (args.metrics_url or metrics_url(args.base_url))
    rows = run_tenants(args, loads, model, tok, murl)
    if args.json:
        config = {"base_url": args.base_url, "model": model, "endpoint": args.endpoint,
                  "dataset": args.dataset, "tokenizer": tok_name, "seed": args.seed,
                  # Never the keys: a result file gets shared.
                  "tenants": [{k: v for k, v in dataclasses.asdict(t).items() if k != "key"}
                              for t in loads]}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(_finite({"config": config, "tenants": rows}),
                                              indent=1, allow_nan=False))
        print(f"wrote {args.json}")
    if all(r["completed"] == 0 for r in rows):
        return _die("every request of every tenant failed")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except SuperInferError as e:  # WorkloadError, BenchError, ModelLoadError
        return _die(str(e))


def _run(args: argparse.Namespace) -> int:
    if args.speculative:
        from superinfer.bench.serve.speculative import run_speculative

        if args.repeats < 1:
            raise BenchError("--repeats must be >= 1")
        return run_speculative(args)
    if args.baseline_url:
        from superinfer.bench.serve.baseline import run_baseline

        if args.repeats < 1 or args.requests_per_stream < 1 or args.output_len < 1:
            raise BenchError("--repeats, --requests-per-stream and --output-len must be >= 1")
        probe_target = Target(args.base_url, args.endpoint, args.api_key, args.timeout)
        models = asyncio.run(probe(probe_target))
        tok, _ = _tokenizer(args.tokenizer, args.model or (models[0] if models else ""))
        return run_baseline(args, tok)
    _check(args)
    if args.tenant:
        return _run_tenants(args)
    target = Target(args.base_url, args.endpoint, args.api_key, args.timeout, args.max_concurrency)
    models = asyncio.run(probe(target))
    model = args.model or (models[0] if models else None)
    if model is None:
        raise BenchError(f"{args.base_url}/models lists no model; pass --model")
    tok, tok_name = _tokenizer(args.tokenizer, model)
    label = args.label or model
    murl = None if args.metrics_url == "none" else (args.metrics_url or metrics_url(args.base_url))
    send_slo = not args.no_send_slo
    opts = BodyOptions(args.endpoint, model, args.temperature, args.ignore_eos,
                       args.ttft_slo if send_slo else None, args.tbt_slo if send_slo else None,
                       system_prompt(args.system_prompt_len, args.seed, tok), args.max_tokens)
    rows: list[dict[str, Any]] = []
    traces = {}
    for rps in args.sweep_rps or [args.rps]:
        spec = _spec(args, rps)
        trace = build_trace(spec, tok.encode if tok else None)
        traces[rps] = trace_stats(trace)
        texts = [prompt_text(r, args.seed, tok) for r in trace]
        turns = Conversations(len(trace), args.multi_turn)
        before = asyncio.run(scrape(murl))
        with progress_bar(len(trace), f"{rps:g} req/s", not args.no_progress) as bar:
            outcomes, start, end = asyncio.run(replay(
                target, trace, turns.bodies(trace, texts, opts), on_done=_ticker(bar),
                after=turns.previous, think_s=args.think_time))
        server = metric_deltas(before, asyncio.run(scrape(murl)))
        # Goodput per second of arrivals, as the simulator counts it; with every request
        # at t = 0 there is no arrival span, so per second of the run, as vLLM counts it.
        duration = end - start if math.isinf(rps) else spec.trace_duration_s
        row = result_row(label=label, rps=rps, trace=trace, outcomes=outcomes,
                         ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
                         duration_s=duration, start=start, end=end, server=server)
        rows.append(row)
        print(format_pass(row, args.ttft_slo, args.tbt_slo), end="\n\n", flush=True)
    if len(rows) > 1:
        print(format_sweep(rows))

    config = {
        "base_url": args.base_url, "model": model, "endpoint": args.endpoint, "label": label,
        "dataset": args.dataset, "tokenizer": tok_name,
        "rps": [r["rps"] for r in rows], "num_prompts": args.num_prompts,
        "duration_s": args.duration, "burstiness": args.burstiness, "seed": args.seed,
        "max_prompt_len": args.max_prompt_len, "max_output_len": args.max_output_len,
        "length_scale": args.length_scale, "max_concurrency": args.max_concurrency,
        "temperature": args.temperature, "ignore_eos": args.ignore_eos,
        "max_tokens": args.max_tokens,
        "system_prompt_len": args.system_prompt_len, "multi_turn": args.multi_turn,
        "think_time_s": args.think_time,
        "ttft_slo_s": args.ttft_slo, "tbt_slo_s": args.tbt_slo, "slo_sent": send_slo,
        "slo_classes": args.slo_classes,
        "traces": {f"{k:g}": v for k, v in traces.items()},
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        data = _finite({"config": config, "results": rows})
        Path(args.json).write_text(json.dumps(data, indent=1, allow_nan=False))
        print(f"wrote {args.json}")
    finite = [r for r in rows if math.isfinite(r["rps"])]
    if args.plot and not finite:
        print("no plot: an infinite rate has no place on an RPS axis", file=sys.stderr)
    elif args.plot:
        from superinfer.sim.plots import rate_plot as plot

        plot(finite, args.plot, f"{label} at {args.base_url}, {args.dataset}, "
             f"SLO TTFT {args.ttft_slo:g} s / TBT {args.tbt_slo * 1000:g} ms")
        print(f"wrote {args.plot}")
    if rows and all(r["completed"] == 0 for r in rows):
        first = next((d["error"] for r in rows for d in r["per_request"] if d["error"]), "?")
        return _die(f"every request failed; the first: {first}")
    return 0
