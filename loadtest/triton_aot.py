"""Every Triton kernel compiled for an NVIDIA GPU on a machine without one, and what each costs the GPU.

On CPU the kernels run in the Triton interpreter (tests/test_*_triton.py), which checks what they compute
but never compiles them: a kernel can pass every interpreted test and still fail to compile for CUDA
(a type the backend refuses, a layout conversion, too much shared memory) or spill registers. Here the
kernels' own launch wrappers are called with CPU tensors while each `*_kernel` is swapped for a recorder
(nothing runs), and every recorded launch — its arguments, constexprs, warps and stages — is handed to
`triton.compile` for a CUDA target (Triton's own argument binding and specialization, so the signature
is the one a real launch would compile; pointers as 16-byte aligned). Launch choices that depend on
the device are the CUDA ones (`F32_DOT` off: the tensor-core dot; K and KV splits as passed). The cubin's
resource use comes from `cuobjdump` (bundled with Triton): registers per thread, local memory (spills),
shared memory.

    python -m loadtest.triton_aot                       # sm_90: one row per launch
    python -m loadtest.triton_aot --arch 80,90 --out loadtest/results/gpu-decode/compile-only/triton_aot.txt
    python -m loadtest.triton_aot --only "compressed 1 rows" --set num_warps=8   # another launch shape

Columns beside registers, spills and shared bytes: the SASS's shared-memory instructions and barriers and
the TTGIR's layout conversions (a loop that moves its operands through shared memory every iteration
shows there).

`tests/test_triton_aot.py` compiles every launch for sm_90 in CI.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

KERNEL_MODULES = ("compressed_triton", "quant_triton", "fp8_triton", "moe_triton", "lora_triton", "mla_triton",
                  "triton_ops", "split_k")
# Kernels that need a newer GPU than some --arch asks for: FP8 tensor-core dots from sm_89 (an sm_80 GPU runs
# FP8 weights through the weight-only kernels instead). Launches of these cases are compiled from this arch up.
MIN_ARCH = {"fp8_triton": 89}
# Constexprs that say "not on CUDA" when the wrapper is called with CPU tensors, and their CUDA values.
CUDA_CONSTEXPRS = {"F32_DOT": False}


@dataclass
class Launch:
    case: str  # which representative call made it
    module: str
    name: str
    fn: Any  # the JITFunction
    args: tuple
    kwargs: dict[str, Any]

    @property
    def label(self) -> str:
        consts = {k: CUDA_CONSTEXPRS.get(k, v) for k, v in self.kwargs.items()
                  if isinstance(v, (bool, int)) and k.isupper()}
        opts = {k: v for k, v in self.kwargs.items() if k in ("num_warps", "num_stages")}
        return f"{self.name} [{self.case}] " + " ".join(f"{k}={v}" for k, v in {**consts, **opts}.items())


@dataclass
class Compiled:
    launch: Launch
    arch: int
    seconds: float
    registers: int = 0
    local_bytes: int = 0  # per thread: spilled registers (and local arrays)
    shared_bytes: int = 0
    shared_ops: int = 0  # SASS instructions that load or store shared memory (LDS/STS/LDSM/STSM)
    barriers: int = 0  # SASS BAR instructions
    conversions: int = 0  # TTGIR convert_layout ops (a register layout change; through shared memory unless trivial)
    tensor_cores: bool = False  # the PTX has mma / wgmma instructions
    loop: int = 0  # SASS instructions in the main loop (see `main_loop`): the work of one iteration
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


class _Recorder:
    """Stands in for a module's JITFunction: `kernel[grid](*args, **kw)` records the launch, runs nothing."""

    def __init__(self, module: str, name: str, fn: Any, log: list[Launch], case: list[str]):
        self.module, self.name, self.fn, self.log, self.case = module, name, fn, log, case

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.log.append(Launch(self.case[0], self.module, self.name, self.fn, args, kwargs))
        return launch


@contextmanager
def captured() -> Iterator[tuple[list[Launch], list[str], set[str]]]:
    """Every `*_kernel` of the kernel modules swapped for a recorder; yields (the launches, a one-item
    list naming the current case, which the caller sets, and every kernel swapped as "module.name")."""
    import importlib

    log: list[Launch] = []
    case = [""]
    swapped: list[tuple[Any, str, Any]] = []
    try:
        for short in KERNEL_MODULES:
            mod = importlib.import_module(f"engine.model.kernels.{short}")
            for name, obj in list(vars(mod).items()):
                if name.endswith("_kernel") and hasattr(obj, "arg_names"):
                    swapped.append((mod, name, obj))
                    setattr(mod, name, _Recorder(short, name, obj, log, case))
        if not swapped:
            raise RuntimeError("no Triton kernels found to capture (TRITON_INTERPRET set? the kernels must be "
                               "JITFunctions here)")
        yield log, case, {f"{mod.__name__.rsplit('.', 1)[1]}.{name}" for mod, name, _ in swapped}
    finally:
        for mod, name, obj in swapped:
            setattr(mod, name, obj)


def _mock(v: Any) -> Any:
    from triton.runtime.jit import MockTensor

    return MockTensor(v.dtype) if isinstance(v, torch.Tensor) else v


_SHARED_OP = re.compile(r"\b(?:LDS|STS|LDSM|STSM)(?:\.[\w.]+)?\b")
_BARRIER = re.compile(r"\bBAR\.")


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);", re.MULTILINE)
_BRANCH = re.compile(r"\bBRA\s+(0x[0-9a-f]+)")


_MMA = re.compile(r"^(?:@!?U?P\w+\s+)?(?:HMMA|HGMMA|IMMA)\b")
_FMA = re.compile(r"^(?:@!?U?P\w+\s+)?FFMA\b")


def main_loop(sass: str) -> int:
    """Instructions in a kernel's main loop, per thread and iteration: of the SASS's loops (a branch to an
    earlier address, and the instructions from its target to it) one with tensor-core MMAs if any, else
    the one with the most FFMAs (an escape or epilogue loop has neither), the larger on a tie."""
    addrs = [(int(a, 16), text.strip()) for a, text in _SASS_LINE.findall(sass)]
    best = (False, 0, 0)
    for at, text in addrs:
        m = _BRANCH.search(text)
        if m is not None and int(m.group(1), 16) < at:
            body = [t for a, t in addrs if int(m.group(1), 16) <= a <= at]
            best = max(best, (any(_MMA.match(t) for t in body), sum(1 for t in body if _FMA.match(t)), len(body)))
    return best[2]


def _resources(cubin: bytes, sass_to: Path | None = None) -> tuple[int, int, int, int, int, int]:
    """(registers, local bytes, shared bytes, shared-memory instructions, barriers, main loop's
    instructions) of the cubin's one kernel, from `cuobjdump -res-usage` and `-sass` (written to `sass_to`
    when given)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        tool = Path(shutil.which("cuobjdump") or "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", "-sass", f.name], capture_output=True, text=True,
                             check=True).stdout
    if sass_to is not None:
        sass_to.write_text(out)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{out[-1000:]}")
    reg, _stack, shared, local = (int(g) for g in m.groups())
    return reg, local, shared, len(_SHARED_OP.findall(out)), len(_BARRIER.findall(out)), main_loop(out)


def compile_launch(launch: Launch, arch: int, dump: Path | None = None) -> Compiled:
    """`launch` compiled for sm_`arch` through Triton's own binding of its arguments (as a launch on that
    GPU would); the kernel's dynamic shared memory from its metadata (cuobjdump counts static only).
    With `dump`, the launch's TTGIR, PTX and SASS are written there (one file each, named for it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = {k: _mock(v) for k, v in launch.kwargs.items()}
    for k, v in CUDA_CONSTEXPRS.items():
        if k in fn.arg_names:
            kwargs[k] = v
    kwargs.update(debug=False, instrumentation_mode="", fpsan_homomorphic_casts=False)
    t0 = time.perf_counter()
    try:
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, options = binder(*map(_mock, launch.args), **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
        stem = None
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            stem = dump / re.sub(r"[^\w.-]+", "_", f"sm{arch}_{launch.label}").strip("_")[:150]
            for kind in ("ttgir", "ptx"):
                stem.with_suffix(f".{kind}").write_text(kernel.asm[kind])
        reg, local, shared, shared_ops, barriers, loop = _resources(kernel.asm["cubin"],
                                                                    stem.with_suffix(".sass") if stem else None)
    except Exception as e:  # reported per launch with the launch named; the caller decides
        return Compiled(launch, arch, time.perf_counter() - t0, error=f"{type(e).__name__}: {str(e)[-3000:]}")
    shared = max(shared, int(kernel.metadata.shared))
    ptx = kernel.asm["ptx"]
    return Compiled(launch, arch, time.perf_counter() - t0, reg, local, shared, shared_ops, barriers,
                    kernel.asm["ttgir"].count("ttg.convert_layout"), "mma." in ptx or "wgmma." in ptx, loop)


# -- the representative calls --------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    run: Callable[[], Any]


def cases() -> list[Case]:
    """One call per launch shape the engine makes on CUDA (small tensors: only the launch matters, and
    nothing runs). Decode attention, split-K and MLA with explicit splits, as a GPU would choose them."""
    import torch.nn.functional as F

    from engine.model import quant
    from engine.model.compressed_weight import pack
    from engine.model.kernels import compressed_triton as ct
    from engine.model.kernels import fp8_triton, lora_triton, mla_triton, moe_triton, quant_triton, triton_ops
    from engine.model.moe import route

    bf = torch.bfloat16
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = bf) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    def compressed(n: int, k: int, escapes: bool) -> Any:
        # magnitudes in [0.5, 4): three exponents, all coded; an infinity has no code (an escape)
        w = ((torch.rand(n, k, generator=g) * 3.5 + 0.5) * (torch.randint(0, 2, (n, k), generator=g) * 2 - 1)).to(bf)
        if escapes:
            w[0, 0] = float("inf")
        return pack(w)

    out: list[Case] = []
    w_esc, w_plain = compressed(256, 512, True), compressed(256, 512, False)
    assert w_esc.num_escapes > 0 and w_plain.num_escapes == 0
    for m in (1, 16, 32):
        out.append(Case(f"compressed {m} rows", lambda m=m: ct.compressed_linear(randn(m, 512), w_esc)))
        out.append(Case(f"compressed {m} rows, no escapes", lambda m=m: ct.compressed_linear(randn(m, 512), w_plain)))
    out.append(Case("compressed 1 row, split K", lambda: ct.compressed_linear(randn(1, 512), w_esc, split_k=2)))
    for rows in ct.GEMV_ROWS[1:]:  # (the row kernel's several rows per program: each weight decoded once)
        out.append(Case(f"compressed {rows} rows, row kernel", lambda rows=rows: ct.compressed_linear(
            randn(rows, 512), w_esc, gemv=True, block_m=rows)))
    out.append(Case("compressed 16 rows, split K", lambda: ct.compressed_linear(randn(16, 512), w_esc, split_k=2)))
    out.append(Case("compressed kernel on plain weights", lambda: ct.compressed_linear(randn(16, 512), w_esc,
                                                                                        plain=randn(256, 512))))
    def other(default: str) -> str:  # (the decode "auto" does not take)
        return "select" if default == "fast" else "fast"

    for m, decode in ((1, other(ct.GEMV_DECODE)), (16, other(ct.TILES_DECODE)), (32, other(ct.TILES_DECODE))):
        out.append(Case(f"compressed {m} rows, {decode} decode",
                        lambda m=m, decode=decode: ct.compressed_linear(randn(m, 512), w_esc, decode=decode)))
    out.append(Case("compressed decode", lambda: ct.decompress(w_esc)))
    decoder = other(ct.DECOMPRESS_DECODE)
    out.append(Case(f"compressed decode, {decoder} decode", lambda: ct.decompress(w_esc, decode=decoder)))
    out.append(Case("compressed rows (embedding)", lambda: ct.rows(w_esc, torch.tensor([1, 5, 7]))))

    for kind, group in (("int4", 32), ("int4", 64), ("int8", 32), ("int8", 56), ("fp8", 64), ("fp8", 56)):
        qw = quant.quantize(torch.randn(256, 448, generator=g), kind, group)
        methods = ("per_weight",) if not quant_triton.packed_group(group) else ("gemv", "dot", "dequant")
        for method in methods:
            for rows, split in ((1, 1), (16, 1), (64, 1), (16, 4)):
                if (method == "gemv" and rows > 1) or (method == "dequant" and split > 1):
                    continue

                def run(qw: Any = qw, rows: int = rows, method: str = method, split: int = split) -> None:
                    y = torch.empty(rows, 256, dtype=bf)
                    quant_triton.wo_gemm(randn(rows, 448), qw.kind, qw.q, qw.scales, qw.mins, qw.group_size,
                                         randn(256), y, split_k=split, method=method)
                out.append(Case(f"{kind} g{group} {method} {rows} rows split {split}", run))

    experts, hidden, inter = 4, 512, 256
    x = randn(9, hidden)
    weights, ids = route(torch.randn(9, experts, generator=g), 2, renormalize=True)
    weights = weights.to(bf)
    out.append(Case("MoE bf16 experts", lambda: moe_triton.fused_experts(
        x, ids, weights, randn(experts, 2 * inter, hidden), randn(experts, hidden, inter), F.silu)))
    for kind, group in (("int4", 32), ("int8", 64), ("fp8", 128)):
        def stack(n: int, k: int, kind: str = kind, group: int = group) -> Any:
            s = quant.QuantizedStack.of([quant.quantize(torch.randn(n, k, generator=g), kind, group)
                                         for _ in range(experts)])
            assert s is not None
            return s
        gu, dn = stack(2 * inter, hidden), stack(hidden, inter)
        out.append(Case(f"MoE {kind} experts", lambda gu=gu, dn=dn: moe_triton.fused_experts(
            x, ids, weights, gu, dn, F.silu)))
    cgu, cdn = compressed(experts * 2 * inter, hidden, True), compressed(experts * hidden, inter, True)
    out.append(Case("MoE compressed experts", lambda: moe_triton.fused_experts(
        x, ids, weights, cgu, cdn, F.silu, num_experts=experts)))

    w8 = quant.quantize(torch.randn(256, 512, generator=g), "fp8", 128)
    for rows, split in ((1, 4), (16, 1), (64, 1), (256, 1)):
        def w8a8(rows: int = rows, split: int = split) -> None:
            fp8_triton.w8a8_gemm(randn(rows, 512), w8.q, w8.scales, w8.group_size, randn(256),
                                 torch.empty(rows, 256, dtype=bf), split_k=split)
        out.append(Case(f"FP8 w8a8 {rows} rows split {split}", w8a8))

    def experts_decoded(decode: str) -> None:
        kept = moe_triton.EXPERTS_DECODE
        moe_triton.EXPERTS_DECODE = decode
        try:
            moe_triton.fused_experts(x, ids, weights, cgu, cdn, F.silu, num_experts=experts)
        finally:
            moe_triton.EXPERTS_DECODE = kept

    experts_other = other(moe_triton.EXPERTS_DECODE)
    out.append(Case(f"MoE compressed experts, {experts_other} decode", lambda: experts_decoded(experts_other)))

    def lora(rank: int) -> None:
        rows = [-1, 2, 2, 0, 0, 0, 1]
        segs = [(1, 3, 2), (3, 6, 0), (6, 7, 1)]
        lora_triton.sgmv(randn(len(rows), 512), torch.empty(len(rows), 256, dtype=bf), randn(3, rank, 512),
                         randn(3, 256, rank), segs)
    for rank in (8, 64):
        out.append(Case(f"LoRA rank {rank}", lambda rank=rank: lora(rank)))

    rank, rope, bs = 512, 64, 16
    cache = randn(8, 1, bs, 1, rank + rope)
    tables = torch.arange(8).view(2, 4)
    ctx = torch.tensor([5, 40])
    for splits in (1, 4):
        out.append(Case(f"MLA decode, {splits} splits", lambda splits=splits: mla_triton.mla_decode(
            randn(2, 16, rank), randn(2, 16, rope), cache, tables, ctx, 0.1, splits=splits)))

    kv_heads, dim = 8, 128
    kv = randn(16, 2, bs, kv_heads, dim)
    table = torch.arange(16).view(2, 8)
    for group, window, splits in ((1, 0, 1), (4, 0, 4), (8, 0, 8), (4, 64, 4)):
        out.append(Case(f"decode attention group {group} window {window} splits {splits}",
                        lambda group=group, window=window, splits=splits: triton_ops.paged_decode_attention(
                            randn(2, kv_heads * group, dim), kv, table, torch.tensor([7, 100]), 0.1,
                            window=window, splits=splits)))
    segs = torch.tensor([[0, 32, 32], [32, 16, 80]])  # (first row, new tokens, context) per prompt
    for window in (0, 64):
        q = randn(48, kv_heads * 4, dim)
        out.append(Case(f"prefill attention window {window}", lambda q=q, window=window:
                        triton_ops.paged_prefill_attention(q, kv, table, segs, 0.1, torch.empty_like(q),
                                                           max_q_len=32, window=window)))
    out.append(Case("store KV", lambda: triton_ops.store_kv(kv, randn(3, kv_heads, dim), randn(3, kv_heads, dim),
                                                            torch.tensor([0, 1, 1]), torch.tensor([3, 0, 1]))))
    kv8 = kv.to(torch.float8_e4m3fn)  # --kv-cache-dtype fp8: the same kernels over the cache's bytes
    out.append(Case("store KV e4m3", lambda: triton_ops.store_kv(kv8, randn(3, kv_heads, dim), randn(3, kv_heads, dim),
                                                                 torch.tensor([0, 1, 1]), torch.tensor([3, 0, 1]))))
    for splits in (1, 4):
        out.append(Case(f"decode attention e4m3 splits {splits}", lambda splits=splits: triton_ops.paged_decode_attention(
            randn(2, kv_heads * 4, dim), kv8, table, torch.tensor([7, 100]), 0.1, splits=splits)))
    out.append(Case("prefill attention e4m3", lambda: triton_ops.paged_prefill_attention(
        randn(48, kv_heads * 4, dim), kv8, table, segs, 0.1, randn(48, kv_heads * 4, dim), max_q_len=32)))
    cache8 = cache.to(torch.float8_e4m3fn)
    out.append(Case("MLA decode e4m3", lambda: mla_triton.mla_decode(randn(2, 16, rank), randn(2, 16, rope), cache8,
                                                                     tables, ctx, 0.1, splits=1)))
    out.append(Case("RMSNorm", lambda: triton_ops.rms_norm(randn(4, 4096), randn(4096), 1e-5)))
    out.append(Case("RMSNorm + residual", lambda: triton_ops.rms_norm(randn(4, 4096), randn(4096), 1e-5,
                                                                      randn(4, 4096))))
    out.append(Case("RMSNorm + residual, Llama's order", lambda: triton_ops.rms_norm(
        randn(4, 4096), randn(4096), 1e-5, randn(4, 4096), weight_after_cast=True)))
    out.append(Case("RMSNorm, 8192 wide", lambda: triton_ops.rms_norm(randn(4, 8192), randn(4096 * 2), 1e-5,
                                                                      randn(4, 8192), weight_after_cast=True)))
    out.append(Case("RoPE", lambda: triton_ops.rope(randn(4, 40, 128), torch.polar(
        torch.ones(4, 1, 64), randn(4, 1, 64, dtype=torch.float32)))))
    out.append(Case("RoPE, MLA's 64-wide rope part", lambda: triton_ops.rope(randn(4, 128, 192)[..., 128:], torch.polar(
        torch.ones(4, 1, 32), randn(4, 1, 32, dtype=torch.float32)))))
    return out


def capture_all() -> list[Launch]:
    """Every launch the representative calls make (the kernels swapped for recorders meanwhile). Raises
    naming any kernel no call launched: a new kernel needs a case here, or it is never compiled."""
    with captured() as (log, case, every):
        for c in cases():
            case[0] = c.name
            c.run()
    missing = every - {f"{x.module}.{x.name}" for x in log}
    if missing:
        raise RuntimeError(f"no case launches {sorted(missing)}: add one to loadtest/triton_aot.py cases()")
    return log


def unique(launches: list[Launch]) -> list[Launch]:
    """One launch per distinct compile: the same kernel with the same constexprs, options and argument
    kinds compiles once (the first case that made it names it)."""
    seen: set[str] = set()
    out = []
    for launch in launches:
        kinds = tuple(str(v.dtype) if isinstance(v, torch.Tensor) else
                      (v if v is None or isinstance(v, bool) else type(v).__name__) for v in launch.args)
        key = repr((launch.module, launch.name, kinds, sorted((k, repr(v)) for k, v in launch.kwargs.items()
                                                              if not isinstance(v, torch.Tensor))))
        if key not in seen:
            seen.add(key)
            out.append(launch)
    return out


def table(results: list[Compiled]) -> str:
    lines = ["| kernel [first case] constexprs | arch | compile s | registers | local (spill) bytes | shared bytes "
             "| shared-memory instructions | barriers | layout conversions | tensor cores | main loop (instructions) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in results:
        if r.ok:
            lines.append(f"| {r.launch.label} | sm_{r.arch} | {r.seconds:.1f} | {r.registers} | {r.local_bytes} | "
                         f"{r.shared_bytes} | {r.shared_ops} | {r.barriers} | {r.conversions} | "
                         f"{'yes' if r.tensor_cores else 'no'} | {r.loop} |")
        else:
            lines.append(f"| {r.launch.label} | sm_{r.arch} | {r.seconds:.1f} | FAILED: {r.error.splitlines()[0][:200]} "
                         "| | | | | | | |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="90", help="compute capabilities, comma-separated (80: A100, 90: H100/H200)")
    p.add_argument("--only", default="", help="only launches whose label contains this")
    p.add_argument("--set", default="", metavar="K=V,...",
                   help="launch choices to try instead, on the launches selected (e.g. with --only 'compressed 1 "
                        "rows' --set BLOCK_N=32,BLOCK_K=128,num_warps=8); integers or true/false")
    p.add_argument("--out", default="", help="append the table to this file")
    p.add_argument("--dump", default="", metavar="DIR", help="write each launch's TTGIR, PTX and SASS into DIR")
    a = p.parse_args()
    launches = [x for x in unique(capture_all()) if a.only in x.label]
    if a.set:
        pairs = [kv.split("=", 1) for kv in a.set.split(",")]
        if any(len(kv) != 2 or not (kv[1].lower() in ("true", "false") or kv[1].lstrip("-").isdigit())
               for kv in pairs):
            p.error(f"--set takes K=V,... with integer or true/false values, got {a.set!r}")
        values = {k: v.lower() == "true" if v.lower() in ("true", "false") else int(v) for k, v in pairs}
        launches = [Launch(x.case, x.module, x.name, x.fn, x.args, {**x.kwargs, **values}) for x in launches]
    results = []
    for arch in (int(v) for v in a.arch.split(",")):
        for launch in launches:
            if arch < MIN_ARCH.get(launch.module, 0):
                continue
            r = compile_launch(launch, arch, Path(a.dump) if a.dump else None)
            results.append(r)
            print(f"sm_{arch} {launch.label}: " + (f"{r.registers} registers, {r.local_bytes} B local, "
                  f"{r.shared_bytes} B shared, {r.shared_ops} shared-memory instructions, {r.barriers} barriers, "
                  f"{r.conversions} layout conversions, tensor cores {r.tensor_cores}, main loop {r.loop} "
                  f"instructions ({r.seconds:.1f} s)" if r.ok
                  else f"FAILED {r.error}"),
                  file=sys.stderr, flush=True)
    import triton

    args = " ".join(f"--{k} {v!r}" for k, v in (("only", a.only), ("set", a.set)) if v)
    text = (f"## {time.strftime('%Y-%m-%d %H:%M')} python -m loadtest.triton_aot --arch {a.arch} {args} (Triton "
            f"{triton.__version__}, compiled on a CPU-only host)\n\n{table(results)}\n")
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
