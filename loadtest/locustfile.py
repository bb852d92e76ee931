"""Locust scenarios against the router. TTFT and inter-token latency are recorded as custom
request types ("TTFT" and "ITL") next to the HTTP rows, so they show up in the UI and CSVs.

    locust -f loadtest/locustfile.py --headless -u 32 -r 8 -t 60s --host http://127.0.0.1:8000 \\
        --csv loadtest/results/locust

Pick scenarios with class names: `locust -f loadtest/locustfile.py ChatUser AgentUser ...`.
Env: SPLITFIRE_LOCUST_MAX_TOKENS (default 64), SPLITFIRE_LOCUST_MODEL (default: the router's first model).
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid

from locust import HttpUser, between, events, task

MAX_TOKENS = int(os.environ.get("SPLITFIRE_LOCUST_MAX_TOKENS", "64"))
WORDS = ("serving latency decode prefill cache token router tensor kernel memory bandwidth cluster request stream "
         "batch worker transfer affinity session the of and to in is was for on that with as by at from").split()
SYSTEM_PROMPT = ("You are a coding agent. You can call tools: read_file(path), run_tests(), search(query). "
                 "Think step by step, call one tool per turn, and report results concisely. " * 6)
_model: dict[str, str] = {}


def words(n: int) -> str:
    return " ".join(random.choice(WORDS) for _ in range(n))


def _metric(name: str, kind: str, seconds: float) -> None:
    events.request.fire(request_type=kind, name=name, response_time=seconds * 1000, response_length=0,
                        exception=None, context={})


class _Streaming(HttpUser):
    abstract = True
    wait_time = between(0.5, 2.0)

    def model(self) -> str:
        if "name" not in _model:
            _model["name"] = os.environ.get("SPLITFIRE_LOCUST_MODEL") or self.client.get("/v1/models").json()["data"][0]["id"]
        return _model["name"]

    def chat(self, name: str, messages: list[dict], max_tokens: int = MAX_TOKENS, session: str | None = None) -> str:
        body = {"model": self.model(), "messages": messages, "max_tokens": max_tokens, "stream": True,
                "temperature": 0.7, "stream_options": {"include_usage": True}}
        headers = {"x-session-affinity": session} if session else {}
        text, t0, last = [], time.perf_counter(), None
        with self.client.post("/v1/chat/completions", json=body, headers=headers, stream=True, name=name,
                              catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return ""
            for line in resp.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    resp.failure(obj["error"]["message"])
                    return "".join(text)
                if not obj["choices"] or not obj["choices"][0]["delta"].get("content"):
                    continue
                now = time.perf_counter()
                if last is None:
                    _metric(name, "TTFT", now - t0)
                else:
                    _metric(name, "ITL", now - last)
                last = now
                text.append(obj["choices"][0]["delta"]["content"])
            resp.success()
        return "".join(text)


class ChatUser(_Streaming):
    """(a) Streaming chat: short prompts, a few dozen tokens out."""

    weight = 3

    @task
    def chat_once(self) -> None:
        self.chat("chat", [{"role": "user", "content": words(random.randint(10, 40))}])


class AgentUser(_Streaming):
    """(b) Multi-turn agent sessions: a shared long system prompt, a context that grows every turn
    (tool call, tool result), pinned with x-session-affinity."""

    weight = 2
    turns_per_session = 10

    def on_start(self) -> None:
        self.new_session()

    def new_session(self) -> None:
        self.session = uuid.uuid4().hex
        self.messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        self.turn = 0

    @task
    def turn_once(self) -> None:
        if self.turn >= self.turns_per_session:
            self.new_session()
        self.messages.append({"role": "user", "content": f"Tool result {self.turn}: {words(random.randint(20, 60))}"})
        reply = self.chat("agent-turn", self.messages, max_tokens=32, session=self.session)
        self.messages.append({"role": "assistant", "content": reply or "ok"})
        self.turn += 1


class MixedUser(_Streaming):
    """(c) Mixed long and short prompts: one in five carries ~1k words."""

    weight = 1

    @task
    def mixed(self) -> None:
        if random.random() < 0.2:
            self.chat("mixed-long", [{"role": "user", "content": words(random.randint(600, 1000))}], max_tokens=16)
        else:
            self.chat("mixed-short", [{"role": "user", "content": words(random.randint(10, 30))}])
