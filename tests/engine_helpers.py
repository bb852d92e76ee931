from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # (token id, logprob, top) per token, when asked for
    error: str | None = None
    cached_tokens: int = 0


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_gb", 0.01)
    kw.setdefault("device", "cpu")
    # SPLITFIRE_QUANTIZATION=int8 runs the suite's in-process engines (and, through the environment,
    # its worker processes) with quantized weights.
    kw.setdefault("quantization", os.environ.get("SPLITFIRE_QUANTIZATION") or None)
    return LLMEngine(EngineConfig(model=str(model_dir), **kw))


def drain(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return results
        for o in engine.step():
            r = results.setdefault(o.request_id, Result())
            r.token_ids += o.token_ids
            r.text += o.text
            r.cached_tokens = max(r.cached_tokens, o.num_cached_tokens)
            r.logprobs += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]
            if o.finished:
                r.finish_reason, r.error = o.finish_reason, o.error
    raise AssertionError("engine did not finish")
