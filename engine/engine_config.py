"""Runtime settings shared by every process that loads a model. torch is imported only where
a device or dtype is resolved: the CLI builds every subcommand's flags from here, and the
router (which never loads a model) should not pay ~1 s and ~200 MB for it."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from common.settings import setting

if TYPE_CHECKING:
    import torch


# On CPU a prompt token costs about as much compute as a decode row (~1.8 ms on the 2-core AVX2
# EPYC with SmolLM2): a 512-token chunk beside 16 decoding streams stalled them ~0.9 s. 24 tokens
# per step kept their inter-token p99 at 101 ms (llama-server on the same machine: 146 ms) for
# 1.59x its output tokens/s; 32: 125 ms, 1.64x; 16: 78 ms, 1.51x and 5x the time to first token
# (`python -m loadtest.vs_llama_server`, README). On CUDA a chunk costs a fraction of a step: no cap.
CPU_PREFILL_WHILE_DECODING = 24
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3")  # fp8 = fp8_e4m3 (e4m3)


ENGINE = "model and engine"
LORA = "LoRA adapters"


def parse_lora_modules(items: list[str] | dict[str, str]) -> dict[str, str]:
    """--lora-modules NAME=PATH ... -> {name: path}; a malformed or repeated name is refused."""
    if isinstance(items, dict):
        return items
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {item!r}")
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


@dataclass
class EngineConfig:
    """Every setting of a process that loads a model; each field is also its flag (`common.settings`: the
    worker commands, `splitfire generate` and the docs' CLI reference read these declarations)."""

    model: str | None = setting(None, "built-in name, HF model dir or .gguf (default smollm2-135m-instruct)",
                                group=ENGINE)
    device: str = setting("auto", "auto | cpu | cuda (auto: cuda where torch sees a GPU)",
                          choices=("auto", "cpu", "cuda"), group=ENGINE)
    dtype: str = setting("auto", "the model's float type (auto: float32 on CPU, bfloat16 on CUDA)",
                         choices=("auto", "float32", "bfloat16"), group=ENGINE)
    kv_cache_dtype: str = setting(
        "auto", "KV cache element type (auto: the model dtype; see torch_kv_dtype). fp8 (= fp8_e4m3) holds 2x "
        "bfloat16's tokens in the same memory, anywhere; float16 on CPU halves float32's bytes per token; on CUDA "
        "the model dtype or fp8. Disaggregated workers must agree (refused by name otherwise)",
        choices=("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3"), group=ENGINE)
    quantization: str | None = setting(
        None, "keep matmul weights quantized (group-wise; decode moves 4x / 8x / 4x fewer bytes than float32): "
        "quantizes a float checkpoint at load (fp8: e4m3 with a scale per row per 128 columns); a GGUF's "
        "Q8_0/Q6_K/Q4_0/Q4_1/Q4_K tensors and a block-FP8 checkpoint's weights stay as stored without it",
        choices=("int8", "int4", "fp8"), group=ENGINE)
    # bfloat16 matmul weights kept losslessly compressed in device memory, decoded per tile by a Triton matmul
    # (engine/model/compressed_weight.py): ~0.75 of the bytes, identical weights.
    compress_weights: bool = setting(
        False, "keep bfloat16 matmul weights losslessly compressed in GPU memory (a 4-bit exponent code per weight, "
        "~0.75 of the bytes; a Triton matmul decodes each tile): more room for the KV cache, identical weights; an "
        "8B decode step measured 1.39x the bfloat16 time at batch 1 on an H200 (the matmul 1.4-2.9x), so it trades "
        "step time for memory", group=ENGINE)
    decode_graphs: str = setting(
        "auto", "no CUDA graphs: every decode step runs eagerly (by default decode-only steps replay a graph "
        "captured per batch-size bucket on CUDA; CPU always runs eagerly); see graph_runner.py",
        flag="--enforce-eager", const="off", group=ENGINE)
    # Queue decode step n+1 before reading step n's tokens (LLMEngine: schedule and prepare while the device
    # computes): auto = on wherever decode steps replay from graphs on CUDA | on | off.
    async_scheduling: str = setting(
        "auto", "queue decode step n+1 before reading step n's tokens, so the host schedules and prepares while "
        "the device computes (auto: on CUDA with decode graphs; greedy or sampled rows without logprobs, "
        "penalties or a grammar — other steps run in order)", choices=("auto", "on", "off"), group=ENGINE)
    cpu_activations: str = setting(
        "float", "quantized weights on CPU at batch 1-2: multiply their codes by float activations (exactly the "
        "dequantized model; default) or by activations rounded to int8 per 32 values (llama.cpp's scheme: ~25% "
        "faster batch-1 decode, but it changed SmolLM2-135M's greedy chat answers)", choices=("float", "int8"),
        group=ENGINE)
    kv_cache_gb: float = setting(1.0, "KV cache size on CPU (GiB)", group=ENGINE)
    # of free GPU memory after weights: KV + activation peaks (memory_profile.py)
    gpu_memory_fraction: float = setting(
        0.85, "share of the free GPU memory (after weights) the engine uses: the KV cache gets it less the measured "
        "peaks of the largest prompt chunk and the decode graphs", group=ENGINE)
    block_size: int = setting(16, "tokens per KV block", group=ENGINE)
    max_num_seqs: int = setting(64, "running batch limit", group=ENGINE)
    max_num_batched_tokens: int = setting(512, "tokens per step (prefill chunk size)", group=ENGINE)
    # Prompt tokens a step may carry while streams decode: None = the device's default
    # (CPU_PREFILL_WHILE_DECODING on CPU, the whole step budget on CUDA), 0 = the whole budget.
    max_prefill_tokens_while_decoding: int | None = setting(
        None, "prompt tokens a step may carry while streams are decoding (default: 24 on CPU, the whole step budget "
        "on CUDA; 0: the whole budget); smaller bounds their inter-token latency, at the cost of time to first "
        "token", group=ENGINE)
    max_model_len: int | None = setting(None, "context limit (default: the model's max_position_embeddings)",
                                        group=ENGINE)
    enable_prefix_cache: bool = setting(True, "disable prefix caching", flag="--no-prefix-cache", const=False,
                                        group=ENGINE)
    threads: int | None = setting(None, "torch CPU threads (per rank with --tensor-parallel-size; default: the "
                                        "cores shared out)", group=ENGINE)
    # Serving on CPU: fewer compute threads while other processes take some of the cores
    # (engine/compute_threads.CoreShare); False: always `threads`.
    adaptive_threads: bool = setting(
        True, "keep --threads compute threads even while other processes take some of the worker's cores "
        "(default: one fewer per core taken, so the threads never wait for each other behind a neighbour)",
        flag="--fixed-threads", const=False, group=ENGINE)
    tensor_parallel_size: int = setting(
        1, "split the model across this many ranks (one process each; gloo on CPU, NCCL on CUDA)", short="-tp",
        group=ENGINE)
    pipeline_parallel_size: int = setting(
        1, "split the layers into this many stages, one process each (CPU hosts; with -tp, each stage tensor "
        "parallel)", short="-pp", group=ENGINE)
    enable_expert_parallel: bool = setting(
        False, "place routed experts whole over the tensor-parallel ranks (default: split each expert)", group=ENGINE)
    speculative: str = setting(
        "off", "speculative decoding: ngram = prompt lookup (drafts copied from earlier text), draft = a smaller "
        "model of the same tokenizer (--draft-model), eagle3 = an EAGLE-3 head trained for this target "
        "(--draft-model DIR); drafts are verified in one step: greedy and seeded output identical, sampled output "
        "from the same distribution; default ngram on decode workers, else off; prefill workers never decode, so "
        "it does nothing there", choices=("off", "ngram", "draft", "eagle3"), group=ENGINE)
    draft_model: str | None = setting(
        None, "with --speculative draft: the draft model (built-in name, HF directory or .gguf); with --speculative "
        "eagle3: the head's directory (config.json + safetensors)", group=ENGINE)
    num_speculative_tokens: int = setting(4, "drafts per verification step at most", group=ENGINE)
    speculative_max_batch: int = setting(
        4, "no drafting while more sequences than this are running (verification then costs more)", group=ENGINE)
    # LoRA adapters (PEFT layout) served beside the base model: name -> directory, loaded at start.
    lora_modules: dict[str, str] = setting(
        help="serve these PEFT LoRA adapters beside the base model (a request names one as its model)",
        factory=dict, metavar="NAME=PATH", parse=parse_lora_modules, group=LORA)
    enable_lora: bool = setting(False, "room for adapters even with none at start (loaded at run time)", group=LORA)
    max_loras: int = setting(4, "adapters resident at once", group=LORA)
    max_lora_rank: int = setting(16, "the highest rank an adapter may have", group=LORA)
    # The factors the fused CPU decode loop reads: float32 (exact) or float16 (half the bytes a step reads
    # per adapter row; the torch paths keep the model dtype).
    lora_dtype: str = setting(
        "float32", "adapter factors in the CPU decode loop: float32 (exact) or float16 (half the bytes read per "
        "adapter row and step: faster, factors rounded to float16)", choices=("float32", "float16"), group=LORA)

    @property
    def lora(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def validate(self) -> EngineConfig:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3") and self.torch_device.type == "cuda" and (
                getattr(_torch(), self.kv_cache_dtype) != self.torch_dtype):
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} differs from the model dtype ({self.torch_dtype}): "
                             "on CUDA the attention kernels read the KV cache in the model dtype or in fp8; leave it "
                             "auto or use fp8")
        if self.device == "cuda" and not _torch().cuda.is_available():
            raise ValueError("--device cuda asked for, but torch sees no CUDA device")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"--block-size must be a power of two up to 256, got {self.block_size}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"--kv-cache-gb must be positive, got {self.kv_cache_gb}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= --max-num-seqs "
                f"({self.max_num_seqs}): every running sequence needs one token per step"
            )
        if self.max_prefill_tokens_while_decoding is not None and self.max_prefill_tokens_while_decoding < 0:
            raise ValueError("--max-prefill-tokens-while-decoding must be >= 1, 0 (no cap) or unset (the device's "
                             f"default), got {self.max_prefill_tokens_while_decoding}")
        if self.quantization not in (None, "int8", "int4", "fp8"):
            raise ValueError(f"--quantization must be int8, int4 or fp8 (or unset), got {self.quantization!r}")
        if self.compress_weights:
            from engine.model.kernels import backend

            if self.quantization is not None:
                raise ValueError("--compress-weights keeps bfloat16 weights losslessly compressed; --quantization "
                                 "replaces them with int8/int4 codes: choose one")
            if self.torch_dtype != _torch().bfloat16:
                raise ValueError(f"--compress-weights compresses bfloat16 weights: it needs --dtype bfloat16 (the "
                                 f"model runs in {self.torch_dtype})")
            if self.device != "cuda" and backend() != "triton":
                raise ValueError("--compress-weights keeps weights compressed in GPU memory for a Triton matmul: it "
                                 "needs --device cuda (a compressed checkpoint from `splitfire compress` is decoded "
                                 "at load on any device)")
        self._validate_steps()
        self._validate_parallelism()
        return self

    def _validate_steps(self) -> None:
        """How steps run: graphs, async scheduling, CPU activations, speculation."""
        if self.decode_graphs not in ("auto", "on", "off"):
            raise ValueError(f"decode_graphs must be auto, on or off, got {self.decode_graphs!r}")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"--async-scheduling must be auto, on or off, got {self.async_scheduling!r}")
        if self.async_scheduling == "on" and (self.decode_graphs == "off" or self.speculative != "off"):
            raise ValueError("--async-scheduling on queues decode steps that replay from graphs, without speculative "
                             "decoding: drop --enforce-eager / --speculative, or leave it auto")
        if self.cpu_activations not in ("int8", "float"):
            raise ValueError(f"--cpu-activations must be int8 or float, got {self.cpu_activations!r}")
        if self.speculative not in ("off", "ngram", "draft", "eagle3"):
            raise ValueError(f"--speculative must be off, ngram, draft or eagle3, got {self.speculative!r}")
        if (self.speculative in ("draft", "eagle3")) != bool(self.draft_model):
            raise ValueError("--speculative draft needs --draft-model (a smaller model with the same tokenizer), "
                             "--speculative eagle3 needs --draft-model (an EAGLE-3 head's directory), and "
                             "--draft-model is only read with one of them")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"--num-speculative-tokens must be in 1..16, got {self.num_speculative_tokens}")

    def _validate_parallelism(self) -> None:
        """Model parallelism and LoRA (whose adapters every rank holds a slice of)."""
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pipeline_parallel_size > 1 and self.device == "cuda":
            raise ValueError("--pipeline-parallel-size above 1 runs on CPU hosts only for now: stages hand their "
                             "hidden states on through shared memory (on CUDA that would be NCCL send/recv)")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("--enable-expert-parallel places experts over the tensor-parallel ranks: it needs "
                             "--tensor-parallel-size above 1")
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1 and self.speculative == "eagle3":
            raise ValueError("--speculative eagle3 with model parallelism is not supported: the head reads the "
                             "target's embedding and hidden states, which are split across the ranks; use ngram "
                             "or draft")
        if self.lora:
            if not 1 <= self.max_loras <= 256:
                raise ValueError(f"--max-loras must be in 1..256, got {self.max_loras}")
            if not 1 <= self.max_lora_rank <= 512:
                raise ValueError(f"--max-lora-rank must be in 1..512, got {self.max_lora_rank}")
            if self.lora_dtype not in ("float32", "float16"):
                raise ValueError(f"--lora-dtype must be float32 or float16, got {self.lora_dtype!r}")
            if len(self.lora_modules) > self.max_loras:
                raise ValueError(f"--lora-modules names {len(self.lora_modules)} adapters; --max-loras is "
                                 f"{self.max_loras}")

    @property
    def torch_device(self) -> torch.device:
        torch = _torch()
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model dtype unless asked. float16 on CPU halves the bytes per
        cached token (twice the tokens in `--kv-cache-gb`) and what decode attention streams (SmolLM2,
        Q4_1, 2-core AVX2: decode 1.06x at batch 1 and 1.10x at batch 16 after 256-token prompts,
        perplexity unchanged to 3 decimals; `python -m loadtest.bench_engine --kv-dtypes`), at the cost
        of exactness: logits then differ from the float32 model by float16's rounding of K and V. fp8 (e4m3,
        1 byte: 2x bfloat16's tokens per byte, 4x float32's) rounds K and V to 3 mantissa bits, with a scale of
        1 per layer (e4m3 reaches +-448; vLLM's default without calibrated scales); kernels widen it exactly."""
        if self.kv_cache_dtype == "auto":
            return self.torch_dtype
        if self.kv_cache_dtype in ("fp8", "fp8_e4m3"):
            return _torch().float8_e4m3fn
        return getattr(_torch(), self.kv_cache_dtype)

    @property
    def prefill_cap(self) -> int | None:
        """Prompt tokens per step while streams decode, resolved for the device (None: no cap)."""
        cap = self.max_prefill_tokens_while_decoding
        if cap is None:
            return CPU_PREFILL_WHILE_DECODING if self.torch_device.type == "cpu" else None
        return cap or None

    @property
    def torch_dtype(self) -> torch.dtype:
        torch = _torch()
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


def _torch() -> ModuleType:
    import torch

    return torch
