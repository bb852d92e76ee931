"""Every request field is honoured or refused with a 400 that names it — never silently dropped.

`HONOURED` fields are read by `protocol.py` (each with its own validation). `DEFAULT_ONLY` fields
are accepted only at values that ask for nothing we do not do (e.g. `store: false`). Anything
else is refused, as OpenAI refuses an unrecognized argument. A test walks the `openai` SDK's own
parameter lists so a field it adds cannot be accepted without a decision here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from router.api.errors import bad_request

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
           "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "logprobs",
           "n", "response_format", "logit_bias", "min_tokens",
           # who the end user is: no effect on the output, logged with the request
           "user", "safety_identifier",
           # a cache-routing hint: used as the session-affinity key when no x-session-affinity header is sent
           "prompt_cache_key",
           # vLLM's request priority (lower is more important): admission bands and the workers' schedulers
           "priority"}
HONOURED = {
    "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                       "parallel_tool_calls"},
    "completion": _COMMON | {"prompt", "best_of", "echo", "suffix"},
}


def _none(v: Any) -> bool:
    return v is None


# field -> (accepted value?, what to say otherwise)
DEFAULT_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "store": (lambda v: v in (None, False), "responses are not stored here; send store=false or omit it"),
    "metadata": (lambda v: v in (None, {}), "'metadata' is for stored completions, which are not kept here"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "only service_tier 'auto' or 'default' is served"),
    "modalities": (lambda v: v in (None, ["text"]), "only the 'text' modality is served"),
    "reasoning_effort": (_none, "'reasoning_effort' is not supported; the model reasons as its chat template says"),
    "verbosity": (_none, "'verbosity' is not supported"),
    "audio": (_none, "audio output is not supported"),
    "prediction": (_none, "predicted outputs are not supported"),
    "web_search_options": (_none, "web search is not supported"),
    "functions": (_none, "'functions' is deprecated and not supported; use 'tools'"),
    "function_call": (_none, "'function_call' is deprecated and not supported; use 'tool_choice'"),
    "moderation": (_none, "'moderation' is not supported"),
    "prompt_cache_retention": (_none, "'prompt_cache_retention' is not supported: cached prefixes live as long as "
                                      "the workers' KV caches have room"),
    "prompt_cache_options": (_none, "'prompt_cache_options' is not supported"),
}


def check_fields(body: dict[str, Any], kind: str) -> None:
    """400 for the first field of `body` that is neither honoured nor at an accepted default."""
    honoured = HONOURED[kind]
    for name, value in body.items():
        if name in honoured:
            continue
        rule = DEFAULT_ONLY.get(name)
        if rule is None:
            raise bad_request(f"Unrecognized request argument supplied: {name}", param=name)
        accepted, why = rule
        if not accepted(value):
            raise bad_request(why, param=name)
