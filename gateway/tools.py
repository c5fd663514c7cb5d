"""Function calling (OpenAI's `tools` / `tool_choice`) on any chat model.

How a request's `tool_choice` is served, as vLLM serves it:

* a named function, or `"required"`: the output is constrained by a JSON schema (the
  grammar engine the structured outputs use): the function's `parameters`, or a list of
  `{"name": ..., "parameters": ...}` calls, one of the tools each (at most one call when
  `parallel_tool_calls` is false). The calls are then certain to parse and to name a
  tool, whatever the model.
* `"auto"` (the default with tools): the model writes text and calls freely, and the
  calls are found afterwards as Hermes writes them (`<tool_call>{"name": ..., "arguments":
  ...}</tool_call>`, the convention of Qwen, Hermes and many fine-tunes); whether a small
  model calls at all is up to it.
* `"none"`: the tools are left out of the prompt; plain text.

The prompt: a chat template that speaks of `tools` gets them as its `tools` variable and
the messages in OpenAI's shape (assistant `tool_calls`, `tool` results). A template that
does not (SmolLM2's) gets the tools described in the system message, the assistant's past
calls written as `<tool_call>` blocks and tool results as `<tool_response>` blocks, so
that the conversation reads the same way the model is asked to answer.

Pure functions over plain data: the request conversion (gateway/conversion.py) and the
response formatting (gateway/openai_routes.py) call them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

_HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query. The functions are "
    "described within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a JSON object with the function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(NO_PARAMETERS))

    def as_tool(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolMode:
    """What a request's tools and tool_choice ask for."""

    kind: str  # "none" | "auto" | "required" | "named"
    functions: tuple[Function, ...] = ()
    name: str | None = None  # kind "named": the function
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.kind != "none"

    @property
    def constrained(self) -> bool:
        return self.kind in ("required", "named")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow (constrained kinds), else None."""
        if self.kind == "named":
            return next(f.parameters for f in self.functions if f.name == self.name)
        if self.kind != "required":
            return None
        call = {"anyOf": [{"type": "object",
                           "properties": {"name": {"type": "string", "enum": [f.name]},
                                          "parameters": f.parameters},
                           "required": ["name", "parameters"],
                           "additionalProperties": False} for f in self.functions]}
        out: dict[str, Any] = {"type": "array", "minItems": 1, "items": call}
        if not self.parallel:
            out["maxItems"] = 1
        return out


def tool_mode(functions: list[Function], tool_choice: Any, parallel: bool | None) -> ToolMode:
    """The mode of a request; ValueError (a 400 naming `tool_choice` or `tools`) when the
    choice is malformed or names no given function."""
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ValueError(f"tools name a function twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    keep = bool(parallel) if parallel is not None else True
    if tool_choice is None:
        return ToolMode("auto" if functions else "none", tuple(functions), parallel=keep)
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be none, auto, required or a named function, "
                             f"got {tool_choice!r}")
        if tool_choice != "none" and not functions:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return ToolMode(tool_choice, tuple(functions), parallel=keep)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not one of the tools "
                         f"({', '.join(names) or 'none given'})")
    return ToolMode("named", tuple(functions), name=name, parallel=keep)


NO_TOOLS = ToolMode("none")


# -- the prompt -------------------------------------------------------------------------


def template_speaks_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def prompt_messages(messages: list[dict[str, Any]], mode: ToolMode, native: bool
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, template variables) for the chat template.

    `messages`: OpenAI's shape (role, content, and tool_calls / tool_call_id where given).
    `native`: the template speaks of tools (template_speaks_tools)."""
    tools = [f.as_tool() for f in mode.functions] if mode.active else []
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):  # templates read arguments as an object (transformers')
                m["tool_calls"] = [{**c, "function": {**c["function"],
                                                      "arguments": _loads(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                   "arguments": _loads(c["function"]["arguments"])})
                     + f"\n{CALL_CLOSE}" for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        described = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, {}


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # a client's own malformed call: shown to the model as it was


# -- the output -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str | None
    calls: tuple[Call, ...] = ()


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse(mode: ToolMode, text: str) -> Parsed:
    """The calls in one choice's whole output (and what text is left as content)."""
    if mode.kind == "named":
        return Parsed(None, (Call(call_id(), mode.name or "", text),))
    if mode.kind == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:  # cut short (length): no call to give
            return Parsed(text)
        return Parsed(None, tuple(Call(call_id(), c["name"], json.dumps(c["parameters"]))
                                  for c in items))
    if mode.kind == "auto":
        return _parse_hermes(mode, text)
    return Parsed(text)


def _parse_hermes(mode: ToolMode, text: str) -> Parsed:
    known = {f.name for f in mode.functions}
    calls: list[Call] = []
    rest: list[str] = []
    pos = 0
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        end = text.find(CALL_CLOSE, start)
        body = text[start + len(CALL_OPEN): end if end >= 0 else len(text)]
        call = _hermes_call(body, known)
        if call is None:  # not a call after all: it stays text
            break
        rest.append(text[pos:start])
        calls.append(call)
        pos = end + len(CALL_CLOSE) if end >= 0 else len(text)
    rest.append(text[pos:])
    content = "".join(rest).strip()
    if not calls:
        return Parsed(text)
    return Parsed(content or None, tuple(calls))


def _hermes_call(body: str, known: set[str]) -> Call | None:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in known:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return Call(call_id(), obj["name"], args if isinstance(args, str) else json.dumps(args))


class ContentStream:
    """Streaming with tools (an active mode). Under `"auto"`, text is sent as content
    until a `<tool_call>` may begin; from there it is held, and `finish` tells what the
    held text was (calls, or text). A forced call is held whole."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self._held = ""  # text not sent yet
        self._calling = False

    def feed(self, text: str) -> str:
        """The part of the text so far that can go out as content now."""
        self._held += text
        if self.mode.constrained or self._calling:
            return ""
        at = self._held.find(CALL_OPEN)
        if at >= 0:
            self._calling = True
            out, self._held = self._held[:at], self._held[at:]
        else:  # keep back a tail that may be the start of the tag
            keep = next((k for k in range(min(len(CALL_OPEN) - 1, len(self._held)), 0, -1)
                         if CALL_OPEN.startswith(self._held[-k:])), 0)
            out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
        return out

    def finish(self) -> Parsed:
        """At the end: the calls, and the text held back that is content after all."""
        if self.mode.constrained:
            return parse(self.mode, self._held)
        parsed = _parse_hermes(self.mode, self._held)
        if not parsed.calls:
            return Parsed(self._held or None)
        return parsed
