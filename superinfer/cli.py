"""`superinfer` command line: the composition root that wires the pieces together."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.errors import SuperInferError


def _die(msg: str) -> int:
    print(f"superinfer: error: {msg}", file=sys.stderr)
    return 2


def _generate(args: argparse.Namespace) -> int:
    from common.config import EngineConfig
    from scheduler_svc.request import InvalidSamplingParams, SamplingParams
    from superinfer.engine import LLMEngine

    if args.prompt is None and args.prompts_file is None:
        return _die("give --prompt TEXT or --prompts-file FILE")
    if args.prompt is not None:
        texts = [args.prompt]
    else:
        path = Path(args.prompts_file)
        if not path.is_file():
            return _die(f"prompts file {path} not found")
        texts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not texts:
            return _die(f"prompts file {path} holds no prompts")
    if any(not t for t in texts):
        return _die("prompt is empty")
    try:
        sampling = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop or ()),
            ignore_eos=args.ignore_eos,
        )
        engine = LLMEngine(EngineConfig.from_args(args))
        prompts = [engine.encode_prompt(t, chat=args.chat) for t in texts]
        results = engine.generate(prompts, sampling, texts=texts)
        engine.close()
    except (SuperInferError, InvalidSamplingParams, ValueError) as e:
        return _die(str(e))
    for r in results:
        if args.json:
            print(json.dumps({
                "prompt": r.prompt,
                "text": r.text,
                "token_ids": r.token_ids,
                "finish_reason": r.finish_reason,
                "prompt_tokens": len(r.prompt_token_ids),
                "metrics": r.metrics,
            }, ensure_ascii=False))
        else:
            if len(results) > 1:
                print(f"--- {r.prompt!r}")
            print(r.text)
    if args.json:
        print(json.dumps({"stats": engine.stats()}))
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from common.config import EngineConfig

    p = sub.add_parser("generate", help="run prompts through the engine in this process")
    p.add_argument("--prompt", help="one prompt")
    p.add_argument("--prompts-file", help="one prompt per line, all submitted at once")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, then stats")
    EngineConfig.add_arguments(p)
    p.set_defaults(func=_generate)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; `argv`, where given, lets a subcommand that is not chosen
    skip importing its modules (a service process must stay light)."""
    parser = argparse.ArgumentParser(
        prog="superinfer",
        description="SuperInfer: SLO-aware LLM serving that rotates KV between device and host",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from superinfer import bench_cli

    bench_cli.add_parser(sub, argv)
    from superinfer.sim import cli as sim_cli

    sim_cli.add_parser(sub)
    from superinfer import tenants_cli

    tenants_cli.add_parser(sub)
    try:
        from superinfer import services_cli
    except ImportError:  # the services are optional in a partial install
        pass
    else:
        services_cli.add_parsers(sub)
        from superinfer import replicas

        replicas.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["health"]:  # a container health check, every few seconds: stay light
        from superinfer.probes import health_main

        return health_main(argv[1:])
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    from common.logging import configure_logging

    # Warnings (a kernel build that failed, a --dtype fallback) go to stderr as JSON, never
    # into a command's stdout; the services reconfigure logging for their own log files.
    configure_logging(args.command, level=getattr(args, "log_level", None) or "warning")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except SuperInferError as e:
        return _die(str(e))


if __name__ == "__main__":
    sys.exit(main())
