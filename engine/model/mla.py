"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): the KV cache holds one latent per token.

Per token the cache keeps `c` (the `kv_lora_rank` latent, normed) and `k_r` (a `qk_rope_head_dim`
RoPE key shared by every head): one page is one block's `[slots, rank + rope]` for one layer,
so the prefill → decode transfer moves latents, not per-head K and V. Every head's key is
`[W_UK[h] c, k_r]` and its value `W_UV[h] c` (`kv_b_proj` stacks W_UK and W_UV per head).

Two ways to attend, held equal in tests/test_mla.py:

- **up-projecting** (the reference; used for long prompt chunks, where the matmul is amortised over
  many queries): expand the context's latents into per-head K and V, then ordinary attention.
- **absorbed** (decode, and short chunks such as speculative verifications: `MLAttention.absorbs`):
  W_UK folds into the query (`q_c[h] = W_UK[h]^T q_nope[h]`), so scores are `q_c · c + q_r · k_r`
  against the cached latents directly, the weighted sum stays a latent, and W_UV is applied once
  per query afterwards. Nothing per context token is
  up-projected: a step reads `rank + rope` numbers per cached token instead of computing
  `heads × (nope + v)` of them. On CUDA a Triton kernel (`kernels/mla_triton.py`) reads the pages
  in place; the torch path gathers them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import AttentionMetadata, DecodeBatch, store_rows
from engine.model.kernels import kernels
from engine.model.layers import Linear, RMSNorm
from engine.model.lora import LoRATarget
from engine.model.model_config import LayerConfig, ModelConfig
from engine.model.parallel import ONE, Shard
from engine.model.rope import apply_rope

# The kv_b adapters a run of rows uses: (A [R, rank], B [heads, nope + v, R] scaled, the rows' indices).
Adapters = Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class MLAttention(nn.Module):
    """Tensor parallel: the heads are split (q_b or a plain q projection, kv_b and o by head); the
    latent projection, its norm and the q LoRA's first half are replicated, and so is the latent cache:
    every rank's heads read every cached latent (its bytes per token do not shrink with the ranks)."""

    def __init__(self, cfg: ModelConfig, layer: LayerConfig, shard: Shard = ONE):
        super().__init__()
        m = cfg.mla
        assert m is not None
        if layer.window is not None:
            raise ValueError("sliding-window layers with latent attention are not implemented")
        self.head_range = shard.even(cfg.num_heads, "the attention heads")
        self.heads, self.rank = len(self.head_range), m.kv_lora_rank
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        qk = self.nope + self.rope
        # The query's first projection and the latent's share their input: one matmul (vLLM fuses them too).
        self.q_rows = m.q_lora_rank or self.heads * qk
        self.qkv_a = Linear(cfg.hidden_size, self.q_rows + self.rank + self.rope)
        self.q_a_norm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps) if m.q_lora_rank else None
        self.q_b = Linear(m.q_lora_rank, self.heads * qk) if m.q_lora_rank else None
        self.kv_a_norm = RMSNorm(self.rank, cfg.rms_norm_eps)
        # [heads * (nope + v), rank], kept a plain float tensor: the absorbed path reads it per head.
        self.kv_b = nn.Parameter(torch.empty(self.heads * (self.nope + self.v_dim), self.rank), requires_grad=False)
        # LoRA adapters on kv_b (`lora.py`): added where kv_b is read — on the expanded keys and values, or
        # absorbed like kv_b itself (`_lora_queries`, `_lora_values`).
        self.kv_b_target = LoRATarget(self.rank, self.heads * (self.nope + self.v_dim))
        self.o = Linear(self.heads * self.v_dim, cfg.hidden_size)
        if shard.parallel:
            self.o.reduce = shard
        self.scale = cfg.scale
        self.absorb = True  # decode rows attend against the latents (False: up-project, the reference)
        self.absorb_chunks = True  # short chunks too, by the cost rule in `absorbs`

    def w_uk(self) -> torch.Tensor:
        """[heads, nope, rank] view of kv_b: latent → each head's non-RoPE key."""
        return self.kv_b.view(self.heads, self.nope + self.v_dim, self.rank)[:, : self.nope]

    def w_uv(self) -> torch.Tensor:
        """[heads, v, rank] view of kv_b: latent → each head's value."""
        return self.kv_b.view(self.heads, self.nope + self.v_dim, self.rank)[:, self.nope :]

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, layer_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        a = self.qkv_a(x)
        q = a[:, : self.q_rows]
        if self.q_b is not None and self.q_a_norm is not None:
            q = self.q_b(self.q_a_norm(q))
        q = q.view(t, self.heads, self.nope + self.rope)
        q_nope, q_rope = q[..., : self.nope], apply_rope(q[..., self.nope :], freqs)
        entry = torch.cat((self.kv_a_norm(a[:, self.q_rows : self.q_rows + self.rank]),
                           apply_rope(a[:, self.q_rows + self.rank :].unsqueeze(1), freqs).squeeze(1)), dim=-1)
        # [rows, rank + rope]: the layer's pages flattened; k_rows addresses each new token's slot.
        flat = layer_cache.view(-1, self.rank + self.rope)
        store_rows(flat, meta.k_rows, entry)

        out = x.new_empty(t, self.heads, self.v_dim)
        for seg in meta.prefills:
            rows = slice(seg.start, seg.start + seg.length)
            latents = self._pages(layer_cache, seg.blocks, x.dtype)[: seg.context_len]
            attend = self.attend_absorbed_chunk if self.absorbs(seg.length) else self.attend_expanded
            out[rows] = attend(q_nope[rows], q_rope[rows], latents, seg.mask(None), self.adapters(rows))
        for d in meta.decodes:
            rows = slice(d.start, d.start + d.blocks.shape[0])
            out[rows] = (self.attend_absorbed if self.absorb else self.attend_decode_expanded)(
                q_nope[rows], q_rope[rows], layer_cache, d, self.adapters(rows))
        return self.o(out.view(t, -1))

    def adapters(self, rows: slice) -> Adapters:
        """The kv_b adapters that the step's `rows` run under: (A [R, rank], B [heads, nope + v, R] scaled,
        the rows' indices within `rows`) per adapter; empty for base rows or adapters that leave kv_b alone."""
        lora = self.kv_b_target.lora
        if lora is None:
            return []
        return [(lora.a[s], lora.b[s].view(self.heads, self.nope + self.v_dim, -1), idx)
                for s, idx in lora.row_groups(rows)]

    def _lora_queries(self, q_c: torch.Tensor, q_nope: torch.Tensor, adapters: Adapters) -> torch.Tensor:
        """q_c [heads, L, rank] (W_UK^T q_nope) plus each adapter's (B_K A)^T q_nope for its rows: W_UK + B_K A
        absorbed as W_UK is, through the rank-R space (nothing the size of kv_b is formed per adapter)."""
        for a, b, idx in adapters:
            q_c[:, idx] += torch.bmm(q_nope[idx].transpose(0, 1), b[:, : self.nope]) @ a
        return q_c

    def _lora_values(self, out: torch.Tensor, o_c: torch.Tensor, adapters: Adapters) -> torch.Tensor:
        """out [L, heads, v] (W_UV o_c) plus each adapter's B_V A o_c for its rows; o_c [heads, L, rank]."""
        for a, b, idx in adapters:
            out[idx] += torch.bmm(o_c[:, idx] @ a.T, b[:, self.nope :].transpose(1, 2)).transpose(0, 1)
        return out

    def absorbs(self, queries: int) -> bool:
        """Whether a chunk of `queries` rows is cheaper absorbed. Per context token, up-projecting costs
        rank x heads x (nope + v) once plus heads x (nope + rope + v) per query; absorbed costs
        heads x (2 rank + rope) per query. Short chunks — speculative verifications, small prefill
        steps after a long prefix — absorb (DeepSeek-V3: below ~170 rows); long prompt chunks expand."""
        per_query = 2 * self.rank + self.rope - (self.nope + self.rope + self.v_dim)
        return self.absorb and self.absorb_chunks and queries * per_query < self.rank * (self.nope + self.v_dim)

    def _pages(self, layer_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[len(blocks) * block_size, rank + rope]: the latents of those blocks, in order, in `dtype`."""
        n = layer_cache.shape[0]
        pages = layer_cache.view(n, -1).index_select(0, blocks.reshape(-1)).view(-1, self.rank + self.rope)
        return pages.to(dtype)

    def expand(self, latents: torch.Tensor, adapters: Adapters = (), batched: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """latents [..., N, rank + rope] → keys [..., N, heads, nope + rope], values [..., N, heads, v]. With
        `adapters`, their rows' context is up-projected by kv_b + B A: one sequence's (`batched` False: its
        adapter applies to every latent) or a batch's [B, N, ...] (the adapter's indices pick sequences)."""
        c = latents[..., : self.rank]
        kv = F.linear(c, self.kv_b).unflatten(-1, (self.heads, self.nope + self.v_dim))
        for a, b, idx in adapters:
            if batched:
                kv[idx] += (c[idx] @ a.T @ b.flatten(0, 1).T).unflatten(-1, b.shape[:2])
            else:
                kv += (c @ a.T @ b.flatten(0, 1).T).unflatten(-1, b.shape[:2])
        k_rope = latents[..., None, self.rank :].expand(*kv.shape[:-1], self.rope)
        return torch.cat((kv[..., : self.nope], k_rope), dim=-1), kv[..., self.nope :]

    def attend_expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor,
                        mask: torch.Tensor | None, adapters: Adapters = ()) -> torch.Tensor:
        """One sequence's queries [L, heads, *] against its whole context (causal; `mask` when the
        context is longer than the queries). Returns [L, heads, v]."""
        k, v = self.expand(latents, adapters)
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(0, 1).unsqueeze(0)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=self.scale)
        return o[0].transpose(0, 1)

    def attend_absorbed_chunk(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor,
                              mask: torch.Tensor | None, adapters: Adapters = ()) -> torch.Tensor:
        """`attend_expanded` computed against the latents (the decode path's algebra for L queries):
        [L, heads, *] queries, [N, rank + rope] context, causal. Returns [L, heads, v]."""
        length, n = q_nope.shape[0], latents.shape[0]
        q_c = self._lora_queries(torch.bmm(q_nope.transpose(0, 1), self.w_uk()), q_nope, adapters)  # [heads, L, rank]
        q = torch.cat((q_c, q_rope.transpose(0, 1)), dim=-1)  # [heads, L, rank + rope]
        scores = (q.reshape(-1, self.rank + self.rope) @ latents.T).view(self.heads, length, n)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).mul_(self.scale)
        if mask is None:  # the queries are the whole context: plain causal
            mask = torch.ones(length, n, dtype=torch.bool, device=latents.device).tril_()
        scores.masked_fill_(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(latents.dtype)
        o_c = (p.view(-1, n) @ latents[:, : self.rank]).view(self.heads, length, self.rank)
        return self._lora_values(torch.bmm(o_c, self.w_uv().transpose(1, 2)).transpose(0, 1), o_c, adapters)

    def attend_decode_expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_cache: torch.Tensor,
                               d: DecodeBatch, adapters: Adapters = ()) -> torch.Tensor:
        """The reference decode: every context latent up-projected to per-head K and V each step."""
        b = d.blocks.shape[0]
        k, v = self.expand(self._pages(layer_cache, d.blocks, q_nope.dtype).view(b, -1, self.rank + self.rope),
                           adapters, batched=True)
        q = torch.cat((q_nope, q_rope), dim=-1).unsqueeze(2)  # [B, heads, 1, nope + rope]
        o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=d.mask, scale=self.scale)
        return o.squeeze(2)

    def attend_absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, layer_cache: torch.Tensor,
                        d: DecodeBatch, adapters: Adapters = ()) -> torch.Tensor:
        """Decode against the latents: scores = (W_UK^T q_nope)·c + q_rope·k_r, out = W_UV (Σ p c)."""
        b = d.blocks.shape[0]
        q_c = self._lora_queries(torch.bmm(q_nope.transpose(0, 1), self.w_uk()), q_nope, adapters)  # [heads, B, rank]
        fused = kernels("mla_triton", layer_cache.device.type)
        if (fused is not None and d.context_lens is not None
                and fused.supported(self.rank, self.rope, layer_cache.shape[2])):
            # Pages read in place through the block table (kernels/mla_triton.py).
            o_c = fused.mla_decode(q_c.transpose(0, 1), q_rope, layer_cache, d.blocks, d.context_lens,
                                   self.scale).transpose(0, 1)
            return self._lora_values(torch.bmm(o_c, self.w_uv().transpose(1, 2)).transpose(0, 1), o_c, adapters)
        latents = self._pages(layer_cache, d.blocks, q_nope.dtype).view(b, -1, self.rank + self.rope)
        q = torch.cat((q_c.transpose(0, 1), q_rope), dim=-1)  # [B, heads, rank + rope]
        # Softmax in float32 at least (bfloat16 scores would round the weights).
        scores = torch.bmm(q, latents.transpose(1, 2))
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).mul_(self.scale)  # [B, heads, N]
        scores.masked_fill_(~d.mask.view(b, 1, -1), float("-inf"))
        p = torch.softmax(scores, dim=-1).to(latents.dtype)
        o_c = torch.bmm(p, latents[..., : self.rank]).transpose(0, 1)  # [heads, B, rank]
        return self._lora_values(torch.bmm(o_c, self.w_uv().transpose(1, 2)).transpose(0, 1), o_c, adapters)
