"""The drafter an engine's `--speculative` setting names: prompt lookup (ngram), a smaller model of the
same tokenizer (draft) or an EAGLE-3 head reading the target's hidden states (eagle3); None when off."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from common.errors import ModelLoadError
from engine.loading.model_store import resolve_model
from engine.model.decoder import DecoderModel
from engine.spec.eagle3 import Eagle3Drafter
from engine.spec.speculative import Drafter, NgramDrafter


class Settings(Protocol):
    """The engine settings a drafter is made from (`EngineConfig`'s)."""

    speculative: str
    draft_model: str | None
    num_speculative_tokens: int
    speculative_max_batch: int
    block_size: int


def make_drafter(c: Settings, model: DecoderModel, model_dir: Path, vocab_size: int, device: torch.device,
                 dtype: torch.dtype, num_blocks: int, max_model_len: int) -> Drafter | None:
    """`num_blocks`: the target's KV blocks (a draft model's cache holds as many); EAGLE-3 also sets the
    target's `aux_layers` (the layers whose residual stream it reads)."""
    max_positions = max_model_len + c.num_speculative_tokens + 1
    if c.speculative == "ngram":
        return NgramDrafter(c.num_speculative_tokens, c.speculative_max_batch)
    if c.speculative == "eagle3":
        assert c.draft_model is not None
        head_dir = Path(c.draft_model)
        if not head_dir.is_dir():
            raise ModelLoadError(f"--draft-model {c.draft_model}: an EAGLE-3 head is a local directory "
                                 "(config.json + safetensors)")
        eagle = Eagle3Drafter(head_dir, model, c.num_speculative_tokens, c.speculative_max_batch, device, dtype,
                              c.block_size, num_blocks, max_positions)
        model.aux_layers = eagle.aux_layers
        return eagle
    if c.speculative != "draft":
        return None
    from engine.spec.draft_model import DraftModelDrafter, same_tokenizer

    draft_dir = resolve_model(c.draft_model)
    differs = same_tokenizer(model_dir, draft_dir)
    if differs:
        raise ModelLoadError(f"--draft-model {c.draft_model}: its tokenizer is not the target's ({differs}); a draft "
                             "model must share the target's vocabulary")
    return DraftModelDrafter(draft_dir, c.num_speculative_tokens, c.speculative_max_batch, device, dtype, c.block_size,
                             num_blocks, max_positions, vocab_size)
