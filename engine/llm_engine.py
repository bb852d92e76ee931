"""The engine: requests in, token outputs out, one `step()` at a time.

Single-threaded and synchronous on purpose; `async_engine.py` runs it on its own
thread for the gRPC workers, `splitfire generate` drives it directly.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import torch

from common.detokenizer import detokenizer
from common.errors import ModelLoadError, RequestError
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from engine.batch.block_manager import BlockManager
from engine.batch.constrained import GrammarEngine
from engine.batch.graph_runner import DecodeGraphs
from engine.batch.model_runner import Launched, ModelRunner
from engine.batch.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from engine.batch.sequence import Mode, Sequence, Status, TokenLogprob
from engine.batch.step_times import StepTimes
from engine.engine_config import EngineConfig
from engine.handoff import Handoff, check_request
from engine.loading import weight_cache
from engine.loading.lora_adapters import LoRAAdapter
from engine.loading.model_store import resolve_model
from engine.loading.weights import load_model
from engine.loras import LoRAManager, require_loras, start_loras
from engine.memory_profile import kv_layout
from engine.model.kv_cache import KVCache
from engine.model.model_config import ModelConfig
from engine.model.parallel import ONE, WHOLE, split_layers
from engine.outputs import EngineStats, RequestOutput, StepObserver
from engine.overlap import Overlap
from engine.ranks import RankGroup, RankMain, threads_per_rank
from engine.spec.drafters import make_drafter
from engine.spec.eagle3 import Eagle3Drafter
from engine.spec.speculative import verify

log = logging.getLogger("splitfire.engine")


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
        t0 = time.perf_counter()
        rss_weights = self._load(rank_main)
        weights_s = time.perf_counter() - t0
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.model.build_rope_cache(self.max_model_len + 1, self.device, self.dtype)
        t_kv = time.perf_counter()
        self._build_runner(self._decode_graphs())
        kv_s = time.perf_counter() - t_kv
        # resident LoRA adapters, when enabled (`loras.py`)
        self.loras: LoRAManager | None = start_loras(config, self.model, self.kv, self.ranks) if config.lora else None
        self.drafter = make_drafter(config, self.model, self.model_dir, self.model_config.vocab_size, self.device,
                                    self.dtype, self.kv.layout.num_blocks, self.max_model_len)
        # the drafter, when it reads the target's hidden states
        self.eagle = self.drafter if isinstance(self.drafter, Eagle3Drafter) else None
        self.scheduler.drafter = self.drafter
        self.scheduler.max_model_len = self.max_model_len
        self.async_scheduling = self._async_scheduling()
        self.overlap = Overlap(self)  # (async scheduling's queued step: `overlap.py`)
        self.seqs: dict[str, Sequence] = {}
        self._arrival = itertools.count()
        self.times: StepTimes | None = None  # per-phase host time, when a benchmark asks (and on the runner)
        self.handoff = Handoff(self)  # disaggregation and the cluster-wide KV tier (`handoff.py`)
        log.info(
            "engine ready model=%s device=%s dtype=%s kv_blocks=%d block_size=%d kv_mib=%.0f load_s=%.2f "
            "weights_s=%.3f kv_s=%.3f weights_mib=%.1f mapped=%s rss_start_mib=%.0f rss_weights_mib=%.1f",
            self.model_dir, self.device, self.dtype, self.kv.layout.num_blocks, config.block_size,
            self.kv.nbytes / 2**20, time.perf_counter() - t0, weights_s, kv_s,
            weight_cache.nbytes(self.model) / 2**20, self.model.weight_mapping is not None, rss_start, rss_weights,
        )

    def _load(self, rank_main: RankMain | None) -> float:
        """The model (this rank's part; the other model-parallel ranks start loading theirs first). Returns
        the RSS the weights added (MiB)."""
        config = self.config
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        stages = split_layers(self.model_config, pp) if pp > 1 else None
        self.ranks = RankGroup(config, self.model_dir, tp, pp, self.model_config.hidden_size,
                               self.model_config.vocab_size, stages, rank_main) if tp * pp > 1 else None
        shard = self.ranks.shard if self.ranks is not None else ONE
        stage = self.ranks.stage if self.ranks is not None else WHOLE
        if self.ranks is not None and self.device.type == "cpu":
            torch.set_num_threads(threads_per_rank(config, tp * pp))
        rss_before = _rss_mib()
        self.model = load_model(self.model_dir, self.device, self.dtype, config.quantization, shard=shard,
                                stage=stage, compress_weights=config.compress_weights)
        self.model.set_int8_activations(config.cpu_activations == "int8")
        return _rss_mib() - rss_before

    def _decode_graphs(self) -> bool:
        """Whether decode steps replay captured graphs: on CUDA by default, never where a step's inputs or
        outputs change what runs (EAGLE-3's features, the other ranks' inputs, adapter rows)."""
        c = self.config
        graphs = c.decode_graphs == "on" or (c.decode_graphs == "auto" and self.device.type == "cuda")
        return graphs and c.speculative != "eagle3" and self.ranks is None and not c.lora

    def _build_runner(self, graphs: bool) -> None:
        """The KV cache, block manager, scheduler, grammar engine and model runner (with the other ranks'
        step hand-off, and the decode graphs captured if asked: a failed capture decodes eagerly)."""
        config = self.config
        self.kv = KVCache(kv_layout(self.model, self.model_config, config, self.device, self.dtype,
                                    self.max_model_len, graphs, self.ranks), self.device)
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
            if self.ranks.pp > 1:
                self.runner.pipeline = self.ranks.pipeline(self.model, self.kv)
                self.runner.micro_batches = self.ranks.pp  # (enough for every stage to have one in flight)
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

    def _async_scheduling(self) -> bool:
        """Whether decode steps queue ahead of the last one's read (`overlap.py`): only where they replay from
        graphs, without speculation; `on` where that cannot be is refused."""
        c = self.config
        on = self.runner.graphs is not None and self.drafter is None and (
            c.async_scheduling == "on" or (c.async_scheduling == "auto" and self.device.type == "cuda"))
        if c.async_scheduling == "on" and not on:
            raise ModelLoadError("--async-scheduling on: this engine's decode steps do not replay from graphs "
                                 "(tensor or pipeline parallel, LoRA, or a failed capture): leave it auto")
        return on

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one rank)."""
        if self.ranks is not None:
            self.ranks.close()

    def time_steps(self) -> StepTimes:
        """Start summing each step's host time per phase (benchmarks: `loadtest/bench_host.py`)."""
        self.times = self.runner.times = StepTimes()
        return self.times

    # -- requests -------------------------------------------------------------------

    def new_sequence(self, request_id: str, prompt: list[int], sampling: SamplingParams, tenant: str, mode: Mode,
                 weight: float = 1.0, adapter: str = "", priority: int = 0) -> Sequence:
        if request_id in self.seqs:
            raise RequestError(f"request id {request_id!r} is already in flight")
        slot = -1
        if adapter:
            if self.loras is None:
                raise RequestError(f"LoRA adapter {adapter!r} asked for, but this worker serves none "
                                   "(--lora-modules / --enable-lora)")
            slot = self.loras.slot(adapter)
        check_request(prompt, sampling, weight, self.model_config.vocab_size, self.max_model_len, self.blocks)
        seq = Sequence(request_id, list(prompt), sampling, tenant=tenant, weight=weight, adapter=adapter,
                       lora_slot=slot, mode=mode, arrival=next(self._arrival), priority=priority)
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
        priority: int = 0,
    ) -> Sequence:
        """Queue a prompt. `fetch`: the KV tier holds part of it; when the scheduler admits it, it is
        handed out (`take_fetches`) to be filled, and computes the rest after `resume_after_fill`.
        `adapter`: a resident LoRA adapter's name to run it under ("" = the base model). `priority`: lower
        is more important (scheduler.py)."""
        seq = self.new_sequence(request_id, prompt_token_ids, sampling, tenant, mode, weight, adapter, priority)
        seq.fetch = fetch and self.handoff.kv_tier
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def free_blocks(self, seq: Sequence) -> None:
        """Free a stopped sequence's blocks, or once the queued step that still writes into them is read."""
        launched = self.overlap.launched
        if launched is not None and seq in launched.rows:
            launched.free_after.append(seq)
        else:
            self.blocks.free_seq(seq)

    def _drop(self, seq: Sequence) -> None:
        """Free a stopped sequence's blocks (and what a draft model holds for it)."""
        self.free_blocks(seq)
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

    # -- stepping -------------------------------------------------------------------

    @property
    def _launched(self) -> Launched | None:
        """The queued step (tests look at it)."""
        return self.overlap.launched

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.overlap.launched is not None

    def step(self, observer: StepObserver | None = None) -> list[RequestOutput]:
        """Run one step; the outputs of the steps finished since the last call.

        Async scheduling: a step of overlappable decodes (`Sequence.overlappable`, replayed from a graph) is
        queued on the device and its tokens read at the next call, after the step after it is queued (its
        inputs take the unread tokens on the device): the host schedules, prepares and commits while the
        device computes. Anything else (a prompt to admit, a block short, another kind of row, an
        observer) first reads the queued step and runs in order. A sequence that stops at the step read
        had a row in the next one: that row's token is dropped."""
        if self.overlap.launched is not None:
            if observer is None and self.overlap.overlaps_next():
                return self.overlap.step_ahead()
            return self.overlap.read_launched()
        times = self.times
        t0 = time.perf_counter() if times is not None else 0.0
        batch = self.scheduler.schedule()
        if not batch:  # (admissions for fetching from the KV tier compute nothing yet)
            return []
        if observer is None and self.async_scheduling and self.overlap.launchable(batch):
            if times is not None:
                times.steps += 1
                times.schedule += time.perf_counter() - t0
            self.overlap.queued(self.runner.launch(batch, None))
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

    # -- LoRA adapters ---------------------------------------------------------------

    def adapter_in_use(self, name: str) -> bool:
        return any(seq.adapter == name for seq in self.seqs.values())

    def load_adapter(self, name: str, path: str) -> None:
        require_loras(self.loras).load(name, path)

    def install_adapter(self, adapter: LoRAAdapter) -> None:
        """An adapter read off the engine thread (`read_adapter`), placed between steps."""
        require_loras(self.loras).install(adapter)

    def unload_adapter(self, name: str) -> bool:
        """True: gone now; False: requests still run under it (it takes no new ones, freed when they end)."""
        return require_loras(self.loras).unload(name, self.adapter_in_use)

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
            self.handoff.publish(seq, seq.num_prompt_tokens)
        out = RequestOutput(seq.request_id, num_prompt_tokens=seq.num_prompt_tokens,
                            num_cached_tokens=seq.num_cached_tokens)
        self.append_token(seq, sampled[0], sampled[1], out)
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
            self.append_token(seq, token, None, out)
            if out.finished:
                return out
            if j < len(emitted) - 1:  # an accepted draft: its K/V (computed from it) are valid
                self.blocks.mark_computed(seq, 1)
        return out

    def first_output(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        """The output carrying a sequence's first token (received from a prefill worker)."""
        out = RequestOutput(seq.request_id, num_prompt_tokens=seq.num_prompt_tokens,
                            num_cached_tokens=seq.num_cached_tokens)
        self.append_token(seq, token, logprob, out)
        return out

    def append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None, out: RequestOutput) -> None:
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
            out.stop_reason = token if token in sp.stop_token_ids else None
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
            out.stop_reason = seq.detok.hit
            self._finish(seq, "stop", out)
        elif len(seq.output_token_ids) >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", out)

    def _finish(self, seq: Sequence, reason: str, out: RequestOutput, error: str | None = None) -> RequestOutput:
        if seq.detok is not None and error is None:
            out.text += seq.detok.flush()
        if error is None:
            self.handoff.publish(seq, seq.num_computed_tokens)  # the output's blocks too: the next turn's prompt
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
            store_hit_tokens=self.handoff.store_hit_tokens,
            spec_drafted=self.drafter.drafted if self.drafter is not None else 0,
            spec_accepted=self.drafter.accepted if self.drafter is not None else 0,
        )
