"""`splitfire generate`: offline batch generation from JSONL, in-process, continuously batched."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm import tqdm

from common import grammar
from common.errors import EngineError, RequestError
from common.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos",
                 "logprobs", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop_token_ids")


@dataclass
class OfflineRequest:
    index: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    adapter: str = ""  # a LoRA adapter of --lora-modules ("" = the base model)


def parse_line(engine: LLMEngine, index: int, obj: Any) -> OfflineRequest:
    if not isinstance(obj, dict):
        raise RequestError("each line must be a JSON object")
    kinds = [k for k in ("prompt", "messages", "prompt_token_ids") if k in obj]
    if len(kinds) != 1:
        raise RequestError("give exactly one of prompt, messages, prompt_token_ids")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise RequestError("prompt must be a string")
        ids = engine.tokenizer.encode(obj["prompt"])
    elif "messages" in obj:
        if not isinstance(obj["messages"], list) or not obj["messages"]:
            raise RequestError("messages must be a non-empty list")
        ids = engine.tokenizer.encode_chat(obj["messages"])
    else:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise RequestError("prompt_token_ids must be a list of integers")
    unknown = sorted(set(obj) - {"prompt", "messages", "prompt_token_ids", "response_format", "adapter",
                                 *SAMPLING_KEYS})
    if unknown:
        raise RequestError(f"unsupported field(s) {unknown}; a line takes prompt | messages | prompt_token_ids, "
                           f"response_format, adapter and {list(SAMPLING_KEYS)}")
    adapter = obj.get("adapter") or ""
    if not isinstance(adapter, str):
        raise RequestError("adapter must be the name of a --lora-modules adapter")
    kw = {k: obj[k] for k in SAMPLING_KEYS if k in obj and obj[k] is not None}
    kw["grammar"] = grammar.response_format(obj.get("response_format"))
    if isinstance(kw.get("stop"), str):
        kw["stop"] = [kw["stop"]]
    if kw.get("logprobs") is True:
        kw["logprobs"] = 0
    elif kw.get("logprobs") is False:
        kw.pop("logprobs")
    try:
        sampling = SamplingParams(**kw).validate()
    except TypeError as e:
        raise RequestError(f"bad sampling value: {e}") from e
    return OfflineRequest(index, ids, sampling, adapter)


def generate(engine: LLMEngine, lines: Iterable[str], out: TextIO, progress: bool = True) -> int:
    """Runs every request; writes one JSON line per input line, in input order. Returns the error count."""
    results: dict[int, dict[str, Any]] = {}
    pending: dict[str, int] = {}
    n = 0
    for n, line in enumerate(lines, 1):
        i = n - 1
        if not line.strip():
            results[i] = {"error": "empty line"}
            continue
        try:
            req = parse_line(engine, i, json.loads(line))
            engine.add_request(f"line-{i}", req.prompt_token_ids, req.sampling, adapter=req.adapter)
            pending[f"line-{i}"] = i
            results[i] = {"token_ids": [], "text": "", "finish_reason": None}
            if req.sampling.logprobs is not None:
                results[i]["logprobs"] = []
        except (json.JSONDecodeError, EngineError) as e:
            results[i] = {"error": f"line {n}: {e}"}
    bar = tqdm(total=len(pending), desc="generating", unit="req", disable=not progress, file=sys.stderr)
    while engine.has_work:
        for o in engine.step():
            r = results[pending[o.request_id]]
            r["token_ids"] += o.token_ids
            r["text"] += o.text
            if "logprobs" in r:
                r["logprobs"] += [
                    {"token_id": lp.token_id, "logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]}
                    for lp in o.logprobs
                ]
            if o.finished:
                r["finish_reason"] = o.finish_reason
                if o.error:
                    r["error"] = o.error
                bar.update(1)
    bar.close()
    for i in range(n):
        out.write(json.dumps(results[i], ensure_ascii=False) + "\n")
    out.flush()
    return sum(1 for r in results.values() if "error" in r)
