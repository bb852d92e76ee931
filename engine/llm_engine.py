"""The engine: requests in, token outputs out, one `step()` at a time.

Single-threaded and synchronous on purpose; `async_engine.py` runs it on its own
thread for the gRPC workers, `splitfire generate` drives it directly.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from common.detokenizer import detokenizer
from common.errors import ModelLoadError, RequestError
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from engine import memory_profile
from engine.batch.block_manager import BlockManager, BlockStats
from engine.batch.constrained import GrammarEngine
from engine.batch.graph_runner import DecodeGraphs
from engine.batch.model_runner import Launched, ModelRunner
from engine.batch.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from engine.batch.sequence import PENDING, Mode, Sequence, Status, TokenLogprob
from engine.batch.step_times import StepTimes
from engine.engine_config import EngineConfig
from engine.loading import weight_cache
from engine.loading.lora_adapters import LoRAAdapter, LoRAError
from engine.loading.model_store import resolve_model
from engine.loading.weights import load_model
from engine.loras import LoRAManager
from engine.model.kv_cache import KVCache, KVLayout
from engine.model.model_config import ModelConfig
from engine.model.parallel import ONE, WHOLE, split_layers
from engine.ranks import RankGroup, RankMain, threads_per_rank
from engine.spec.eagle3 import Eagle3Drafter
from engine.spec.speculative import Drafter, NgramDrafter, verify

log = logging.getLogger("splitfire.engine")


class StepObserver(Protocol):
    """Sees each forward pass layer by layer (the prefill worker's KV transfer plugs in here)."""

    def before_forward(self, batch: list[ScheduledSeq]) -> None: ...

    def after_layer(self, layer: int) -> None: ...

    def after_forward(self) -> dict[str, str]:
        """Waits for work started per layer; returns {request_id: error} for sequences that failed."""
        ...


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int] = field(default_factory=list)  # new since the last output
    text: str = ""  # new text since the last output
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error | prefill
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    def merge(self, later: RequestOutput) -> None:
        """Fold a later output of the same request into this one (a reader that fell behind)."""
        self.token_ids += later.token_ids
        self.text += later.text
        self.logprobs += later.logprobs
        self.finished, self.finish_reason, self.error = later.finished, later.finish_reason, later.error
        self.num_output_tokens = later.num_output_tokens
        self.num_prompt_tokens = later.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = later.num_cached_tokens or self.num_cached_tokens


@dataclass
class EngineStats:
    blocks: BlockStats
    running: int
    waiting: int
    reserved: int
    num_preemptions: int
    prompt_tokens_in_flight: int  # prompt tokens not yet computed, queued or running
    kv_tokens_held: int = 0
    decode_tokens_remaining: int = 0
    store_hit_tokens: int = 0  # prompt tokens filled from the cluster-wide KV tier so far
    spec_drafted: int = 0  # speculative tokens proposed so far
    spec_accepted: int = 0  # of those, accepted by verification


def _rss_mib() -> float:
    """This process's resident memory (Linux; NaN elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class LLMEngine:
    def __init__(self, config: EngineConfig, rank_main: RankMain | None = None, tokenizer: Tokenizer | None = None):
        """`rank_main`: what the model-parallel ranks other than 0 run (`engine/ranks.py`; a prefill or
        decode worker's adds its KV transfer). `tokenizer`: this model's, kept from an earlier engine (a
        worker reloading a model it evicted: reading tokenizer.json and building the detokenizer's byte
        table take longer than mapping the weights)."""
        self.config = config.validate()
        rss_start = _rss_mib()  # (for the start-up log line: what loading the model adds)
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        if config.threads and self.device.type == "cpu":
            torch.set_num_threads(config.threads)
        self.model_dir = resolve_model(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer(self.model_dir)
        # Model parallel: the other ranks start loading their parts while this one loads its own.
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        stages = split_layers(self.model_config, pp) if pp > 1 else None
        self.ranks = RankGroup(config, self.model_dir, tp, pp, self.model_config.hidden_size,
                               self.model_config.vocab_size, stages, rank_main) if tp * pp > 1 else None
        shard = self.ranks.shard if self.ranks is not None else ONE
        stage = self.ranks.stage if self.ranks is not None else WHOLE
        if self.ranks is not None and self.device.type == "cpu":
            torch.set_num_threads(threads_per_rank(config, tp * pp))
        t0 = time.perf_counter()
        rss_before = _rss_mib()
        self.model = load_model(self.model_dir, self.device, self.dtype, config.quantization, shard=shard,
                                stage=stage, compress_weights=config.compress_weights)
        rss_weights = _rss_mib() - rss_before
        self.model.set_int8_activations(config.cpu_activations == "int8")
        weights_s = time.perf_counter() - t0
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.model.build_rope_cache(self.max_model_len + 1, self.device, self.dtype)
        graphs = config.decode_graphs == "on" or (config.decode_graphs == "auto" and self.device.type == "cuda")
        graphs = graphs and config.speculative != "eagle3"  # (its steps need the features a graph does not return)
        graphs = graphs and self.ranks is None  # (a step's inputs go to the other ranks first)
        graphs = graphs and not config.lora  # (a step's adapter rows change what runs)
        t_kv = time.perf_counter()
        self.kv = KVCache(self._kv_layout(graphs), self.device)
        kv_s = time.perf_counter() - t_kv
        # With decode graphs the last block is the padding rows' scratch space, never handed out.
        usable = self.kv.layout.num_blocks - (1 if graphs else 0)
        self.blocks = BlockManager(usable, config.block_size, config.enable_prefix_cache)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.prefill_cap), self.blocks)
        self.eos_token_ids = self.tokenizer.eos_token_ids or frozenset(self.model_config.eos_token_ids)
        self.grammar = GrammarEngine(self.model_dir / "tokenizer.json", self.model_config.vocab_size,
                                     sorted(self.eos_token_ids), config.threads)
        self.runner = ModelRunner(self.model, self.kv, self.device, self.grammar, frozenset(self.eos_token_ids))
        if self.ranks is not None:
            self.ranks.setup(self.kv.layout, self.max_model_len + 1, config.cpu_activations == "int8")
            if pp > 1:
                self.runner.pipeline = self.ranks.pipeline(self.model, self.kv)
                self.runner.micro_batches = pp  # (enough for every stage to have one in flight)
            else:
                self.runner.broadcast = self.ranks.step
        if graphs:
            self.runner.graphs = DecodeGraphs(
                lambda ids, pos, meta: self.model(ids, pos, self.kv, meta), config.max_num_seqs,
                -(-self.max_model_len // config.block_size), config.block_size, usable, self.device,
                self.kv.layout.planes)
            try:
                with torch.inference_mode():
                    self.runner.graphs.capture()
            except RuntimeError as e:  # e.g. a model path with a host sync, which a graph cannot hold
                log.warning("event=decode_graphs_off reason=capture_failed error=%s", str(e).splitlines()[0])
                self.runner.graphs = None
        self.loras: LoRAManager | None = None  # resident LoRA adapters, when enabled (`loras.py`)
        if config.lora:
            if config.lora_dtype == "float16":  # (the setting exists for that loop: refused where it cannot run)
                why = self.model.cpu_layers_unavailable(self.kv)
                if why:
                    raise ModelLoadError(f"--lora-dtype float16 sets the adapter factors the fused CPU decode loop "
                                         f"reads, and this model's decode steps do not run there ({why}): drop it")
            self.loras = LoRAManager(self.model, config.max_loras, config.max_lora_rank,
                                     config.lora_dtype == "float16")
            for name, path in config.lora_modules.items():
                try:
                    self.loras.load(name, path)
                except LoRAError as e:
                    raise ModelLoadError(f"--lora-modules {name}={path}: {e}") from e
            if self.ranks is not None:  # (the other ranks loaded --lora-modules themselves, in the same slots)
                ranks = self.ranks
                self.loras.on_install = lambda a, slot: ranks.lora(("install", a.name, str(a.path), slot))
                self.loras.on_free = lambda name: ranks.lora(("free", name))
        self.eagle: Eagle3Drafter | None = None  # the drafter, when it reads the target's hidden states
        self.drafter = self._drafter()
        self.scheduler.drafter = self.drafter
        # Async scheduling: the decode step queued on the device whose tokens are not read yet.
        self.async_scheduling = (self.runner.graphs is not None and self.drafter is None and (
            config.async_scheduling == "on" or (config.async_scheduling == "auto" and self.device.type == "cuda")))
        if config.async_scheduling == "on" and not self.async_scheduling:
            raise ModelLoadError("--async-scheduling on: this engine's decode steps do not replay from graphs "
                                 "(tensor or pipeline parallel, LoRA, or a failed capture): leave it auto")
        self._launched: Launched | None = None
        self.scheduler.max_model_len = self.max_model_len
        self.seqs: dict[str, Sequence] = {}
        self._arrival = itertools.count()
        self.times: StepTimes | None = None  # per-phase host time, when a benchmark asks (and on the runner)
        # Cluster-wide KV tier (set by a worker that has one): full blocks this engine computed are
        # pinned and handed out for publishing, released by `unpin_published` once copied out.
        self.kv_tier = False
        self.to_publish: list[tuple[list[bytes], list[int]]] = []
        self.store_hit_tokens = 0
        log.info(
            "engine ready model=%s device=%s dtype=%s kv_blocks=%d block_size=%d kv_mib=%.0f load_s=%.2f "
            "weights_s=%.3f kv_s=%.3f weights_mib=%.1f mapped=%s rss_start_mib=%.0f rss_weights_mib=%.1f",
            self.model_dir, self.device, self.dtype, self.kv.layout.num_blocks, config.block_size,
            self.kv.nbytes / 2**20, time.perf_counter() - t0, weights_s, kv_s,
            weight_cache.nbytes(self.model) / 2**20, self.model.weight_mapping is not None, rss_start, rss_weights,
        )

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one rank)."""
        if self.ranks is not None:
            self.ranks.close()

    def time_steps(self) -> StepTimes:
        """Start summing each step's host time per phase (benchmarks: `loadtest/bench_host.py`)."""
        self.times = self.runner.times = StepTimes()
        return self.times

    def _kv_layout(self, graphs: bool) -> KVLayout:
        c = self.config
        budget = int(c.kv_cache_gb * 2**30)
        if self.device.type == "cuda":
            # What the largest prompt chunk and the decode graphs' pool need is measured first.
            peaks = memory_profile.profile(self.model, self.device, self.dtype, c.block_size,
                                           min(c.max_num_batched_tokens, self.max_model_len),
                                           c.max_num_seqs if graphs else 1)
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = memory_profile.kv_budget(free, c.gpu_memory_fraction, peaks, graphs)
        # Pipeline parallel: blocks sized for the stage with the most layers, this stage's own layers held.
        most = max(len(s) for s in self.ranks.stages) if self.ranks is not None and self.ranks.pp > 1 else None
        layout = KVLayout.for_budget(self.model_config, budget, c.block_size, c.torch_kv_dtype, self.model.kv_entry,
                                     most)
        return dataclasses.replace(layout, num_layers=len(self.model.layers))

    # -- requests -------------------------------------------------------------------

    def _new_seq(self, request_id: str, prompt: list[int], sampling: SamplingParams, tenant: str, mode: Mode,
                 weight: float = 1.0, adapter: str = "") -> Sequence:
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in flight")
        slot = -1
        if adapter:
            if self.loras is None:
                raise RequestError(f"LoRA adapter {adapter!r} asked for, but this worker serves none "
                                   "(--lora-modules / --enable-lora)")
            slot = self.loras.slot(adapter)
        if not prompt:
            raise RequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        sampling.validate()
        if not 0 < weight < float("inf"):
            raise RequestError(f"tenant weight must be a positive number, got {weight}")
        if len(prompt) >= self.max_model_len:
            raise RequestError(
                f"prompt is {len(prompt)} tokens; this model's context is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        total = min(len(prompt) + sampling.max_tokens, self.max_model_len)
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise RequestError(
                f"prompt + max_tokens = {total} tokens needs {self.blocks.blocks_for(total)} KV blocks; "
                f"this worker has {self.blocks.num_blocks} in all"
            )
        if sampling.resumed_tokens >= len(prompt):
            raise RequestError(f"resumed_tokens ({sampling.resumed_tokens}) must leave at least one prompt token "
                               f"(prompt: {len(prompt)})")
        seq = Sequence(request_id, list(prompt), sampling, tenant=tenant, weight=weight, adapter=adapter,
                       lora_slot=slot, mode=mode, arrival=next(self._arrival))
        if sampling.grammar is not None:
            seq.matcher = self.grammar.matcher(sampling.grammar)
            self.grammar.advance(seq.matcher, seq.generated_token_ids)
            if sampling.grammar_release is not None and sampling.resumed_tokens:
                # A failover resuming: the branch was chosen by the output before it.
                opened = self.tokenizer.decode(seq.generated_token_ids).lstrip()
                if opened:
                    seq.grammar_branch_known = True
                    if opened[0] not in sampling.grammar_release:
                        seq.matcher = None
        if mode == Mode.FULL:
            seq.detok = detokenizer(self.tokenizer, prompt, sampling.stop)
        seq.overlappable = (self.async_scheduling and mode == Mode.FULL and seq.matcher is None and slot < 0
                            and not sampling.penalized and sampling.logprobs is None)
        return seq

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
        tenant: str = "", mode: Mode = Mode.FULL, fetch: bool = False, weight: float = 1.0, adapter: str = "",
    ) -> Sequence:
        """Queue a prompt. `fetch`: the KV tier holds part of it; when the scheduler admits it, it is
        handed out (`take_fetches`) to be filled, and computes the rest after `resume_after_fill`.
        `adapter`: a resident LoRA adapter's name to run it under ("" = the base model)."""
        seq = self._new_seq(request_id, prompt_token_ids, sampling, tenant, mode, weight, adapter)
        seq.fetch = fetch and self.kv_tier
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _drafter(self) -> Drafter | None:
        c = self.config
        if c.speculative == "ngram":
            return NgramDrafter(c.num_speculative_tokens, c.speculative_max_batch)
        if c.speculative == "eagle3":
            assert c.draft_model is not None
            head_dir = Path(c.draft_model)
            if not head_dir.is_dir():
                raise ModelLoadError(f"--draft-model {c.draft_model}: an EAGLE-3 head is a local directory "
                                     "(config.json + safetensors)")
            self.eagle = Eagle3Drafter(head_dir, self.model, c.num_speculative_tokens, c.speculative_max_batch,
                                       self.device, self.dtype, c.block_size, self.kv.layout.num_blocks,
                                       self.max_model_len + c.num_speculative_tokens + 1)
            self.model.aux_layers = self.eagle.aux_layers
            return self.eagle
        if c.speculative != "draft":
            return None
        from engine.spec.draft_model import DraftModelDrafter, same_tokenizer

        draft_dir = resolve_model(c.draft_model)
        differs = same_tokenizer(self.model_dir, draft_dir)
        if differs:
            raise ModelLoadError(f"--draft-model {c.draft_model}: its tokenizer is not the target's ({differs}); "
                                 "a draft model must share the target's vocabulary")
        return DraftModelDrafter(draft_dir, c.num_speculative_tokens, c.speculative_max_batch, self.device, self.dtype,
                                 c.block_size, self.kv.layout.num_blocks, self.max_model_len + c.num_speculative_tokens + 1,
                                 self.model_config.vocab_size)

    def _free_blocks(self, seq: Sequence) -> None:
        """Free a stopped sequence's blocks, or once the queued step that still writes into them is read."""
        if self._launched is not None and seq in self._launched.rows:
            self._launched.free_after.append(seq)
        else:
            self.blocks.free_seq(seq)

    def _drop(self, seq: Sequence) -> None:
        """Free a stopped sequence's blocks (and what a draft model holds for it)."""
        self._free_blocks(seq)
        if self.drafter is not None:
            self.drafter.release(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        self._drop(seq)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        return True

    def hold(self, request_id: str) -> Sequence | None:
        """Stop a request but keep its blocks (another process may still be writing into them)."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
            if self.drafter is not None:
                self.drafter.release(seq)  # the draft cache is this process's alone
        return seq

    def release(self, seq: Sequence) -> None:
        """Free the blocks of a request stopped with `hold`."""
        self._free_blocks(seq)

    # -- disaggregated decode: KV filled by another process --------------------------

    def reserve(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, tenant: str = "",
                mode: Mode = Mode.FULL, weight: float = 1.0, adapter: str = "") -> Sequence | None:
        """Take blocks for a prompt whose K/V another process will write (a prefill worker, or the
        cluster-wide KV store). None = no blocks now.

        Reuses this worker's own cached prefix: `seq.num_cached_tokens` tokens need no transfer.
        """
        seq = self._new_seq(request_id, prompt_token_ids, sampling, tenant, mode, weight, adapter)
        if not self.blocks.allocate(seq, seq.num_tokens):
            return None
        seq.status = Status.RESERVED
        self.seqs[request_id] = seq
        return seq

    def take_landing(self, request_id: str, first_block: int) -> list[int] | None:
        """Spare blocks, one per block of a reserved prompt's table from `first_block` on, for a prefill
        worker to land whole pages in (`KVCache.land`); None when not that many are free."""
        seq = self.seqs[request_id]
        return list(seq.landing) if self.blocks.take_landing(seq, first_block) else None

    def activate(self, request_id: str, first_token: int, logprob: TokenLogprob | None = None,
                 cached_tokens: int = 0, landed: list[tuple[int, int, int]] | None = None) -> RequestOutput:
        """The prompt's K/V have landed: start decoding from `first_token`. `cached_tokens`: prompt
        tokens nobody had to compute for this request (the prefill worker's cache hits too). `landed`:
        the (rank, first head, heads) sections the prefill worker wrote into the landing blocks, moved
        into place here on every rank before the request's first step."""
        seq = self.seqs[request_id]
        assert seq.status == Status.RESERVED, f"{request_id} is {seq.status}, not reserved"
        if landed:
            assert seq.landing, f"{request_id}: K/V landed in blocks that were never offered"
            dst = seq.block_table[seq.landing_from:]
            self.kv.land(seq.landing, dst, [(h, n) for r, h, n in landed if r == 0])
            if self.ranks is not None:
                self.ranks.land((seq.landing, dst, landed))
        self.blocks.free_landing(seq)
        self.blocks.mark_computed(seq, seq.num_prompt_tokens - seq.num_computed_tokens)
        seq.num_cached_tokens = max(seq.num_cached_tokens, min(cached_tokens, seq.num_prompt_tokens))
        seq.num_published_blocks = seq.num_prompt_tokens // self.config.block_size  # the prefill side publishes those
        self.scheduler.add_running(seq)
        out = RequestOutput(request_id, num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens)
        self._append_token(seq, first_token, logprob, out)
        return out

    # -- the cluster-wide KV tier ------------------------------------------------------

    def fill_plan(self, request_id: str) -> tuple[list[bytes], list[int]]:
        """Block hashes and block ids of a reserved prompt's reusable blocks past its local cache hit:
        what the KV store may fill (at least one token is always left to compute)."""
        seq = self.seqs[request_id]
        bs = self.config.block_size
        first, last = seq.num_computed_tokens // bs, (seq.num_prompt_tokens - 1) // bs
        return seq.block_hashes[first:last], seq.block_table[first:last]

    def mark_filled(self, request_id: str, num_blocks: int) -> int:
        """The next `num_blocks` of a reserved prompt were read from the KV store: they count as
        computed and cached. Returns the prompt tokens now cached."""
        seq = self.seqs[request_id]
        n = num_blocks * self.config.block_size
        self.blocks.mark_computed(seq, n)
        seq.num_cached_tokens += n
        seq.num_published_blocks = seq.num_computed_tokens // self.config.block_size
        self.store_hit_tokens += n
        return seq.num_cached_tokens

    def _publish(self, seq: Sequence, upto_tokens: int) -> None:
        """Pin the full blocks of `seq` computed here and not yet handed out, for the KV tier."""
        full = min(upto_tokens, seq.num_computed_tokens) // self.config.block_size
        lo = seq.num_published_blocks
        if not self.kv_tier or full <= lo:
            return
        self.blocks.register_computed(seq)
        if len(seq.block_hashes) < full:
            return  # prefix caching is off: no content hashes to publish under
        blocks = seq.block_table[lo:full]
        self.blocks.pin(blocks)
        self.to_publish.append((seq.block_hashes[lo:full], blocks))
        seq.num_published_blocks = full

    def take_fetches(self) -> list[str]:
        """Requests the scheduler admitted for filling from the KV tier since the last call."""
        out = [s.request_id for s in self.scheduler.admitted_for_fetch]
        self.scheduler.admitted_for_fetch = []
        return out

    def resume_after_fill(self, request_id: str) -> None:
        """The KV tier filled what it could: compute the rest (unless the request is gone)."""
        seq = self.seqs.get(request_id)
        if seq is not None and seq.status == Status.RESERVED:
            self.scheduler.add_running(seq)

    def take_published(self) -> list[tuple[list[bytes], list[int]]]:
        out, self.to_publish = self.to_publish, []
        return out

    def unpin_published(self, blocks: list[int]) -> None:
        self.blocks.unpin(blocks)

    def start_local_prefill(self, request_id: str) -> None:
        """A reserved request will be prefilled here after all (short uncached suffix)."""
        seq = self.seqs[request_id]
        assert seq.status == Status.RESERVED, f"{request_id} is {seq.status}, not reserved"
        self.scheduler.add_running(seq)

    # -- stepping -------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._launched is not None

    def step(self, observer: StepObserver | None = None) -> list[RequestOutput]:
        """Run one step; the outputs of the steps finished since the last call.

        Async scheduling: a step of overlappable decodes (`Sequence.overlappable`, replayed from a graph) is
        queued on the device and its tokens read at the next call, after the step after it is queued (its
        inputs take the unread tokens on the device): the host schedules, prepares and commits while the
        device computes. Anything else (a prompt to admit, a block short, another kind of row, an
        observer) first reads the queued step and runs in order. A sequence that stops at the step read
        had a row in the next one: that row's token is dropped."""
        if self._launched is not None:
            if observer is None and self._overlaps_next():
                return self._step_ahead()
            return self._read_launched()
        times = self.times
        t0 = time.perf_counter() if times is not None else 0.0
        batch = self.scheduler.schedule()
        if not batch:  # (admissions for fetching from the KV tier compute nothing yet)
            return []
        if observer is None and self.async_scheduling and self._launchable(batch):
            if times is not None:
                times.steps += 1
                times.schedule += time.perf_counter() - t0
            self._queued(self.runner.launch(batch, None))
            return []
        hook = None
        if observer is not None:
            observer.before_forward(batch)
            hook = observer.after_layer
        if times is not None:
            times.steps += 1
            times.schedule += time.perf_counter() - t0
        samples = self.runner.run(batch, hook)
        failed = observer.after_forward() if observer is not None else {}
        t1 = time.perf_counter() if times is not None else 0.0
        outputs: list[RequestOutput] = []
        it = iter(samples)
        for s in batch:
            seq, start = s.seq, s.seq.num_computed_tokens
            out = self._commit(s, next(it) if s.samples and not s.draft else None, failed.get(seq.request_id))
            if out is not None:
                outputs.append(out)
            if s.features is not None and self.eagle is not None and seq.status != Status.FINISHED:
                # EAGLE-3: the target's features of the positions this step committed (a verification's
                # rows past the accepted drafts are not)
                self.eagle.observe(seq, start, s.features[: seq.num_computed_tokens - start])
        if times is not None:
            times.commit += time.perf_counter() - t1
        if self.loras is not None and self.loras.unloading:
            self.loras.sweep(self.adapter_in_use)
        return outputs

    # -- async scheduling -------------------------------------------------------------

    def _launchable(self, batch: list[ScheduledSeq]) -> bool:
        return all(s.num_tokens == 1 and s.samples and not s.draft and s.seq.overlappable for s in batch) \
            and self.runner.graphable(batch)

    def _overlaps_next(self) -> bool:
        """Whether the next step will be a launchable batch of every running sequence, with nothing
        admitted and no preemption (each needs at most one new block): decided before scheduling it."""
        sched = self.scheduler
        running = sched.running
        if sched.waiting or not running or self.blocks.num_available < len(running):
            return False
        assert self.runner.graphs is not None
        if len(running) > self.runner.graphs.buckets[-1]:
            return False
        return all(s.overlappable and s.status == Status.RUNNING and s.num_remaining == 1 for s in running)

    def _step_ahead(self) -> list[RequestOutput]:
        """Queue the next decode step behind the launched one, then read and commit the launched one."""
        times = self.times
        t0 = time.perf_counter() if times is not None else 0.0
        batch = self.scheduler.schedule()
        # A sequence whose pending token is its last by length needs no further row.
        batch = [s for s in batch if len(s.seq.output_token_ids) < s.seq.sampling.max_tokens
                 and s.seq.num_tokens < self.max_model_len]
        if times is not None and batch:
            times.steps += 1
            times.schedule += time.perf_counter() - t0
        prev = self._launched
        assert prev is not None
        # (queued first: a sequence that stops in this read still has a row there, its blocks freed after it)
        self._launched = self.runner.launch(batch, prev) if batch else None
        outputs = self._read(prev)
        if self._launched is not None:
            self._queued(self._launched)
        return outputs

    def _queued(self, launched: Launched) -> None:
        """A step is queued: each of its sequences still running has its K/V computed one further and a
        pending token (an entry stopped since it was scheduled keeps neither)."""
        for s in launched.batch:
            seq = s.seq
            if seq.status == Status.RUNNING:
                self.blocks.mark_computed(seq, 1)
                seq.output_token_ids.append(PENDING)
        self._launched = launched

    def _read_launched(self) -> list[RequestOutput]:
        launched, self._launched = self._launched, None
        assert launched is not None
        return self._read(launched)

    def _read(self, launched: Launched) -> list[RequestOutput]:
        """Wait for a queued step's tokens and commit them (a stopped sequence's is dropped); then the
        blocks of the sequences that stopped while it was queued are free."""
        try:
            tokens = launched.read()
        finally:
            for seq in launched.free_after:
                self._free_blocks(seq)  # (or after the step queued since, if it has a row there too)
        t1 = time.perf_counter() if self.times is not None else 0.0
        outputs: list[RequestOutput] = []
        for s, token in zip(launched.batch, tokens, strict=True):
            seq = s.seq
            if seq.status != Status.RUNNING or not seq.output_token_ids or seq.output_token_ids[-1] != PENDING:
                continue  # stopped (aborted, held) since it was queued
            seq.output_token_ids.pop()
            out = RequestOutput(seq.request_id, num_prompt_tokens=seq.num_prompt_tokens,
                                num_cached_tokens=seq.num_cached_tokens)
            self._append_token(seq, token, None, out)
            outputs.append(out)
        if self.times is not None:
            self.times.commit += time.perf_counter() - t1
        return outputs

    # -- LoRA adapters ---------------------------------------------------------------

    def adapter_in_use(self, name: str) -> bool:
        return any(seq.adapter == name for seq in self.seqs.values())

    def load_adapter(self, name: str, path: str) -> None:
        self._lora_manager().load(name, path)

    def install_adapter(self, adapter: LoRAAdapter) -> None:
        """An adapter read off the engine thread (`read_adapter`), placed between steps."""
        self._lora_manager().install(adapter)

    def _lora_manager(self) -> LoRAManager:
        if self.loras is None:
            raise RequestError("this worker serves no LoRA adapters: start it with --enable-lora or --lora-modules")
        return self.loras

    def unload_adapter(self, name: str) -> bool:
        """True: gone now; False: requests still run under it (it takes no new ones, freed when they end)."""
        if self.loras is None:
            raise RequestError("this worker serves no LoRA adapters")
        return self.loras.unload(name, self.adapter_in_use)

    @property
    def adapters(self) -> list[str]:
        return self.loras.names() if self.loras is not None else []

    def _commit(self, s: ScheduledSeq, sampled: tuple[int, TokenLogprob | None] | None,
                error: str | None) -> RequestOutput | None:
        seq = s.seq
        if s.draft:
            return self._verified(seq, s, error)
        if error is not None:
            return self._finish(seq, "error", RequestOutput(seq.request_id), error)
        self.blocks.mark_computed(seq, s.num_tokens)
        if sampled is None:
            return None
        if seq.num_computed_tokens == seq.num_prompt_tokens:  # this step finished the prompt
            self._publish(seq, seq.num_prompt_tokens)
        out = RequestOutput(seq.request_id, num_prompt_tokens=seq.num_prompt_tokens,
                            num_cached_tokens=seq.num_cached_tokens)
        self._append_token(seq, sampled[0], sampled[1], out)
        return out

    def _verified(self, seq: Sequence, s: ScheduledSeq, error: str | None) -> RequestOutput:
        """Commit a speculative step: the accepted drafts and the model's next token."""
        out = RequestOutput(seq.request_id, num_prompt_tokens=seq.num_prompt_tokens,
                            num_cached_tokens=seq.num_cached_tokens)
        if error is not None:
            return self._finish(seq, "error", out, error)
        emitted = verify(s.draft, s.targets)
        assert self.drafter is not None
        self.drafter.record(seq, len(s.draft), len(emitted) - 1)
        self.blocks.mark_computed(seq, 1)  # the fed token (before a finish frees the blocks: they stay cached)
        for j, token in enumerate(emitted):
            self._append_token(seq, token, None, out)
            if out.finished:
                return out
            if j < len(emitted) - 1:  # an accepted draft: its K/V (computed from it) are valid
                self.blocks.mark_computed(seq, 1)
        return out

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None, out: RequestOutput) -> None:
        sp = seq.sampling
        seq.output_token_ids.append(token)
        out.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
            out.logprobs.append(logprob)
        out.num_output_tokens = len(seq.output_token_ids)
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            # Tokens are chosen under the mask, so this is a received token (a prefill worker's
            # first token) that the grammar does not allow: a bug somewhere, not a user error.
            self._finish(seq, "error", out, f"token {token} violates the request's grammar: {seq.matcher.get_error()}")
            return
        if seq.mode == Mode.PREFILL_ONLY:
            self._finish(seq, "prefill", out)
            return
        if (token in self.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            self._finish(seq, "stop", out)
            return
        assert seq.detok is not None
        if self.times is not None:
            t0 = time.perf_counter()
            text, hit_stop = seq.detok.push(token)
            spent = time.perf_counter() - t0
            self.times.detokenize += spent
            self.times.commit -= spent  # (commit's time is measured around this)
            self.times.tokens += 1
        else:
            text, hit_stop = seq.detok.push(token)
        if seq.matcher is not None and sp.grammar_release is not None and not seq.grammar_branch_known:
            opened = seq.detok.text.lstrip()
            if opened:
                seq.grammar_branch_known = True
                if opened[0] not in sp.grammar_release:
                    seq.matcher = None  # the free-text branch: nothing left to constrain
        out.text += text
        if hit_stop or (seq.matcher is not None and seq.matcher.is_stopped()):
            # A completed grammar admits nothing but EOS: end now rather than spend a step on it.
            self._finish(seq, "stop", out)
        elif len(seq.output_token_ids) >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", out)

    def _finish(self, seq: Sequence, reason: str, out: RequestOutput, error: str | None = None) -> RequestOutput:
        if seq.detok is not None and error is None:
            out.text += seq.detok.flush()
        if error is None:
            self._publish(seq, seq.num_computed_tokens)  # the output's blocks too: the next turn's prompt
        seq.status, seq.finish_reason, seq.error = Status.FINISHED, reason, error
        out.finished, out.finish_reason, out.error = True, reason, error
        self.scheduler.remove(seq)
        self._drop(seq)
        self.seqs.pop(seq.request_id, None)
        return out

    def kv_tokens_held(self) -> int:
        return sum(s.num_computed_tokens for s in self.seqs.values())

    def decode_tokens_remaining(self) -> int:
        return sum(max(s.sampling.max_tokens - len(s.output_token_ids), 0) for s in self.seqs.values())

    def stats(self) -> EngineStats:
        sched = self.scheduler
        pending = sum(s.num_remaining for s in sched.waiting) + sum(
            s.num_remaining for s in sched.running if s.num_remaining > 1
        )
        return EngineStats(
            blocks=self.blocks.stats(),
            running=len(sched.running),
            waiting=len(sched.waiting),
            reserved=sum(1 for s in self.seqs.values() if s.status == Status.RESERVED),
            num_preemptions=sched.num_preemptions,
            prompt_tokens_in_flight=pending,
            kv_tokens_held=self.kv_tokens_held(),
            decode_tokens_remaining=self.decode_tokens_remaining(),
            store_hit_tokens=self.store_hit_tokens,
            spec_drafted=self.drafter.drafted if self.drafter is not None else 0,
            spec_accepted=self.drafter.accepted if self.drafter is not None else 0,
        )
