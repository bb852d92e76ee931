"""Turning a step's logits into tokens, one row per sequence.

Pure functions of (logits, settings, generator) so tests call them directly. A seeded
request draws the random number for its n-th generated token from a generator seeded by (seed, n)
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
    """One row's sampling distribution, unnormalised, zero outside what the filters keep: softmax at
    `temperature`, then top-k, top-p and min-p in that order (vLLM's order). Each filter keeps every
    token at least as likely as its cut (ties at a cut are all kept, whatever order a sort gives equal
    values): top-k the k-th largest probability; top-p the least likely of the fewest most likely
    tokens (of those top-k kept) whose mass reaches top_p of the kept mass; min-p min_p x the largest.

    The plain reference, one row at a time: `sample_batch` is what the engine runs, a test holds the
    two equal."""
    probs = torch.softmax(logits / sp.temperature, dim=-1)
    k = sp.top_k if 0 < sp.top_k < probs.shape[-1] else probs.shape[-1]
    ranked = probs.sort(descending=True).values[:k]
    cut = ranked[-1]
    if sp.top_p < 1.0:
        mass = ranked.cumsum(-1)
        total = mass[-1] if k < probs.shape[-1] else 1.0  # (a softmax's total is 1)
        cut = ranked[int(((mass - ranked) < sp.top_p * total).sum()) - 1]  # at least one: the first's is 0
    if sp.min_p > 0.0:
        cut = torch.maximum(cut, sp.min_p * ranked[0])
    return probs.masked_fill(probs < cut, 0.0)


def seeded_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """The generator for a seeded request's `index`-th generated token."""
    return torch.Generator(device).manual_seed((seed * 0x9E3779B97F4A7C15 + index) % 2**63)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Sample from (unnormalised) probs: the first token, in vocabulary order, whose cumulative mass
    exceeds a uniform draw over the total (one random number; a token of zero probability is never
    chosen). The plain reference of `sample_batch`'s draw."""
    cdf = probs.cumsum(-1)
    u = torch.rand((), generator=generator, dtype=cdf.dtype, device=cdf.device)
    token = int(torch.searchsorted(cdf, (u * cdf[-1])[None], right=True)[0])
    return token if token < cdf.shape[-1] else int((probs > 0).nonzero()[-1, 0])  # (u x total rounded up)


# The cuts are looked for among the most likely tokens first (a partial sort); rows whose top-p cut
# lies beyond them (a flat distribution) look among more, then sort their whole row. Sorting a 49k
# vocabulary took ~3.5 ms a row on one core: 64 rows sampled at top_p=0.95 spent 240 ms per step.
CANDIDATES = (64, 1024)


def uniform_draws(generators: list[torch.Generator | None], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """Each sampled row's uniform number: from its generator, or (the others) one draw per row from
    torch's."""
    u = torch.empty(len(generators), dtype=dtype, device=dev)
    if any(g is None for g in generators):
        u.uniform_()
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand((), generator=g, dtype=dtype, device=dev)
    return u


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                on_device: bool | None = None) -> list[int]:
    """`sample_batch`'s tokens for these rows and draws. On a GPU (`on_device`, by default when the logits
    are on CUDA) by `sample_on_device` — whole sorted rows, the settings one copy, nothing read back but
    the tokens — where `sample_batch`'s host-made tensors and host reads cost milliseconds a step; on a
    CPU `sample_batch` itself (a whole-row sort costs there). A test holds the two equal."""
    if not (logits.device.type == "cuda" if on_device is None else on_device):
        return sample_batch(logits, params, generators)
    dev = logits.device
    settings = torch.tensor([row_settings(sp) for sp in params], dtype=torch.float32, device=dev)
    return sample_on_device(logits, settings, uniform_draws(generators, logits.dtype, dev)).tolist()


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
    """`draw(filtered_probs(row, sp), generator)` for every row of `logits` [R, V], in a few
    whole-batch operations instead of a dozen per row: the cuts come from the most likely tokens
    only, and a row whose kept tokens all lie among them draws from those alone (the same partial
    sums, in the same vocabulary order, as the whole row with zeros elsewhere). A row with a
    generator draws its uniform number from it; the others share one draw from torch's."""
    rows, vocab = logits.shape
    dev = logits.device
    temps = torch.tensor([sp.temperature for sp in params], dtype=logits.dtype, device=dev)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    u = uniform_draws(generators, probs.dtype, dev)
    cuts, narrow, candidates = _cuts(probs, params)
    tokens = [0] * rows
    wide = (~narrow).nonzero().flatten().tolist()
    if wide:  # the whole vocabulary: pure temperature rows, flat ones, ties at the candidates' edge
        sel = torch.tensor(wide, device=dev)
        kept = probs.index_select(0, sel) if len(wide) < rows else probs
        wide_cuts = cuts.index_select(0, sel)
        if bool((wide_cuts > 0).any()):
            kept = kept.masked_fill(kept < wide_cuts, 0.0)
        cdf = kept.cumsum(-1)
        hit = torch.searchsorted(cdf, (u.index_select(0, sel) * cdf[:, -1])[:, None], right=True).flatten()
        for j, (i, t) in enumerate(zip(wide, hit.tolist(), strict=True)):
            tokens[i] = t if t < vocab else int((kept[j] > 0).nonzero()[-1, 0])
    if narrow.any():
        assert candidates is not None
        cand_rows, cand_p, cand_i = candidates
        pos = torch.full((rows,), -1, dtype=torch.long, device=dev)
        pos[cand_rows] = torch.arange(len(cand_rows), device=dev)
        nar = narrow.nonzero().flatten()
        cp, ci = cand_p.index_select(0, pos[nar]), cand_i.index_select(0, pos[nar])
        cp = cp.masked_fill(cp < cuts.index_select(0, nar), 0.0)
        # in vocabulary order: the partial sums are the whole row's at its kept tokens
        ci, order = ci.masked_fill(cp == 0, vocab).sort(-1)
        cdf = cp.gather(1, order).cumsum(-1)
        last = (ci < vocab).sum(-1, keepdim=True) - 1
        hit = torch.searchsorted(cdf, (u.index_select(0, nar) * cdf.gather(1, last).flatten())[:, None],
                                 right=True)
        hit = torch.minimum(hit, last)
        for i, t in zip(nar.tolist(), ci.gather(1, hit).flatten().tolist(), strict=True):
            tokens[i] = t
    return tokens


def _cuts(probs: torch.Tensor, params: list[SamplingParams]) -> tuple[
        torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """Each row's probability cut (top-k, top-p and min-p together; 0 keeps everything), found among its most
    likely tokens (more of them only for a top-p row whose cut lies further on); which rows keep tokens only
    among the first candidates (`narrow`); and those candidates (rows, probabilities, ids)."""
    rows, vocab = probs.shape
    dev = probs.device
    ks = [sp.top_k if 0 < sp.top_k < vocab else vocab for sp in params]
    cuts = torch.zeros(rows, 1, dtype=probs.dtype, device=dev)  # (0: keep everything)
    narrow = torch.zeros(rows, dtype=torch.bool, device=dev)  # every kept token among the first candidates
    todo = [i for i, sp in enumerate(params) if ks[i] < vocab or sp.top_p < 1.0 or sp.min_p > 0.0]
    kmax = max((ks[i] for i in todo if ks[i] < vocab), default=0)
    sizes = sorted({min(max(c, kmax), vocab) for c in CANDIDATES} | {vocab})
    candidates = None
    waiting: dict[int, list[int]] = {0: todo} if todo else {}  # rows by the candidate count they look among
    for stage, n in enumerate(sizes):
        todo = waiting.pop(stage, [])
        if not todo:
            continue
        sel = torch.tensor(todo, device=dev)
        part = probs if len(todo) == rows else probs.index_select(0, sel)
        ranked, ids = torch.topk(part, n, dim=-1) if n < vocab else part.sort(-1, descending=True)
        has_k = torch.tensor([ks[i] < vocab for i in todo], device=dev)[:, None]
        k = torch.tensor([min(ks[i], n) for i in todo], device=dev)[:, None]
        cut = torch.where(has_k, ranked.gather(1, k - 1), torch.zeros_like(ranked[:, :1]))
        found = torch.ones(len(todo), dtype=torch.bool, device=dev)
        if any(params[i].top_p < 1.0 for i in todo):
            has_p = torch.tensor([params[i].top_p < 1.0 for i in todo], device=dev)[:, None]
            top_p = torch.tensor([params[i].top_p for i in todo], dtype=probs.dtype, device=dev)[:, None]
            mass = ranked.cumsum(-1)
            total = torch.where(has_k, mass.gather(1, k - 1), torch.ones_like(cut))
            within = torch.arange(n, device=dev)[None, :] < k
            keep = (((mass - ranked) < top_p * total) & within).sum(-1, keepdim=True)
            cut = torch.where(has_p, ranked.gather(1, keep - 1), cut)
            # without top-k, a cut at the last candidate may lie further on: more candidates next
            found = (~has_p | has_k | (keep < n)).flatten() | (n == vocab)
            if not bool(found.all()):
                # the next count that can hold the cut: m more tokens add at most m x the last one's
                # probability (a bound only: a row that skips ahead sorts more, never wrongly)
                reach = [(mass[:, -1] + (m - n) * ranked[:, -1] >= top_p.flatten()).tolist() for m in sizes]
                for j in (~found).nonzero().flatten().tolist():
                    nxt = next(t for t in range(stage + 1, len(sizes)) if reach[t][j] or t == len(sizes) - 1)
                    waiting.setdefault(nxt, []).append(todo[j])
        min_p = torch.tensor([params[i].min_p for i in todo], dtype=probs.dtype, device=dev)[:, None]
        cut = torch.maximum(cut, min_p * ranked[:, :1])
        got = found.nonzero().flatten()
        cuts[sel[got]] = cut[got]
        if stage == 0 and n < vocab:  # (a tie at the last candidate may continue past it: not narrow)
            narrow[sel[found & (cut.flatten() > ranked[:, -1])]] = True
            candidates = (sel, ranked, ids)
    return cuts, narrow, candidates


# The columns of `sample_on_device`'s per-row settings.
SETTINGS = ("temperature", "top_k", "top_p", "min_p")


def row_settings(sp: SamplingParams) -> tuple[float, float, float, float]:
    """One row of `sample_on_device`'s settings (temperature 0: greedy)."""
    return (0.0 if sp.greedy else sp.temperature, float(sp.top_k), sp.top_p, sp.min_p)


def sample_on_device(logits: torch.Tensor, settings: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A token per row of `logits` [R, V] without reading anything back to the host, so a queued step
    samples on the device (async scheduling). `settings` [R, 4] float32 (`row_settings`), `u` [R]: each
    row's uniform draw. Greedy rows (temperature 0) take the argmax; the others the cuts and draw of
    `sample_batch` for the same u, computed over whole sorted rows (sample_batch looks among the most
    likely tokens first, deciding on the host how far to look; a sort is cheap on a GPU). A test holds
    the two equal."""
    vocab = logits.shape[1]
    dev = logits.device
    temp, top_k, top_p, min_p = (c[:, None] for c in settings.to(logits.dtype).unbind(1))
    greedy = temp == 0
    probs = torch.softmax(logits / torch.where(greedy, torch.ones_like(temp), temp), dim=-1)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab)).long()
    ranked = probs.sort(-1, descending=True)[0]
    has_k = k < vocab
    cut = torch.where(has_k, ranked.gather(1, k - 1), torch.zeros_like(temp))
    mass = ranked.cumsum(-1)
    total = torch.where(has_k, mass.gather(1, k - 1), torch.ones_like(temp))
    within = torch.arange(vocab, device=dev)[None, :] < k
    keep = (((mass - ranked) < top_p * total) & within).sum(-1, keepdim=True)
    del mass, within  # (a few [R, V] temporaries at a time)
    cut = torch.where(top_p < 1.0, ranked.gather(1, keep - 1), cut)
    cut = torch.maximum(cut, min_p * ranked[:, :1])
    del ranked
    cdf = probs.masked_fill_(probs < cut, 0.0).cumsum(-1)
    total = cdf[:, -1:].contiguous()
    hit = torch.searchsorted(cdf, u.to(cdf.dtype)[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total)  # the last kept token: where the sum reaches the total
    drawn = torch.minimum(hit, last)  # (u x total rounded up past it: the last kept token)
    return torch.where(greedy, logits.argmax(-1, keepdim=True), drawn).flatten()


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
    if len(plain_greedy) == len(seqs):
        greedy_tokens = dict(enumerate(logits.argmax(-1).tolist()))
    elif plain_greedy:
        idx = torch.tensor(plain_greedy, dtype=torch.long, device=logits.device)
        greedy_tokens = dict(zip(plain_greedy, logits.index_select(0, idx).argmax(-1).tolist(), strict=True))
    if raw_lp is None and len(greedy_tokens) == len(seqs):  # the common case: nothing else to do
        return [(greedy_tokens[i], None) for i in range(len(seqs))]
    tokens: dict[int, int] = dict(greedy_tokens)
    drawn: list[int] = []  # rows sampled at a temperature: filtered and drawn together
    penalized: dict[int, torch.Tensor] = {}  # (their rows after penalties)
    for i, seq in enumerate(seqs):
        if i in tokens:
            continue
        sp = seq.sampling
        row = logits[i]
        if sp.penalized:
            banned = ([t for t in (*eos_token_ids, *sp.stop_token_ids) if t < row.shape[-1]]
                      if seq.num_generated < sp.min_tokens else None)
            row = penalized[i] = apply_penalties(row, sp, seq.prompt_token_ids, seq.generated_token_ids, banned)
        if sp.greedy:
            tokens[i] = int(row.argmax())
        else:
            drawn.append(i)
    if drawn:
        params = [seqs[i].sampling for i in drawn]
        gens = [seeded_generator(sp.seed, seqs[i].num_generated, logits.device) if sp.seed is not None else None
                for i, sp in zip(drawn, params, strict=True)]
        if penalized:
            rows = torch.stack([penalized.get(i, logits[i]) for i in drawn])
        else:  # (no copy of a [batch, vocab] tensor when every row is drawn as it is)
            rows = logits if len(drawn) == len(seqs) else logits.index_select(0, torch.tensor(drawn, device=logits.device))
        tokens.update(zip(drawn, sample_rows(rows, params, gens), strict=True))
    for i, seq in enumerate(seqs):
        token = tokens[i]
        info = (top_logprobs(raw_lp[i], token, seq.sampling.logprobs) if raw_lp is not None and want_lp[i]
                else None)
        out.append((token, info))
    return out


def speculative_targets(rows: torch.Tensor, seq: Sequence, draft: list[int]) -> list[int]:
    """The tokens the sampler draws at a verification step's rows (`rows`: [len(draft) + 1, vocab]):
    row j is the sequence's (num_generated + j)-th token, drawn as `sample` would draw it. Stops
    at the first row that disagrees with the draft (nothing after it is emitted)."""
    sp = seq.sampling
    if sp.greedy:
        return rows.argmax(-1).tolist()
    gens = [seeded_generator(sp.seed, seq.num_generated + j, rows.device) if sp.seed is not None else None
            for j in range(rows.shape[0])]
    out: list[int] = []
    for j, token in enumerate(sample_rows(rows, [sp] * rows.shape[0], gens)):
        out.append(token)
        if j < len(draft) and token != draft[j]:
            break
    return out
