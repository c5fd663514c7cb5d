"""Rendering chat templates the way transformers does.

Templates come from model files downloaded from anywhere, so they are untrusted code:
they run in jinja2's immutable sandbox. The environment mirrors transformers'
``apply_chat_template`` (trim_blocks, lstrip_blocks, loopcontrols, a ``tojson`` that
does not HTML-escape, ``raise_exception``, ``strftime_now``) so a prompt renders to the
same text, and therefore the same tokens, as the model's reference implementation.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.errors import InvalidRequestError


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per distinct template text."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """Render ``messages`` with the template; template errors become InvalidRequestError.

    ``variables`` are the extra names templates expect (bos_token, eos_token, tools, …).
    """
    try:
        template = compile_chat_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequestError(f"the model's chat template does not compile: {e}") from e
    try:
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.exceptions.TemplateError as e:  # includes raise_exception() and sandbox errors
        raise InvalidRequestError(f"chat template rejected the messages: {e}") from e
    except (TypeError, KeyError, AttributeError, ValueError) as e:
        # Malformed messages (e.g. content that is not a string) fail inside the template.
        raise InvalidRequestError(f"chat template could not render the messages: {e}") from e
