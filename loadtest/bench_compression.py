"""`python -m loadtest.bench_engine --compression`: lossless weight compression (engine/loading/compressed.py)
on a bfloat16 checkpoint — size per tensor kind against the order-0 entropy bound, compress and decode
throughput (GB/s of bfloat16 weights, decode on one thread and on the default pool), and load time of
the compressed directory against the plain bfloat16 safetensors, rounds alternating, medians: through the
loader (`Checkpoint`; "cold" asks posix_fadvise to drop the files' pages first, which an overlay filesystem
ignores) and read from the device past the page cache with O_DIRECT (plain: the files read in 8 MiB
requests and every tensor copied out; compressed: `Checkpoint(direct=True)`, each pair of chunks read
and decoded by one task of the pool and the next tensors decoded ahead, so reads overlap decoding).

The checkpoint: `--model` (default SmolLM2-135M as this project stores it, converted to bfloat16 for
the benchmark; its weights came from a Q4_1 GGUF, so their exponents are a quantized model's, not a
trained bfloat16 release's), a transformers-initialized Llama of the same shape (normal init), and six
4096 x 4096 normal-init matrices (a 7B model's matrix shape: enough chunks per tensor for every core —
SmolLM2's matrices are one chunk each, decoded on one thread).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.loading import compressed
from engine.loading.checkpoint import DTYPES, Checkpoint
from engine.loading.compress import compress_dir


def bf16_copy(src: Path, out: Path) -> Path:
    """Every float tensor of `src` in bfloat16 (others as they are), with its config and tokenizer."""
    from safetensors.torch import save_file

    ck = Checkpoint(src)
    tensors = {}
    for name in ck.tensors:
        t = ck.get(name)
        tensors[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    return out


def drop_cache(model_dir: Path) -> None:
    for f in model_dir.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def load_all(model_dir: Path) -> float:
    drop_cache(model_dir)
    t0 = time.perf_counter()
    ck = Checkpoint(model_dir)
    for name in ck.tensors:
        ck.get(name)
    return time.perf_counter() - t0


def read_direct(path: Path, block: int = 8 << 20) -> memoryview:
    """A whole file read with O_DIRECT (from the device, past the page cache) in `block`-byte reads."""
    size = path.stat().st_size
    buf = mmap.mmap(-1, max(-(-size // 4096) * 4096, 4096))
    with compressed.DataFile(path, direct=True) as f:
        done = 0
        while done < size:
            n = os.preadv(f.fd, [memoryview(buf)[done : done + block]], done)
            if n <= 0:
                raise EOFError(f"{path}: {size - done} bytes short")
            done += n
    return memoryview(buf)[:size]


def load_direct_plain(model_dir: Path) -> float:
    """Seconds to read the safetensors files from the device (O_DIRECT) and copy every tensor into memory
    of its own (what loading into a model's parameters does)."""

    t0 = time.perf_counter()
    for path in sorted(model_dir.glob("*.safetensors")):
        data = read_direct(path)
        n = int.from_bytes(data[:8], "little")
        header = json.loads(bytes(data[8 : 8 + n]))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            lo, hi = meta["data_offsets"]
            dtype = DTYPES[meta["dtype"]]
            src = torch.frombuffer(data, dtype=torch.uint8, offset=8 + n + lo, count=hi - lo) if hi > lo else None
            out = torch.empty(meta["shape"], dtype=dtype)
            if src is not None:
                out.reshape(-1).view(torch.uint8).copy_(src)
    return time.perf_counter() - t0


def load_direct_compressed(model_dir: Path) -> float:
    """Seconds to read and decode every tensor of a compressed directory from the device (O_DIRECT) through
    the loader (`Checkpoint(direct=True)`: each pair of chunks read and decoded by one task of the pool,
    the next tensors decoded ahead on another thread)."""
    t0 = time.perf_counter()
    ck = Checkpoint(model_dir, direct=True)
    for name in ck.tensors:
        ck.get(name)
    ck.close()
    return time.perf_counter() - t0


def decode_rate(model_dir: Path, threads: int) -> float:
    """GB/s of original weights decoded (page cache warm: the codec alone)."""
    entries = compressed.read_manifest(model_dir)
    saved = compressed._THREADS
    compressed._THREADS = threads
    try:
        t0 = time.perf_counter()
        total = 0
        for e in entries.values():
            if e.codec == compressed.CODEC_RAW:
                continue
            out = torch.empty(e.shape, dtype=torch.bfloat16)
            compressed.decode_into(model_dir, e, out)
            total += out.numel() * 2
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        compressed._THREADS = saved


def codec_rates(model_dir: Path, rounds: int = 3) -> dict[str, float]:
    """G exponent symbols/s decoded on one thread: the C decoder on each tensor's chunks in pairs as a load
    reads them (`decode_pair`) and one by one (`decode`), zlib's inflate (the reference) over the same
    chunks, and both over the chunks zlib's own Huffman-only mode writes (what the format held before);
    best of `rounds`, codec only (no CRC, no join)."""
    import zlib

    import numpy as np

    from engine.loading import deflate_literals

    chunks, groups = [], []  # groups: each tensor's chunks, as decode_into pairs them
    for e in compressed.read_manifest(model_dir).values():
        if e.codec == compressed.CODEC_RAW:
            continue
        with compressed.DataFile(model_dir / e.file) as f:
            mine = [(bytes(f.read(off, length)), n) for off, length, n, *_ in e.chunks]
        chunks += mine
        groups += [mine[i : i + 2] for i in range(0, len(mine), 2)]
    symbols = sum(n for _, n in chunks)
    plain = [(np.frombuffer(zlib.decompress(c, -15), np.uint8), n) for c, n in chunks]
    made_by_zlib = []
    for data, n in plain:
        z = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
        made_by_zlib.append((z.compress(data.tobytes()) + z.flush(), n))

    def best(fn, streams) -> float:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for c, n in streams:
                fn(c, n)
            times.append(time.perf_counter() - t0)
        return symbols / min(times) / 1e9

    def pairs(group, _n) -> None:
        if len(group) == 2:
            deflate_literals.decode_pair(group[0][0], group[0][1], group[1][0], group[1][1])
        else:
            deflate_literals.decode(*group[0])

    return {"c_pairs": best(pairs, [(g, 0) for g in groups]),
            "c": best(deflate_literals.decode, chunks), "zlib": best(lambda c, n: zlib.decompress(c, -15), chunks),
            "zlib_own": best(lambda c, n: zlib.decompress(c, -15), made_by_zlib),
            "c_on_zlib_own": best(deflate_literals.decode, made_by_zlib)}


def rans_rate(model_dir: Path, rounds: int = 3) -> float:
    """G exponent symbols/s the rANS decoder reads on one thread over a `--coder rans` directory's chunks
    (best of `rounds`, codec only), to set beside `codec_rates`' Huffman figures."""
    from engine.loading import rans

    chunks = []
    for e in compressed.read_manifest(model_dir).values():
        if e.codec in compressed.RANS_CODECS:
            with compressed.DataFile(model_dir / e.file) as f:
                chunks += [(bytes(f.read(off, length)), n) for off, length, n, *_ in e.chunks]
    symbols = sum(n for _, n in chunks)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for c, n in chunks:
            rans.decode(c, n)
        times.append(time.perf_counter() - t0)
    return symbols / min(times) / 1e9 if symbols else float("nan")


def rank_slices(model_dir: Path, ranks: int, rounds: int = 3) -> dict[str, float]:
    """Seconds for rank 0 of `ranks` to read its slice of every 2-D compressed tensor (page cache warm: the
    decoding): its rows (a column-parallel layer's split: only the chunks holding them decoded) and its
    columns (a row-parallel layer's: every chunk), against the whole tensors; best of `rounds`."""
    ck = Checkpoint(model_dir)
    names = [n for n, e in ck.compressed.items() if e.codec != compressed.CODEC_RAW and len(e.shape) == 2]
    out = {}
    for kind in ("whole", "rows", "cols"):
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for n in names:
                rows_, cols_ = ck.compressed[n].shape
                if kind == "whole":  # (decode_into itself: Checkpoint's reads would also start decoding ahead)
                    e = ck.compressed[n]
                    compressed.decode_into(model_dir, e, torch.empty(e.shape, dtype=DTYPES[e.dtype]))
                elif kind == "rows":
                    ck.read_part(n, range(0, rows_ // ranks), None)
                else:
                    ck.read_part(n, None, range(0, cols_ // ranks))
            times.append(time.perf_counter() - t0)
        out[kind] = min(times)
    return out


def in_memory_ratio(plain: Path) -> tuple[float, float]:
    """The device-memory form's bytes against bfloat16's over the checkpoint's 2-D bfloat16 matrices
    (`engine.model.compressed_weight`: what the Triton matmul reads per weight), and escapes per million."""
    from engine.model.compressed_weight import pack

    ck = Checkpoint(plain)
    packed = original = escapes = weights = 0
    for name in ck.tensors:
        t = ck.get(name)
        if t.dtype != torch.bfloat16 or t.dim() != 2 or t.shape[1] % 2:
            continue
        c = pack(t)
        packed += c.nbytes
        original += t.numel() * 2
        escapes += c.num_escapes
        weights += t.numel()
    return (packed / original if original else float("nan")), (escapes / weights * 1e6 if weights else float("nan"))


def bench_one(label: str, plain: Path, work: Path, rounds: int) -> dict[str, object]:
    packed = work / f"{label}-z"
    t0 = time.perf_counter()
    stats = compress_dir(plain, packed)
    took = time.perf_counter() - t0
    by_kind = {}
    for kind, (orig, stored, ent) in stats.by_kind.items():
        by_kind[kind] = {"ratio": stored / orig, "bound": (4 * orig + ent) / (8 * orig) if ent else 1.0,
                         "mib": orig / 2**20}
    plain_bytes = sum(f.stat().st_size for f in plain.glob("*.safetensors"))
    packed_bytes = sum(f.stat().st_size for f in packed.glob("*.sfz"))
    loads: dict[str, list[float]] = {"plain": [], "compressed": []}
    direct: dict[str, list[float]] = {"plain": [], "compressed": []}
    for _ in range(rounds):
        loads["plain"].append(load_all(plain))
        loads["compressed"].append(load_all(packed))
        direct["plain"].append(load_direct_plain(plain))
        direct["compressed"].append(load_direct_compressed(packed))
    # The other coder, on the same weights: size, speed, and the load from the device.
    ranspath = work / f"{label}-rans"
    t0 = time.perf_counter()
    rstats = compress_dir(plain, ranspath, coder="rans")
    rtook = time.perf_counter() - t0
    orig, stored, _ = rstats.by_kind["bfloat16"]
    rdirect = statistics.median(load_direct_compressed(ranspath) for _ in range(rounds))
    coders = {"rans": {"bf16_ratio": stored / orig, "compress_gbps": rstats.original_bytes / rtook / 1e9,
                       "decode_gbps_1_thread": decode_rate(ranspath, 1),
                       f"decode_gbps_{compressed._THREADS}_threads": decode_rate(ranspath, compressed._THREADS),
                       "direct_load_s": rdirect, "gsym_s": rans_rate(ranspath)}}
    slices = {str(n): rank_slices(packed, n, rounds) for n in (2, 8)}
    return {"label": label, "by_kind": by_kind, "size_ratio": packed_bytes / plain_bytes, "coders": coders,
            "rank_slices_s": slices,
            "compress_gbps": stats.original_bytes / took / 1e9,
            "decode_gbps_1_thread": decode_rate(packed, 1), f"decode_gbps_{compressed._THREADS}_threads":
            decode_rate(packed, compressed._THREADS),
            "cold_load_s": {k: statistics.median(v) for k, v in loads.items()},
            "direct_load_s": {k: statistics.median(v) for k, v in direct.items()},
            "bf16_gb": plain_bytes / 1e9,
            "codec_gsym_s": codec_rates(packed),
            "in_memory": dict(zip(("ratio", "escapes_per_million"), in_memory_ratio(plain), strict=True))}


def main_compression(args: argparse.Namespace) -> int:
    import transformers

    from engine.loading.model_store import resolve_model

    work = Path(tempfile.mkdtemp(prefix="bench-compress-"))
    try:
        src = Path(resolve_model(args.model))
        smol = bf16_copy(src, work / "smollm2-bf16")
        cfg = transformers.AutoConfig.from_pretrained(src)
        torch.manual_seed(0)
        init = work / "llama-init-bf16"
        transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(init)
        big = work / "matrices-bf16"  # a 7B model's matrix shape: chunks enough for every core
        big.mkdir()
        from safetensors.torch import save_file

        g = torch.Generator().manual_seed(0)
        save_file({f"layers.{i}.weight": (torch.randn(4096, 4096, generator=g) * 0.02).to(torch.bfloat16)
                   for i in range(6)}, str(big / "model.safetensors"))
        rows = [bench_one("smollm2 (from Q4_1)", smol, work, args.rounds),
                bench_one("transformers init", init, work, args.rounds),
                bench_one("6 x 4096^2 normal", big, work, args.rounds)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    print(f"\n{os.cpu_count()} CPUs, {cpu}; chunks of {compressed.CHUNK} weights, two DEFLATE streams of literals "
          f"with one code each (deflate_literals.py); medians of {args.rounds} cold loads")
    print(f"{'checkpoint':<22}{'bf16 ratio':>11}{'bound':>8}{'all files':>10}{'compress':>10}{'decode 1T':>10}"
          f"{'decode':>8}{'cold load plain':>16}{'compressed':>11}{'O_DIRECT plain':>16}{'compressed':>11}")
    for r in rows:
        bk = r["by_kind"]["bfloat16"]  # type: ignore[index]
        cold = r["cold_load_s"]
        print(f"{r['label']:<22}{bk['ratio']:>11.3f}{bk['bound']:>8.3f}{r['size_ratio']:>10.3f}"  # type: ignore[index]
              f"{r['compress_gbps']:>8.2f}GB/s{r['decode_gbps_1_thread']:>6.2f}GB/s"
              f"{r[f'decode_gbps_{compressed._THREADS}_threads']:>6.2f}GB/s"
              f"{cold['plain']:>14.3f} s{cold['compressed']:>9.3f} s"  # type: ignore[index]
              f"{r['direct_load_s']['plain']:>14.3f} s{r['direct_load_s']['compressed']:>9.3f} s")  # type: ignore[index]
    print("\nexponent decoding alone, one thread, G symbols/s (a symbol is one bfloat16 weight's exponent):")
    print(f"{'checkpoint':<22}{'C, pairs':>10}{'C, one':>8}{'zlib':>8}{'C on zlib-made':>16}{'zlib on zlib-made':>19}")
    for r in rows:
        k = r["codec_gsym_s"]
        print(f"{r['label']:<22}{k['c_pairs']:>10.2f}{k['c']:>8.2f}{k['zlib']:>8.2f}"  # type: ignore[index]
              f"{k['c_on_zlib_own']:>16.2f}{k['zlib_own']:>19.2f}")  # type: ignore[index]
    print("\nthe other coder (splitfire compress --coder rans: 32 lanes, 12-bit frequencies), against the Huffman rows above:")
    print(f"{'checkpoint':<22}{'bf16 ratio':>11}{'huffman':>9}{'compress':>10}{'decode 1T':>10}{'decode':>8}"
          f"{'G sym/s 1T':>11}{'huffman':>9}{'O_DIRECT load':>14}{'huffman':>9}")
    for r in rows:
        c = r["coders"]["rans"]  # type: ignore[index]
        print(f"{r['label']:<22}{c['bf16_ratio']:>11.4f}{r['by_kind']['bfloat16']['ratio']:>9.4f}"  # type: ignore[index]
              f"{c['compress_gbps']:>8.2f}GB/s{c['decode_gbps_1_thread']:>6.2f}GB/s"
              f"{c[f'decode_gbps_{compressed._THREADS}_threads']:>6.2f}GB/s{c['gsym_s']:>11.2f}"
              f"{r['codec_gsym_s']['c_pairs']:>9.2f}{c['direct_load_s']:>12.3f} s"  # type: ignore[index]
              f"{r['direct_load_s']['compressed']:>7.3f} s")  # type: ignore[index]
    print("\na tensor-parallel rank's slices of the 2-D tensors, decode seconds (rank 0; rows: only their chunks "
          "decoded; columns: every chunk):")
    print(f"{'checkpoint':<22}{'whole':>8}{'rows /2':>9}{'cols /2':>9}{'rows /8':>9}{'cols /8':>9}")
    for r in rows:
        sl = r["rank_slices_s"]
        print(f"{r['label']:<22}{sl['2']['whole']:>8.3f}{sl['2']['rows']:>9.3f}{sl['2']['cols']:>9.3f}"  # type: ignore[index]
              f"{sl['8']['rows']:>9.3f}{sl['8']['cols']:>9.3f}")  # type: ignore[index]
    print("\nin device memory (engine/model/compressed_weight.py, the Triton matmul's operand): bytes / bfloat16's "
          "over 2-D bf16 matrices, escapes per million weights")
    for r in rows:
        mem = r["in_memory"]
        print(f"{r['label']:<22}{mem['ratio']:>10.3f}{mem['escapes_per_million']:>12.1f}")  # type: ignore[index]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print("targets (#39): bf16 ratio <= 0.80 on real weights; decode faster than reading the plain bytes from disk")
    return 0

