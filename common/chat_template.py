"""Rendering a model's Jinja chat template with the semantics of transformers' `apply_chat_template`.

Same environment (sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls), the same
helpers (`raise_exception`, `tojson`, `strftime_now`) and the same variables
(`messages`, `add_generation_prompt`, `tools`, the special tokens), so a template
renders byte for byte as it would under transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.errors import RequestError


class TemplateError(RequestError):
    """The template refused the conversation (its `raise_exception`) or failed to render."""


class _GenerationTag(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used for assistant masks) and renders the body."""

    tags = {"generation"}  # noqa: RUF012  (jinja2's Extension declares it)

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template does not compile: {e}") from e


def render_chat(
    source: str,
    messages: list[dict[str, Any]],
    special_tokens: dict[str, str],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> str:
    template = compile_template(source)
    try:
        return template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **special_tokens, **extra
        )
    except TemplateError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template failed to render: {e}") from e
