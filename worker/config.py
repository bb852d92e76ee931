"""One config dataclass per worker process, from CLI flags (and `SPLITFIRE_<FLAG>` env vars)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from engine.engine_config import EngineConfig
from kvtransfer.config import TransferConfig

ROLES = ("prefill", "decode", "both")
DEFAULT_GRPC_PORT = {"prefill": 50061, "decode": 50051, "both": 50051}


@dataclass
class WorkerConfig:
    role: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    host: str = "0.0.0.0"  # bind address of the gRPC and metrics servers
    grpc_port: int = 50051
    metrics_port: int = 0  # 0 = grpc_port + 1000
    advertise: str = ""  # host:port the router should dial; default <mooncake host>:<grpc port>
    redis_url: str = ""  # self-register with a heartbeat here (router discovery)
    cpus: list[int] = field(default_factory=list)  # pin the process to these cores
    drain_timeout_s: float = 30.0
    # decode role: conditional disaggregation and remote-prefill safety
    local_prefill_max_tokens: int = 128
    local_prefill_max_fraction: float = 1.0
    prefill_timeout_s: float = 120.0
    kv_quarantine_s: float = 5.0  # hold blocks this long after a failed/aborted transfer (late writes)
    kv_landing: bool = True  # offer spare blocks to prefill workers split over more ranks (KVCache.land)
    reserve_timeout_s: float = 30.0  # wait this long for free KV blocks before refusing a request
    stream_interval: int = 1  # send a stream event every N new tokens (first token and the end: at once)
    stream_relay: str = "direct"  # mux streams: "direct" (a step's plain tokens framed as the engine hands them
    # out, decode_worker/service.py) or "queued" (every output through the stream's handler: the reference)
    kv_store: str = ""  # host:port of mooncake_master: the cluster-wide KV tier ("" = none)
    kv_store_gb: float = 0.0  # memory this worker lends to that tier
    lora_roots: list[str] = field(default_factory=list)  # run-time adapter loads only from under these
    # Colocated role: more base models this worker serves, loaded when a request names one
    # (worker/model_host.py), within these limits (0: none).
    on_demand_models: list[str] = field(default_factory=list)
    max_loaded_models: int = 0
    model_memory_gb: float = 0.0

    def lora_path(self, path: str) -> str:
        """`path` resolved, if it lies under a --lora-root; ValueError naming the rule otherwise."""
        if not self.lora_roots:
            raise ValueError("loading adapters at run time is off on this worker: start it with --lora-root DIR")
        real = os.path.realpath(path)
        for root in self.lora_roots:
            r = os.path.realpath(root)
            if os.path.commonpath([real, r]) == r:
                return real
        raise ValueError(f"lora_path {path!r} is outside the adapter roots (--lora-root: {', '.join(self.lora_roots)})")

    def validate(self) -> WorkerConfig:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 < self.grpc_port < 65536:
            raise ValueError(f"--grpc-port must be in 1..65535, got {self.grpc_port}")
        if self.metrics_port == 0:
            self.metrics_port = self.grpc_port + 1000
        if not 0 < self.metrics_port < 65536 or self.metrics_port == self.grpc_port:
            raise ValueError(f"--metrics-port must be in 1..65535 and differ from --grpc-port, got {self.metrics_port}")
        if self.local_prefill_max_tokens < 0 or not 0 <= self.local_prefill_max_fraction <= 1:
            raise ValueError("--local-prefill-max-tokens must be >= 0 and --local-prefill-max-fraction in [0, 1]")
        for root in self.lora_roots:
            if not os.path.isdir(root):
                raise ValueError(f"--lora-root {root} is not a directory")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.stream_relay not in ("direct", "queued"):
            raise ValueError(f"--stream-relay must be direct or queued, got {self.stream_relay!r}")
        for name in ("prefill_timeout_s", "kv_quarantine_s", "reserve_timeout_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.cpus and any(c < 0 or c >= (os.cpu_count() or 1) for c in self.cpus):
            raise ValueError(f"--cpus {self.cpus} names a core this machine does not have ({os.cpu_count()} cores)")
        if self.kv_store_gb < 0:
            raise ValueError(f"--kv-store-gb must be >= 0, got {self.kv_store_gb}")
        if self.kv_store:
            from kvtransfer.store import StoreConfig

            StoreConfig(self.kv_store).validate()
        if not self.advertise:
            self.advertise = f"{self.transfer.hostname}:{self.grpc_port}"
        self.engine.validate()
        if self.role != "both":
            self.transfer.validate()
        self._validate_hosting()
        return self

    def _validate_hosting(self) -> None:
        if self.max_loaded_models < 0 or self.model_memory_gb < 0:
            raise ValueError("--max-loaded-models and --model-memory-gb must be >= 0")
        if not self.on_demand_models:
            if self.max_loaded_models or self.model_memory_gb:
                raise ValueError("--max-loaded-models / --model-memory-gb limit the models loaded on demand: "
                                 "add --on-demand-model")
            return
        if self.role != "both":
            raise ValueError("--on-demand-model is served by colocated workers (splitfire serve) for now: a prefill "
                             "or decode worker's KV transfer addresses one model's cache")
        if self.engine.tensor_parallel_size * self.engine.pipeline_parallel_size > 1:
            raise ValueError("--on-demand-model with --tensor-parallel-size / --pipeline-parallel-size above 1 is "
                             "not supported yet")
        if self.engine.device == "cuda":
            raise ValueError("--on-demand-model is CPU-only for now: on CUDA each engine sizes its KV cache from "
                             "the GPU's free memory, so a second model would find none left")
        if self.max_loaded_models == 1:
            raise ValueError("--max-loaded-models 1 leaves no room beside the first model, which stays resident")


def _env(name: str, default: object) -> object:
    return os.environ.get(f"SPLITFIRE_{name.upper()}", default)


def _list_env(name: str) -> list[str]:
    """A repeatable flag's default from `SPLITFIRE_<NAME>` (comma-separated)."""
    return [v for v in str(_env(name, "")).split(",") if v]


def parse_cpus(spec: str) -> list[int]:
    """'0', '0,1', '2-5' → core ids."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=os.environ.get("SPLITFIRE_MODEL"), help="built-in name, HF model dir or .gguf (env SPLITFIRE_MODEL; default smollm2-135m-instruct)")
    g.add_argument("--device", default=_env("device", "auto"), choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", default=_env("dtype", "auto"), choices=["auto", "float32", "bfloat16"])
    g.add_argument("--kv-cache-dtype", default=_env("kv_cache_dtype", "auto"),
                   choices=["auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3"],
                   help="KV cache element type (auto: the model dtype). fp8 (= fp8_e4m3) holds 2x bfloat16's tokens "
                        "in the same memory, anywhere; float16 on CPU halves float32's bytes per token; on CUDA the "
                        "model dtype or fp8. Disaggregated workers must agree (refused by name otherwise)")
    g.add_argument("--quantization", default=_env("quantization", None), choices=["int8", "int4", "fp8"],
                   help="keep matmul weights quantized (group-wise; decode moves 4x / 8x / 4x fewer bytes "
                        "than float32): quantizes a float checkpoint at load (fp8: e4m3 with a scale per row per 128 "
                        "columns); a GGUF's Q8_0/Q6_K/Q4_0/Q4_1/Q4_K tensors and a block-FP8 checkpoint's weights "
                        "stay as stored without it")
    g.add_argument("--compress-weights", action="store_true",
                   default=_env("compress_weights", "") not in ("", "0"),
                   help="keep bfloat16 matmul weights losslessly compressed in GPU memory (a 4-bit exponent code "
                        "per weight, ~0.75 of the bytes; a Triton matmul decodes each tile): more room for the KV "
                        "cache, identical weights; an 8B decode step measured 1.39x the bfloat16 time at batch 1 on an "
                        "H200 (the matmul 1.4-2.9x), so it "
                        "trades step time for memory")
    g.add_argument("--enforce-eager", action="store_true", default=_env("enforce_eager", "") not in ("", "0"),
                   help="no CUDA graphs: every decode step runs eagerly (by default decode-only steps replay a graph "
                        "captured per batch-size bucket on CUDA; CPU always runs eagerly)")
    g.add_argument("--async-scheduling", default=_env("async_scheduling", "auto"), choices=["auto", "on", "off"],
                   help="queue decode step n+1 before reading step n's tokens, so the host schedules and prepares "
                        "while the device computes (auto: on CUDA with decode graphs; greedy or sampled rows without "
                        "logprobs, penalties or a grammar — other steps run in order)")
    g.add_argument("--cpu-activations", default=_env("cpu_activations", "float"), choices=["float", "int8"],
                   help="quantized weights on CPU at batch 1-2: multiply their codes by float activations (exactly the "
                        "dequantized model; default) or by activations rounded to int8 per 32 values (llama.cpp's "
                        "scheme: ~25%% faster batch-1 decode, but it changed SmolLM2-135M's greedy chat answers)")
    g.add_argument("--kv-cache-gb", type=float, default=float(_env("kv_cache_gb", 1.0)), help="KV cache size on CPU (GiB)")
    g.add_argument("--gpu-memory-fraction", type=float, default=float(_env("gpu_memory_fraction", 0.85)),
                   help="share of the free GPU memory (after weights) the engine uses: the KV cache gets it less the "
                        "measured peaks of the largest prompt chunk and the decode graphs")
    g.add_argument("--block-size", type=int, default=int(_env("block_size", 16)), help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=int(_env("max_num_seqs", 64)), help="running batch limit")
    g.add_argument("--max-num-batched-tokens", type=int, default=int(_env("max_num_batched_tokens", 512)),
                   help="tokens per step (prefill chunk size)")
    g.add_argument("--max-prefill-tokens-while-decoding", type=int,
                   default=_env("max_prefill_tokens_while_decoding", None),
                   help="prompt tokens a step may carry while streams are decoding (default: 24 on CPU, the whole "
                        "step budget on CUDA; 0: the whole budget); smaller bounds their inter-token latency, at the "
                        "cost of time to first token")
    g.add_argument("--max-model-len", type=int, default=_env("max_model_len", None), help="context limit (default: the model's)")
    g.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    g.add_argument("--threads", type=int, default=_env("threads", None),
                   help="torch CPU threads (per rank with --tensor-parallel-size; default: the cores shared out)")
    g.add_argument("--fixed-threads", action="store_true", default=_env("fixed_threads", "") not in ("", "0"),
                   help="keep --threads compute threads even while other processes take some of the worker's "
                        "cores (default: one fewer per core taken, so the threads never wait for each other "
                        "behind a neighbour)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=int(_env("tensor_parallel_size", 1)),
                   help="split the model across this many ranks (one process each; gloo on CPU, NCCL on CUDA)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=int(_env("pipeline_parallel_size", 1)),
                   help="split the layers into this many stages, one process each (CPU hosts; with -tp, each "
                        "stage tensor parallel)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   default=_env("enable_expert_parallel", "") not in ("", "0"),
                   help="place routed experts whole over the tensor-parallel ranks (default: split each expert)")
    g.add_argument("--speculative", default=_env("speculative", "off"), choices=["off", "ngram", "draft", "eagle3"],
                   help="speculative decoding: ngram = prompt lookup (drafts copied from earlier "
                        "text), draft = a smaller model of the same tokenizer (--draft-model), eagle3 = an EAGLE-3 "
                        "head trained for this target (--draft-model DIR); drafts are verified "
                        "in one step: greedy and seeded output identical, sampled output from the same distribution; "
                        "default ngram on decode workers, else off; prefill workers never decode, so it does "
                        "nothing there")
    g.add_argument("--draft-model", default=_env("draft_model", None),
                   help="with --speculative draft: the draft model (built-in name, HF directory or .gguf); "
                        "with --speculative eagle3: the head's directory (config.json + safetensors)")
    g.add_argument("--num-speculative-tokens", type=int, default=int(_env("num_speculative_tokens", 4)),
                   help="drafts per verification step at most")
    g.add_argument("--speculative-max-batch", type=int, default=int(_env("speculative_max_batch", 4)),
                   help="no drafting while more sequences than this are running (verification then costs more)")
    lo = p.add_argument_group("LoRA adapters")
    lo.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                    help="serve these PEFT LoRA adapters beside the base model (a request names one as its model)")
    lo.add_argument("--enable-lora", action="store_true", default=_env("enable_lora", "") not in ("", "0"),
                    help="room for adapters even with none at start (loaded at run time)")
    lo.add_argument("--max-loras", type=int, default=int(_env("max_loras", 4)), help="adapters resident at once")
    lo.add_argument("--max-lora-rank", type=int, default=int(_env("max_lora_rank", 16)),
                    help="the highest rank an adapter may have")
    lo.add_argument("--lora-dtype", default=_env("lora_dtype", "float32"), choices=["float32", "float16"],
                    help="adapter factors in the CPU decode loop: float32 (exact) or float16 (half the bytes read "
                         "per adapter row and step: faster, factors rounded to float16)")


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        kv_cache_gb=args.kv_cache_gb,
        gpu_memory_fraction=args.gpu_memory_fraction,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=int(args.max_model_len) if args.max_model_len else None,
        max_prefill_tokens_while_decoding=(int(args.max_prefill_tokens_while_decoding)
                                           if args.max_prefill_tokens_while_decoding not in (None, "") else None),
        enable_prefix_cache=not args.no_prefix_cache,
        threads=int(args.threads) if args.threads else None,
        adaptive_threads=not args.fixed_threads,
        quantization=args.quantization,
        compress_weights=args.compress_weights,
        cpu_activations=args.cpu_activations,
        decode_graphs="off" if args.enforce_eager else "auto",
        async_scheduling=args.async_scheduling,
        speculative=args.speculative,
        draft_model=args.draft_model,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_max_batch=args.speculative_max_batch,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        lora_modules=parse_lora_modules(args.lora_modules),
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        lora_dtype=args.lora_dtype,
    )


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {item!r}")
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


def add_worker_args(p: argparse.ArgumentParser, role: str) -> None:
    add_engine_args(p)
    if role == "decode":  # decode workers speculate by default (prompt lookup, lossless)
        p.set_defaults(speculative=_env("speculative", "ngram"))
    g = p.add_argument_group("serving")
    g.add_argument("--host", default=_env("host", "0.0.0.0"), help="bind address")
    g.add_argument("--grpc-port", type=int, default=int(_env("grpc_port", DEFAULT_GRPC_PORT[role])))
    g.add_argument("--metrics-port", type=int, default=int(_env("metrics_port", 0)), help="Prometheus /metrics (default grpc port + 1000)")
    g.add_argument("--advertise", default=_env("advertise", ""), help="host:port the router dials (default <mooncake-host>:<grpc-port>)")
    g.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""), help="self-register here for router discovery (env REDIS_URL)")
    g.add_argument("--cpus", default=_env("cpus", ""), help="pin to these cores, e.g. 0 or 0-3 (also sets torch threads)")
    g.add_argument("--drain-timeout", type=float, default=float(_env("drain_timeout", 30.0)), help="SIGTERM: seconds to finish in-flight requests")
    g.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                   help="adapters may be loaded at run time (POST /v1/load_lora_adapter) from under this directory "
                        "only (repeatable; none: run-time loading is refused)")
    m = p.add_argument_group("KV transfer (Mooncake)")
    m.add_argument("--mooncake-protocol", default=_env("mooncake_protocol", "tcp"), choices=["tcp", "rdma"])
    m.add_argument("--mooncake-metadata", default=_env("mooncake_metadata", "P2PHANDSHAKE"),
                   help="P2PHANDSHAKE, etcd://host:port or http://host:port/metadata")
    m.add_argument("--mooncake-host", default=_env("mooncake_host", "127.0.0.1"), help="address peers reach this worker at")
    m.add_argument("--mooncake-device", default=_env("mooncake_device", ""), help="RDMA NICs, e.g. mlx5_0,mlx5_1")
    m.add_argument("--mooncake-timeout", type=int, default=int(_env("mooncake_timeout", 30)), help="seconds (>= 5)")
    m.add_argument("--kv-store", default=_env("kv_store", ""),
                   help="host:port of mooncake_master: share full KV blocks with every worker (Mooncake Store)")
    m.add_argument("--kv-store-gb", type=float, default=float(_env("kv_store_gb", 0.0)),
                   help="memory this worker lends to the shared KV store (0: use it, hold none of it)")
    if role in ("decode", "both"):
        d = p.add_argument_group("decode")
        d.add_argument("--local-prefill-max-tokens", type=int, default=int(_env("local_prefill_max_tokens", 128)),
                       help="prefill here when the uncached prompt part is at most this many tokens ...")
        d.add_argument("--local-prefill-max-fraction", type=float, default=float(_env("local_prefill_max_fraction", 1.0)),
                       help="... and at most this fraction of the prompt (0 disables local prefill)")
        d.add_argument("--prefill-timeout", type=float, default=float(_env("prefill_timeout", 120.0)))
        d.add_argument("--kv-quarantine", type=float, default=float(_env("kv_quarantine", 5.0)),
                       help="seconds to hold blocks after a failed or aborted transfer")
        d.add_argument("--no-kv-landing", action="store_true", default=_env("no_kv_landing", "") not in ("", "0"),
                       help="write a prefill worker split over more tensor-parallel ranks row by row into the "
                            "pages, instead of letting it send whole pages into spare blocks moved into place here")
        if role == "both":
            h = p.add_argument_group("several models in one worker")
            h.add_argument("--on-demand-model", action="append", default=_list_env("on_demand_models"),
                           metavar="MODEL", help="another base model this worker serves, loaded when a request names "
                           "it (repeatable; --model stays resident)")
            h.add_argument("--max-loaded-models", type=int, default=int(_env("max_loaded_models", 0)),
                           help="models resident at once, --model included (0: no limit); the least recently used "
                                "idle one is evicted to load another")
            h.add_argument("--model-memory-gb", type=float, default=float(_env("model_memory_gb", 0.0)),
                           help="GiB of weights + KV cache the resident models may take together (0: no limit)")
        d.add_argument("--stream-interval", type=int, default=int(_env("stream_interval", 1)),
                       help="send a stream event every N tokens: fewer gRPC messages (router CPU) for "
                            "coarser streaming; the first token and the end are always sent at once")
        d.add_argument("--stream-relay", default=_env("stream_relay", "direct"), choices=("direct", "queued"),
                       help="streams multiplexed to a router: direct frames a step's plain tokens as the engine "
                            "hands them out (no task switch per token per stream); queued sends every output "
                            "through the stream's handler (the reference path)")


def worker_config_from(args: argparse.Namespace, role: str) -> WorkerConfig:
    cfg = WorkerConfig(
        role=role,
        engine=engine_config_from(args),
        transfer=TransferConfig(
            hostname=args.mooncake_host, protocol=args.mooncake_protocol, metadata=args.mooncake_metadata,
            device_name=args.mooncake_device, timeout_s=args.mooncake_timeout,
        ),
        host=args.host,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        advertise=args.advertise,
        redis_url=args.redis_url,
        cpus=parse_cpus(args.cpus) if args.cpus else [],
        drain_timeout_s=args.drain_timeout,
        kv_store=args.kv_store,
        kv_store_gb=args.kv_store_gb,
        lora_roots=list(args.lora_root),
    )
    if role == "both":
        cfg.on_demand_models = list(args.on_demand_model)
        cfg.max_loaded_models = args.max_loaded_models
        cfg.model_memory_gb = args.model_memory_gb
    if role in ("decode", "both"):
        cfg.local_prefill_max_tokens = args.local_prefill_max_tokens
        cfg.local_prefill_max_fraction = args.local_prefill_max_fraction
        cfg.prefill_timeout_s = args.prefill_timeout
        cfg.kv_quarantine_s = args.kv_quarantine
        cfg.kv_landing = not args.no_kv_landing
        cfg.stream_interval = args.stream_interval
        cfg.stream_relay = args.stream_relay
    return cfg.validate()
