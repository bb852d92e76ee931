"""The models one router serves: for each, its tokenizer and chat template (a request parser and a reply
format of its own), its context length, and which workers are its pool.

A router started with one model keeps today's behaviour (every worker serves it). With `--extra-model
NAME=MODEL` it serves several: a request's `model` picks the pool (a LoRA adapter's requests go to the
pool whose workers hold it), and only workers reporting that model's directory name in their health
check (`HealthResponse.model`) receive it. Each model's workers scale apart; a worker that reports no
known model serves none of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.tokenizer import Tokenizer
from router.api.protocol import RequestParser
from router.api.sse import OpenAIFormat


@dataclass
class ModelPool:
    name: str  # what clients send as `model`
    root: str  # the model directory
    tokenizer: Tokenizer | None
    max_model_len: int
    parser: RequestParser
    openai_format: OpenAIFormat

    @property
    def worker_model(self) -> str:
        """What this model's workers report (their model directory's name)."""
        return Path(self.root).name if self.root else ""


def load_model(model: str | None) -> tuple[str, Tokenizer, int]:
    """(directory, tokenizer, context length) of a model directory or built-in name (None: the default)."""
    from engine.loading.model_store import resolve_model

    model_dir = resolve_model(model)
    max_len = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", 4096)
    return str(model_dir), Tokenizer(model_dir), int(max_len)


def check_distinct(pools: list[ModelPool]) -> None:
    """Workers are told apart by their model directory's name: two models may not share one."""
    seen: dict[str, str] = {}
    for p in pools:
        if p.worker_model in seen:
            raise ValueError(f"models {seen[p.worker_model]!r} and {p.name!r} are both in a directory named "
                             f"{p.worker_model!r}: their workers could not be told apart (rename one directory)")
        seen[p.worker_model] = p.name
