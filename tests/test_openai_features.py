"""The OpenAI API's sampling features end to end, driven by the official `openai` client
against the real stack (worker + kvmem + scheduler + gateway processes): logprobs and
top_logprobs (completions and chat, streamed and not), echo with prompt logprobs, n and
best_of, penalties and logit_bias, structured outputs (response_format and vLLM's guided_*
extras), and their 400s. Values are checked against the in-process engine on the same
model (tests/test_sampling_features.py checks that engine against a plain forward pass).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from common.modelfile import resolve_model
from common.tokenizer import Tokenizer
from proto import client_pb2, client_pb2_grpc, common_pb2
from tests.stack import FEATURES_PROMPT, Stack
from tests.test_gateway import _error
from tests.test_gateway import _wait_all_blocks_free as wait_all_blocks_free

PROMPT = FEATURES_PROMPT
LOGPROB_TOL = 1e-3  # the served batch differs from the reference's: other matmul shapes
@pytest.fixture
def stack(shared_stack: Stack) -> Stack:
    """The session's stack (tests/stack.py, conftest.py)."""
    return shared_stack


def _ref(stack: Stack) -> dict[str, Any]:
    return dict(stack.reference["features"])


# -- logprobs -----------------------------------------------------------------------------


def test_completion_logprobs_equal_the_engines(stack: Stack) -> None:
    ref = _ref(stack)
    r = stack.client().completions.create(model=stack.model, prompt=PROMPT, max_tokens=8,
                                          temperature=0, logprobs=3)
    c = r.choices[0]
    assert c.text == ref["text"]
    lp = c.logprobs
    assert lp is not None and len(lp.tokens) == len(ref["token_ids"]) == r.usage.completion_tokens
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for got, top, (_, want, _, want_top) in zip(lp.token_logprobs, lp.top_logprobs,
                                                 ref["logprobs"], strict=True):
        assert abs(got - want) <= LOGPROB_TOL
        assert len(top) == 3
        assert abs(max(top.values()) - got) <= 1e-6  # greedy: the sampled token is the top one
        assert sorted(top.values(), reverse=True) == pytest.approx(want_top, abs=LOGPROB_TOL)


def test_completion_logprobs_streamed_equal_non_streamed(stack: Stack) -> None:
    kw: dict[str, Any] = dict(model=stack.model, prompt=PROMPT, max_tokens=8, temperature=0,
                              logprobs=2)
    whole = stack.client().completions.create(**kw).choices[0].logprobs
    tokens: list[str] = []
    values: list[float] = []
    for chunk in stack.client().completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert whole is not None and tokens == whole.tokens
    assert values == pytest.approx(whole.token_logprobs, abs=LOGPROB_TOL)


def test_echo_with_logprobs_scores_the_prompt(stack: Stack) -> None:
    """What evaluation harnesses send: echo, logprobs, max_tokens 1, the prompt as ids."""
    ref = _ref(stack)
    ids = ref["prompt_ids"]
    r = stack.client().completions.create(model=stack.model, prompt=ids, max_tokens=1,
                                          temperature=0, logprobs=1, echo=True)
    c = r.choices[0]
    lp = c.logprobs
    assert lp is not None and len(lp.tokens) == len(ids) + 1
    assert c.text.startswith(PROMPT) and "".join(lp.tokens) == c.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for got, (_, want, _, _) in zip(lp.token_logprobs[1 : len(ids)], ref["prompt_logprobs"],
                                      strict=True):
        assert abs(got - want) <= LOGPROB_TOL
    assert abs(lp.token_logprobs[-1] - ref["logprobs"][0][1]) <= LOGPROB_TOL
    # The same request as text: the prompt echoed verbatim.
    again = stack.client().completions.create(model=stack.model, prompt=PROMPT, max_tokens=1,
                                              temperature=0, logprobs=0, echo=True)
    assert again.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1:], abs=LOGPROB_TOL)
    assert again.choices[0].logprobs.top_logprobs[1] == {}


def test_echo_without_logprobs_repeats_the_prompt(stack: Stack) -> None:
    r = stack.client().completions.create(model=stack.model, prompt=PROMPT, max_tokens=4,
                                          temperature=0, echo=True)
    assert r.choices[0].text == PROMPT + _ref(stack)["text"][: len(r.choices[0].text) - len(PROMPT)]
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_and_top_logprobs(stack: Stack, stream: bool) -> None:
    kw: dict[str, Any] = dict(model=stack.model, max_tokens=10, temperature=0, logprobs=True,
                              top_logprobs=4,
                              messages=[{"role": "user", "content": "Name a colour."}])
    client = stack.client()
    if stream:
        text, content = "", []
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                text += c.delta.content or ""
                if c.logprobs is not None and c.logprobs.content:
                    content += c.logprobs.content
    else:
        r = client.chat.completions.create(**kw)
        text = r.choices[0].message.content or ""
        assert r.choices[0].logprobs is not None
        content = r.choices[0].logprobs.content or []
    assert content and len(content) <= 10
    assert b"".join(bytes(t.bytes or []) for t in content).decode() == text
    for t in content:
        assert len(t.top_logprobs) == 4
        assert t.top_logprobs[0].token == t.token  # greedy
        assert abs(t.top_logprobs[0].logprob - t.logprob) <= 1e-6
        assert [x.logprob for x in t.top_logprobs] == sorted(
            (x.logprob for x in t.top_logprobs), reverse=True)


# -- n and best_of ------------------------------------------------------------------------


def test_n4_seeded_distinct_and_reproducible(stack: Stack) -> None:
    kw: dict[str, Any] = dict(model=stack.model, prompt=PROMPT, max_tokens=12, temperature=1.0,
                              seed=7, n=4)
    a = stack.client().completions.create(**kw)
    b = stack.client().completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert len(set(texts)) == 4
    assert [c.text for c in b.choices] == texts
    assert a.usage.completion_tokens == 48  # 12 each (the prompt counted once)
    # Streamed: each choice arrives under its index, the same texts.
    got = {i: "" for i in range(4)}
    for chunk in stack.client().completions.create(stream=True, **kw):
        for c in chunk.choices:
            got[c.index] += c.text
    assert [got[i] for i in range(4)] == texts
    # Chat too.
    chat = stack.client().chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Say a word."}], max_tokens=6,
        temperature=1.0, seed=7, n=3)
    assert len(chat.choices) == 3 and len({c.message.content for c in chat.choices}) > 1
    wait_all_blocks_free(stack)


def test_best_of_returns_the_likeliest_choices(stack: Stack) -> None:
    r = stack.client().completions.create(model=stack.model, prompt=PROMPT, max_tokens=6,
                                          temperature=1.0, seed=3, n=2, best_of=5, logprobs=0)
    assert len(r.choices) == 2
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums[0] >= sums[1]
    everyone = stack.client().completions.create(model=stack.model, prompt=PROMPT, max_tokens=6,
                                                 temperature=1.0, seed=3, n=5, logprobs=0)
    all_sums = sorted((sum(c.logprobs.token_logprobs) for c in everyone.choices), reverse=True)
    # The two calls' batches need not match (the prefix cache may hold the prompt for the
    # second, so its first step has other matmul shapes): the same samples, the same
    # logprobs within LOGPROB_TOL, not bit for bit.
    assert sums == pytest.approx(all_sums[:2], abs=LOGPROB_TOL)


# -- penalties and logit_bias -------------------------------------------------------------


def test_penalties_equal_the_engines(stack: Stack) -> None:
    ref = _ref(stack)
    assert ref["penalized"] != ref["token_ids"]  # the penalties change the greedy output
    r = stack.client().completions.create(
        model=stack.model, prompt=PROMPT, max_tokens=8, temperature=0, frequency_penalty=1.5,
        presence_penalty=0.5, extra_body={"repetition_penalty": 1.2})
    assert r.choices[0].text == ref["penalized_text"]


@functools.cache
def _ids_by_token_string() -> dict[str, list[int]]:
    """The bundled model's token ids by the string a completion's logprobs show for each."""
    tok = Tokenizer.from_source(resolve_model(None))
    out: dict[str, list[int]] = {}
    for i in range(tok.backend.get_vocab_size()):
        out.setdefault(tok.decode([i]), []).append(i)
    return out


def _token_ids(tokens: list[str]) -> list[int]:
    """The ids behind a completion's logprobs.tokens (each string one id's, checked)."""
    ids = []
    for t in tokens:
        [i] = _ids_by_token_string()[t]  # an ambiguous string would not name the id
        ids.append(i)
    return ids


def test_logit_bias_bans_and_forces(stack: Stack) -> None:
    ref = _ref(stack)
    first, *_ = ref["token_ids"]
    [_, _, top_ids, top_logprobs] = ref["logprobs"][0]
    assert top_ids[0] == first and top_logprobs[1] > top_logprobs[2] + LOGPROB_TOL
    banned = stack.client().completions.create(model=stack.model, prompt=PROMPT, max_tokens=8,
                                               temperature=0, logprobs=0,
                                               logit_bias={str(first): -100},
                                               extra_body={"ignore_eos": True})
    lp = banned.choices[0].logprobs
    assert lp is not None and banned.usage and banned.usage.completion_tokens == 8
    got = _token_ids(lp.tokens)
    assert first not in got, got  # never, at any position
    assert got[0] == top_ids[1]  # greedy takes the model's runner-up instead
    # The logprob is the model's own: the runner-up's, below the banned token's.
    assert abs(lp.token_logprobs[0] - top_logprobs[1]) <= LOGPROB_TOL
    forced = stack.client().completions.create(model=stack.model, prompt=PROMPT, max_tokens=4,
                                               temperature=1.0, seed=1,
                                               logit_bias={"1000": 100}, logprobs=0,
                                               extra_body={"ignore_eos": True})
    lp = forced.choices[0].logprobs
    assert lp is not None and forced.usage and forced.usage.completion_tokens == 4
    assert _token_ids(lp.tokens) == [1000] * 4  # sampled at temperature 1, every time
    assert forced.choices[0].text == "".join(lp.tokens)


# -- structured outputs -------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_json_schema_response_format_parses_and_validates(stack: Stack) -> None:
    client = stack.client()

    async def main() -> list[tuple[str, str]]:
        ac = stack.async_client()

        async def constrained(i: int) -> tuple[str, str]:
            r = await ac.chat.completions.create(
                model=stack.model, max_tokens=60, temperature=0.8, seed=i,
                messages=[{"role": "user", "content": f"Invent person {i} as JSON."}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "person", "schema": PERSON}})
            return "json", r.choices[0].message.content or ""

        async def free(i: int) -> tuple[str, str]:
            r = await ac.completions.create(model=stack.model, prompt=PROMPT, max_tokens=8,
                                            temperature=0)
            return "free", r.choices[0].text

        return await asyncio.gather(*(f(i) for i in range(8) for f in (constrained, free)))

    out = asyncio.run(main())
    for kind, text in out:
        if kind == "json":
            jsonschema.validate(json.loads(text), PERSON)
        else:
            assert text == _ref(stack)["text"]  # neighbours change no free token
    obj = client.chat.completions.create(
        model=stack.model, max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"})
    content = obj.choices[0].message.content or ""
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")


def test_guided_extras(stack: Stack) -> None:
    client = stack.client()
    msg = [{"role": "user", "content": "What is the capital of France?"}]
    choice = client.chat.completions.create(model=stack.model, messages=msg, max_tokens=10,
                                            extra_body={"guided_choice": ["Paris", "Rome"]})
    assert choice.choices[0].message.content in ("Paris", "Rome")
    regex = client.completions.create(model=stack.model, prompt="Phone:", max_tokens=24,
                                      temperature=1.0, seed=2,
                                      extra_body={"guided_regex": r"\+33 [0-9]{9}"})
    assert re.fullmatch(r"\+33 [0-9]{9}", regex.choices[0].text)
    gj = client.completions.create(model=stack.model, prompt="A person:", max_tokens=60,
                                   temperature=0.5, seed=2, extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(gj.choices[0].text), PERSON)


# -- function calling ---------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


def _schema_of(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in (WEATHER, TIME)
                if t["function"]["name"] == name)


def test_named_tool_choice_calls_that_function_with_valid_arguments(stack: Stack) -> None:
    client = stack.client()
    kw: dict[str, Any] = {"model": stack.model, "messages": ASK, "max_tokens": 60,
                          "temperature": 0, "tools": [WEATHER, TIME],
                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = client.chat.completions.create(**kw)
    msg, choice = r.choices[0].message, r.choices[0]
    assert msg.content is None and choice.finish_reason == "stop"
    (call,) = msg.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), _schema_of("get_weather"))
    # Streamed: the same call (greedy), sent whole in one delta, then the finish.
    calls, reasons, content = [], [], ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            content += c.delta.content or ""
            reasons += [c.finish_reason] if c.finish_reason else []
    assert content == "" and reasons == ["stop"]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (0, "get_weather", call.function.arguments)]


def test_required_tool_choice_gives_calls_to_given_tools(stack: Stack) -> None:
    client = stack.client()
    for parallel in (False, True):
        r = client.chat.completions.create(
            model=stack.model, messages=ASK, max_tokens=120, temperature=0.7, seed=3,
            tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel)
        choice = r.choices[0]
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls", choice
        assert calls and (parallel or len(calls) == 1)
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), _schema_of(c.function.name))
        assert len({c.id for c in calls}) == len(calls)


def test_auto_tools_reach_the_prompt_and_a_tool_conversation_renders(stack: Stack) -> None:
    client = stack.client()
    base = {"model": stack.model, "max_tokens": 24, "temperature": 0}
    none = client.chat.completions.create(**base, messages=ASK, tools=[WEATHER],
                                          tool_choice="none")
    auto = client.chat.completions.create(**base, messages=ASK, tools=[WEATHER])
    plain = client.chat.completions.create(**base, messages=ASK)
    assert none.usage and auto.usage and plain.usage
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # "none": tools left out
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # described to the model
    assert none.choices[0].message.content == plain.choices[0].message.content
    m = auto.choices[0].message
    assert (m.content or m.tool_calls) and auto.choices[0].finish_reason in (
        "stop", "length", "tool_calls")
    for c in m.tool_calls or []:
        assert c.function.name == "get_weather"
    # A whole round: the assistant's call and the tool's answer, then the model goes on.
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    after = client.chat.completions.create(**base, messages=turn, tools=[WEATHER])  # type: ignore[arg-type]
    assert after.usage and after.usage.prompt_tokens > auto.usage.prompt_tokens
    assert after.choices[0].message.content or after.choices[0].message.tool_calls


# -- bad input ----------------------------------------------------------------------------

C = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "x"}]
BAD: list[tuple[str, str, dict[str, Any], str, str | None]] = [
    # (path, what, body, param, code)
    (C, "presence_penalty above 2", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty",
     None),
    (C, "frequency_penalty below -2", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty",
     None),
    (C, "repetition_penalty 0", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty",
     None),
    (C, "logit_bias above 100", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", None),
    (C, "logit_bias key not an id", {"prompt": "x", "logit_bias": {"hello": 1}}, "logit_bias", None),
    (C, "logit_bias id out of vocab", {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias",
     None),
    (CHAT, "top_logprobs above 20", {"messages": MSG, "logprobs": True, "top_logprobs": 21},
     "top_logprobs", None),
    (CHAT, "top_logprobs without logprobs", {"messages": MSG, "top_logprobs": 2}, "top_logprobs",
     None),
    (C, "best_of below n", {"prompt": "x", "n": 3, "best_of": 2}, "best_of", None),
    (C, "best_of streamed", {"prompt": "x", "n": 1, "best_of": 2, "stream": True}, "best_of", None),
    (CHAT, "bad json schema", {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format", "invalid_grammar"),
    (CHAT, "json_schema without schema", {"messages": MSG, "response_format": {
        "type": "json_schema"}}, "response_format", None),
    (C, "bad regex", {"prompt": "x", "guided_regex": "([a-z"}, "guided_regex", "invalid_grammar"),
    (C, "two constraints", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]},
     "response_format", None),
    (C, "empty choice", {"prompt": "x", "guided_choice": []}, "guided_choice", "invalid_grammar"),
    (CHAT, "a tool without its function", {"messages": MSG, "tools": [{"type": "function"}]},
     "tools[0].function", None),
    (CHAT, "a tool name with a space", {"messages": MSG, "tools": [
        {"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name",
     None),
    (CHAT, "tool_choice naming no tool", {"messages": MSG, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, "tool_choice", None),
    (CHAT, "tool_choice required without tools", {"messages": MSG, "tool_choice": "required"},
     "tool_choice", None),
    (CHAT, "a forced tool and a response_format", {"messages": MSG, "tools": [WEATHER],
     "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     None),
]


@pytest.mark.parametrize(("path", "what", "body", "param", "code"), BAD, ids=[b[1] for b in BAD])
def test_bad_sampling_fields_get_a_clear_400(stack: Stack, path: str, what: str,
                                             body: dict[str, Any], param: str,
                                             code: str | None) -> None:
    with stack.http() as h:
        r = h.post(path, json=body)
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code, err


def test_bad_schema_through_the_client_names_the_problem(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        stack.client().chat.completions.create(
            model=stack.model, messages=MSG,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}})
    assert "schema" in str(e.value)
    wait_all_blocks_free(stack)


def test_grpc_api_n_logprobs_echo_and_grammar(stack: Stack) -> None:
    ref = _ref(stack)

    async def main() -> None:
        async with grpc.aio.insecure_channel(stack.grpc_addr,
                                             options=[("grpc.enable_http_proxy", 0)]) as ch:
            stub = client_pb2_grpc.SuperInferStub(ch)
            sp = common_pb2.SamplingParams(max_tokens=8, temperature=0, logprobs=3,
                                           prompt_logprobs=True)
            events = [e async for e in stub.Generate(client_pb2.ClientGenerateRequest(
                prompt=PROMPT, sampling=sp))]
            assert [t for e in events for t in e.token_ids] == ref["token_ids"]
            lps = [lp for e in events for lp in e.logprobs]
            assert [lp.token_id for lp in lps] == ref["token_ids"]
            assert all(len(lp.top_ids) == 3 for lp in lps)
            prompt_lps = [lp for e in events for lp in e.prompt_logprobs]
            assert [lp.token_id for lp in prompt_lps] == ref["prompt_ids"][1:]
            for got, want in zip(prompt_lps, ref["prompt_logprobs"], strict=True):
                assert abs(got.logprob - want[1]) <= LOGPROB_TOL

            seeded = common_pb2.SamplingParams(max_tokens=6, temperature=1.0, seed=11,
                                               grammar=common_pb2.Grammar(
                                                   kind="choice", spec='["yes", "no", "maybe"]'))
            texts: dict[int, str] = {}
            async for e in stub.Generate(client_pb2.ClientGenerateRequest(
                    prompt="Is it raining?", sampling=seeded, n=3)):
                texts[e.index] = texts.get(e.index, "") + e.text
            assert sorted(texts) == [0, 1, 2]
            assert all(t in ("yes", "no", "maybe") for t in texts.values()), texts

            for bad in [
                client_pb2.ClientGenerateRequest(prompt="x", n=33),
                client_pb2.ClientGenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(
                    presence_penalty=3)),
                client_pb2.ClientGenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(
                    logprobs=21)),
                client_pb2.ClientGenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(
                    grammar=common_pb2.Grammar(kind="regex", spec="(["))),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    _ = [e async for e in stub.Generate(bad)]
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()

    asyncio.run(main())
    wait_all_blocks_free(stack)
