"""The oracle for the tiny model directory: Hugging Face transformers loading it from disk.

Its forward pass is run in full each step (no KV cache), the plainest use of their code, so
what the paged, batched, chunked, disaggregated engine produces is held against an
implementation that shares none of ours.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch


@cache
def _load(model_dir: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class Reference:
    def __init__(self, model_dir: Path):
        self.model = _load(str(model_dir))

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([ids])).logits[0, -1].float()

    @cache  # noqa: B019 - the instance lives as long as the test module's fixture
    def _greedy(self, ids: tuple[int, ...], n: int) -> tuple[int, ...]:
        out: list[int] = []
        seq = list(ids)
        for _ in range(n):
            tok = int(self.logits(seq).argmax())
            out.append(tok)
            seq.append(tok)
        return tuple(out)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        return list(self._greedy(tuple(ids), n))
