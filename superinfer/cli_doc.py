"""`python -m superinfer.cli_doc`: docs/cli.md, every command's --help, from the parser.

tests/test_cli_doc.py fails when the committed page differs from what this prints, so
the page cannot drift from the flags; `make cli-doc` rewrites it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# (command words, one line on when to use it); the parser's help says the rest.
COMMANDS: list[tuple[list[str], str]] = [
    (["serve"], "all four services on this machine, restarted when one dies"),
    (["generate"], "prompts through the engine in this process, no services"),
    (["worker"], "the model and the device KV pool, alone"),
    (["kvmem"], "the host KV pool and the transfer streams, alone"),
    (["scheduler"], "the engine core, alone"),
    (["gateway"], "the REST and client gRPC APIs, alone"),
    (["health"], "a health probe for containers"),
    (["tenants", "new-key"], "a new API key and its tenants-file entry"),
    (["tenants", "hash-key"], "the tenants-file entry of an existing key"),
    (["tenants", "check"], "check a tenants file as the gateway would"),
    (["bench", "serve"], "load any OpenAI-compatible server against your SLOs"),
    (["bench", "engine"], "the engine's speed in one process"),
    (["bench", "transfer"], "KV block transfer bandwidth"),
    (["bench", "gpu-worker"], "the CUDA worker's checks"),
    (["sim"], "the scheduler on a modelled machine"),
    (["sim", "calibrate"], "measure this machine for the simulator"),
]
WIDTH = "100"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def _help(words: list[str]) -> str:
    from superinfer.cli import build_parser

    parser = build_parser(words)
    node: argparse.ArgumentParser = parser
    for w in words:
        sub = next(a for a in node._actions if isinstance(a, argparse._SubParsersAction))
        node = sub.choices[w]
    return node.format_help().rstrip()


def render() -> str:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH  # argparse wraps to the terminal: fix it
    try:
        return _render()
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def _render() -> str:
    lines = ["# Command line", "",
             "Generated from the parser by `make cli-doc` (`python -m superinfer.cli_doc`); "
             "a test fails when it differs.", ""]
    lines += [f"* [`superinfer {' '.join(w)}`](#superinfer-{'-'.join(w)}) — {why}"
              for w, why in COMMANDS]
    for words, _ in COMMANDS:
        lines += ["", f"## superinfer {' '.join(words)}", "", "```text", _help(words), "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    text = render()
    if sys.argv[1:] == ["--write"]:
        PAGE.write_text(text)
        print(f"wrote {PAGE}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
