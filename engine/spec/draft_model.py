"""Draft-model speculation (`--speculative draft --draft-model DIR`): a smaller model with the same
tokenizer proposes k tokens greedily; the target verifies them as it verifies prompt-lookup
drafts (`speculative.py`), so output stays exactly what the target alone would produce.

The draft model has its own paged KV cache in this process, sized to hold as many tokens as the
target's. Per sequence it keeps the K/V of the tokens it has seen; a proposal first feeds the
tokens it has not (the whole prompt the first time — on a disaggregated decode worker too,
where the target's prompt K/V arrived over the wire), then decodes k - 1 more. K/V of drafts the
target accepted stay valid and are not recomputed; rejected ones are overwritten next time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.batch.model_runner import ModelRunner
from engine.batch.sequence import Sequence
from engine.loading.weights import load_model
from engine.model.attention import AttentionMetadata
from engine.model.kv_cache import KVCache, KVLayout
from engine.spec.speculative import PagedDrafter, SpecState

log = logging.getLogger("splitfire.engine")


@dataclass
class DraftSeq:
    """A sequence as the draft model's runner sees it (the fields `ModelRunner.prepare` reads)."""

    all_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # leading tokens whose draft K/V are in the draft cache
    fed_drafts: list[int] = field(default_factory=list)  # drafts fed after them last time (K/V in the cache)
    base_len: int = 0  # the sequence's length when this round of drafting began

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        return self.all_token_ids[start:end]


def same_tokenizer(target_dir: Path, draft_dir: Path) -> str | None:
    """None when both directories' tokenizers map every token to the same id, else what differs."""
    from tokenizers import Tokenizer

    theirs, ours = (Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab(with_added_tokens=True)
                    for d in (target_dir, draft_dir))
    if theirs == ours:
        return None
    differ = sum(1 for t, i in theirs.items() if ours.get(t) != i) + len(set(ours) - set(theirs))
    return f"{differ} of {len(theirs)} tokens differ"


class DraftModelDrafter(PagedDrafter):
    def __init__(self, draft_dir: Path, k: int, max_batch: int, device: torch.device, dtype: torch.dtype,
                 block_size: int, num_blocks: int, max_positions: int, target_vocab: int):
        super().__init__(k, max_batch, num_blocks, block_size)
        self.model = load_model(draft_dir, device, dtype)
        cfg = self.model.cfg
        self.model.build_rope_cache(max_positions, device, dtype)
        planes, heads, dim = cfg.kv_entry
        self.kv = KVCache(KVLayout(cfg.num_layers, num_blocks, block_size, heads, dim, dtype, planes), device)
        self.runner = ModelRunner(self.model, self.kv, device)
        self.vocab = min(target_vocab, cfg.vocab_size)  # never propose an id the target cannot score
        self.device = device
        log.info("event=draft_model_loaded model=%s layers=%d kv_blocks=%d", draft_dir, cfg.num_layers, num_blocks)

    def _forward(self, order: list[DraftSeq], ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, rows: list[int]) -> tuple[list[int], None]:
        hidden = self.model(ids, positions, self.kv, meta)
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model.logits(hidden.index_select(0, index))[:, : self.vocab].argmax(-1).tolist(), None

    def _done(self, d: DraftSeq, drafts: list[int]) -> None:
        # K/V valid for the sequence's tokens, plus the drafts fed after them
        d.num_computed_tokens = d.base_len
        d.fed_drafts = drafts[:-1]

    def _catch_up(self, seq: Sequence, k: int) -> DraftSeq | None:
        """The sequence's draft state, ready to feed what the draft cache lacks (None: no room for it)."""
        st: SpecState = seq.spec
        d: DraftSeq = st.draft_cache if st.draft_cache is not None else DraftSeq()
        st.draft_cache = d
        tokens = seq.all_token_ids
        # Drafts fed last time that are now the sequence's tokens keep their K/V.
        valid = d.num_computed_tokens
        for j, t in enumerate(d.fed_drafts):
            if valid + j < len(tokens) and tokens[valid + j] == t:
                continue
            valid += j
            break
        else:
            valid += len(d.fed_drafts)
        # The last token is always fed: its logits give the first draft.
        d.num_computed_tokens = min(valid, len(tokens) - 1)
        d.fed_drafts = []
        if not self._cover(d, len(tokens) + k - 1):
            return None  # the draft cache is full: no drafts for this sequence this step
        d.all_token_ids = tokens  # a fresh list (Sequence.all_token_ids concatenates): drafts append to it
        d.base_len = len(tokens)
        return d
