"""GPU engine benchmark: decode step time vs the memory-bandwidth roofline, prefill MFU, and the
Triton attention path vs torch SDPA, on random bf16 weights of real model shapes. Prints one table.

    python -m loadtest.bench_gpu                          # Llama-3-8B and SmolLM2 shapes, CUDA
    python -m loadtest.bench_gpu --preset deepseek-v2-lite   # latent attention + experts
    python -m loadtest.bench_gpu --preset deepseek-v2-lite --quantization int4   # quantized experts
    python -m loadtest.bench_gpu --preset llama3-8b --compress-weights   # weights held losslessly compressed
    python -m loadtest.bench_gpu --preset llama3-8b --quantization fp8 --fp8-gemm weight-only,w8a8   # FP8 weights
    python -m loadtest.bench_gpu --preset llama3-8b --kv-cache-dtype fp8 --context 16384 --batches 1,8   # e4m3 KV
    python -m loadtest.bench_gpu --device cpu --preset tiny --batches 1,4 --prefill-tokens 128   # smoke test

Roofline: a decode step must read every weight once plus each sequence's K/V; bytes / measured
copy bandwidth is the fastest the step could be. MFU: model FLOPs of a 2k-token prefill / time /
the measured peak of a large bf16 matmul on this device (an achievable peak, not the spec sheet).
Each decode batch has an eager row and a CUDA-graph row (`engine/batch/graph_runner.py`; on CPU the
"graph" row is the padded forward, no replay). `--first-token DIR` adds a real model's start:
`splitfire serve` from process start to engine ready, worker ready and first token on this device
(one start; `python -m loadtest.bench_coldstart --device cuda --model DIR` for medians, load paths
and memory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from common.sampling_params import SamplingParams
from engine.batch.block_manager import BlockManager
from engine.batch.graph_runner import DecodeGraphs
from engine.batch.model_runner import ModelRunner
from engine.batch.scheduler import ScheduledSeq
from engine.batch.sequence import Sequence
from engine.loading import weight_cache
from engine.model.decoder import DecoderModel
from engine.model.kernels import compressed_triton, kernels, moe_triton
from engine.model.kv_cache import KVCache, KVLayout
from engine.model.model_config import ModelConfig

PRESETS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=4096,
                 tie_word_embeddings=True),
    # Latent attention + routed experts (fits one GPU): DeepSeek-V2-Lite's shape.
    "deepseek-v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048,
                             intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                             num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
                             num_experts_per_tok=6, first_k_dense_replace=1, topk_method="greedy",
                             max_position_embeddings=8192, tie_word_embeddings=False),
    "tiny-mla": dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=512, hidden_size=128, intermediate_size=256,
                     moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=32,
                     q_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                     n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                     max_position_embeddings=4096, tie_word_embeddings=True),
}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bandwidth(dev: torch.device) -> float:
    n = (2 << 30) if dev.type == "cuda" else (256 << 20)
    a, b = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    b.copy_(a)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    sync(dev)
    return 2 * n * 5 / (time.perf_counter() - t0)  # read + write


def matmul_peak(dev: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if dev.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    a @ b
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(dev)
    return 2 * n**3 * 10 / (time.perf_counter() - t0)


def build(preset: str, dev: torch.device, dtype: torch.dtype, blocks: int, block_size: int,
          quantization: str | None = None, compress: bool = False, kv_dtype: torch.dtype | None = None,
          positions: int = 0):
    """(config, model, KV cache, parameter counts of the float model, bytes per weight as stored). `positions`:
    the context the run needs (a preset's max_position_embeddings is raised to it, as Llama-3.1's 128k is
    Llama-3's 8k with another rope: the step's cost does not depend on it)."""
    shape = dict(PRESETS[preset])
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], positions)
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, **shape})
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the engine's loader builds it: routers stay float32
    try:
        with torch.device(dev):
            model = DecoderModel(cfg)
    finally:
        torch.set_default_dtype(default)
    for p in model.parameters():
        p.normal_(0.0, 0.02)
    counts = ParamCounts.of(model, cfg)
    element = float(torch.empty((), dtype=dtype).element_size())
    if quantization:
        float_bytes = weight_cache.nbytes(model)
        model.quantize(quantization)
        element *= weight_cache.nbytes(model) / float_bytes  # scales and mins included
    if compress:  # (as --compress-weights: every bfloat16 linear weight; the embedding stays)
        float_bytes = weight_cache.nbytes(model)
        element *= (float_bytes - model.compress_weights()) / float_bytes
    model.build_rope_cache(cfg.max_position_embeddings + 1, dev, dtype)
    if dev.type == "cpu":
        model.optimize_for_cpu()
    planes, heads, dim = cfg.kv_entry
    kv = KVCache(KVLayout(cfg.num_layers, blocks, block_size, heads, dim, kv_dtype or dtype, planes), dev)
    return cfg, model, kv, counts, element


@dataclass
class ParamCounts:
    """Counted on the float model, before any quantization replaces its parameters."""

    layers_and_head: int  # every weight a step multiplies through but the embedding table
    experts: int  # of which routed experts

    @classmethod
    def of(cls, model: DecoderModel, cfg: ModelConfig) -> ParamCounts:
        total = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embed"))
        if cfg.tie_word_embeddings:
            total += cfg.vocab_size * cfg.hidden_size
        return cls(total, sum(p.numel() for name, p in model.named_parameters() if ".experts." in name))


def active_params(counts: ParamCounts, cfg: ModelConfig, tokens: int) -> float:
    """Parameters a step over `tokens` tokens multiplies through: every layer weight and the LM head
    (the embedding: a few rows), routed experts only in the share `tokens` tokens are expected to touch
    (top-k of E chosen uniformly: E (1 - (1 - k/E)^tokens) distinct experts)."""
    total = float(counts.layers_and_head)
    if cfg.moe is not None:
        e, k = cfg.moe.num_experts, cfg.moe.top_k
        total -= counts.experts * (1 - (1 - (1 - k / e) ** tokens))
    return total


def params_per_token(counts: ParamCounts, cfg: ModelConfig) -> float:
    """Parameters one token multiplies through (its FLOPs are twice this): routed experts only its top-k."""
    total = float(counts.layers_and_head)
    if cfg.moe is not None:
        total -= counts.experts * (1 - cfg.moe.top_k / cfg.moe.num_experts)
    return total


def attention_flops(cfg: ModelConfig, n: int) -> float:
    """Causal QK^T and PV of an n-token prompt (half of n^2 each)."""
    if cfg.mla is not None:
        m = cfg.mla
        return cfg.num_layers * cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * n * n
    return 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * n


def decode_batch(bm: BlockManager, batch: int, ctx: int) -> list[ScheduledSeq]:
    out = []
    for i in range(batch):
        s = Sequence(f"d{i}", [1] * ctx, SamplingParams(max_tokens=1))
        assert bm.allocate(s, ctx + 1), "KV cache too small for this batch"
        s.num_computed_tokens = ctx - 1
        out.append(ScheduledSeq(s, 1))
    return out


def time_forward(runner: ModelRunner, batch: list[ScheduledSeq], dev: torch.device, iters: int) -> tuple[float, float]:
    """Median wall seconds and CPU seconds of one forward (inputs prepared each time, as in serving)."""
    walls, cpus = [], []
    with torch.inference_mode():
        for i in range(iters + 2):
            c0, t0 = time.process_time(), time.perf_counter()
            ids, pos, meta, _ = runner.prepare(list(batch))
            runner.model(ids, pos, runner.kv, meta)
            sync(dev)
            if i >= 2:
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def time_graph(runner: ModelRunner, batch: list[ScheduledSeq], dev: torch.device, iters: int) -> tuple[float, float]:
    """The same decode step through the graph runner (a captured CUDA graph per bucket; on CPU the
    padded forward it would replay)."""
    walls, cpus = [], []
    with torch.inference_mode():
        for i in range(iters + 2):
            c0, t0 = time.process_time(), time.perf_counter()
            runner._run_graph(list(batch))
            sync(dev)
            if i >= 2:
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def parse_launch(text: str, flag: str, stages: bool = True) -> tuple[int, ...]:
    """"32x256/8/3" -> (block_n, block_k, warps, stages): a launch shape as `flag` spells it (this script's
    --gemv-launch, bench_compressed_gemm's --tiles); with `stages` False "16x512/4" -> (block_n, block_k,
    warps) (a kernel without a pipelined loop: bench_compressed_gemm's --decoder-launches)."""
    form, example = ("NxK/WARPS/STAGES", "32x256/8/3") if stages else ("NxK/WARPS", "16x512/4")
    try:
        dims, *rest = text.split("/")
        bn, bk = (int(v) for v in dims.split("x"))
        if len(rest) != (2 if stages else 1):
            raise ValueError(text)
        return (bn, bk, *(int(v) for v in rest))
    except ValueError:
        raise SystemExit(f"{flag}: {text!r} is not {form} (e.g. {example})") from None


def compressed_ints(args: argparse.Namespace, name: str) -> list[int | None]:
    """A --compress-weights sweep flag's integers, in order ([None]: not given, the module's default)."""
    text, flag = getattr(args, name), "--" + name.replace("_", "-")
    if not text:
        return [None]
    if not args.compress_weights:
        raise SystemExit(f"{flag} needs --compress-weights")
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag} takes integers, got {text!r}") from None


def set_backend(name: str) -> None:
    os.environ["SPLITFIRE_KERNELS"] = name
    kernels.cache_clear()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="llama3-8b,smollm2-135m")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--context", type=int, default=1024, help="tokens of context per decoding sequence")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--backends", default=None, metavar="torch,triton",
                   help="kernel backends to time (default: both on CUDA, torch on CPU)")
    p.add_argument("--first-token", metavar="DIR", default=None,
                   help="also time `splitfire serve` of this model dir from process start to its first token")
    p.add_argument("--quantization", choices=["int8", "int4", "fp8"], default=None,
                   help="quantize the random weights (as --quantization does): the Triton weight-only GEMM (fp8: "
                   "also the w8a8 GEMM, see --fp8-gemm) and, for experts, the grouped kernel over quantized stacks")
    p.add_argument("--fp8-gemm", default=None, metavar="weight-only,w8a8,...",
                   help="with --quantization fp8: time every case once per FP8 matmul method, in this order "
                   "(default: fp8_triton.method_for's choice per batch)")
    p.add_argument("--kv-cache-dtype", choices=["model", "fp8"], default="model",
                   help="the KV cache's element type: the model dtype, or e4m3 (as --kv-cache-dtype fp8)")
    p.add_argument("--compress-weights", action="store_true",
                   help="hold the bfloat16 linear weights losslessly compressed (as --compress-weights does; "
                   "CUDA, Triton backend only): the roofline counts the compressed bytes")
    p.add_argument("--tiles-decode", default=None, metavar="select,fast,...",
                   help="with --compress-weights: time every case once per decode of the many-row kernels: the "
                   "2-32-row tiles, the compressed experts and the prefill's decoder, in this order "
                   "(compressed_triton.TILES_DECODE, moe_triton.EXPERTS_DECODE, "
                   "compressed_triton.DECOMPRESS_DECODE; default: theirs)")
    p.add_argument("--experts-min-blocks", default=None, metavar="2,0,...",
                   help="with --compress-weights: time every case once per moe_triton.DECODED_EXPERTS_MIN_BLOCKS "
                   "(blocks per expert from which the compressed stacks are decoded for the plain grouped GEMM; "
                   "0: never), in this order")
    p.add_argument("--gemv-max-rows", default=None, metavar="1,4,...",
                   help="with --compress-weights: time every case once per compressed_triton.GEMV_MAX_ROWS (rows up "
                   "to which the row kernel runs, 1, 2 or 4 rows per program, instead of the tiles), in this order")
    p.add_argument("--gemv-launch", default=None, metavar="NxK/W/S,...",
                   help="with --compress-weights: time the decode steps once per one-row kernel launch shape "
                   "(block_n x block_k / warps / stages; 'auto': compressed_triton.GEMV_LAUNCH)")
    args = p.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    bw, peak = bandwidth(dev), matmul_peak(dev, dtype)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"device {name}: copy bandwidth {bw / 1e9:.0f} GB/s, {dtype} matmul peak {peak / 1e12:.1f} TFLOP/s; "
          f"weights {args.quantization or dtype}{' compressed' if args.compress_weights else ''}; KV cache "
          f"{'e4m3' if args.kv_cache_dtype == 'fp8' else dtype}"
          f"{'; e4m3 widened by the GPU cvt' if os.environ.get('SPLITFIRE_E4M3_NATIVE') == '1' else ''}")
    backends = ["torch", "triton"] if (dev.type == "cuda" or os.environ.get("TRITON_INTERPRET")) else ["torch"]
    if args.backends:
        if not set(args.backends.split(",")) <= set(backends):
            raise SystemExit(f"--backends: {args.backends!r}; this device runs {','.join(backends)}")
        backends = args.backends.split(",")
    if args.compress_weights:
        if dev.type != "cuda" or args.quantization:
            raise SystemExit("--compress-weights needs --device cuda and no --quantization (as the engine's flag)")
        backends = ["triton"]
    fp8_methods: list[str | None] = [None]
    if args.fp8_gemm:
        if args.quantization != "fp8":
            raise SystemExit("--fp8-gemm needs --quantization fp8")
        fp8_methods = list(args.fp8_gemm.split(","))
        if not set(fp8_methods) <= {"weight-only", "w8a8", "auto"}:
            raise SystemExit(f"--fp8-gemm takes weight-only, w8a8 and auto (the engine's choice by rows), "
                             f"got {args.fp8_gemm!r}")
    from engine.model.kernels import fp8_triton

    default_w8a8_rows = (fp8_triton.W8A8_MIN_ROWS, fp8_triton.W8A8_MAX_ROWS)
    decodes: list[str | None] = [None]
    if args.tiles_decode:
        if not args.compress_weights:
            raise SystemExit("--tiles-decode needs --compress-weights")
        decodes = list(args.tiles_decode.split(","))
        if not set(decodes) <= {"select", "fast"}:
            raise SystemExit(f"--tiles-decode takes select and fast, got {args.tiles_decode!r}")
    default_decodes = (compressed_triton.TILES_DECODE, moe_triton.EXPERTS_DECODE, compressed_triton.DECOMPRESS_DECODE)
    min_blocks = compressed_ints(args, "experts_min_blocks")
    default_min_blocks = moe_triton.DECODED_EXPERTS_MIN_BLOCKS
    max_rows = compressed_ints(args, "gemv_max_rows")
    default_max_rows = compressed_triton.GEMV_MAX_ROWS
    launches: list[tuple[int, int, int, int] | None] = [None]
    default = compressed_triton.GEMV_LAUNCH
    if args.gemv_launch:
        if not args.compress_weights:
            raise SystemExit("--gemv-launch needs --compress-weights (it shapes the compressed one-row kernel)")
        launches = [None if t == "auto" else parse_launch(t, "--gemv-launch") for t in args.gemv_launch.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    # (the path names the launch, decode and experts' blocks)
    pw = (8 + 10 * bool(args.gemv_launch) + 7 * bool(args.tiles_decode) + 5 * bool(args.experts_min_blocks)
          + 5 * bool(args.gemv_max_rows) + 12 * bool(args.fp8_gemm))
    print(f"{'model':<14}{'path':<{pw}}{'case':<18}{'ms':>9}{'CPU ms':>9}{'% roofline / MFU':>18}")
    for preset in args.preset.split(","):
        block_size = 16
        need = max(batches) * (-(-(args.context + 1) // block_size)) + -(-args.prefill_tokens // block_size) + 8
        cfg, model, kv, counts, element = build(preset, dev, dtype, need + 1, block_size, args.quantization,
                                                args.compress_weights,
                                                torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None,
                                                max(args.context + 1, args.prefill_tokens))
        runner = ModelRunner(model, kv, dev)
        page = kv.layout.page_bytes
        for backend, launch, decode, blocks, rows, fp8m in [(b, la, d, mb, r, f) for b in backends for la in launches
                                                            for d in decodes for mb in min_blocks for r in max_rows
                                                            for f in fp8_methods]:
            set_backend(backend)
            # (w8a8 from every row count, or from none: the engine's fp8_triton.method_for decides by rows)
            fp8_triton.W8A8_MIN_ROWS, fp8_triton.W8A8_MAX_ROWS = {
                None: default_w8a8_rows, "auto": default_w8a8_rows, "w8a8": (1, 1 << 30),
                "weight-only": (1 << 30, 1 << 30)}[fp8m]
            if fp8m:
                backend += f"/{fp8m}"
            compressed_triton.GEMV_LAUNCH = launch or default
            (compressed_triton.TILES_DECODE, moe_triton.EXPERTS_DECODE,
             compressed_triton.DECOMPRESS_DECODE) = (decode,) * 3 if decode else default_decodes
            if args.gemv_launch:
                backend += f"@{launch[0]}x{launch[1]}/{launch[2]}" if launch else "@auto"
            moe_triton.DECODED_EXPERTS_MIN_BLOCKS = default_min_blocks if blocks is None else blocks
            if decode:
                backend += f"/{decode}"
            compressed_triton.GEMV_MAX_ROWS = default_max_rows if rows is None else rows
            if blocks is not None:
                backend += f"/mb{blocks}"
            if rows is not None:
                backend += f"/gr{rows}"
            # Decode graphs: the last block is the padding rows' scratch, outside every BlockManager below.
            runner.graphs = DecodeGraphs(lambda ids, pos, meta, m=runner.model, c=runner.kv: m(ids, pos, c, meta),
                                         max(batches),
                                         -(-(args.context + 1) // block_size), block_size, need, dev,
                                         kv.layout.planes)
            paths = [("eager", time_forward), ("graph", time_graph)]
            try:
                runner.graphs.capture()
            except RuntimeError as e:  # as the engine does: say why, decode eagerly
                print(f"{preset:<14}{backend:<{pw}}no decode graphs: {str(e).splitlines()[0]}", flush=True)
                paths = paths[:1]
            for b in batches:
                kv_bytes = b * cfg.num_layers * -(-args.context // block_size) * page
                roof = (active_params(counts, cfg, b) * element + kv_bytes) / bw
                for path, timer in paths:
                    bm = BlockManager(need, block_size, enable_prefix_cache=False)
                    wall, cpu = timer(runner, decode_batch(bm, b, args.context), dev, args.iters)
                    print(f"{preset:<14}{backend:<{pw}}{f'decode b={b} {path}':<18}{wall * 1e3:>9.2f}{cpu * 1e3:>9.2f}"
                          f"{roof / wall:>17.0%}", flush=True)
            runner.graphs = None
            bm = BlockManager(need, block_size, enable_prefix_cache=False)
            n = args.prefill_tokens
            s = Sequence("p", [1] * n, SamplingParams(max_tokens=1))
            assert bm.allocate(s, n)
            wall, cpu = time_forward(runner, [ScheduledSeq(s, n)], dev, max(2, args.iters // 3))
            # Linear layers for every token, the LM head for the last one, causal QK^T + PV (half of n^2 each).
            # (Per token: its own top-k experts, not every expert the batch touches: that count is for bytes.)
            flops = (2 * (params_per_token(counts, cfg) - cfg.vocab_size * cfg.hidden_size) * n
                     + 2 * cfg.vocab_size * cfg.hidden_size + attention_flops(cfg, n))
            print(f"{preset:<14}{backend:<{pw}}{f'prefill {n}':<18}{wall * 1e3:>9.2f}{cpu * 1e3:>9.2f}"
                  f"{flops / wall / peak:>17.0%}  ({n / wall:.0f} tok/s)", flush=True)
        del model, kv, runner
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.first_token:
        from pathlib import Path

        from loadtest.bench_coldstart import serve_start

        start = serve_start(args.first_token, 1.0, 2, False, Path(args.first_token), device=dev.type)
        marks = "  ".join(f"{name} {t:.2f} s" for name, t in start.marks.items())
        print(f"first token: {Path(args.first_token).name} on {dev.type}, after process start: {marks} "
              f"(weights loaded in {start.weights_s:.3f} s)")
    print("targets (issue #7): 8B decode b=1 >= 80% of roofline; prefill MFU >= 50%; CUDA graphs -80% CPU/step "
          "(compare each 'graph' row's CPU ms with its 'eager' row; on CPU 'graph' is the padded forward, no replay)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
