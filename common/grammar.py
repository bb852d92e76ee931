"""Grammars from API requests: OpenAI `response_format` and tool-call shapes → llguidance grammar
text, validated before anything runs.

Torch-free on purpose: the router builds and validates the grammar at the edge (a bad schema is
a 400 naming the problem) and sends its text to the workers, which only compile and run it
(`engine/batch/constrained.py`). JSON is generated compactly, with one space after ':' and ',' (how
models write JSON in their training data) and no free whitespace: small models otherwise pad
with newlines until max_tokens.
"""

from __future__ import annotations

import json
from typing import Any

from common.errors import RequestError

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(RequestError):
    """A request's constraint is invalid or unsupported; `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _llg() -> Any:
    import llguidance

    return llguidance


def validate(grammar: str, param: str) -> str:
    err = _llg().LLMatcher.validate_grammar(grammar)
    if err:
        raise GrammarError(f"'{param}' cannot be enforced: {err.strip()}", param)
    return grammar


def json_schema(schema: Any, param: str) -> str:
    """Grammar for JSON matching `schema` (unsupported keywords are refused, never ignored)."""
    if not isinstance(schema, dict):
        raise GrammarError(f"'{param}' must be a JSON schema object", param)
    try:
        grammar = _llg().LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    except ValueError as e:
        raise GrammarError(f"'{param}' is not a valid JSON schema: {e}", param) from e
    return validate(grammar, param)


def lark(source: str, param: str) -> str:
    """Grammar from Lark text (`%json {...}` embeds a JSON schema; used for tool-call formats)."""
    return validate(_llg().LLMatcher.grammar_from_lark(source), param)


def lark_json(schema: dict[str, Any]) -> str:
    """A JSON schema as a Lark `%json` item, written in the compact style above."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE}, separators=(",", ":"))


def lark_literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON escaping is a subset of what Lark reads


def response_format(rf: Any) -> str | None:
    """The grammar an OpenAI `response_format` asks for; None for plain text."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise GrammarError("'response_format' must be an object", "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError("'response_format.json_schema' must be an object with 'name' and 'schema'",
                               "response_format.json_schema")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError("'response_format.json_schema.name' is required", "response_format.json_schema.name")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError("'response_format.json_schema.strict' must be a boolean",
                               "response_format.json_schema.strict")
        # strict or not, the schema is enforced token by token: there is no weaker mode to fall back to.
        return json_schema(spec.get("schema", {}), "response_format.json_schema.schema")
    raise GrammarError(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                       "response_format.type")
