"""`splitfire` — one command for every part: up, router, prefill, decode, serve, generate, model fetch."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Coroutine
from typing import Any

from common import gc_heap

# Commands that call `gc_heap.release` once ready; the others get the collector back at once.
_RELEASE_WHEN_READY = {"prefill", "decode", "serve", "router", "generate"}


def _worker(args: argparse.Namespace, role: str) -> int:
    if role == "prefill":
        from prefill_worker import server as prefill

        _run_loop(prefill.run(prefill.config_from(args)))
    else:
        from decode_worker import server as decode

        _run_loop(decode.run(decode.config_from(args, role)))
    return 0


def _run_loop(main: Coroutine[Any, Any, None]) -> None:
    """uvloop where installed (the `router` extra; `make setup` installs it): its loop costs the
    serving shell about a third less CPU per streamed token than asyncio's (loadtest/bench_host.py)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def _generate(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine
    from engine.offline import generate
    from worker.config import engine_config_from

    engine = LLMEngine(engine_config_from(args))
    gc_heap.release("generate")
    src = open(args.input, encoding="utf-8") if args.input != "-" else sys.stdin
    dst = open(args.output, "w", encoding="utf-8") if args.output != "-" else sys.stdout
    try:
        with src, dst:
            errors = generate(engine, src, dst, progress=not args.quiet)
    finally:
        engine.close()
    if errors:
        print(f"{errors} request(s) failed; see their 'error' fields", file=sys.stderr)
    return 1 if errors else 0


def _fetch(args: argparse.Namespace) -> int:
    from engine.loading.model_store import resolve_model

    print(resolve_model(args.name))
    return 0


def _compress(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from engine.loading.compress import compress_dir
    from engine.loading.compressed import CHUNK
    from engine.loading.model_store import resolve_model

    t0 = time.perf_counter()
    stats = compress_dir(Path(resolve_model(args.model_dir)), Path(args.out_dir), args.chunk or CHUNK, progress=True,
                         coder=args.coder)
    took = time.perf_counter() - t0
    for kind, (orig, stored, ent) in sorted(stats.by_kind.items()):
        # 16-bit weights: n = orig / 2 of them, 8 raw bits each plus the coded plane's order-0 entropy `ent` bits
        bound = f", order-0 entropy bound {(4 * orig + ent) / (8 * orig):.3f}" if ent else ""
        print(f"{kind}: {orig / 2**20:.1f} MiB -> {stored / 2**20:.1f} MiB ({stored / orig:.3f}{bound})")
    print(f"total: {stats.original_bytes / 2**20:.1f} MiB -> {stats.stored_bytes / 2**20:.1f} MiB "
          f"({stats.stored_bytes / max(stats.original_bytes, 1):.3f}) in {took:.1f} s -> {args.out_dir}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from common import sizing

    model = sizing.read_model(args.model)
    device = sizing.DEVICES[args.gpu]
    if args.tp:
        layout = sizing.Layout(args.tp, args.pp, args.enable_expert_parallel)
        p = sizing.plan(model, device, layout, args.quantization, args.kv_cache_dtype,
                        compress_weights=args.compress_weights)
        print(sizing.render(p))
        if args.compress_weights:
            plain = sizing.plan(model, device, layout, args.quantization, args.kv_cache_dtype)
            print(f"  --compress-weights frees     {(plain.weight_bytes - p.weight_bytes) / sizing.GiB:10.1f} GiB "
                  f"per device: {p.kv_tokens - plain.kv_tokens:+,d} KV tokens (after "
                  f"{sizing.DECOMPRESS_BUFFER_BYTES / sizing.GiB:.2f} GiB for the prefill's decoder)")
        print()
    best = sizing.smallest(model, device, args.quantization, args.kv_cache_dtype, args.min_kv_tokens)
    if best is None:
        print(f"no layout of up to 64 {device.name} holds {args.min_kv_tokens:,} KV tokens per device")
        return 1
    print(f"smallest layout holding {args.min_kv_tokens:,} KV tokens per device:")
    print(sizing.render(best))
    return 0


def build_parser() -> argparse.ArgumentParser:
    # Flags only: the worker modules (and torch) are imported by the command that runs one.
    from worker.config import add_engine_args, add_worker_args

    p = argparse.ArgumentParser(prog="splitfire", description=__doc__)
    p.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING (env SPLITFIRE_LOG_LEVEL)")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("prefill", help="run a prefill worker")
    add_worker_args(sp, "prefill")
    sp.set_defaults(func=lambda a: _worker(a, "prefill"))
    sp = sub.add_parser("decode", help="run a decode worker")
    add_worker_args(sp, "decode")
    sp.set_defaults(func=lambda a: _worker(a, "decode"))
    sp = sub.add_parser("serve", help="run a colocated worker (prefill and decode in one process)")
    add_worker_args(sp, "both")
    sp.set_defaults(func=lambda a: _worker(a, "both"))

    sp = sub.add_parser("generate", help="offline batch generation: JSONL in, JSONL out")
    add_engine_args(sp)
    sp.add_argument("--input", default="-", help="JSONL file (default stdin)")
    sp.add_argument("--output", default="-", help="JSONL file (default stdout)")
    sp.add_argument("--quiet", action="store_true", help="no progress bar")
    sp.set_defaults(func=_generate)

    from common.sizing import DEVICES

    pp = sub.add_parser("plan", help="size a deployment from a model's config.json alone (no weights loaded)")
    pp.add_argument("--model", required=True, help="a model directory, its config.json, or a built-in name "
                    "(deepseek-v3, kimi-k2, llama-3.1-70b, llama-3.1-405b, qwen3-235b-a22b, llama-4-scout)")
    pp.add_argument("--gpu", default="h100-80gb", choices=sorted(DEVICES))
    pp.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=0,
                    help="also print this layout (default: only the smallest that fits)")
    pp.add_argument("--pp", "--pipeline-parallel-size", dest="pp", type=int, default=1)
    pp.add_argument("--enable-expert-parallel", action="store_true")
    pp.add_argument("--quantization", choices=["bfloat16", "fp8", "int8", "int4"], default=None,
                    help="weight format (default: as published: FP8 checkpoints in FP8, else their dtype)")
    pp.add_argument("--kv-cache-dtype", choices=["bfloat16", "float16", "fp8"], default=None)
    pp.add_argument("--compress-weights", action="store_true",
                    help="with --tp: bfloat16 matmul weights held losslessly compressed in device memory (the "
                         "worker flag of that name): the weight bytes and the KV tokens they free")
    pp.add_argument("--min-kv-tokens", type=int, default=32768, help="what 'fits' means: KV tokens per device")
    pp.set_defaults(func=_plan)

    cp = sub.add_parser("compress", help="losslessly compress a model's bfloat16/float16 weights (exponents "
                        "entropy-coded; loads bit-exact)")
    cp.add_argument("model_dir", help="a model directory (safetensors) or a built-in name")
    cp.add_argument("out_dir")
    cp.add_argument("--chunk", type=int, default=None, help="weights per independently decodable chunk (default 1M)")
    cp.add_argument("--coder", choices=["huffman", "rans"], default="huffman",
                    help="the exponents' entropy coder: huffman (raw DEFLATE, zlib-readable; default) or rans "
                         "(0.4-2.4%% fewer bytes, decodes at about the same speed)")
    cp.set_defaults(func=_compress)

    mp = sub.add_parser("model", help="model management")
    msub = mp.add_subparsers(dest="model_command", required=True)
    fp = msub.add_parser("fetch", help="fetch and convert a model; prints its directory")
    fp.add_argument("name", nargs="?", default=None, help="default: $SPLITFIRE_MODEL or smollm2-135m-instruct")
    fp.set_defaults(func=_fetch)

    try:
        from router.app import cli as router_cli
    except ImportError:
        router_cli = None
    if router_cli is not None:
        router_cli.add_subcommands(sub)
    from planner import cli as planner_cli
    from splitfire_cli import supervisor

    planner_cli.add_subcommands(sub)
    supervisor.add_subcommand(sub)
    return p


def main(argv: list[str] | None = None, gc_held: bool = False) -> int:
    """`gc_held`: `cli` turned the collector off; commands without a ready point turn it back on here."""
    args = build_parser().parse_args(argv)
    if gc_held and args.command not in _RELEASE_WHEN_READY:
        gc_heap.resume()
    import prometheus_client

    from common.logs import setup_logging

    setup_logging(args.log_level)
    prometheus_client.disable_created_metrics()  # *_created series only add noise to dashboards
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:  # config validation: a clear message, no traceback
        print(f"splitfire {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from common.errors import EngineError
        from kvtransfer.errors import TransferError

        if isinstance(e, EngineError | TransferError | OSError):
            print(f"splitfire {args.command}: {e}", file=sys.stderr)
            return 1
        raise


def cli() -> None:
    """The `splitfire` executable (and `python -m splitfire_cli`). The garbage collector is held off
    from here, before the imports, until the command is ready (common/gc_heap.py); `main` alone,
    called inside another program, leaves that program's collector alone."""
    sys.exit(main(gc_held=gc_heap.hold()))
