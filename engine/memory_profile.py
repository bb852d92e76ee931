"""How much GPU memory a step needs besides the weights and the KV cache, measured before the KV
cache is sized.

The KV cache takes what is left, so what steps allocate has to be known first: the largest prompt
chunk (`--max-num-batched-tokens` rows through every layer, then logits for the rows that sample)
and, with decode graphs, the largest decode bucket, whose activations live in the graphs' memory
pool for as long as the graphs do (every bucket is captured into one pool, largest first, so the
pool is about the largest bucket's peak — `graph_runner.DecodeGraphs.capture`). Both are measured
by running those two steps once over a small temporary KV cache and reading the allocator's peak.

The engine profiles on CUDA only; on CPU the KV cache is sized by `--kv-cache-gb`. `profile` runs
on any device (tests run it on CPU, where it measures nothing but proves the dummy steps are
well-formed for every model family).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine.batch.model_runner import ModelRunner
from engine.batch.scheduler import ScheduledSeq
from engine.engine_config import EngineConfig
from engine.model.decoder import DecoderModel
from engine.model.kv_cache import KVCache, KVLayout
from engine.model.model_config import ModelConfig
from engine.spec.draft_model import DraftSeq

log = logging.getLogger("splitfire.engine")


@dataclass
class ActivationPeaks:
    prefill: int = 0  # bytes above the weights while the largest prompt chunk runs
    decode: int = 0  # the same for a decode step of the largest graph bucket


def kv_budget(free: int, fraction: float, peaks: ActivationPeaks, graphs: bool) -> int:
    """Bytes for the KV cache: `fraction` of the free memory, less what the largest prompt chunk
    and (with graphs) the decode graphs' pool need."""
    reserve = peaks.prefill + (peaks.decode if graphs else 0)
    budget = int(free * fraction) - reserve
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache: {fraction:.2f} of {free / 2**30:.2f} GiB free "
                         f"after the weights, less {reserve / 2**30:.2f} GiB for activations "
                         f"(a {peaks.prefill / 2**30:.2f} GiB prompt chunk"
                         + (f", {peaks.decode / 2**30:.2f} GiB of decode graphs" if graphs else "") +
                         "); lower --max-num-batched-tokens or --max-num-seqs, pass --enforce-eager, or use a "
                         "larger GPU")
    return budget


def profile(model: DecoderModel, device: torch.device, dtype: torch.dtype, block_size: int, chunk_tokens: int,
            decode_batch: int) -> ActivationPeaks:
    """Run the largest prompt chunk and the largest decode batch once over a temporary KV cache
    (one sequence of `chunk_tokens`; `decode_batch` sequences of one token each); on CUDA, return
    the peak memory each allocated above what was allocated before."""
    cuda = device.type == "cuda"
    try:
        peaks = _measure(model, device, dtype, block_size, chunk_tokens, decode_batch, cuda)
    finally:  # (the temporary cache is gone with _measure's frame)
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        log.info("event=activation_profile prefill_tokens=%d prefill_mib=%.0f decode_batch=%d decode_mib=%.0f",
                 chunk_tokens, peaks.prefill / 2**20, decode_batch, peaks.decode / 2**20)
    return peaks


def _measure(model: DecoderModel, device: torch.device, dtype: torch.dtype, block_size: int, chunk_tokens: int,
             decode_batch: int, cuda: bool) -> ActivationPeaks:
    cfg = model.cfg
    vocab = cfg.vocab_size
    planes, heads, dim = cfg.kv_entry
    chunk_blocks = -(-chunk_tokens // block_size)
    kv = KVCache(KVLayout(cfg.num_layers, chunk_blocks + decode_batch, block_size, heads, dim, dtype, planes), device)
    runner = ModelRunner(model, kv, device)
    peaks = ActivationPeaks()
    with torch.inference_mode():
        prompt = DraftSeq([(7 * i) % vocab for i in range(chunk_tokens)], list(range(chunk_blocks)))
        peaks.prefill = _peak(lambda: _step(model, runner, kv, [ScheduledSeq(prompt, chunk_tokens)]), cuda)
        seqs = [DraftSeq([(3 * i) % vocab], [chunk_blocks + i]) for i in range(decode_batch)]
        peaks.decode = _peak(lambda: _step(model, runner, kv, [ScheduledSeq(s, 1) for s in seqs]), cuda)
    return peaks


def _step(model: DecoderModel, runner: ModelRunner, kv: KVCache, batch: list[ScheduledSeq]) -> None:
    ids, positions, meta, rows = runner.prepare(batch)  # type: ignore[arg-type]
    hidden = model(ids, positions, kv, meta)
    model.logits(hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=hidden.device)))


def _peak(run, cuda: bool) -> int:
    if not cuda:
        run()
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return max(0, torch.cuda.max_memory_allocated() - before)


def kv_layout(model: DecoderModel, cfg: ModelConfig, c: EngineConfig, device: torch.device, dtype: torch.dtype,
              max_model_len: int, graphs: bool, ranks: Any) -> KVLayout:
    """The engine's KV cache: --kv-cache-gb on CPU; on CUDA, what the free memory holds once the largest prompt
    chunk's and the decode graphs' measured peaks are set aside. `ranks` (an `engine.ranks.RankGroup` or None):
    pipeline stages size blocks for the stage with the most layers and hold their own layers."""
    budget = int(c.kv_cache_gb * 2**30)
    if device.type == "cuda":
        peaks = profile(model, device, dtype, c.block_size, min(c.max_num_batched_tokens, max_model_len),
                        c.max_num_seqs if graphs else 1)
        free, _ = torch.cuda.mem_get_info(device)
        budget = kv_budget(free, c.gpu_memory_fraction, peaks, graphs)
    most = max(len(s) for s in ranks.stages) if ranks is not None and ranks.pp > 1 else None
    layout = KVLayout.for_budget(cfg, budget, c.block_size, c.torch_kv_dtype, model.kv_entry, most)
    return dataclasses.replace(layout, num_layers=len(model.layers))

