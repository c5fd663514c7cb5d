"""Typed errors shared by every service.

Each error carries a short machine-readable ``code`` and the HTTP status it maps to, so
the gateway (HTTP and gRPC) can turn any of them into a clear response without a table
of special cases, and no bad input ever surfaces as a crash.
"""

from __future__ import annotations


class SuperInferError(Exception):
    """Base of all errors SuperInfer raises on purpose."""

    code: str = "internal_error"
    http_status: int = 500

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return self.message


class InvalidRequestError(SuperInferError):
    """The request itself is wrong (bad parameter, malformed body)."""

    code = "invalid_request"
    http_status = 400


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested tokens exceed the model's context window."""

    code = "context_length_exceeded"


class NotFoundError(SuperInferError):
    """An addressed thing (model name, request id) does not exist."""

    code = "not_found"
    http_status = 404


class ModelLoadError(SuperInferError):
    """A model path is missing, of the wrong kind, or its file is corrupt.

    The message says what was wrong and what to do about it.
    """

    code = "model_load_error"
    http_status = 500


class OverloadedError(SuperInferError):
    """Admission refused because queues are full; the client should retry later."""

    code = "overloaded"
    http_status = 429


class UnavailableError(SuperInferError):
    """A backing service (scheduler, worker, kvmem) is down or restarting."""

    code = "unavailable"
    http_status = 503


# gRPC's standard trailing-metadata key for "retry after this many milliseconds" (its own
# retry machinery honours it). The scheduler sends it with RESOURCE_EXHAUSTED and the
# gateway turns it into HTTP Retry-After.
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
