"""The model catalogue's routes: /v1/models (what the caller's key may use), /v1/models/{id}, and vLLM's
/tokenize and /detokenize with the named model's tokenizer and chat template."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from common.chat_template import TemplateError
from common.tokenizer import Tokenizer
from router.api.errors import bad_request
from router.api.protocol import parse_messages
from router.app.body import read_json
from router.core.model_pools import ModelPools
from router.tenancy.tenants import Caller, Tenants


class ModelRoutes:
    def __init__(self, pools: ModelPools, tenants: Tenants):
        self.pools = pools
        self.tenants = tenants

    async def models(self, request: web.Request) -> web.Response:
        caller = self.tenants.caller(request)
        return web.json_response({"object": "list", "data": [self.pools.card(n) for n in self.pools.visible(caller.policy.may_use)]})

    async def model(self, request: web.Request) -> web.Response:
        caller = self.tenants.caller(request)
        name = request.match_info["model_id"]
        self.pools.check_visible(name, caller.policy.may_use)
        return web.json_response(self.pools.card(name))

    def _tokenizer_for(self, caller: Caller, body: Any) -> Tokenizer:
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        model = body.get("model")
        if model is not None:
            self.pools.check_visible(model, caller.policy.may_use)
        tok = self.pools.pool_for(body).tokenizer
        if tok is None:
            raise bad_request("this router has no tokenizer (it fronts OpenAI-compatible upstreams without --model); "
                              "ask the upstreams, or start the router with --model")
        return tok

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: {prompt} or {messages, add_generation_prompt}; add_special_tokens."""
        caller = self.tenants.caller(request)
        body = await read_json(request)
        tok = self._tokenizer_for(caller, body)
        special = body.get("add_special_tokens", "messages" not in body)
        if not isinstance(special, bool):
            raise bad_request("'add_special_tokens' must be a boolean", param="add_special_tokens")
        if "messages" in body:
            gen = body.get("add_generation_prompt", True)
            if not isinstance(gen, bool):
                raise bad_request("'add_generation_prompt' must be a boolean", param="add_generation_prompt")
            try:
                ids = tok.encode_chat(parse_messages(body), add_generation_prompt=gen)
            except TemplateError as e:
                raise bad_request(f"chat template rejected the conversation: {e}", param="messages") from e
        elif isinstance(body.get("prompt"), str):
            ids = tok.encode(body["prompt"], add_special_tokens=special)
        else:
            raise bad_request("give 'prompt' (a string) or 'messages'", param="prompt")
        return web.json_response({"count": len(ids), "max_model_len": self.pools.pool_for(body).max_model_len, "tokens": ids,
                                  "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        caller = self.tenants.caller(request)
        body = await read_json(request)
        tok = self._tokenizer_for(caller, body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                and 0 <= t < tok.vocab_size for t in ids):
            raise bad_request(f"'tokens' must be a list of token ids in [0, {tok.vocab_size})", param="tokens")
        return web.json_response({"prompt": tok.decode(ids)})
