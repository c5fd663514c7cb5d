"""Every service logs one JSON object per line, carrying the bound request context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog

from common.logging import configure_logging, get_logger


def test_json_lines_to_stderr_and_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_file = tmp_path / "logs" / "gateway.jsonl"
    configure_logging("gateway", log_file=log_file, level="info")
    log = get_logger(request_id="req-1")
    log.debug("hidden")
    log.info("request admitted", prompt_tokens=12)
    structlog.contextvars.bind_contextvars(trace="t-9")
    try:
        get_logger().warning("slow")
    finally:
        structlog.contextvars.clear_contextvars()

    err_lines = capsys.readouterr().err.strip().splitlines()
    file_lines = log_file.read_text().strip().splitlines()
    assert err_lines == file_lines
    first, second = (json.loads(line) for line in err_lines)
    assert list(first)[:4] == ["timestamp", "level", "service", "event"]
    assert first["level"] == "info"
    assert first["service"] == "gateway"
    assert first["event"] == "request admitted"
    assert first["request_id"] == "req-1"
    assert first["prompt_tokens"] == 12
    assert first["timestamp"].endswith("Z")
    assert second["level"] == "warning" and second["trace"] == "t-9"


def test_unknown_level_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("worker", level="loud")
