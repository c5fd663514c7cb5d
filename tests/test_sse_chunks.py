"""The streamed chunks' per-token fast path (``_Format._templated``) writes the same bytes
as building and dumping the pydantic chunk, for every text a token may produce."""

from __future__ import annotations

import dataclasses

import pytest
from starlette.requests import Request

from common.modelfile import resolve_model
from common.tokenizer import Tokenizer
from gateway import openai_routes as r
from gateway import openai_schema as s
from gateway.backend import ModelState
from gateway.generation import Delta, Generation
from proto import scheduler_pb2

TEXTS = ["", " the", "a\"b\\c", "line\nnext\ttab\r", "\x00\x01\x1f\x7f", "é ü ß 中文 🙂",
         "\u2028\u2029", "</script>/", "{\"json\": [1]}", "\ud7ff\ue000\uffff", "x" * 300]


@pytest.fixture(scope="module")
def model() -> ModelState:
    return ModelState(info=scheduler_pb2.ModelInfo(), tokenizer=Tokenizer.from_source(resolve_model(None)),
                      served_name="smol \"quoted\" ✓", max_model_len=2048, vocab_size=49152)


def _request(request_id: str) -> Request:
    return Request({"type": "http", "state": {"request_id": request_id}})


def _built_completion(fmt: r._CompletionFormat, delta: Delta, include_usage: bool) -> str:
    choice = s.CompletionChoice(index=delta.index, text=delta.text, finish_reason=delta.finish_reason)
    return fmt._dump(fmt._chunk([choice]), include_usage)


def _built_chat(fmt: r._ChatFormat, delta: Delta, include_usage: bool) -> str:
    choice = s.ChatChunkChoice(index=delta.index, delta=s.ChatDelta(content=delta.text))
    return fmt._dump(fmt._chunk([choice]), include_usage)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("name", ["", "\x00superinfer-text\x00"])
def test_completion_chunks_equal_the_dumped_models(model: ModelState, include_usage: bool,
                                                   name: str) -> None:
    if name:
        model = dataclasses.replace(model, served_name=name)
    body = s.CompletionRequest(model="m", prompt="hi", n=3)
    fmt = r._CompletionFormat(_request("req-1"), model, body, [1], "hi")
    gen: Generation = None  # type: ignore[assignment]  # unused without logprobs
    for text in TEXTS:
        for index in range(3):
            for reason in (None, "stop", "length"):
                delta = Delta(text, [1], reason, index)
                [fast] = fmt.chunks(delta, gen, include_usage)
                assert fast == _built_completion(fmt, delta, include_usage)
    # The model's name is the placeholder in the second case: no template, built as before.
    assert fmt._templates
    assert all(v == () for v in fmt._templates.values()) == bool(name)
    assert not any(v == () for v in fmt._templates.values()) == (not name)


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_content_chunks_equal_the_dumped_models(model: ModelState, include_usage: bool) -> None:
    body = s.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], n=2)
    fmt = r._ChatFormat(_request("req-2"), model, body)
    gen: Generation = None  # type: ignore[assignment]
    for text in TEXTS[1:]:  # an empty text sends no content chunk
        for index in range(2):
            [fast] = fmt.chunks(Delta(text, [1], None, index), gen, include_usage)
            assert fast == _built_chat(fmt, Delta(text, [1], None, index), include_usage)
    assert fmt._templates and all(v != () for v in fmt._templates.values())
    # The finish chunk is built as before (content, then the empty delta with the reason).
    out = fmt.chunks(Delta("end", [1], "stop", 1), gen, include_usage)
    assert out[0] == _built_chat(fmt, Delta("end", [1], None, 1), include_usage)
    assert '"finish_reason":"stop"' in out[1] and '"delta":{}' in out[1]
