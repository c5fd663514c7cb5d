"""Each typed error maps to the status code a client will see."""

from __future__ import annotations

import pytest

from common.errors import (
    ContextLengthError,
    InvalidRequestError,
    ModelLoadError,
    NotFoundError,
    OverloadedError,
    SuperInferError,
    UnavailableError,
)


@pytest.mark.parametrize(
    ("cls", "status", "code"),
    [
        (InvalidRequestError, 400, "invalid_request"),
        (ContextLengthError, 400, "context_length_exceeded"),
        (NotFoundError, 404, "not_found"),
        (ModelLoadError, 500, "model_load_error"),
        (OverloadedError, 429, "overloaded"),
        (UnavailableError, 503, "unavailable"),
    ],
)
def test_status_and_code(cls: type[SuperInferError], status: int, code: str) -> None:
    err = cls("something went wrong")
    assert isinstance(err, SuperInferError)
    assert (err.http_status, err.code, str(err)) == (status, code, "something went wrong")


def test_context_length_is_an_invalid_request() -> None:
    assert isinstance(ContextLengthError("too long"), InvalidRequestError)


def test_code_can_be_overridden_per_instance() -> None:
    err = InvalidRequestError("bad temperature", code="invalid_temperature")
    assert err.code == "invalid_temperature"
    assert InvalidRequestError.code == "invalid_request"
