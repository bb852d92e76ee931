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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.tokenizer import Tokenizer
from router.api.errors import not_found
from router.api.protocol import GenRequest, RequestParser
from router.api.sse import OpenAIFormat
from router.core.endpoints import Endpoint


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


class ModelPools:
    """Every model this router serves and the names clients may ask for: the base models' pools, and the
    LoRA adapters some worker holds (each a model name too, belonging to the pool whose workers hold it).
    Queries take `may_use` (a caller's policy: which names its key may see) rather than the caller."""

    def __init__(self, default: ModelPool, extra: list[ModelPool]):
        self.started = int(time.time())
        self.base_name = default.name
        # The names clients may ask for; learned from the upstreams when none is configured.
        self.model_names: set[str] = {default.name} if default.name else set()
        self.adapter_names: set[str] = set()  # LoRA adapters resident on some worker (also in model_names)
        self.default = default
        self.pools: dict[str, ModelPool] = {default.name: default}
        for pool in extra:
            self.pools[pool.name] = pool
            self.model_names.add(pool.name)
        check_distinct(list(self.pools.values()))
        # Several models: each request carries its pool (the workers reporting its model), and a LoRA
        # adapter belongs to the pool whose workers hold it.
        self.multi = len(self.pools) > 1
        self.adapter_pool: dict[str, str] = {}

    def pool_for(self, body: Any) -> ModelPool:
        """The model a body names (an adapter: the model whose workers hold it); any other name gets the
        first model's parser, which answers it with the 404 naming what exists."""
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and self.multi:
            if model in self.pools:
                return self.pools[model]
            if model in self.adapter_pool:
                return self.pools[self.adapter_pool[model]]
        return self.default

    def pooled(self, pool: ModelPool, reqs: list[GenRequest]) -> list[GenRequest]:
        """Requests tagged with their pool's workers (several models), and with their adapter."""
        if self.multi:
            for r in reqs:
                r.pool = pool.worker_model
        if reqs and reqs[0].model in self.adapter_names:
            for r in reqs:
                r.adapter = r.model
        return reqs

    def visible(self, may_use: Callable[[str], bool]) -> list[str]:
        return sorted(n for n in self.model_names if may_use(n))

    def check_visible(self, model: str, may_use: Callable[[str], bool]) -> None:
        """A name the caller may not see, or that is not served, gets the 404 of a model that does not
        exist, naming only the models it may use (other names do not leak)."""
        if model not in self.model_names or not may_use(model):
            raise not_found(f"model '{model}' does not exist; available: {self.visible(may_use)}",
                            code="model_not_found")

    def card(self, name: str) -> dict[str, Any]:
        adapter = name in self.adapter_names
        pool = self.pools.get(self.adapter_pool.get(name, self.base_name) if adapter else name, self.default)
        return {"id": name, "object": "model", "created": self.started, "owned_by": "splitfire",
                "root": name if adapter else pool.root or name, "parent": pool.name if adapter else None,
                "max_model_len": pool.max_model_len, "permission": []}

    def refresh_adapters(self, endpoints: list[Endpoint]) -> None:
        """The adapters some worker holds become model names (a request naming one runs under it)."""
        names: set[str] = set()
        for ep in endpoints:
            if ep.role != "openai":
                names |= ep.adapters
        names -= set(self.pools)
        self.model_names -= self.adapter_names - names
        self.model_names |= names
        self.adapter_names = names
        if self.multi:
            by_worker = {p.worker_model: p.name for p in self.pools.values()}
            self.adapter_pool = {a: by_worker[base] for ep in endpoints if ep.role != "openai"
                                 for a in ep.adapters if (base := ep.adapter_models.get(a, ep.served_model)) in by_worker}
