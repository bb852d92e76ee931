"""Turns a scheduled batch into tensors, runs the model once, and samples."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, DecodeBatch, PrefillSegment
from engine.kv_cache import KVCache
from engine.model import LayerHook, LlamaModel
from engine.sampler import sample
from engine.scheduler import ScheduledSeq
from engine.sequence import TokenLogprob


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCache, device: torch.device):
        self.model = model
        self.kv = kv
        self.device = device
        self.block_size = kv.layout.block_size

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the batch: prompt chunks first (one attention segment each), then decodes."""
        bs = self.block_size
        prefills = [s for s in batch if not (s.num_tokens == 1 and s.samples)]
        decodes = [s for s in batch if s.num_tokens == 1 and s.samples]
        ids: list[int] = []
        pos: list[int] = []
        k_rows: list[int] = []
        segments: list[PrefillSegment] = []
        sample_rows: list[int] = []
        dev = self.device
        for i, s in enumerate(prefills + decodes):
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_tokens
            row0 = len(ids)
            ids.extend(seq.all_token_ids[start:end])
            pos.extend(range(start, end))
            table = seq.block_table
            k_rows.extend(table[p // bs] * 2 * bs + p % bs for p in range(start, end))
            if i < len(prefills):
                nb = -(-end // bs)
                segments.append(PrefillSegment(row0, s.num_tokens, end, torch.tensor(table[:nb], device=dev)))
            if s.samples:
                sample_rows.append(len(ids) - 1)
        decode = None
        if decodes:
            start = len(ids) - len(decodes)
            max_nb = max(len(s.seq.block_table) for s in decodes)
            tables = [s.seq.block_table + [0] * (max_nb - len(s.seq.block_table)) for s in decodes]
            ctx = torch.tensor([s.seq.num_computed_tokens + 1 for s in decodes], device=dev)
            mask = (torch.arange(max_nb * bs, device=dev)[None, :] < ctx[:, None]).view(len(decodes), 1, 1, -1)
            decode = DecodeBatch(start, torch.tensor(tables, device=dev), mask)
        k = torch.tensor(k_rows, dtype=torch.long, device=dev)
        meta = AttentionMetadata(bs, k, k + bs, segments, decode)
        order = prefills + decodes
        batch[:] = order  # callers read results in this order
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            meta,
            sample_rows,
        )

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], layer_hook: LayerHook | None = None) -> list[tuple[int, TokenLogprob | None]]:
        """Runs one step. Reorders `batch` in place; returns one sample per entry with `samples`."""
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv, meta, layer_hook)
        if not sample_rows:
            return []
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.logits(hidden.index_select(0, rows))
        return sample(logits, [s.seq for s in batch if s.samples])
