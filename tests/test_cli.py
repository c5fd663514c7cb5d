"""`superinfer generate` on bad input: one clear line on stderr, non-zero exit, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "superinfer.cli", "generate", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens must be at least 1"),
        (["--prompt", "hi", "--max-tokens", "-5"], "max_tokens must be at least 1"),
        (["--prompt", "hi", "--model", "/nonexistent/model.gguf"], "not found"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--device-blocks", "0"], "--device-blocks"),
        (["--prompts-file", "/nonexistent/prompts.txt"], "not found"),
        ([], "give --prompt"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], message: str,
                                     capfd: pytest.CaptureFixture[str]) -> None:
    # In this process (the command line's own entry point): each case fails before a model
    # would compute, and a process per case cost seconds of imports each.
    from superinfer.cli import main

    assert main(["generate", *args]) != 0
    err = capfd.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize(("args", "message"), [
    (["--tbt-slo", "0"], "--tbt-slo must be a positive number of seconds"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least 1"),
])
def test_serve_refuses_a_bad_engine_flag_in_one_line_before_any_process(
        tmp_path: Path, args: list[str], message: str) -> None:
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "superinfer.cli", "serve", "--run-dir",
                        str(run_dir), *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("superinfer serve: error: "), p.stderr
    assert message in lines[0]
    assert not run_dir.exists() or not any(q.suffix in (".out", ".pid") for q in run_dir.iterdir())


def test_corrupt_model_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    p = generate("--prompt", "hi", "--model", str(bad))
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "broken.gguf" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_prompt_longer_than_context() -> None:
    p = generate("--prompt", "hello " * 9000, "--max-tokens", "4")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "context" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_generate_prints_text() -> None:
    # float32, the reference: the first token is a near-tie ("The" 25.33 vs "L" 25.24) that
    # the quantized default format may break the other way (its answer: "L'Étoile, ...").
    p = generate("--prompt", "What is the capital of France?", "--chat", "--max-tokens", "12",
                 "--dtype", "float32")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout


def test_the_light_services_never_import_torch() -> None:
    """The supervisor, gateway and scheduler import only what they use: parsing any
    command's flags and importing those services' modules loads no torch (which would map
    ~400 MB into each process)."""
    code = (
        "import sys\n"
        "from superinfer.cli import build_parser\n"
        "for cmd in ('serve', 'scheduler', 'gateway', 'worker', 'kvmem'):\n"
        "    build_parser([cmd]).parse_args([cmd])\n"
        "import superinfer.supervisor, superinfer.services_cli, gateway.server, gateway.app\n"
        "import scheduler_svc.service, scheduler_svc.loop\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(len(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0", out.stdout + out.stderr
