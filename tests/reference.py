"""A plain Llama forward pass — no cache, no paging, full recompute every token — read
straight from the safetensors file. The oracle the engine's greedy output must equal."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


class ReferenceLlama:
    def __init__(self, model_dir: Path):
        self.cfg = json.loads((Path(model_dir) / "config.json").read_text())
        self.w = load_file(str(Path(model_dir) / "model.safetensors"))
        c = self.cfg
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c["hidden_size"] // self.heads
        self.eps = c["rms_norm_eps"]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        self.inv_freq = inv.float()

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _rope(self, x: torch.Tensor) -> torch.Tensor:  # x: [heads, T, d]
        t = x.shape[1]
        ang = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        w, t = self.w, len(ids)
        x = w["model.embed_tokens.weight"][torch.tensor(ids)]
        mask = torch.full((t, t), float("-inf")).triu(1)
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])

            def proj(n: str, heads: int, h=h, p=p) -> torch.Tensor:
                y = h @ w[p + f"self_attn.{n}_proj.weight"].T
                if p + f"self_attn.{n}_proj.bias" in w:
                    y = y + w[p + f"self_attn.{n}_proj.bias"]
                return y.view(t, heads, self.head_dim).transpose(0, 1)

            q, k, v = proj("q", self.heads), proj("k", self.kv_heads), proj("v", self.kv_heads)
            q, k = self._rope(q), self._rope(k)
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
            att = torch.softmax(q @ k.transpose(1, 2) / self.head_dim**0.5 + mask, -1)
            o = (att @ v).transpose(0, 1).reshape(t, -1)
            x = x + o @ w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        x = self._norm(x, w["model.norm.weight"])
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return x[-1] @ head.T

    def greedy(self, ids: list[int], n: int) -> list[int]:
        ids = list(ids)
        out = []
        for _ in range(n):
            tok = int(self.logits(ids).argmax())
            out.append(tok)
            ids.append(tok)
        return out
