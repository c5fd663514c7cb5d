"""Function calling's pure parts (gateway/tools.py): the modes a request's tools and
tool_choice give, the schema a forced call follows, the prompt a template without tools
gets, and the calls found in a model's text, whole or streamed in pieces."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway import tools
from gateway.tools import CALL_CLOSE, CALL_OPEN, ContentStream, Function, parse, tool_mode

WEATHER = Function("get_weather", "Weather", {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]})
TIME = Function("get_time", None)


def test_modes_from_tool_choice() -> None:
    assert tool_mode([], None, None).kind == "none"
    assert tool_mode([WEATHER], None, None).kind == "auto"
    named = tool_mode([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                      False)
    assert (named.kind, named.name, named.parallel) == ("named", "get_time", False)
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"type": "x"}):
        with pytest.raises(ValueError):
            tool_mode([WEATHER], bad, None)
    with pytest.raises(ValueError, match="needs tools"):
        tool_mode([], "required", None)
    with pytest.raises(ValueError, match="twice"):
        tool_mode([WEATHER, WEATHER], None, None)


def test_required_schema_admits_only_calls_to_the_tools() -> None:
    schema = tool_mode([WEATHER, TIME], "required", False).schema()
    assert schema is not None
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}],
                [{"name": "rm_rf", "parameters": {}}],
                [{"name": "get_time", "parameters": {}}] * 2,  # one call: not parallel
                [{"name": "get_time", "parameters": {}, "description": "more"}]):  # nothing else
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert tool_mode([WEATHER], {"type": "function", "function": {"name": "get_weather"}},
                     None).schema() == WEATHER.parameters


def test_a_template_without_tools_gets_them_in_the_system_message() -> None:
    mode = tool_mode([WEATHER], "auto", None)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "content": "-3 C", "tool_call_id": "c1"}]
    out, variables = tools.prompt_messages(msgs, mode, native=False)
    assert variables == {}
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert json.dumps(WEATHER.as_tool()) in out[0]["content"]
    assert out[2]["content"] == CALL_OPEN + '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' + CALL_CLOSE
    assert out[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
    native, variables = tools.prompt_messages(msgs, mode, native=True)
    assert variables == {"tools": [WEATHER.as_tool()]}
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    none, variables = tools.prompt_messages(msgs[:2], tool_mode([WEATHER], "none", None), False)
    assert none == msgs[:2] and variables == {}


def test_auto_finds_hermes_calls_and_keeps_the_rest_as_text() -> None:
    mode = tool_mode([WEATHER], "auto", None)
    text = f'Let me look. {CALL_OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}\n{CALL_CLOSE}'
    got = parse(mode, text)
    assert got.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", {"city": "Oslo"})]
    # Not calls: unknown function, broken JSON, no tag.
    for text in (f'{CALL_OPEN}{{"name": "rm", "arguments": {{}}}}{CALL_CLOSE}',
                 f"{CALL_OPEN}{{oops{CALL_CLOSE}", "It is sunny."):
        assert parse(mode, text) == tools.Parsed(text)


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7])
def test_streamed_text_is_sent_until_a_call_begins(cut: int) -> None:
    mode = tool_mode([WEATHER], "auto", None)
    text = f'Checking <b> {CALL_OPEN}{{"name": "get_weather", "arguments": {{"city": "Rome"}}}}{CALL_CLOSE}'
    stream = ContentStream(mode)
    sent = "".join(stream.feed(text[i:i + cut]) for i in range(0, len(text), cut))
    assert sent == "Checking <b> "
    end = stream.finish()
    assert end.content is None and [c.name for c in end.calls] == ["get_weather"]
    plain = ContentStream(mode)
    sent = "".join(plain.feed(t) for t in ["a <", "tool", " b"])
    assert sent + (plain.finish().content or "") == "a <tool b"
