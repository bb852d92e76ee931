"""The engine's side of disaggregation: K/V that another process writes into this engine's blocks, and
blocks that leave it for other workers. One interface; `async_engine`, `worker/kv/`, `decode_worker/`
and `prefill_worker/` reach the engine's blocks for disaggregation through it alone.

Decode side (a prefill worker writes the prompt's K/V): `reserve` takes the destination blocks (reusing
this engine's own cached prefix, which needs no transfer), `take_landing` offers spare blocks where a
prefill worker split over more ranks writes whole pages, `activate` starts decoding once every layer
landed (moving landed pages into place first), `start_local_prefill` computes it here after all.
`hold` stops a request but keeps its blocks (a failed or cancelled transfer may still write into them);
`release` frees them once nothing can land.

The cluster-wide KV tier (Mooncake Store): `fill_plan` / `mark_filled` / `resume_after_fill` fill a
prompt's blocks from the store before it is computed; full blocks computed here are pinned and queued
(`publish`, from the engine's commit), handed out (`take_published`) and unpinned once copied
(`unpin_published`).
"""

from __future__ import annotations

from typing import Any, Protocol

from common.errors import RequestError
from common.sampling_params import SamplingParams
from engine.batch.block_manager import BlockManager
from engine.batch.scheduler import Scheduler
from engine.batch.sequence import Mode, Sequence, Status, TokenLogprob
from engine.engine_config import EngineConfig
from engine.model.kv_cache import KVCache
from engine.outputs import RequestOutput


class Engine(Protocol):
    """What the handoff reaches of the engine (`LLMEngine`)."""

    config: EngineConfig
    seqs: dict[str, Sequence]
    blocks: BlockManager
    scheduler: Scheduler
    kv: KVCache
    ranks: Any  # engine.ranks.RankGroup | None
    drafter: Any  # engine.spec.speculative.Drafter | None

    def new_sequence(self, request_id: str, prompt: list[int], sampling: SamplingParams, tenant: str, mode: Mode,
                     weight: float = 1.0, adapter: str = "", priority: int = 0) -> Sequence: ...

    def free_blocks(self, seq: Sequence) -> None: ...

    def first_output(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput: ...


class Handoff:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.block_size = engine.config.block_size
        # Set by a worker with a cluster-wide KV tier: full blocks this engine computed are pinned and handed
        # out for publishing, released by `unpin_published` once copied out.
        self.kv_tier = False
        self.to_publish: list[tuple[list[bytes], list[int]]] = []
        self.store_hit_tokens = 0  # prompt tokens filled from the tier so far

    # -- decode side: the prompt's K/V written by another process --------------------------

    def reserve(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, tenant: str = "",
                mode: Mode = Mode.FULL, weight: float = 1.0, adapter: str = "", priority: int = 0
                ) -> Sequence | None:
        """Take blocks for a prompt whose K/V another process will write (a prefill worker, or the
        cluster-wide KV store). None = no blocks now. Reuses this engine's own cached prefix:
        `seq.num_cached_tokens` tokens need no transfer."""
        e = self.engine
        seq = e.new_sequence(request_id, prompt_token_ids, sampling, tenant, mode, weight, adapter, priority)
        if not e.blocks.allocate(seq, seq.num_tokens):
            return None
        seq.status = Status.RESERVED
        e.seqs[request_id] = seq
        return seq

    def take_landing(self, request_id: str, first_block: int) -> list[int] | None:
        """Spare blocks, one per block of a reserved prompt's table from `first_block` on, for a prefill
        worker to land whole pages in (`KVCache.land`); None when not that many are free."""
        seq = self.engine.seqs[request_id]
        return list(seq.landing) if self.engine.blocks.take_landing(seq, first_block) else None

    def activate(self, request_id: str, first_token: int, logprob: TokenLogprob | None = None,
                 cached_tokens: int = 0, landed: list[tuple[int, int, int]] | None = None) -> RequestOutput:
        """The prompt's K/V have landed: start decoding from `first_token`. `cached_tokens`: prompt tokens
        nobody had to compute for this request (the prefill worker's cache hits too). `landed`: the (rank,
        first head, heads) sections the prefill worker wrote into the landing blocks, moved into place here
        on every rank before the request's first step."""
        e = self.engine
        seq = e.seqs[request_id]
        assert seq.status == Status.RESERVED, f"{request_id} is {seq.status}, not reserved"
        if landed:
            assert seq.landing, f"{request_id}: K/V landed in blocks that were never offered"
            dst = seq.block_table[seq.landing_from:]
            e.kv.land(seq.landing, dst, [(h, n) for r, h, n in landed if r == 0])
            if e.ranks is not None:
                e.ranks.land((seq.landing, dst, landed))
        e.blocks.free_landing(seq)
        e.blocks.mark_computed(seq, seq.num_prompt_tokens - seq.num_computed_tokens)
        seq.num_cached_tokens = max(seq.num_cached_tokens, min(cached_tokens, seq.num_prompt_tokens))
        seq.num_published_blocks = seq.num_prompt_tokens // self.block_size  # the prefill side publishes those
        e.scheduler.add_running(seq)
        return e.first_output(seq, first_token, logprob)

    def start_local_prefill(self, request_id: str) -> None:
        """A reserved request will be prefilled here after all (a short uncached suffix)."""
        seq = self.engine.seqs[request_id]
        assert seq.status == Status.RESERVED, f"{request_id} is {seq.status}, not reserved"
        self.engine.scheduler.add_running(seq)

    def hold(self, request_id: str) -> Sequence | None:
        """Stop a request but keep its blocks (another process may still be writing into them)."""
        e = self.engine
        seq = e.seqs.pop(request_id, None)
        if seq is not None:
            e.scheduler.remove(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
            if e.drafter is not None:
                e.drafter.release(seq)  # the draft cache is this process's alone
        return seq

    def release(self, seq: Sequence) -> None:
        """Free the blocks of a request stopped with `hold`."""
        self.engine.free_blocks(seq)

    # -- the cluster-wide KV tier ------------------------------------------------------------

    def fill_plan(self, request_id: str) -> tuple[list[bytes], list[int]]:
        """Block hashes and block ids of a reserved prompt's reusable blocks past its local cache hit: what
        the KV store may fill (at least one token is always left to compute)."""
        seq = self.engine.seqs[request_id]
        bs = self.block_size
        first, last = seq.num_computed_tokens // bs, (seq.num_prompt_tokens - 1) // bs
        return seq.block_hashes[first:last], seq.block_table[first:last]

    def mark_filled(self, request_id: str, num_blocks: int) -> int:
        """The next `num_blocks` of a reserved prompt were read from the KV store: they count as computed
        and cached. Returns the prompt tokens now cached."""
        seq = self.engine.seqs[request_id]
        n = num_blocks * self.block_size
        self.engine.blocks.mark_computed(seq, n)
        seq.num_cached_tokens += n
        seq.num_published_blocks = seq.num_computed_tokens // self.block_size
        self.store_hit_tokens += n
        return seq.num_cached_tokens

    def resume_after_fill(self, request_id: str) -> None:
        """The KV tier filled what it could: compute the rest (unless the request is gone)."""
        seq = self.engine.seqs.get(request_id)
        if seq is not None and seq.status == Status.RESERVED:
            self.engine.scheduler.add_running(seq)

    def take_fetches(self) -> list[str]:
        """Requests the scheduler admitted for filling from the KV tier since the last call."""
        sched = self.engine.scheduler
        out = [s.request_id for s in sched.admitted_for_fetch]
        sched.admitted_for_fetch = []
        return out

    def publish(self, seq: Sequence, upto_tokens: int) -> None:
        """Pin the full blocks of `seq` computed here and not yet handed out, for the KV tier."""
        full = min(upto_tokens, seq.num_computed_tokens) // self.block_size
        lo = seq.num_published_blocks
        if not self.kv_tier or full <= lo:
            return
        blocks_mgr = self.engine.blocks
        blocks_mgr.register_computed(seq)
        if len(seq.block_hashes) < full:
            return  # prefix caching is off: no content hashes to publish under
        blocks = seq.block_table[lo:full]
        blocks_mgr.pin(blocks)
        self.to_publish.append((seq.block_hashes[lo:full], blocks))
        seq.num_published_blocks = full

    def take_published(self) -> list[tuple[list[bytes], list[int]]]:
        out, self.to_publish = self.to_publish, []
        return out

    def unpin_published(self, blocks: list[int]) -> None:
        self.engine.blocks.unpin(blocks)


def check_request(prompt: list[int], sampling: SamplingParams, weight: float, vocab: int, max_model_len: int,
                  blocks: BlockManager) -> None:
    """A request any engine could run, or a RequestError saying why not: token ids in the vocabulary, room
    for one generated token in the context and for prompt + max_tokens in the KV cache, a failover's resumed
    tokens inside the prompt (the same checks wherever a request arrives: queued here, or reserved for KV
    another process writes)."""
    if not prompt:
        raise RequestError("prompt is empty")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise RequestError(f"prompt token ids must be in [0, {vocab})")
    sampling.validate()
    if not 0 < weight < float("inf"):
        raise RequestError(f"tenant weight must be a positive number, got {weight}")
    if len(prompt) >= max_model_len:
        raise RequestError(f"prompt is {len(prompt)} tokens; this model's context is {max_model_len} (prompt plus at "
                           "least one generated token)")
    total = min(len(prompt) + sampling.max_tokens, max_model_len)
    if blocks.blocks_for(total) > blocks.num_blocks:
        raise RequestError(f"prompt + max_tokens = {total} tokens needs {blocks.blocks_for(total)} KV blocks; this "
                           f"worker has {blocks.num_blocks} in all")
    if sampling.resumed_tokens >= len(prompt):
        raise RequestError(f"resumed_tokens ({sampling.resumed_tokens}) must leave at least one prompt token "
                           f"(prompt: {len(prompt)})")

