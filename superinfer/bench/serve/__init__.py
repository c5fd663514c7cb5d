"""`superinfer bench serve`: a load benchmark for any OpenAI-compatible server (DESIGN 8).

    superinfer bench serve --base-url http://127.0.0.1:8000/v1 --dataset sharegpt \\
        --sweep-rps 1,2,4 --num-prompts 200 --ttft-slo 5 --tbt-slo 0.1 \\
        --json out.json --plot out.png

Modules: `prompts` (request text and bodies), `stream` (one SSE stream and how its
tokens are timed), `runner` (arrivals on schedule, server probe, /metrics), `summary`
(metrics, table, per-request details), `cli` (the command).
"""

from superinfer.bench.serve.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
