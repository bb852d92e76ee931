"""Malformed and adversarial request bodies for the router: every one must get a client error
(4xx) or a normal answer — never a 5xx, never a hang.

    python -m loadtest.fuzz --url http://127.0.0.1:8000 --model tiny --n 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

# Every field of the chat and completions references, plus some that exist nowhere.
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "best_of", "stream", "stream_options", "stop", "stop_token_ids", "seed", "logprobs",
          "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "user",
          "tools", "tool_choice", "parallel_tool_calls", "response_format", "ignore_eos", "echo", "suffix",
          "min_tokens", "metadata", "store", "service_tier", "reasoning_effort", "modalities", "audio",
          "prediction", "web_search_options", "functions", "function_call", "x" * 300, "\u0000", "🙂"]
MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "tool_call_id", "refusal", "function_call"]


def _deep(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"a":' * depth + "1" + "}" * depth)


def weird_value(rng: random.Random, depth: int = 0) -> object:
    choices = [None, True, False, 0, -1, 1, 2**31, 2**64, -(2**63), 1e308, -1e-308, 0.5, "", "x", "x" * 5000,
               "\ud83d", "\u0000\u202e", "system", "user", "assistant", "tool", "auto", "none", "required",
               [], {}, [1, 2, 3], ["a", ""], [{"type": "text", "text": "hi"}], [{"type": "image_url"}],
               {"type": "json_schema"}, {"type": "json_object"}, {"type": "function", "function": {"name": 1}},
               {"include_usage": "yes"}, {"50256": 100}, {"a": {"b": {"c": []}}}]
    if depth < 2 and rng.random() < 0.2:
        return [weird_value(rng, depth + 1) for _ in range(rng.randint(1, 3))]
    if depth < 2 and rng.random() < 0.1:
        return {rng.choice(FIELDS + MESSAGE_FIELDS): weird_value(rng, depth + 1) for _ in range(rng.randint(1, 3))}
    return rng.choice(choices)


def valid_body(rng: random.Random, model: str) -> tuple[str, dict]:
    if rng.random() < 0.6:
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hello there"}],
                                        "max_tokens": 4, "temperature": 0}
    return "/v1/completions", {"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0}


def fuzzed(rng: random.Random, model: str) -> tuple[str, bytes]:
    """One request: (path, raw body)."""
    path, body = valid_body(rng, model)
    r = rng.random()
    if r < 0.12:  # not a JSON object at all, or not JSON
        raw = rng.choice([b"", b"{", b"null", b"[]", b'"x"', b"42", b"\xff\xfe\x00", b'{"model": NaN}',
                          _deep(rng.choice([100, 1000, 100_000]), rng.choice(["list", "dict"])).encode(),
                          json.dumps(body).encode()[: rng.randint(1, 30)], b'{"model": "' + b"\xc3" + b'"}'])
        return path, raw
    for _ in range(rng.randint(1, 4)):
        target = body
        msgs = body.get("messages")
        if isinstance(msgs, list) and rng.random() < 0.4:
            if rng.random() < 0.2:
                msgs.append({"role": weird_value(rng)})
            target = msgs[rng.randrange(len(msgs))] if msgs and isinstance(msgs[-1], dict) else body
            key = rng.choice(MESSAGE_FIELDS + ["x"])
        else:
            key = rng.choice(FIELDS)
        if not isinstance(target, dict):
            target = body
        if rng.random() < 0.15:
            target.pop(key, None)
        else:
            target[key] = weird_value(rng)
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = body["max_tokens"] if body["max_tokens"] < 64 else 64 + body["max_tokens"] % 7
    return path, json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


@dataclass
class FuzzResult:
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[tuple[int, str, bytes, str]] = field(default_factory=list)  # status, path, body, answer
    hangs: int = 0
    bad_error_bodies: int = 0  # 4xx without an OpenAI-style error object


async def run(url: str, model: str, n: int, seed: int = 0, concurrency: int = 8, timeout_s: float = 30) -> FuzzResult:
    rng = random.Random(seed)
    cases = [fuzzed(rng, model) for _ in range(n)]
    res = FuzzResult()
    sem = asyncio.Semaphore(concurrency)

    async def one(s: aiohttp.ClientSession, path: str, raw: bytes) -> None:
        async with sem:
            try:
                async with asyncio.timeout(timeout_s):
                    async with s.post(url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
                        text = await r.text(errors="replace")
            except TimeoutError:
                res.hangs += 1
                return
            res.statuses[r.status] += 1
            if r.status >= 500:
                res.server_errors.append((r.status, path, raw[:300], text[:300]))
            elif r.status >= 400:
                try:
                    err = json.loads(text)["error"]
                    ok = isinstance(err["message"], str) and err["message"]
                except (ValueError, KeyError, TypeError):
                    ok = False
                res.bad_error_bodies += not ok

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(one(s, p, raw) for p, raw in cases))
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    res = asyncio.run(run(args.url, args.model, args.n, args.seed))
    print(f"statuses: {dict(sorted(res.statuses.items()))}  hangs: {res.hangs}  4xx without an error object: "
          f"{res.bad_error_bodies}")
    for status, path, raw, answer in res.server_errors[:10]:
        print(f"  {status} {path} {raw!r} -> {answer}")
    return 1 if res.server_errors or res.hangs or res.bad_error_bodies else 0


if __name__ == "__main__":
    sys.exit(main())
