"""Turns a scheduled batch into tensors, runs the model once, and samples."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.batch.constrained import GrammarEngine
from engine.batch.graph_runner import DecodeGraphs
from engine.batch.sampler import row_settings, sample, sample_on_device, seeded_generator, speculative_targets
from engine.batch.scheduler import ScheduledSeq
from engine.batch.sequence import PENDING, Sequence, TokenLogprob
from engine.batch.step_times import StepTimes
from engine.model.attention import AttentionMetadata, DecodeBatch, PrefillSegment, kernels_enabled
from engine.model.decoder import DecoderModel, LayerHook
from engine.model.kv_cache import KVCache
from engine.model.lora import LoRARows


def kv_row(block_table: list[int], pos: int, block_size: int, planes: int = 2) -> int:
    """Row of position `pos`'s K in the layer cache viewed as [blocks * planes * block_size, kv_heads, dim]
    (its V is `block_size` rows later; a latent cache has one plane)."""
    return block_table[pos // block_size] * planes * block_size + pos % block_size


def _length_groups(num_blocks: list[int]) -> list[range]:
    """Split decodes (sorted by context) into groups padded to their own longest context.

    One padded gather for the whole batch copies batch x longest-context pages per layer:
    a single 1.5k-token sequence among short ones made every step 3x slower (measured).
    A group closes when a context exceeds twice (and 8 blocks more than) its shortest.
    """
    groups: list[range] = []
    start = 0
    for i, nb in enumerate(num_blocks):
        if nb > max(2 * num_blocks[start], num_blocks[start] + 8):
            groups.append(range(start, i))
            start = i
    if num_blocks:
        groups.append(range(start, len(num_blocks)))
    return groups


def long_tensor(values: list, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=torch.long, device=device)` (the reference; a test holds them equal)
    through numpy: torch reads a Python list element by element (a batch-64 decode step's block table of
    1,280 entries took 165 us that way, 28 us through numpy)."""
    t = torch.from_numpy(np.array(values, dtype=np.int64))
    return t if device.type == "cpu" else t.to(device)


@dataclass(eq=False)
class Launched:
    """A decode step queued on the device whose sampled tokens the host has not read yet (async
    scheduling: `ModelRunner.launch`)."""

    batch: list[ScheduledSeq]  # in the order of `host`
    host: torch.Tensor  # each entry's sampled token, copied to host memory (pinned on CUDA)
    ready: Any  # torch.cuda.Event recorded after that copy (None on CPU: made already)
    rows: dict[Sequence, int]  # each entry's row in `host` (and in `DecodeGraphs.tokens` until the next step)
    # Sequences stopped while it was queued: their blocks are freed once it is read (it still writes their K/V).
    free_after: list[Sequence] = field(default_factory=list)

    def read(self) -> list[int]:
        """The tokens, waiting for the device to have made them."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host[: len(self.batch)].tolist()


class ModelRunner:
    def __init__(self, model: DecoderModel, kv: KVCache, device: torch.device, grammar: GrammarEngine | None = None,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.model = model
        self.grammar = grammar
        self.eos_token_ids = eos_token_ids  # impossible before a request's min_tokens
        self.kv = kv
        self.device = device
        self.block_size = kv.layout.block_size
        self.planes = kv.layout.planes
        self.graphs: DecodeGraphs | None = None  # set by the engine when decode steps replay from buckets
        self.times: StepTimes | None = None  # per-phase host time (a benchmark's)
        # Tensor parallel: sends each step's inputs to the other ranks before this one runs it
        # (engine/ranks.py); they run the same forward and logits on their shards.
        self.broadcast: Callable[[tuple], None] | None = None
        # Pipeline parallel: runs the step's micro-batches through the stages, returns their logits.
        self.pipeline: Callable[[list[tuple], LayerHook | None], list[torch.Tensor]] | None = None
        self.micro_batches = 1
        self._lap_at = 0.0
        # Two pinned buffers (and their copy's event) the launched steps' tokens alternate in.
        self._token_host: list[tuple[torch.Tensor, Any]] = []

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the batch: prompt chunks first (one attention segment each), then decodes."""
        if getattr(self.model, "lora", None) is None and all(s.num_tokens == 1 and s.samples and not s.draft for s in batch):
            return self.prepare_decodes(batch)
        return self.prepare_any(batch)

    def prepare_decodes(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                                   list[int]]:
        """`prepare_any` for the steady state, a batch of plain decodes (no prompt chunk, no draft, no
        adapter): one pass over the sequences, no per-token generators (a test holds the two equal)."""
        bs, planes, dev = self.block_size, self.planes, self.device
        batch.sort(key=lambda s: s.seq.num_computed_tokens)
        ids: list[int] = []
        pos: list[int] = []
        k_rows: list[int] = []
        nbs: list[int] = []
        for s in batch:
            seq = s.seq
            p = seq.num_computed_tokens
            ids += seq.tokens(p, p + 1)
            pos.append(p)
            k_rows.append(seq.block_table[p // bs] * planes * bs + p % bs)
            nbs.append(p // bs + 1)  # blocks covering the context, the new token's included
        groups: list[DecodeBatch] = []
        for group in _length_groups(nbs):
            members = batch[group.start : group.stop]
            nb = nbs[group.stop - 1]  # (sorted by context)
            tables = [s.seq.block_table[:nb] for s in members]
            for t in tables:
                if len(t) < nb:
                    t += [0] * (nb - len(t))
            ctx = long_tensor(pos[group.start : group.stop], dev) + 1
            mask = (torch.arange(nb * bs, device=dev)[None, :] < ctx[:, None]).view(len(members), 1, 1, -1)
            groups.append(DecodeBatch(group.start, long_tensor(tables, dev), mask, ctx))
        k = long_tensor(k_rows, dev)
        return long_tensor(ids, dev), long_tensor(pos, dev), AttentionMetadata(bs, k, k + bs, [], groups), \
            list(range(len(batch)))

    def prepare_any(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                              list[int]]:
        """Any batch: prompt chunks first (one attention segment each), then decodes."""
        bs = self.block_size
        prefills = [s for s in batch if not (s.num_tokens == 1 and s.samples)]
        decodes = sorted((s for s in batch if s.num_tokens == 1 and s.samples), key=lambda s: s.seq.num_computed_tokens)
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
            ids.extend(seq.tokens(start, end) if not s.draft else [*seq.tokens(start, start + 1), *s.draft])
            pos.extend(range(start, end))
            table = seq.block_table
            k_rows.extend(kv_row(table, p, bs, self.planes) for p in range(start, end))
            if i < len(prefills):
                nb = -(-end // bs)
                segments.append(PrefillSegment(row0, s.num_tokens, end, torch.tensor(table[:nb], device=dev)))
            if s.draft:  # a verification: every row's next token
                sample_rows.extend(range(row0, len(ids)))
            elif s.samples:
                sample_rows.append(len(ids) - 1)
        groups: list[DecodeBatch] = []
        row = len(ids) - len(decodes)
        for group in _length_groups([-(-(s.seq.num_computed_tokens + 1) // bs) for s in decodes]):
            members = decodes[group.start : group.stop]
            nb = max(-(-(s.seq.num_computed_tokens + 1) // bs) for s in members)
            tables = [s.seq.block_table[:nb] + [0] * (nb - min(nb, len(s.seq.block_table))) for s in members]
            ctx = torch.tensor([s.seq.num_computed_tokens + 1 for s in members], device=dev)
            mask = (torch.arange(nb * bs, device=dev)[None, :] < ctx[:, None]).view(len(members), 1, 1, -1)
            groups.append(DecodeBatch(row + group.start, long_tensor(tables, dev), mask, ctx))
        k = long_tensor(k_rows, dev)
        meta = AttentionMetadata(bs, k, k + bs, segments, groups)
        if segments and kernels_enabled(dev):
            max_nb = max(len(seg.blocks) for seg in segments)
            meta.prefill_tables = torch.stack([torch.nn.functional.pad(seg.blocks, (0, max_nb - len(seg.blocks)))
                                               for seg in segments])
            meta.prefill_info = torch.tensor([(seg.start, seg.length, seg.context_len) for seg in segments], device=dev)
            meta.max_prefill_len = max(seg.length for seg in segments)
        order = prefills + decodes
        # LoRA adapters: each row's slot (a drafter's own model, e.g. an EAGLE-3 head, carries none)
        if getattr(self.model, "lora", None) is not None and any(s.seq.lora_slot >= 0 for s in order):
            row_slots: list[int] = []
            for s in order:
                row_slots += [s.seq.lora_slot] * s.num_tokens
            meta.lora = LoRARows.build(row_slots, dev)
        batch[:] = order  # callers read results in this order
        return (
            long_tensor(ids, dev),
            long_tensor(pos, dev),
            meta,
            sample_rows,
        )

    def graphable(self, batch: list[ScheduledSeq]) -> bool:
        """Plain decodes only (no prompt chunk, no drafts), few enough for a bucket."""
        return (self.graphs is not None and not self.model.aux_layers and self.graphs.bucket(len(batch)) is not None
                and all(s.num_tokens == 1 and s.samples and not s.draft for s in batch))

    def _graph_inputs(self, batch: list[ScheduledSeq], carried_rows: dict[Sequence, int]) -> tuple[
            list[int], list[int], list[int], list[list[int]], list[int], list[int]]:
        """A decode batch's graph inputs, sorted as `prepare` sorts decodes: (ids, positions, k_rows, block
        tables, context lengths, carried) — `carried`: each row's index in the previous queued step's
        tokens (`carried_rows`, async scheduling; its entry in ids is then a placeholder 0), or -1."""
        batch.sort(key=lambda s: s.seq.num_computed_tokens)
        bs = self.block_size
        ids, pos, k_rows, tables, ctx, carried = [], [], [], [], [], []
        for s in batch:
            seq, p = s.seq, s.seq.num_computed_tokens
            j = carried_rows.get(seq, -1)
            carried.append(j)
            if j >= 0:
                assert seq.output_token_ids[-1] == PENDING, f"{seq.request_id}: no token pending"
                ids.append(0)
            else:
                ids.extend(seq.tokens(p, p + 1))
            pos.append(p)
            k_rows.append(kv_row(seq.block_table, p, bs, self.planes))
            tables.append(seq.block_table)
            ctx.append(p + 1)
        return ids, pos, k_rows, tables, ctx, carried

    def _run_graph(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        assert self.graphs is not None
        ids, pos, k_rows, tables, ctx, _ = self._graph_inputs(batch, {})
        return self.graphs.run(ids, pos, k_rows, tables, ctx)

    @torch.inference_mode()
    def launch(self, batch: list[ScheduledSeq], prev: Launched | None) -> Launched:
        """Async scheduling: queue a step of plain decodes (`graphable`; greedy or sampled, no penalties,
        logprobs or grammar) and their sampling on the device, and return without waiting for them. An
        entry whose last token is still `prev`'s unread sample (`PENDING` on the host) takes it on the
        device (from `DecodeGraphs.tokens`, inside the graph). The same rows, tokens and order as `run`: a
        plain argmax when every row is greedy, else `sample_on_device` with the uniform draws `sample` would
        make (a test holds the two equal)."""
        assert self.graphs is not None
        if self.times is not None:
            self._lap_at = time.perf_counter()
        ids, pos, k_rows, tables, ctx, carried = self._graph_inputs(batch, prev.rows if prev is not None else {})
        graphs = self.graphs
        seqs = [s.seq for s in batch]
        sampled = not all(seq.sampling.greedy for seq in seqs)
        hidden = graphs.run(ids, pos, k_rows, tables, ctx, carried,
                            [row_settings(seq.sampling) for seq in seqs] if sampled else None)
        n = len(batch)
        tokens = graphs.tokens[:n]  # (the next step's graph reads them there)
        logits = self.model.logits(hidden)
        if not sampled:
            torch.argmax(logits, dim=-1, out=tokens)
        else:
            tokens.copy_(sample_on_device(logits.float(), graphs.sampled_settings(n), self._draws(seqs)))
        if self.device.type == "cpu":
            host, ready = tokens.clone(), None  # (the next launch overwrites `tokens` before this one is read)
        else:
            if not self._token_host:
                size = graphs.buckets[-1]
                self._token_host = [(torch.empty(size, dtype=torch.long, pin_memory=True), torch.cuda.Event())
                                    for _ in range(2)]
            # (the other buffer's step was read before this one was launched)
            self._token_host.reverse()
            host, ready = self._token_host[0]
            host[:n].copy_(tokens, non_blocking=True)
            ready.record()
        self._lap("forward")
        return Launched(list(batch), host, ready, {s.seq: i for i, s in enumerate(batch)})

    def _draws(self, seqs: list[Sequence]) -> torch.Tensor:
        """Each row's uniform number: a seeded row's from its own (seed, index) generator, as `sample` draws
        it (a pending token counts: it stands for one already drawn); the others from torch's generator
        (one draw for every row, where `sample_batch` draws for the sampled rows only: unseeded rows are
        not reproducible either way) — all on the device."""
        dev = self.device
        rows = [(i, seq.sampling) for i, seq in enumerate(seqs) if not seq.sampling.greedy]
        u = torch.rand(len(seqs), device=dev) if any(sp.seed is None for _, sp in rows) else \
            torch.zeros(len(seqs), device=dev)
        for i, sp in rows:
            if sp.seed is not None:
                u[i] = torch.rand((), generator=seeded_generator(sp.seed, seqs[i].num_generated, dev), device=dev)
        return u

    def _lap(self, phase: str) -> None:
        """With `times` on: the time since the last lap goes to `phase`."""
        if self.times is not None:
            now = time.perf_counter()
            setattr(self.times, phase, getattr(self.times, phase) + now - self._lap_at)
            self._lap_at = now

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], layer_hook: LayerHook | None = None) -> list[tuple[int, TokenLogprob | None]]:
        """Runs one step. Reorders `batch` in place; returns one sample per entry with `samples` and
        no draft (a speculative entry gets its greedy tokens in `targets`)."""
        if self.times is not None:
            self._lap_at = time.perf_counter()
        out = self._run(batch, layer_hook)
        self._lap("sample")
        return out

    def _run(self, batch: list[ScheduledSeq], layer_hook: LayerHook | None) -> list[tuple[int, TokenLogprob | None]]:
        if layer_hook is None and self.graphable(batch):
            hidden = self._run_graph(batch)
            logits = self.model.logits(hidden)
            self._lap("forward")
            return sample(logits, [s.seq for s in batch], self.grammar, self.eos_token_ids)
        if self.pipeline is not None:
            return self._run_pipelined(batch, layer_hook)
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        if self.broadcast is not None:
            self.broadcast((input_ids, positions, meta, sample_rows))
        self._lap("prepare")
        hidden = self.model(input_ids, positions, self.kv, meta, layer_hook)
        aux = self.model.aux_out if self.model.aux_layers else None
        if aux is not None:  # EAGLE-3: each entry's rows of the captured hidden states, in batch order
            row = 0
            for s in batch:
                s.features = aux[row : row + s.num_tokens]
                row += s.num_tokens
        if not sample_rows:
            self._lap("forward")
            return []
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.logits(hidden.index_select(0, rows))
        self._lap("forward")
        return self._sample(batch, logits)

    def _run_pipelined(self, batch: list[ScheduledSeq],
                       layer_hook: LayerHook | None = None) -> list[tuple[int, TokenLogprob | None]]:
        """Pipeline parallel: the batch in micro-batches, each prepared on its own; the stages (rank 0
        the first) work on them one after another, so every stage has one to work on while the next
        takes the previous (`engine/ranks.py`). Logits come back from the last stage in batch order.
        `layer_hook` sees each of this stage's layers once every micro-batch has been through it."""
        assert self.pipeline is not None
        count = min(self.micro_batches, len(batch))
        size = -(-len(batch) // count)
        micro = [batch[i : i + size] for i in range(0, len(batch), size)]
        plans = [self.prepare(mb) for mb in micro]  # (each reorders its micro-batch)
        batch[:] = [s for mb in micro for s in mb]
        self._lap("prepare")
        parts = self.pipeline(plans, layer_hook)
        self._lap("forward")
        if not parts:
            return []
        return self._sample(batch, torch.cat(parts))

    def _sample(self, batch: list[ScheduledSeq], logits: torch.Tensor) -> list[tuple[int, TokenLogprob | None]]:
        """Tokens from the logits of the batch's sampled rows (in batch order)."""
        plain: list[int] = []  # logits rows of ordinary samples
        row = 0
        for s in batch:
            if s.draft:  # speculative rows: the token drawn after each fed token
                n = len(s.draft) + 1
                s.targets = speculative_targets(logits[row:row + n], s.seq, s.draft)
                row += n
            elif s.samples:
                plain.append(row)
                row += 1
        if not plain:
            return []
        if len(plain) != row:
            logits = logits.index_select(0, torch.tensor(plain, dtype=torch.long, device=self.device))
        return sample(logits, [s.seq for s in batch if s.samples and not s.draft], self.grammar, self.eos_token_ids)
