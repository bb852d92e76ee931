"""Weight-only int8/int4/fp8 GEMM on the GPU, one matrix at a time: the Triton kernel
(`engine/model/kernels/quant_triton.py`) by each of its methods (one row per program,
tensor-core tiles, dequantize then GEMM, and the per-weight reads of its first version), and for fp8
the FP8 x FP8 kernel (`fp8_triton.py`, method `w8a8`: FP8 tensor cores, sm_89+), against bfloat16
`torch.mm` of the same shape.
Prints microseconds and the weights' bytes per second (the int8/int4 codes plus their scales and
mins, or the bfloat16 matrix), beside the device's copy bandwidth, for Llama-3-8B's matrices at
decode and prefill row counts, each timed inside a CUDA graph (`timed`). `--sweep` also times other tile shapes for each method. The kernel's
own choice per row count (`quant_triton.method_for`) is what these rows decided.

    python -m loadtest.bench_quant_gemm                      # CUDA
    python -m loadtest.bench_quant_gemm --sweep --rows 1,64 --shapes gate_up  # tile shapes
    python -m loadtest.bench_quant_gemm --device cpu --smoke  # the interpreter, tiny shapes: runs, checks

Each Triton result is first checked against dequantize-then-matmul (bfloat16 tolerance).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from loadtest.bench_gpu import bandwidth, sync

if TYPE_CHECKING:
    from engine.model.quant import QuantizedWeight

# Llama-3-8B's matmuls, [N, K]: fused q/k/v, o, fused gate/up, down; the LM head (int8 under int4 too).
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
SMOKE_SHAPES = {"a": (96, 256), "b": (64, 320)}
SWEEP = {  # method: (block_m, block_n, block_k, warps, stages)
    "gemv": [(1, 32, 128, 4, 3), (1, 64, 64, 4, 3), (1, 64, 256, 4, 3), (1, 128, 128, 4, 3), (1, 64, 128, 8, 3),
             (1, 32, 256, 4, 4), (1, 128, 64, 4, 4), (1, 64, 256, 8, 3), (1, 32, 512, 4, 3), (1, 64, 512, 8, 3),
             (1, 16, 512, 4, 3)],
    "dot": [(16, 64, 256, 4, 4), (16, 128, 128, 8, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3)],
    "dequant": [(1, 32, 128, 4, 1), (1, 64, 256, 4, 1), (1, 128, 128, 8, 1)],
}
# w8a8 (fp8_triton.w8a8_gemm): (block_m, block_n, warps, stages, K splits or None: its own choice); BLOCK_K is
# the scale group (128).
W8A8_SWEEP = [(16, 32, 4, 4, None), (16, 64, 4, 4, 1), (16, 64, 4, 4, None), (16, 128, 4, 4, None),
              (16, 64, 4, 3, None), (32, 64, 4, 4, None), (64, 128, 4, 3, 1), (128, 128, 8, 3, 1),
              (128, 256, 8, 3, 1), (64, 256, 8, 3, 1)]


def timed(fn: Callable[[], None], dev: torch.device, reps: int, per_graph: int = 10) -> float:
    """Median seconds of one call. CUDA: `per_graph` calls captured in one CUDA graph and replayed, so
    the time is the GPU's alone, as in the engine's decode graphs (timed eagerly, a Triton launch's
    host time, tens of microseconds, exceeds many of these kernels)."""
    fn()
    sync(dev)
    if dev.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    sync(dev)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_graph)
    del graph
    return statistics.median(times)


def kernels_to_time(x: torch.Tensor, wf: torch.Tensor, qw: QuantizedWeight, out: torch.Tensor, methods: list[str],
                    sweep: bool) -> list[tuple[str, Callable[[], None], int]]:
    """(label, call, weight bytes) for the float matmul and each quantized kernel variant of one case."""
    from engine.model.kernels import quant_triton

    runs: list[tuple[str, Callable[[], None], int]] = [
        ("bf16 torch.mm" if wf.dtype == torch.bfloat16 else "torch.mm", lambda: torch.mm(x, wf.t(), out=out),
         wf.numel() * wf.element_size())]

    def call(**kw: object) -> Callable[[], None]:
        return lambda: quant_triton.wo_gemm(x, qw.kind, qw.q, qw.scales, qw.mins, qw.group_size, None,
                                            out, **kw)  # type: ignore[arg-type]

    nbytes = qw.nbytes
    for method in methods:
        if method == "w8a8":
            if qw.kind == "fp8":
                from engine.model.kernels import fp8_triton

                runs.append(("fp8 w8a8", lambda: fp8_triton.w8a8_gemm(x, qw.q, qw.scales, qw.group_size, None, out),
                             nbytes))
                for bm, bn, warps, stages, split in W8A8_SWEEP if sweep else []:
                    runs.append((f"fp8 w8a8 {bm}x{bn} w{warps}s{stages} k{split or 'auto'}",
                                 lambda bm=bm, bn=bn, warps=warps, stages=stages, split=split: fp8_triton.w8a8_gemm(
                                     x, qw.q, qw.scales, qw.group_size, None, out, block_m=bm, block_n=bn,
                                     warps=warps, stages=stages, split_k=split), nbytes))
            continue
        runs.append((f"{qw.kind} {method}", call(method=method), nbytes))
        if sweep:
            for bm, bn, bk, warps, stages in SWEEP.get(method, []):
                t = quant_triton.Tiles(bm, bn, bk, warps, stages)
                runs.append((f"{qw.kind} {method} {bm}x{bn}x{bk} w{warps}s{stages}", call(method=method, tiles=t),
                             nbytes))
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default="1,2,4,16,64,128,256,2048", help="activation rows (comma list)")
    p.add_argument("--kinds", default="int4,int8", help="int4, int8, fp8 (comma list)")
    p.add_argument("--shapes", default=None, help="comma list of " + ",".join(SHAPES))
    p.add_argument("--sweep", action="store_true", help="also time each method at other tile shapes")
    p.add_argument("--methods", default="gemv,dot,dequant,per_weight",
                   help="quant_triton.wo_gemm methods to time (comma list), and w8a8 (fp8 only)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    from engine.model import quant

    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    bw = bandwidth(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    print(f"device {name}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write); GB/s below = weight bytes / time")
    print(f"{'matrix':9s} {'kind':5s} {'rows':>5s}  {'kernel':28s} {'us':>9s} {'GB/s':>7s} {'% copy bw':>9s}")
    reps = 3 if args.smoke else args.reps
    failed = 0
    for label, (n, k) in shapes.items():
        torch.manual_seed(0)
        w = torch.randn(n, k, device=dev, dtype=dtype) * 0.02
        for kind in args.kinds.split(","):
            qkind = "int8" if label == "lm_head" else kind
            if label == "lm_head" and kind != args.kinds.split(",")[0]:
                continue
            qw = quant.quantize(w, qkind, quant.group_size_for(k, qkind))
            wf = qw.dequantize_torch().to(dtype)
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, k, device=dev, dtype=dtype)
                out = torch.empty(rows, n, device=dev, dtype=dtype)
                want = F.linear(x, wf)
                runs = kernels_to_time(x, wf, qw, out, args.methods.split(","), args.sweep)
                for kernel, fn, nbytes in runs:
                    fn()
                    if "torch.mm" not in kernel:
                        err = (out.float() - want.float()).abs().max().item()
                        scale = want.float().abs().max().item() + 1e-6
                        if err > (0.06 if "w8a8" in kernel else 0.02) * scale:  # (w8a8: e4m3 activations)
                            print(f"MISMATCH {label} {kind} rows={rows} {kernel}: max err {err:.4g} of {scale:.4g}")
                            failed += 1
                            continue
                    s = timed(fn, dev, reps)
                    gbs = nbytes / s / 1e9
                    print(f"{label:9s} {qkind:5s} {rows:5d}  {kernel:28s} {s * 1e6:9.1f} {gbs:7.0f} "
                          f"{100 * nbytes / s / bw:8.0f}%", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
