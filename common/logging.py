"""JSON-lines logging shared by every service.

Each service process calls ``configure_logging`` once at start; every line is one JSON
object with ``timestamp`` (ISO 8601, UTC), ``level``, ``service`` and ``event`` first,
then any bound context (``request_id`` …), so the logs of all services can be merged
and filtered by request. Context bound with ``structlog.contextvars.bind_contextvars``
(per asyncio task) is included too.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path
from typing import IO, Any

import structlog
from structlog.typing import EventDict, WrappedLogger

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
_FIRST_KEYS = ("timestamp", "level", "service", "event")


class _JsonLinesSink:
    """structlog logger that writes each rendered line to stderr and an optional file.

    stderr is looked up on every write so that test harnesses that swap it still
    capture the output.
    """

    def __init__(self, file: IO[str] | None) -> None:
        self._file = file
        self._lock = threading.Lock()

    def msg(self, message: str) -> None:
        with self._lock:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
            if self._file is not None:
                self._file.write(message + "\n")
                self._file.flush()

    debug = info = warning = warn = error = critical = exception = fatal = log = msg


_file: IO[str] | None = None


def configure_logging(service: str, log_file: Path | None = None, level: str = "info") -> None:
    """Route structlog output for this process as JSON lines; safe to call again."""
    global _file
    try:
        threshold = _LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; use one of {sorted(_LEVELS)}") from None
    if _file is not None:
        _file.close()
        _file = None
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        _file = open(log_file, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    sink = _JsonLinesSink(_file)

    def add_service(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
        event_dict.setdefault("service", service)
        return event_dict

    def order_keys(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
        first = {k: event_dict.pop(k) for k in _FIRST_KEYS if k in event_dict}
        return {**first, **event_dict}

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            add_service,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.processors.UnicodeDecoder(),
            order_keys,
            structlog.processors.JSONRenderer(default=str),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=lambda *_: sink,
        cache_logger_on_first_use=False,
    )


def get_logger(**bind: Any) -> structlog.typing.FilteringBoundLogger:
    """A logger carrying ``bind`` (e.g. ``request_id=...``) on every line."""
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger().bind(**bind)
    return logger
