"""OpenAI request bodies → one validated `GenRequest`; every rejection is a 4xx with the param named."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

from common import grammar
from common.chat_template import TemplateError
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from router.api.errors import bad_request, not_found, unavailable
from router.api.fields import check_fields
from router.api.marked_calls import MarkedFormat, detect_marked, marker_pieces
from router.api.reasoning import template_reasons
from router.api.reply import ReplyPlan
from router.api.tool_calls import (
    GENERIC,
    ToolChoice,
    detect_format,
    parse_tool_choice,
    parse_tools,
    template_supports_tools,
)

ROLES = {"system", "user", "assistant", "tool", "developer", "function"}
MAX_STOP = 16


@dataclass
class GenRequest:
    id: str
    kind: str  # chat | completion
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # validated here, field by field, naming the request parameter
    stream: bool
    include_usage: bool
    tenant: str
    session: str | None
    want_logprobs: bool
    body: dict[str, Any]  # the original body, for OpenAI-compatible upstreams
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_index: int = 0  # the choice index: prompt p's j-th sample is choice p * n + j
    sample_index: int = 0  # j: which of a prompt's samples (usage counts each prompt once)
    n: int = 1  # choices per prompt
    best_of: int = 0  # completions: one of best_of candidates (choice p * best_of + j until the best n are kept)
    served_by: Any = None  # the (prefill, decode) pin of the latest attempt, for response headers
    reply: ReplyPlan | None = None  # reasoning / tool calls to read out of the reply; None = plain text
    weight: float = 1.0  # the tenant's share of a worker's batch (router/tenants.py)
    adapter: str = ""  # the LoRA adapter `model` names ("" = the base model)
    pool: str = ""  # a router serving several models: the model directory its workers report ("" = any worker)
    priority: int = 0  # lower is more important: the router's admission band and the workers' scheduling order
    span: Any = None  # the request's trace span when tracing is on (common/tracing.py)
    traceparent: str = ""  # the current attempt span's context, sent to the worker


MAX_LOGIT_BIAS = 1024
MAX_N = 64


def _num(body: dict, name: str, lo: float, hi: float, default: float, integer: bool = False) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or (integer and not isinstance(v, int)):
        raise bad_request(f"'{name}' must be {'an integer' if integer else 'a number'}", param=name)
    if not lo <= v <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {v}", param=name)
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean", param=name)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise bad_request("'stop' must be a non-empty string or a list of them", param="stop")
    if len(v) > MAX_STOP:
        raise bad_request(f"'stop' takes at most {MAX_STOP} strings", param="stop")
    return v


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}} "
                                  "(this model reads text only)", param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")


def _tool_calls(m: dict[str, Any], i: int) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls, with arguments as objects (what chat templates
    render with `tojson`; OpenAI sends them as JSON text)."""
    raw = m.get("tool_calls")
    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise bad_request(f"'{where}' must be a list", param=where)
    out = []
    for j, tc in enumerate(raw):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(tc.get("id", ""), str):
            raise bad_request(f"'{where}[{j}]' must be {{'id': str, 'type': 'function', 'function': {{'name': str, "
                              "'arguments': str}}}}", param=f"{where}[{j}]")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise bad_request(f"'{where}[{j}].function.arguments' is not valid JSON: {e.msg}",
                                  param=f"{where}[{j}].function.arguments") from e
        out.append({"id": tc.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def parse_messages(body: dict) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {sorted(ROLES)}", param=f"messages[{i}].role")
        if m.get("content") is None and not (role == "assistant" and m.get("tool_calls")):
            raise bad_request(f"messages[{i}].content is required for a {role} message", param=f"messages[{i}].content")
        if m.get("name") is not None and not isinstance(m.get("name"), str):
            raise bad_request(f"messages[{i}].name must be a string", param=f"messages[{i}].name")
        msg = dict(m)
        msg["content"] = _content_text(m.get("content"), i)
        if role == "developer":
            msg["role"] = "system"
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m, i)
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise bad_request(f"messages[{i}].tool_call_id is required for a tool message",
                              param=f"messages[{i}].tool_call_id")
        out.append(msg)
    return out


GENERIC_TOOLS_PROMPT = (
    "You can call these functions:\n{specs}\n\nTo call functions, reply with only a JSON list of calls, "
    '[{{"name": <function name>, "arguments": <arguments object>}}{many}]. A function\'s result comes back to '
    "you between <tool_response> and </tool_response>. If no function is needed, answer in plain text.")


def tools_as_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]], with_system: bool,
                  parallel: bool = True) -> list[dict[str, Any]]:
    """For a chat template with no tool support (the generic format, `tool_calls.GENERIC`): the tools
    are described in a system message, earlier calls become the assistant's JSON list of calls and
    results come back as the user's `<tool_response>` blocks: the shapes the grammar produces."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            m = {"role": "assistant",
                 "content": (m["content"] + "\n" if m["content"] else "") + json.dumps(calls, ensure_ascii=False)}
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if with_system:
        specs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        note = GENERIC_TOOLS_PROMPT.format(specs=specs, many=", ..." if parallel else "")
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


class RequestParser:
    def __init__(self, tokenizer: Tokenizer | None, model_names: set[str], max_model_len: int,
                 upstream_only: bool = False):
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.max_model_len = max_model_len
        # In front of OpenAI-compatible servers only: they enforce response_format and tools and
        # parse their own replies; here those fields are validated and passed through.
        self.upstream_only = upstream_only
        template = tokenizer.chat_template if tokenizer else None
        token_to_id = tokenizer.hf.token_to_id if tokenizer else lambda _: None
        marked = detect_marked(template or "", token_to_id)
        pieces = tokenizer.byte_pieces() if tokenizer is not None else None
        # DeepSeek / Kimi: their markers are special tokens the worker's text leaves out, so the reply
        # is read back from its token ids (a byte-level tokenizer's table, markers spelled out).
        self.marker_pieces = marker_pieces(pieces, marked) if marked is not None and pieces is not None else None
        self.tool_format: Any = (marked if self.marker_pieces is not None
                                 else detect_format(template, token_to_id))
        self.template_has_tools = template_supports_tools(template)
        self.reasoning = template_reasons(template)

    def _common(self, body: dict) -> tuple[str, bool, bool]:
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise bad_request("'model' is required", param="model")
        if not isinstance(model, str):
            raise bad_request("'model' must be a string", param="model")
        if not self.model_names:
            raise unavailable("the upstreams have not listed their models yet (GET /v1/models); retry shortly")
        if model not in self.model_names:
            raise not_found(f"model '{model}' does not exist; available: {sorted(self.model_names)}", code="model_not_found")
        if body.get("echo"):
            raise bad_request("'echo' is not supported", param="echo")
        stream = _bool(body, "stream")
        so = body.get("stream_options")
        include_usage = False
        if so is not None:
            if not isinstance(so, dict):
                raise bad_request("'stream_options' must be an object", param="stream_options")
            if not stream:
                raise bad_request("'stream_options' is only allowed with stream=true", param="stream_options")
            include_usage = _bool(so, "include_usage")
            if _bool(so, "continuous_usage_stats") and self.upstream_only:
                raise bad_request("'stream_options.continuous_usage_stats' needs token counts, which upstream streams "
                                  "do not carry through this router", param="stream_options")
            unknown = set(so) - {"include_usage", "continuous_usage_stats", "include_obfuscation"}
            if unknown:
                raise bad_request(f"unknown 'stream_options' field(s) {sorted(unknown)}", param="stream_options")
            if so.get("include_obfuscation"):
                raise bad_request("'stream_options.include_obfuscation' is not supported", param="stream_options")
        for name in ("user", "safety_identifier", "prompt_cache_key"):
            if body.get(name) is not None and not isinstance(body[name], str):
                raise bad_request(f"'{name}' must be a string", param=name)
        _num(body, "priority", -(2**31), 2**31 - 1, 0, integer=True)  # (read by the serving path, per API key)
        return model, stream, include_usage

    def _sampling(self, body: dict, prompt_len: int, logprobs: int | None) -> SamplingParams:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has {prompt_len}",
                param="messages" if "messages" in body else "prompt", code="context_length_exceeded")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _num(body, name, 1, 2**31 - 1, room, integer=True)
        if max_tokens > room:
            raise bad_request(
                f"'{name}' is {max_tokens}, but the prompt ({prompt_len} tokens) leaves room for {room} "
                f"in this model's {self.max_model_len}-token context", param=name, code="context_length_exceeded")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise bad_request("'seed' must be an integer", param="seed")
        stop_ids = body.get("stop_token_ids")
        stop_ids = [] if stop_ids is None else stop_ids
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids):
            raise bad_request("'stop_token_ids' must be a list of non-negative integers", param="stop_token_ids")
        min_tokens = _num(body, "min_tokens", 0, max_tokens, 0, integer=True)
        return SamplingParams(
            max_tokens=max_tokens,
            logit_bias=self._logit_bias(body),
            min_tokens=min_tokens,
            temperature=_num(body, "temperature", 0.0, 2.0, 1.0),
            top_p=_num(body, "top_p", 0.0, 1.0, 1.0) or 1e-9,
            top_k=_num(body, "top_k", -1, 1 << 20, 0, integer=True) if body.get("top_k") != -1 else 0,
            min_p=_num(body, "min_p", 0.0, 1.0, 0.0),
            repetition_penalty=_num(body, "repetition_penalty", 0.01, 10.0, 1.0),
            frequency_penalty=_num(body, "frequency_penalty", -2.0, 2.0, 0.0),
            presence_penalty=_num(body, "presence_penalty", -2.0, 2.0, 0.0),
            seed=seed % 2**63 if seed is not None else None,
            stop=_stop(body),
            stop_token_ids=stop_ids,
            ignore_eos=_bool(body, "ignore_eos"),
            logprobs=logprobs,
        )

    @staticmethod
    def _n(body: dict, stream: bool, completions: bool, upstream_only: bool = False) -> tuple[int, int]:
        """(n, best_of): n choices per prompt, drawn from best_of candidates (completions only)."""
        n = _num(body, "n", 1, MAX_N, 1, integer=True)
        best_of = n
        if completions and body.get("best_of") is not None:
            best_of = _num(body, "best_of", 1, MAX_N, n, integer=True)
            if best_of < n:
                raise bad_request(f"'best_of' ({best_of}) must be >= 'n' ({n})", param="best_of")
            if best_of > n and stream:
                raise bad_request("'best_of' > 'n' cannot be streamed (the best are known only at the end)",
                                  param="best_of")
            if best_of > n and upstream_only:
                raise bad_request("'best_of' > 'n' is not supported in front of upstreams (their log probabilities "
                                  "are passed through, not ranked)", param="best_of")
        return n, best_of

    @staticmethod
    def fan_out(req: GenRequest, n: int, best_of: int, prompt: int = 0) -> list[GenRequest]:
        """A prompt's samples: choice prompt * n + j. A seeded request's j-th sample uses seed + j, so
        the choices differ and each is reproducible; greedy ones are identical."""
        out = []
        for j in range(best_of):
            sampling = req.sampling
            if j and sampling.seed is not None:
                sampling = replace(sampling, seed=(sampling.seed + j) % 2**63)
            if best_of > n:  # candidates are ranked by their log probabilities
                sampling = replace(sampling, logprobs=sampling.logprobs or 0)
            out.append(replace(req, sampling=sampling, prompt_index=prompt * best_of + j, sample_index=j, n=n,
                               best_of=best_of if best_of > n else 0))
        return out

    def _logit_bias(self, body: dict) -> dict[int, float]:
        raw = body.get("logit_bias")
        if raw is None:
            return {}
        if not isinstance(raw, dict) or len(raw) > MAX_LOGIT_BIAS:
            raise bad_request(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids (as strings) "
                              "to numbers in [-100, 100]", param="logit_bias")
        vocab = self.tokenizer.vocab_size if self.tokenizer else 2**31
        out: dict[int, float] = {}
        for key, value in raw.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) < vocab):
                raise bad_request(f"'logit_bias' key {key!r} is not a token id in [0, {vocab})", param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
                raise bad_request(f"'logit_bias' value for token {key} must be a number in [-100, 100]",
                                  param="logit_bias")
            out[int(key)] = float(value)
        return out

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad_request("the prompt is empty", param=param)
        vocab = self.tokenizer.vocab_size if self.tokenizer else 2**31
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise bad_request(f"token ids must be integers in [0, {vocab})", param=param)
        return ids

    @staticmethod
    def _estimate(chars: int) -> list[int]:
        """Without a tokenizer (a router in front of OpenAI-compatible upstreams only) the prompt is
        passed through as JSON; its length is estimated (~4 characters a token) for load balancing."""
        return [0] * max(1, chars // 4)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return self._estimate(len(text))
        return self.tokenizer.encode(text)

    def _fields(self, body: dict, kind: str, session: str | None) -> str | None:
        """The field audit (router/fields.py), and the session key: the x-session-affinity header,
        else the body's prompt_cache_key. In front of upstreams, they judge their own fields."""
        if not self.upstream_only:
            check_fields(body, kind)
        return session or body.get("prompt_cache_key") or None

    def chat(self, body: Any, tenant: str, session: str | None) -> list[GenRequest]:
        """One GenRequest per choice (n)."""
        model, stream, include_usage = self._common(body)
        session = self._fields(body, "chat", session)
        n, _ = self._n(body, stream, completions=False)
        messages = parse_messages(body)
        lp = _bool(body, "logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            if not lp:
                raise bad_request("'top_logprobs' requires logprobs=true", param="top_logprobs")
            top = _num(body, "top_logprobs", 0, 20, 0, integer=True)
        tools = parse_tools(body)
        choice = parse_tool_choice(body, tools)
        constraint = _response_format(body)
        release: str | None = None
        fmt = None
        if self.upstream_only:
            choice = ToolChoice("none", (), choice.parallel)  # the upstream's own tool handling applies
            constraint = None
        if choice.mode != "none":
            fmt = self.tool_format or GENERIC
            if choice.mode in ("required", "named"):
                if constraint is not None:
                    raise bad_request("'response_format' and a required or named 'tool_choice' both constrain the "
                                      "reply; send one of them", param="response_format")
                constraint = fmt.grammar(choice)
            elif fmt is GENERIC:  # auto without a format of the model's own: free text | calls
                if constraint is not None:
                    raise bad_request("'response_format' with tools under tool_choice 'auto': this model's chat "
                                      "template has no tool-call format, and its generic one constrains the reply "
                                      "too; send one of them, or tool_choice 'none'", param="response_format")
                constraint = fmt.auto_grammar(choice)
                release = "["  # (the calls branch opens with the list)
        if self.tokenizer is None:
            ids = self._estimate(sum(len(m["content"]) for m in messages))
        else:
            raw_tools = body.get("tools") if choice.mode != "none" or self.upstream_only else None
            if self.template_has_tools:
                rendered = messages
            else:
                rendered = tools_as_text(messages, raw_tools or [], with_system=bool(raw_tools),
                                         parallel=choice.parallel)
                raw_tools = None
            try:
                ids = self.tokenizer.encode_chat(rendered, add_generation_prompt=True, tools=raw_tools)
            except TemplateError as e:
                raise bad_request(f"chat template rejected the conversation: {e}", param="messages") from e
            ids = self._check_ids(ids, "messages")
        sampling = self._sampling(body, len(ids), (top or 0) if lp else None)
        sampling.grammar = constraint
        sampling.grammar_release = release
        plan = None
        if fmt is not None or (self.reasoning and not self.upstream_only):
            opened = self.reasoning and self.tokenizer is not None and self.tokenizer.decode(
                ids[-4:], skip_special_tokens=False).rstrip().endswith("<think>")
            pieces = self.marker_pieces if isinstance(fmt, MarkedFormat) else None
            plan = ReplyPlan(fmt, self.reasoning, opened, tuple(pieces) if pieces is not None else None)
        req = GenRequest(f"chatcmpl-{secrets.token_hex(12)}", "chat", model, ids, sampling, stream, include_usage,
                         tenant, session, lp, body, reply=plan)
        return self.fan_out(req, n, n)

    def completions(self, body: Any, tenant: str, session: str | None) -> list[GenRequest]:
        """One GenRequest per prompt (a list of prompts becomes several choices)."""
        model, stream, include_usage = self._common(body)
        session = self._fields(body, "completion", session)
        if body.get("suffix") not in (None, ""):
            raise bad_request("'suffix' (fill-in-the-middle) is not supported", param="suffix")
        prompt = body.get("prompt")
        prompts: list[list[int]]
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = [self._encode(p) for p in prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompts = [list(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise bad_request("'prompt' must be a string, a list of strings, a list of token ids, or a list of "
                              "token-id lists", param="prompt")
        if len(prompts) > 64:
            raise bad_request("at most 64 prompts per request", param="prompt")
        lp = body.get("logprobs")
        if lp is not None:
            lp = _num(body, "logprobs", 0, 5, 0, integer=True)
        constraint = None if self.upstream_only else _response_format(body)
        if self.upstream_only:
            _response_format(body)  # validated here, enforced by the upstream
        n, best_of = self._n(body, stream, completions=True, upstream_only=self.upstream_only)
        if len(prompts) * best_of > MAX_N * 4:
            raise bad_request(f"at most {MAX_N * 4} completions per request (prompts x best_of)", param="n")
        rid = f"cmpl-{secrets.token_hex(12)}"
        out = []
        for i, ids in enumerate(prompts):
            ids = self._check_ids(ids, "prompt")
            sampling = self._sampling(body, len(ids), lp)
            sampling.grammar = constraint
            req = GenRequest(rid, "completion", model, ids, sampling, stream, include_usage, tenant, session,
                             lp is not None, body)
            out += self.fan_out(req, n, best_of, prompt=i)
        return out


def _response_format(body: dict) -> str | None:
    try:
        return grammar.response_format(body.get("response_format"))
    except grammar.GrammarError as e:
        raise bad_request(str(e), param=e.param) from e
