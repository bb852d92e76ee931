"""Quantized weights against float32 on the same model, one run (`bench_engine.py --quant`).

Variants of SmolLM2-135M-Instruct from its one GGUF (Q4_1 matmuls, Q8_0 embedding): float32
(every tensor dequantized), int8 and int4 (that float32 checkpoint quantized at load with
--quantization), and the GGUF served at its own precision (the default) with float or int8
activations (--cpu-activations). Per variant: matmul weight bytes, decode tok/s at batch 1 and 16,
prefill tok/s, perplexity on loadtest/data/prose.txt as decode computes it, greedy agreement with
float32 on 16 prose prompts and on 8 short chat questions (each decoded alone, at batch 1). Then, with --vs-llama-server, the HTTP serving
comparison of loadtest/vs_llama_server.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from common.sampling_params import SamplingParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loading.model_store import DEFAULT_MODEL, builtin_gguf, fetch_builtin
from engine.model import quant
from engine.model.kernels import cpu_ops
from loadtest import quality
from loadtest.engine_runs import decode_rate as batch_decode_rate
from loadtest.engine_runs import ours_prefill, prompt_ids, random_ids


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
        model = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "amx_tile") if f in flags]
    return f"{model.split(':', 1)[1].strip()}, {torch.get_num_threads()} threads, {' '.join(simd)}"


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes a decode step streams for matmuls: quantized codes + scales, or float weights."""
    from engine.model.layers import Linear

    total = 0
    for m in engine.model.modules():
        if isinstance(m, Linear):
            if m.quantized is not None:
                total += sum(p.nbytes for p in m.quantized)
            elif m.packed is not None or m.weight is not None:
                w = m.weight if m.weight is not None else m.packed
                total += w.numel() * w.element_size()
    return total


def decode_rate(engine: LLMEngine, batch: int, tag: str, tokens: int = 48) -> float:

    prompts = [prompt_ids(engine.tokenizer, 64, salt=i) for i in range(batch)]
    return batch_decode_rate(engine, prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), tag)


def prefill_rate(engine: LLMEngine, n: int, salt: int) -> float:

    return ours_prefill(engine, random_ids(engine.model_config.vocab_size, n, salt), salt)


def decode_perplexity(engine: LLMEngine) -> float:
    """Perplexity with every row computed by the kernels decode uses (the integer-dot kernel with int8
    activations), not prefill's dequantize-and-GEMM: the accuracy of what is served token by token."""
    saved = quant.KERNEL_MAX_ROWS, quant.Q8X_MAX_ROWS
    quant.KERNEL_MAX_ROWS = quant.Q8X_MAX_ROWS = 1 << 30
    try:
        return quality.perplexity(engine)[0]
    finally:
        quant.KERNEL_MAX_ROWS, quant.Q8X_MAX_ROWS = saved


def _median_us(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _float_gemm(x: torch.Tensor, w: quant.QuantizedWeight) -> torch.Tensor:
    return torch.nn.functional.linear(x, w.dequantize())


def main_gemm(args: argparse.Namespace) -> int:
    """One quantized matmul at SmolLM2's shapes, three ways in one run: the C tiles (weights
    dequantized in registers, activation rows re-read per weight row), the panel GEMM (a panel of
    weight rows dequantized into cache once, 3x4 register blocks) and dequantize + torch's float32
    GEMM. Outputs of the two C paths are compared bit for bit."""
    lib = cpu_ops.library()
    if lib is None or not lib.sf_has_avx2():
        print("the panel GEMM needs the C kernels built with AVX2+FMA", file=sys.stderr)
        return 1
    shapes = [("q|k|v", 960, 576), ("o", 576, 576), ("gate|up", 3072, 576), ("down", 576, 1536)]
    rows_list = [int(r) for r in args.gemm_rows.split(",")]
    saved = quant.KERNEL_MAX_ROWS
    quant.KERNEL_MAX_ROWS = 1 << 30  # every row count through the C kernels; the float GEMM is timed separately
    g = torch.Generator().manual_seed(0)
    print(f"CPU: {cpu_flags()}; median of {args.rounds * 10} calls, us (GFLOP/s)")
    print(f"{'weight':<16}{'rows':>6}{'tiles':>16}{'panel':>16}{'dequant+GEMM':>16}{'panel/tiles':>13}{'panel/GEMM':>12}")
    try:
        for kind in ("int4", "int8"):
            for name, n, k in shapes:
                w = quant.quantize(torch.randn(n, k, generator=g), kind, 32)
                for rows in rows_list:
                    x = torch.randn(rows, k, generator=g)
                    lib.sf_set_panel_min_rows(1 << 30)
                    tiles = _median_us(partial(quant.linear, x, [w], None), args.rounds * 10)
                    ref = quant.linear(x, [w], None)
                    lib.sf_set_panel_min_rows(1)
                    panel = _median_us(partial(quant.linear, x, [w], None), args.rounds * 10)
                    # Bit for bit, except int4 at one row, whose tile factors the min term out.
                    if not (kind == "int4" and rows == 1) and not torch.equal(quant.linear(x, [w], None), ref):
                        raise AssertionError(f"panel and tiles differ: {kind} {name} rows={rows}")
                    gemm = _median_us(partial(_float_gemm, x, w), args.rounds * 10)
                    flop = 2 * rows * n * k / 1e3
                    cells = "".join(f"{t:>8.0f} ({flop / t:>4.0f})" for t in (tiles, panel, gemm))
                    print(f"{kind + ' ' + name:<16}{rows:>6}{cells}{tiles / panel:>12.2f}x{gemm / panel:>11.2f}x")
    finally:
        quant.KERNEL_MAX_ROWS = saved
        lib.sf_set_panel_min_rows(cpu_ops.PANEL_MIN_ROWS)
    return 0


def main_kv(args: argparse.Namespace) -> int:
    """float32 against float16 and e4m3 (fp8) KV caches on the same model (the default SmolLM2, Q4_1
    weights as stored), interleaved rounds in one run: decode tok/s once every sequence decodes, at batch
    1 and 16 after 256-token prompts (the contexts of `vs_llama_server`) and at batch 1 after 1,024;
    cache bytes per token; perplexity on prose.txt (prefill's attention reads the cache too)."""

    path = fetch_builtin(args.model or DEFAULT_MODEL)
    kinds = ("float32", "float16", "fp8")
    engines = {dt: LLMEngine(EngineConfig(model=str(path), device="cpu", threads=args.threads, kv_cache_gb=1.0,
                                          kv_cache_dtype=dt, enable_prefix_cache=False))
               for dt in kinds}
    cases = [(1, 256), (16, 256), (1, 1024)]
    found: dict[str, dict[str, list[float]]] = {dt: {} for dt in engines}
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for r in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        for dt, engine in engines.items():
            for batch, ctx in cases:
                prompts = [random_ids(engine.model_config.vocab_size, ctx, 1000 * r + i) for i in range(batch)]
                found[dt].setdefault(f"b{batch}@{ctx}", []).append(batch_decode_rate(engine, prompts, sp, f"{dt}-{r}-{batch}-{ctx}"))
    ppl = {dt: quality.perplexity(engine)[0] for dt, engine in engines.items()}
    print(f"\nSmolLM2-135M-Instruct (Q4_1 weights), CPU: {cpu_flags()}; decode tok/s, medians of {args.rounds} "
          "interleaved rounds")
    print(f"{'':<30}" + "".join(f"{dt + ' KV':>14}" for dt in kinds) + f"{'f16 / f32':>12}{'fp8 / f32':>12}")
    per_token = {dt: e.kv.layout.page_bytes * e.kv.layout.num_layers / e.kv.layout.block_size for dt, e in engines.items()}

    def row(label: str, v: dict[str, float], fmt: str, ratio: str) -> None:
        cells = "".join(f"{v[dt]:>14{fmt}}" for dt in kinds)
        rel = "".join(f"{(v[dt] / v['float32'] if ratio == 'x' else v[dt] / v['float32'] - 1):>11.2f}x" if ratio == "x"
                      else f"{v[dt] / v['float32'] - 1:>+12.2%}" for dt in kinds[1:])
        print(f"{label:<30}{cells}{rel}")

    row("KV bytes per token", per_token, ".0f", "x")
    for batch, ctx in cases:
        key = f"b{batch}@{ctx}"
        row(f"decode batch {batch}, {ctx}-token prompts", {dt: statistics.median(found[dt][key]) for dt in kinds}, ".1f",
            "x")
    row("perplexity (prose.txt)", ppl, ".3f", "%")
    return 0


def main_quant(args: argparse.Namespace) -> int:
    name = args.model or DEFAULT_MODEL
    native = fetch_builtin(name)
    floats = fetch_builtin(name, keep_quantized=False)
    variants = [("float32", floats, None, "float"), ("int8", floats, "int8", "float"),
                ("fp8", floats, "fp8", "float"), ("int4", floats, "int4", "float"), ("Q4_1", native, None, "float"),
                ("Q4_1 int8-x", native, None, "int8")]
    rows: dict[str, dict[str, float]] = {}
    greedy_ref: list[list[int]] = []
    chat_ref: list[list[int]] = []
    for label, path, q, act in tqdm(variants, desc="variants", file=sys.stderr):
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=str(path), device="cpu", threads=args.threads, quantization=q,
                                        cpu_activations=act, kv_cache_gb=0.5, max_num_batched_tokens=512,
                                        enable_prefix_cache=False))
        r: dict[str, float] = {"load_s": time.perf_counter() - t0, "mb": weight_bytes(engine) / 1e6}
        decode_rate(engine, 1, f"warm-{label}", 8)
        for b in (1, 16):
            r[f"decode_{b}"] = statistics.median(decode_rate(engine, b, f"{label}-{b}-{i}") for i in range(args.rounds))
        r["prefill_512"] = statistics.median(prefill_rate(engine, 512, 1000 + i) for i in range(args.rounds))
        r["ppl"] = decode_perplexity(engine)
        outs = quality.greedy(engine, quality.prompt_set(engine))
        chats = quality.greedy(engine, quality.chat_set(engine), max_tokens=24)
        if not greedy_ref:
            greedy_ref, chat_ref = outs, chats
        r["same"], r["prefix"] = quality.agreement(outs, greedy_ref)
        r["chat_same"], _ = quality.agreement(chats, chat_ref)
        rows[label] = r
        del engine
    print(f"\nSmolLM2-135M-Instruct, CPU: {cpu_flags()}; C kernels: "
          f"{'on' if cpu_ops.library() is not None else 'off (torch paths)'}; medians of {args.rounds} rounds")
    names = list(rows)
    print(f"{'':<28}" + "".join(f"{n:>14}" for n in names))
    fmt = [("matmul weights, MB", "mb", "{:.0f}"), ("load, s", "load_s", "{:.2f}"),
           ("decode batch 1, tok/s", "decode_1", "{:.1f}"), ("decode batch 16, tok/s", "decode_16", "{:.1f}"),
           ("prefill 512, tok/s", "prefill_512", "{:.0f}"), ("perplexity (prose.txt)", "ppl", "{:.3f}"),
           ("greedy = float32 (prose)", "same", "{:.0%}"), ("greedy common prefix", "prefix", "{:.0%}"),
           ("chat answers = float32", "chat_same", "{:.0%}")]
    for label, key, f in fmt:
        print(f"{label:<28}" + "".join(f"{f.format(rows[n][key]):>14}" for n in names))
    base = rows["float32"]
    print(f"{'batch 1 vs float32':<28}" + "".join(f"{rows[n]['decode_1'] / base['decode_1']:>13.2f}x" for n in names))
    print(f"{'perplexity vs float32':<28}" + "".join(f"{rows[n]['ppl'] / base['ppl'] - 1:>+14.2%}" for n in names))
    print("targets: int4 perplexity within 3% of float32")
    if args.vs_llama_server is not None:
        from loadtest import vs_llama_server

        with tempfile.TemporaryDirectory(prefix="vs-llama-") as logs:
            found = vs_llama_server.run(builtin_gguf(name), args.vs_llama_server or None,
                                        [int(s) for s in args.streams.split(",")], args.duration, Path(logs),
                                        args.splitfire_arg or [])
        print(f"\n/v1/completions, ~256-token prompts, {vs_llama_server.MAX_TOKENS} tokens out, greedy, closed loop, "
              f"{args.duration:.0f} s per level, both servers on this CPU ({cpu_flags()}):")
        print(vs_llama_server.table(found))
        print("targets: 1 stream >= 1.0x llama-server output tok/s; 16 streams >= 1.5x, inter-token p99 below theirs")
    return 0
