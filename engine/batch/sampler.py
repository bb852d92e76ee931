"""Turning a step's logits into tokens, one row per sequence.

Pure functions of (logits, settings, generator) so tests call them directly. A seeded
request draws the noise for its n-th generated token from a generator seeded by (seed, n)
alone, so its tokens depend neither on what else shares the batch nor on which worker draws
them: the prefill worker's first token, the decode worker's next ones and a failover's
continuation are the tokens one process would have drawn. Grammar masks (constrained
decoding) are applied to the whole batch's logits before anything is chosen; logprobs are
the model's own (before the mask, as vLLM reports them by default).
"""

from __future__ import annotations

import torch

from common.sampling_params import SamplingParams
from engine.batch.constrained import GrammarEngine
from engine.batch.sequence import Sequence, TokenLogprob


def apply_penalties(logits: torch.Tensor, sp: SamplingParams, prompt: list[int], output: list[int],
                    banned: list[int] | None = None) -> torch.Tensor:
    """Repetition penalty (HF semantics: over prompt and output), OpenAI frequency/presence (output
    only), logit_bias, and `banned` tokens (EOS and stop ids before min_tokens) made impossible."""
    logits = logits.clone()
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if output and (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0):
        ids = torch.tensor(output, dtype=torch.long, device=logits.device)
        counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)
    if sp.logit_bias:
        ids = torch.tensor(list(sp.logit_bias), dtype=torch.long, device=logits.device)
        inside = ids < logits.shape[-1]  # ids past the vocabulary have no logit to bias
        bias = torch.tensor(list(sp.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        logits.index_add_(0, ids[inside], bias[inside])
    if banned:
        logits[torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def filtered_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Softmax at `temperature`, then top-k, top-p and min-p applied in that order (vLLM's order)."""
    logits = logits / sp.temperature
    if 0 < sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= sp.top_p
        drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if sp.min_p > 0.0:
        probs = probs.masked_fill(probs < sp.min_p * probs.max(), 0.0)
    return probs


def seeded_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """The generator for a seeded request's `index`-th generated token."""
    return torch.Generator(device).manual_seed((seed * 0x9E3779B97F4A7C15 + index) % 2**63)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Sample from (unnormalised) probs by the exponential race: argmax(p / E), E ~ Exp(1)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / noise))


def top_logprobs(logprobs: torch.Tensor, token: int, n: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if n > 0:
        vals, ids = torch.topk(logprobs, n)
        top = list(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(token_id=token, logprob=float(logprobs[token]), top=top)


def sample(logits: torch.Tensor, seqs: list[Sequence], grammar: GrammarEngine | None = None,
           eos_token_ids: frozenset[int] = frozenset()) -> list[tuple[int, TokenLogprob | None]]:
    """logits: [len(seqs), vocab] float32 (masked in place for constrained rows). Returns (token,
    logprob info or None) per sequence."""
    out: list[tuple[int, TokenLogprob | None]] = []
    want_lp = [s.sampling.logprobs is not None for s in seqs]
    raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
    constrained = [(i, s.matcher) for i, s in enumerate(seqs) if s.matcher is not None]
    if constrained:
        assert grammar is not None, "constrained sequences need the engine's GrammarEngine"
        grammar.mask_logits(logits, constrained)
    plain_greedy = [i for i, s in enumerate(seqs) if s.sampling.greedy and not s.sampling.penalized]
    greedy_tokens = {}
    if plain_greedy:
        idx = torch.tensor(plain_greedy, dtype=torch.long, device=logits.device)
        greedy_tokens = dict(zip(plain_greedy, logits.index_select(0, idx).argmax(-1).tolist(), strict=True))
    for i, seq in enumerate(seqs):
        sp = seq.sampling
        if i in greedy_tokens:
            token = greedy_tokens[i]
        else:
            row = logits[i]
            if sp.penalized:
                banned = ([t for t in (*eos_token_ids, *sp.stop_token_ids) if t < row.shape[-1]]
                          if seq.num_generated < sp.min_tokens else None)
                row = apply_penalties(row, sp, seq.prompt_token_ids, seq.generated_token_ids, banned)
            if sp.greedy:
                token = int(row.argmax())
            else:
                gen = seeded_generator(sp.seed, seq.num_generated, row.device) if sp.seed is not None else None
                token = draw(filtered_probs(row, sp), gen)
        info = top_logprobs(raw_lp[i], token, sp.logprobs) if raw_lp is not None and want_lp[i] else None
        out.append((token, info))
    return out


def speculative_targets(rows: torch.Tensor, seq: Sequence, draft: list[int]) -> list[int]:
    """The tokens the sampler draws at a verification step's rows (`rows`: [len(draft) + 1, vocab]):
    row j is the sequence's (num_generated + j)-th token, drawn as `sample` would draw it. Stops
    at the first row that disagrees with the draft (nothing after it is emitted)."""
    sp = seq.sampling
    if sp.greedy:
        return rows.argmax(-1).tolist()
    out: list[int] = []
    for j in range(rows.shape[0]):
        gen = seeded_generator(sp.seed, seq.num_generated + j, rows.device) if sp.seed is not None else None
        out.append(draw(filtered_probs(rows[j], sp), gen))
        if j < len(draft) and out[-1] != draft[j]:
            break
    return out
