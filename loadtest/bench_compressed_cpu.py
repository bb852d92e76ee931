"""Can a CPU decode compressed bfloat16 weights inside its matmul as fast as memory delivers them?

Issue #39 asks, for the CPU: measure whether decoding in the kernel keeps up with memory bandwidth,
and keep whichever path is faster. One decode row (a batch-1 step reads every weight once, so it is
bound by bytes) through Llama-3-8B's projection shapes, timed side by side in one run, rounds
alternating (medians):

- `torch f32`: `F.linear` on float32 weights (what the CPU engine runs on unquantized weights; 4 bytes a
  weight);
- `torch bf16`: `F.linear` with bfloat16 activations and weights (2 bytes);
- `C bf16`: `cpu_ops.gemv_bf16`, plain bfloat16 weights widened in registers (2 bytes) — the same loop
  as the next one without the decoding;
- `C compressed`: `cpu_ops.gemv_cbf16`, the `CompressedBF16` form (sign+mantissa byte, 4-bit exponent
  code, escapes apart: ~1.5 bytes) rebuilt in registers;

each as microseconds and as weight bytes per second (what the format moves), on 1 thread and on every
core, with a plain read of the same bytes (`torch.sum` over them as int64) for the memory's own speed.

    python -m loadtest.bench_compressed_cpu
    python -m loadtest.bench_compressed_cpu --shapes o --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from engine.model.compressed_weight import pack
from engine.model.kernels import cpu_ops

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def cpu_flags() -> str:
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "")
    return ", ".join(x for x in ("avx2", "avx512f", "avx512bw", "avx512_bf16") if f" {x} " in flags + " ")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="o,down,gate_up")
    p.add_argument("--reps", type=int, default=9, help="rounds (each times every method once)")
    p.add_argument("--threads", default="", help="thread counts (default: 1 and every core)")
    args = p.parse_args()
    if cpu_ops.library() is None:
        raise SystemExit("needs the C kernels (a C compiler; SPLITFIRE_CPU_KERNELS not 0)")
    cores = torch.get_num_threads()
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, cores})
    print(f"CPU: {torch.get_num_threads()} threads, {cpu_flags()}; one activation row; medians of {args.reps} "
          "alternating rounds; GB/s = the format's weight bytes / time\n")
    print(f"{'shape':8} {'thr':>3} | {'read GB/s':>9} | {'torch f32':>16} {'torch bf16':>16} {'C bf16':>16} "
          f"{'C compressed':>16} | compressed vs C bf16")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        c = pack(w)
        w32 = w.float()
        x = torch.randn(k)
        xb = x.to(torch.bfloat16)[None]
        raw = w.view(torch.int16).reshape(-1).view(torch.int64)
        ref = x.double() @ w.double().T
        for fn in (cpu_ops.gemv_cbf16(x, c), cpu_ops.gemv_bf16(x, w)):
            assert float((fn.double() - ref).norm() / ref.norm()) < 1e-5
        for t in threads:
            torch.set_num_threads(t)
            runs = {"read": raw.sum, "torch f32": partial(F.linear, x[None], w32),
                    "torch bf16": partial(F.linear, xb, w), "C bf16": partial(cpu_ops.gemv_bf16, x, w, t),
                    "C compressed": partial(cpu_ops.gemv_cbf16, x, c, t)}
            times: dict[str, list[float]] = {m: [] for m in runs}
            for fn in runs.values():
                fn()
            for _ in range(args.reps):
                for m, fn in runs.items():
                    t0 = time.perf_counter()
                    fn()
                    times[m].append(time.perf_counter() - t0)
            med = {m: statistics.median(v) for m, v in times.items()}
            size = {"read": w.numel() * 2, "torch f32": w.numel() * 4, "torch bf16": w.numel() * 2,
                    "C bf16": w.numel() * 2, "C compressed": c.nbytes}

            def cell(m: str, med: dict[str, float] = med, size: dict[str, int] = size) -> str:
                return f"{med[m] * 1e6:7.0f} us {size[m] / med[m] / 1e9:4.1f}"

            print(f"{name:8} {t:>3} | {size['read'] / med['read'] / 1e9:9.1f} | {cell('torch f32'):>16} "
                  f"{cell('torch bf16'):>16} {cell('C bf16'):>16} {cell('C compressed'):>16} | "
                  f"{med['C compressed'] / med['C bf16']:.2f}x time", flush=True)
        torch.set_num_threads(cores)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
