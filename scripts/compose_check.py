"""Crash each container of docker-compose.yml under load and check what a client sees.

    python scripts/compose_check.py [--json docs/results/compose/results.json]

Needs a running Docker daemon, `docker compose` or `docker-compose`, the image built
(`docker compose build`), and permission to signal the containers' processes from this
host (root, as dockerd). The run:

1. `up -d`, then it waits until the gateway is healthy.
2. Reference: 4 streamed chat completions (greedy, 200 tokens, EOS ignored).
3. For each of worker, kvmem, gateway and scheduler, the same 4 streams again. 3 s in, the
   service's process is killed with SIGKILL from the host: a crash, not a `docker stop`.
   Docker restarts it (`restart: on-failure`).
4. It records whether the streams finished with the reference texts, when they ended and
   when the service was healthy again (`streams_end_s`, `healthy_s`: seconds after the kill),
   the container's restart count, whether a new request succeeds (retried on 503 for up to
   2 minutes, as a client honouring Retry-After would), and the KV segments left in
   /dev/shm. There should be one.

A dead scheduler ends the streams in flight with an error event, by design (README,
"Restarts and shutdown"). For the scheduler the check is instead that a new request
succeeds once it is back. The gateway holds the client connections, so its streams end
too. For the gateway the check is likewise a new request.

The run takes 3-5 minutes on 2 CPUs. It prints a table and writes JSON. Nothing here runs
in CI: CI machines have no Docker daemon.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from openai import APIConnectionError, InternalServerError, OpenAI

ROOT = Path(__file__).resolve().parent.parent
BASE = "http://127.0.0.1:8000/v1"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
STREAMS = 4


def compose_cmd() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    sys.exit("neither `docker compose` nor `docker-compose` is installed")


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def container(compose: list[str], service: str) -> str:
    return sh(*compose, "ps", "-q", service)


def wait_healthy(cid: str, timeout: float = 300) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        state = sh("docker", "inspect", "-f", "{{.State.Status}} {{.State.Health.Status}}", cid)
        if state == "running healthy":
            return time.monotonic() - t0
        time.sleep(1)
    raise TimeoutError(f"container {cid[:12]} not healthy after {timeout:.0f} s")


def wait_restarted(cid: str, before: int, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while int(sh("docker", "inspect", "-f", "{{.RestartCount}}", cid)) == before:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"container {cid[:12]} was not restarted in {timeout:.0f} s")
        time.sleep(0.2)


def ask(client: OpenAI, timeout: float = 120) -> bool:
    """One short request, retried while the server answers 503 (as it does while a
    service it needs restarts), as a client that honours Retry-After would."""
    t0 = time.monotonic()
    while True:
        try:
            r = client.chat.completions.create(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
            return r.choices[0].message.content is not None
        except (InternalServerError, APIConnectionError):
            if time.monotonic() - t0 > timeout:
                return False
            time.sleep(1)


class Streams:
    """STREAMS greedy chats started at once; `texts` (None: the stream failed) and the
    time each one ended fill in as they finish."""

    def __init__(self, client: OpenAI) -> None:
        self.texts: dict[int, str | None] = {}
        self.ended: dict[int, float] = {}
        self.started = time.monotonic()
        self.threads = [threading.Thread(target=self._one, args=(client, i))
                        for i in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _one(self, client: OpenAI, i: int) -> None:
        try:
            s = client.chat.completions.create(
                model=MODEL, stream=True, max_tokens=200, temperature=0,
                messages=[{"role": "user", "content": f"Write a long story about robot {i}."}],
                extra_body={"ignore_eos": True})
            self.texts[i] = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
        except Exception as e:  # noqa: BLE001 - any failure is the stream's outcome
            self.texts[i] = None
            print(f"  stream {i}: {type(e).__name__}: {e}", file=sys.stderr)
        self.ended[i] = time.monotonic()

    def join(self) -> float:
        """Wait for every stream; the time the last one ended."""
        for t in self.threads:
            t.join()
        return max(self.ended.values())


def segments(compose: list[str]) -> list[str]:
    return sh("docker", "exec", container(compose, "worker"), "ls", "/dev/shm").split()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--keep", action="store_true", help="leave the containers running")
    args = p.parse_args()
    compose = compose_cmd()
    subprocess.run([*compose, "up", "-d", "--no-build"], cwd=ROOT, check=True)
    client = OpenAI(base_url=BASE, api_key="unused", timeout=240, max_retries=0)
    rows: list[dict[str, Any]] = []
    try:
        wait_healthy(container(compose, "gateway"))
        ref = Streams(client)
        ref_s = ref.join() - ref.started
        reference = ref.texts
        if any(v is None for v in reference.values()):
            sys.exit("the reference streams failed: is the stack healthy?")
        print(f"reference: {STREAMS} streams in {ref_s:.1f} s")
        for service in ("worker", "kvmem", "gateway", "scheduler"):
            cid = container(compose, service)
            before = int(sh("docker", "inspect", "-f", "{{.RestartCount}}", cid))
            pid = sh("docker", "inspect", "-f", "{{.State.Pid}}", cid)
            run = Streams(client)
            time.sleep(3)
            sh("kill", "-9", pid)
            t_kill = time.monotonic()
            wait_restarted(cid, before)  # while the streams go on
            wait_healthy(cid)
            back_s = time.monotonic() - t_kill
            took = run.join() - t_kill
            texts = run.texts
            after = int(sh("docker", "inspect", "-f", "{{.RestartCount}}", cid))
            new_ok = ask(client)
            row = {
                "killed": service,
                "restarted": after - before,
                "streams_finished": sum(v is not None for v in texts.values()),
                "texts_unchanged": sum(texts[i] == reference[i] for i in texts),
                "streams_end_s": round(took, 1),
                "healthy_s": round(back_s, 1),
                "new_request_ok": new_ok,
                "kv_segments_in_dev_shm": len(segments(compose)),
            }
            rows.append(row)
            print(json.dumps(row))
    finally:
        if not args.keep:
            subprocess.run([*compose, "down"], cwd=ROOT, check=False)
    headers = list(rows[0]) if rows else []
    print("\n" + "  ".join(headers))
    for r in rows:
        print("  ".join(str(r[h]).rjust(len(h)) for h in headers))
    ok = all(r["restarted"] == 1 and r["new_request_ok"] and r["kv_segments_in_dev_shm"] == 1
             for r in rows) and all(r["texts_unchanged"] == STREAMS for r in rows
                                    if r["killed"] in ("worker", "kvmem"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "compose": " ".join(compose), "reference_streams_s": round(ref_s, 1),
            "streams": STREAMS, "rows": rows, "ok": ok}, indent=2) + "\n")
        print(f"wrote {args.json}")
    print("ok" if ok else "NOT OK: see the rows above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
