"""The matmul on weights held compressed in GPU memory (`--compress-weights`:
`engine/model/kernels/compressed_triton.py`) against the same Triton kernel reading plain bfloat16 and
against torch's bfloat16 `F.linear`, on Llama-3-8B's projection shapes, for decode-sized row counts and
several launch shapes (block_n x block_k / warps / pipeline stages; the packing does not depend on them).

Per shape, rows and launch shape: the compressed kernel's relative difference from the plain kernel and
its relative error against a float64 reference (fresh random inputs), the weight bytes each reads
(compressed: sign+mantissa plane, 4-bit codes, escapes), and the median time of each inside a CUDA
graph (`triton.testing.do_bench_cudagraph`: what a decode step replaying its graph pays, no launch
overhead; matrices larger than L2 are read from HBM every replay) with the bytes over that time, and the
compressed call launched eagerly (`do_bench`, L2 cleared: with the launches' host time). A decode step is
bound by the bytes it reads, so the target is the compressed kernel at ~0.75 of torch's time; the plain
kernel beside it says how much of any gap is the kernel's tiling rather than the decoding. From
`DECOMPRESS_MIN_ROWS` rows the engine decodes the matrix once and calls torch's GEMM (`matmul`): those
rows time that path. `--decoder-launches` times that decoder (`decompress`) alone per tile shape instead:
its bytes are the compressed matrix read and the bfloat16 one written.

    python -m loadtest.bench_compressed_gemm                      # CUDA
    python -m loadtest.bench_compressed_gemm --rows 1 --shapes o --tiles 32x32 --reps 20   # quick
    python -m loadtest.bench_compressed_gemm --decoder-launches 64x128/4,32x256/8   # the prefill's decoder
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import torch.nn.functional as F

from loadtest.bench_gpu import parse_launch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qkv,o,gate_up,down")
    p.add_argument("--rows", default="1,16,24,64,512")
    p.add_argument("--tiles", default="32x256/4/3,64x64/8/3,64x128/4/3",
                   help="launch shapes: block_n x block_k / warps / stages")
    p.add_argument("--reps", type=int, default=100, help="do_bench milliseconds of repetitions")
    p.add_argument("--decodes", default="auto", metavar="auto,fast,select,bfloat16",
                   help="time each kernel with these decodes (compressed_linear's `decode`; the launch column "
                   "names any but auto: '/gemv-select', '-fast')")
    p.add_argument("--decoder-launches", default="", metavar="NxK/WARPS,...",
                   help="time the many-rows decoder (`decompress`, its default decode) alone with these tiles and "
                   "warps ('auto': compressed_triton.DECOMPRESS_LAUNCH) instead of the matmuls")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (tests/test_compressed_weight.py runs the kernel interpreted on CPU)")
    import triton.testing

    if args.decoder_launches:
        time_decoder(args)
        return

    from engine.model.compressed_weight import pack
    from engine.model.kernels.compressed_triton import (
        DECOMPRESS_MIN_ROWS,
        GEMV_MAX_ROWS,
        GEMV_ROWS,
        compressed_linear,
        matmul,
    )

    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; medians inside CUDA graphs (eager: do_bench, L2 cleared); "
          "GB/s = weight bytes read / time; launch /gemv: one row per program, no dot (-fast, -select, -bfloat16: "
          "a decode other than the default)\n")
    print(f"{'shape':8} {'rows':>4} {'launch':>22} | {'torch bf16 us':>13} {'plain kernel us':>15} "
          f"{'compressed us':>13} | {'vs torch':>8} | {'eager us':>8} | {'GB/s torch/compr':>16} | vs plain, vs f64")
    rows_out = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        c = pack(w)
        plain_bytes, comp_bytes = w.numel() * 2, c.nbytes
        for tile in args.tiles.split(","):
            bn, bk, warps, stages = parse_launch(tile, "--tiles")
            launch: dict[str, int] = dict(block_n=bn, block_k=bk, warps=warps, stages=stages)
            kinds = [(g, d) for g in (False, True) for d in args.decodes.split(",")]
            for m, gemv, decode in ((int(r), g, d) for r in args.rows.split(",") for g, d in kinds):
                many = m >= DECOMPRESS_MIN_ROWS
                if ((many and (tile != args.tiles.split(",")[0] or decode == "bfloat16"))
                        or (gemv and (many or m > max(GEMV_MAX_ROWS, GEMV_ROWS[-1])))):
                    continue  # (decode once + torch's GEMM: no launch shape; one row per program: few rows)
                x = torch.randn(m, k, device=dev).to(torch.bfloat16)
                comp = (partial(matmul, x, c, decode=decode) if many
                        else partial(compressed_linear, x, c, None, gemv=gemv, decode=decode, **launch))
                plain = (partial(F.linear, x, w) if many
                         else partial(compressed_linear, x, c, plain=w, gemv=gemv, **launch))
                y, y_plain = comp().float(), plain().float()
                ref = x.double() @ w.double().T
                err = float((y.double() - ref).norm() / ref.norm())
                diff = float((y.double() - y_plain.double()).norm() / y_plain.double().norm())
                t_torch, t_plain, t_comp = (
                    triton.testing.do_bench_cudagraph(fn, rep=args.reps, return_mode="median")
                    for fn in (partial(F.linear, x, w), plain, comp))
                t_eager = triton.testing.do_bench(comp, rep=args.reps, return_mode="median")
                label = ("decode+mm" if many else tile + ("/gemv" if gemv else "")) + ("" if decode == "auto"
                                                                                       else f"-{decode}")
                row = dict(shape=name, n=n, k=k, rows=m, launch=label, torch_us=1e3 * t_torch, plain_us=1e3 * t_plain,
                           compressed_us=1e3 * t_comp, compressed_eager_us=1e3 * t_eager, plain_bytes=plain_bytes,
                           compressed_bytes=comp_bytes, escapes=c.num_escapes, rel_diff_vs_plain_kernel=diff,
                           rel_err=err)
                rows_out.append(row)
                print(f"{name:8} {m:>4} {label:>22} | {1e3 * t_torch:>13.1f} {1e3 * t_plain:>15.1f} "
                      f"{1e3 * t_comp:>13.1f} | {t_comp / t_torch:>7.2f}x | {1e3 * t_eager:>8.1f} | "
                      f"{plain_bytes / t_torch / 1e6:>7.0f} / {comp_bytes / t_comp / 1e6:>6.0f} | {diff:.1e} {err:.1e}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


def time_decoder(args: argparse.Namespace) -> None:
    """The many-rows decoder alone, per shape and launch: median us inside a CUDA graph and the bytes it
    moves (compressed read + bfloat16 written) over that time; each launch's output checked bit for bit."""
    import triton.testing

    from engine.model.compressed_weight import pack
    from engine.model.kernels.compressed_triton import DECOMPRESS_LAUNCH, decompress

    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; the decoder alone, medians inside CUDA graphs; GB/s = (compressed "
          f"bytes read + bfloat16 written) / time; auto = {DECOMPRESS_LAUNCH}\n")
    print(f"{'shape':8} {'launch':>10} | {'us':>8} | {'GB/s':>6} | {'torch copy us':>13}")
    rows_out = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        c = pack(w)
        moved = c.nbytes + w.numel() * 2
        copy = torch.empty_like(w)
        t_copy = triton.testing.do_bench_cudagraph(partial(copy.copy_, w), rep=args.reps, return_mode="median")
        for text in args.decoder_launches.split(","):
            bn, bk, warps = DECOMPRESS_LAUNCH if text == "auto" else parse_launch(text, "--decoder-launches", False)
            fn = partial(decompress, c, block_n=bn, block_k=bk, warps=warps)
            if not torch.equal(fn().view(torch.int16), w.view(torch.int16)):
                raise SystemExit(f"{name} {text}: the decoder's matrix differs from the original")
            t = triton.testing.do_bench_cudagraph(fn, rep=args.reps, return_mode="median")
            rows_out.append(dict(shape=name, n=n, k=k, launch=text, decoder_us=1e3 * t, bytes_moved=moved,
                                 torch_copy_us=1e3 * t_copy))
            print(f"{name:8} {text:>10} | {1e3 * t:>8.1f} | {moved / t / 1e6:>6.0f} | {1e3 * t_copy:>13.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "decoder": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
