"""bfloat16 weights held compressed in device memory (`engine/model/compressed_weight.py`) and the matmul
that decodes them tile by tile (`engine/model/kernels/compressed_triton.py`): packing is bit-exact for
every 16-bit pattern; the kernel on compressed weights without escapes equals the same kernel on the
plain bfloat16 matrix bit for bit in the Triton interpreter, and up to float32 rounding with escapes,
compiled for a GPU, and against a float64 matmul (partial tiles, one row or many, K split or not).
Without a GPU the kernel runs in the Triton interpreter."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at import
triton = pytest.importorskip("triton")

from engine.model.compressed_weight import ESCAPE, pack  # noqa: E402
from engine.model.kernels.compressed_triton import (  # noqa: E402
    DECOMPRESS_MIN_ROWS,
    compressed_linear,
    decompress,
    matmul,
)

DEV = torch.device("cuda" if CUDA else "cpu")


def normal(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)


def with_outliers(w: torch.Tensor, count: int, seed: int = 1) -> torch.Tensor:
    """Weights with exponents outside the common band, spread over the matrix: escapes in many tiles."""
    g = torch.Generator().manual_seed(seed)
    w = w.clone()
    rows = torch.randint(0, w.shape[0], (count,), generator=g)
    cols = torch.randint(0, w.shape[1], (count,), generator=g)
    vals = torch.tensor([3.0, -7.5e2, 1e-12, 4e-30, 2.5e5], dtype=torch.bfloat16)
    w[rows, cols] = vals[torch.arange(count) % len(vals)]
    return w


def test_every_16_bit_pattern_packs_and_unpacks_bit_exact():
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    c = pack(every)
    assert torch.equal(c.decompress().view(torch.int16), every.view(torch.int16))
    assert c.num_escapes == every.numel() - 15 * 256  # (all but the band's 15 exponents x 256 sign/mantissa)


def test_normal_weights_take_three_quarters_of_bfloat16_with_few_escapes():
    w = normal(300, 512)
    c = pack(w)
    assert torch.equal(c.decompress().view(torch.int16), w.view(torch.int16))
    assert (c.codes & 0x0F).eq(ESCAPE).sum() + (c.codes >> 4).eq(ESCAPE).sum() == c.num_escapes
    assert c.num_escapes < w.numel() // 1000
    assert c.nbytes / (w.numel() * 2) < 0.76
    odd = with_outliers(normal(37, 70), 25)  # odd rows, escapes in many places
    c = pack(odd)
    assert torch.equal(c.decompress().view(torch.int16), odd.view(torch.int16))
    assert c.num_escapes >= 20 and len(set(c.esc_rows.tolist())) >= 10


def test_packing_a_chunk_of_rows_at_a_time_gives_the_same_form():
    """`pack` works through a matrix a few rows at a time (bounded temporaries for an LM head): any chunk
    size gives the same planes, codes, base and escapes as one pass."""
    w = with_outliers(normal(41, 70, seed=4), 50)
    whole = pack(w, chunk=1 << 30)
    for chunk in (1, 70, 71, 700, 41 * 70 - 1):
        c = pack(w, chunk=chunk)
        assert c.base == whole.base
        for name in ("plane", "codes", "esc_rows", "esc_cols", "esc_start"):
            assert torch.equal(getattr(c, name), getattr(whole, name)), (chunk, name)
        assert torch.equal(c.esc_vals.view(torch.int16), whole.esc_vals.view(torch.int16))
    assert torch.equal(whole.decompress().view(torch.int16), w.view(torch.int16))


def test_what_cannot_be_packed_is_refused_by_name():
    with pytest.raises(ValueError, match="bfloat16"):
        pack(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="2-D"):
        pack(normal(4, 8).reshape(-1))
    odd = normal(5, 37)  # (any number of columns: the last run of codes is padded)
    assert torch.equal(pack(odd).decompress().view(torch.int16), odd.view(torch.int16))
    with pytest.raises(ValueError, match="multiple of 32"):
        compressed_linear(torch.zeros(1, 37, dtype=torch.bfloat16, device=DEV), pack(odd).to(DEV), block_k=48)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(("m", "n", "k", "block_n", "block_k", "split_k"), [
    (1, 70, 100, 32, 32, 1), (5, 64, 64, 16, 32, 2), (17, 37, 130, 32, 64, 3), (3, 96, 48, 64, 32, 1),
    (2, 33, 45, 16, 64, 2),
])
def test_the_kernel_on_compressed_weights_equals_it_on_plain_ones(m, n, k, block_n, block_k, split_k):
    """Without escapes the compressed and plain kernels compute the same tiles in the same order: bit for
    bit interpreted (compiled for a GPU the two variants may order the reduction differently — seen on an
    H200 — so equal up to float32 rounding there). With escapes (added after the dense product) and
    against a float64 product: up to float32 rounding. Partial tiles, one row or many, K split or not."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
    for w in (normal(n, k, seed=n + k), with_outliers(normal(n, k, seed=n + k), 3 * n // 4)):
        c = pack(w).to(DEV)
        wd = w.to(DEV).contiguous()
        for gemv in (False, True):  # (tensor-core tiles, one row per program)
            launch = dict(block_n=block_n, block_k=block_k, split_k=split_k, gemv=gemv)
            y = compressed_linear(x, c, **launch)
            # Every decode against the reference (through bfloat16): the same weights, the same sums but
            # for the fast decode's escape stand-ins, added and taken back out (float32 rounding)
            y_ref = compressed_linear(x, c, decode="bfloat16", **launch)
            for decode in ("select", "fast"):
                y_d = compressed_linear(x, c, decode=decode, **launch)
                if (decode == "select" or c.num_escapes == 0) and not CUDA:
                    assert torch.equal(y_d, y_ref), (decode, gemv)
                assert _rel(y_d, y_ref) < 1e-5 and _rel(y_d, x.double() @ wd.double().T) < 1e-5, (decode, gemv)
            plain = compressed_linear(x, c, plain=wd, **launch)
            ref = x.double() @ wd.double().T
            if c.num_escapes == 0 and not CUDA:
                assert torch.equal(y, plain)
            assert _rel(y, plain) < 1e-5 and _rel(y, ref) < 1e-5 and not bool(y.isnan().any())
    assert c.num_escapes > 0


@pytest.mark.parametrize(("m", "rows", "split_k"), [(2, 2, 1), (3, 2, 2), (3, 4, 1), (7, 4, 3), (1, 4, 2)])
def test_the_row_kernel_with_several_rows_per_program_equals_it_one_row_at_a_time(m, rows, split_k):
    """`_gemv_kernel` with 2 or 4 rows per program (each weight decoded once for them) gives every row the
    one-row program's sums: bit for bit interpreted, within float32 rounding compiled; every decode, the
    rows past the last masked, escapes (NaN and Inf among them) added to their own rows only."""
    w = with_outliers(normal(70, 200, seed=11), 50)
    w[3, 9], w[60, 150] = float("nan"), float("inf")
    c = pack(w).to(DEV)
    x = torch.randn(m, 200, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).to(DEV)
    for decode in ("fast", "select", "bfloat16"):
        launch = dict(block_n=16, block_k=64, split_k=split_k, gemv=True, decode=decode)
        one = torch.cat([compressed_linear(x[i:i + 1], c, **launch) for i in range(m)])
        many = compressed_linear(x, c, block_m=rows, **launch)
        assert torch.equal(many.isnan(), one.isnan()) and torch.equal(many.isinf(), one.isinf()), decode
        if not CUDA:
            assert torch.equal(many.nan_to_num(), one.nan_to_num()), decode  # (NaN != NaN)
        fine = ~(one.isnan() | one.isinf())
        assert _rel(many[fine], one[fine]) < 1e-6, decode
    with pytest.raises(ValueError, match="rows per program"):
        compressed_linear(x, c, gemv=True, block_m=3)


@pytest.mark.parametrize("block_m", [1, 16, 64])
def test_escapes_land_in_their_own_columns_only_nan_and_inf_included(block_m):
    """Each escape is added into its row's output column by the program owning that row (one of several
    K shares, rows in several row blocks): a NaN or Inf weight spoils its own column as in the reference
    product and no other."""
    w = with_outliers(normal(80, 96, seed=3), 60)
    w[5, 7], w[40, 90], w[79, 0] = float("nan"), float("inf"), float("-inf")
    c = pack(w).to(DEV)
    x = torch.randn(block_m + 3, 96, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEV)
    ref = x.double() @ w.to(DEV).double().T
    bad = [5, 40, 79]
    good = [i for i in range(80) if i not in bad]
    for decode in ("fast", "select"):  # (fast: the NaN/Inf escape's stand-in comes back out as NaN/Inf too)
        y = compressed_linear(x, c, block_n=32, block_k=32, split_k=2, block_m=block_m, gemv=block_m == 1,
                              decode=decode)
        assert torch.equal(y[:, bad].isnan(), ref[:, bad].isnan()), decode
        assert torch.equal(y[:, bad].isinf(), ref[:, bad].isinf()), decode
        assert _rel(y[:, good], ref[:, good]) < 1e-5, decode


def test_escape_stand_ins_only_where_they_stay_small():
    """The one-row kernel's fast decode lets an escape decode at exponent base + 15 and takes that product
    back out; a band high enough that the stand-in could overflow x * w (base > STAND_IN_MAX_BASE) takes
    the select path instead, exact as ever (weights around 2^20, escapes among them, huge and tiny)."""
    from engine.model.kernels.compressed_triton import STAND_IN_MAX_BASE

    w = with_outliers(normal(40, 96, seed=9), 30) * 2.0 ** 20
    w[3, 5], w[7, 70] = 2.0 ** 100, 2.0 ** -100
    c = pack(w.to(torch.bfloat16)).to(DEV)
    assert c.base > STAND_IN_MAX_BASE and c.num_escapes > 0
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEV)
    ref = x.double() @ w.to(torch.bfloat16).to(DEV).double().T
    for gemv in (True, False):
        y = compressed_linear(x, c, block_n=16, block_k=32, gemv=gemv, decode="fast")
        assert not bool(y.isinf().any()) and _rel(y, ref) < 1e-5
        assert torch.equal(y, compressed_linear(x, c, block_n=16, block_k=32, gemv=gemv, decode="select"))
    with pytest.raises(ValueError, match="decode"):
        compressed_linear(x, c, gemv=True, decode="fastest")


@pytest.mark.parametrize("decode", ["select", "fast"])
def test_the_gpu_decoder_equals_the_reference_bit_for_bit(decode, monkeypatch):
    """`decompress` (one program per tile, escapes placed by the tile's program: the many-rows path) ==
    `CompressedBF16.decompress` for every 16-bit pattern, an odd shape with escapes and a band whose
    escapes' base + 15 overflows the exponent field, whole or a range of rows, with either decode (the
    fast one leaves the escapes undecoded for their stores to overwrite); `matmul` from
    DECOMPRESS_MIN_ROWS rows is torch's GEMM on that matrix (decoded whole or a chunk of rows at a time),
    below it the tile kernel."""
    from engine.model.kernels import compressed_triton

    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    odd = with_outliers(normal(150, 70), 120)
    high = with_outliers(normal(96, 64) * 2.0**130, 40)  # (a band based at 241: base + 15 > 255)
    assert pack(high).base + 15 > 255 and pack(high).num_escapes > 0
    for w in (every, odd, high):
        c = pack(w).to(DEV)
        ref = c.decompress().view(torch.int16)
        assert torch.equal(decompress(c, decode=decode).view(torch.int16), ref)
        for n0, n1 in ((0, 64), (64, 129), (3, 150), (100, 101)):
            n1 = min(n1, w.shape[0])
            if n0 < n1:
                assert torch.equal(decompress(c, n0, n1, decode=decode).view(torch.int16), ref[n0:n1])
    monkeypatch.setattr(compressed_triton, "DECOMPRESS_DECODE", decode)
    x = torch.randn(DECOMPRESS_MIN_ROWS, 70, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEV)
    c = pack(odd).to(DEV)
    whole = torch.nn.functional.linear(x, odd.to(DEV))
    assert torch.equal(matmul(x, c), whole)
    monkeypatch.setattr(compressed_triton, "DECOMPRESS_CHUNK", 64 * 70)  # (64 rows at a time: three chunks)
    assert torch.equal(matmul(x, c), whole)
    with pytest.raises(ValueError, match="decode"):
        decompress(c, decode="bfloat16")
    assert _rel(matmul(x[:3], c), x[:3].double() @ odd.to(DEV).double().T) < 1e-5


def _expert_stacks(tokens: int, top_k: int, experts: int, seed: int) -> tuple:
    """Activations, routing (bfloat16 weights, ids), the plain expert stacks ([E, 2I, H], [E, H, I]) and
    each compressed as rows, with escapes in many experts."""
    from engine.model.moe import route

    torch.manual_seed(seed)
    hidden, inter = (1024, 512) if CUDA else (64, 32)
    x = torch.randn(tokens, hidden, device=DEV, dtype=torch.bfloat16)
    weights, ids = route(torch.randn(tokens, experts, device=DEV), top_k, renormalize=True)
    gu = with_outliers(normal(experts * 2 * inter, hidden, seed=1), experts * 8).reshape(experts, 2 * inter, hidden)
    dn = with_outliers(normal(experts * hidden, inter, seed=2), experts * 8).reshape(experts, hidden, inter)
    gu, dn = gu.to(DEV), dn.to(DEV)
    cgu, cdn = pack(gu.reshape(-1, hidden)), pack(dn.reshape(-1, inter))
    assert cgu.num_escapes > 0 and cdn.num_escapes > 0
    return x, weights.to(torch.bfloat16), ids, (gu, dn), (cgu, cdn)


@pytest.mark.parametrize("decode", ["select", "fast"])
@pytest.mark.parametrize("tokens, top_k, experts", [(1, 2, 4), (9, 2, 5)])
def test_compressed_expert_stacks_through_the_grouped_kernel_equal_the_plain_experts(tokens, top_k, experts,
                                                                                      decode, monkeypatch):
    """Each projection's experts stacked as rows and compressed (`Experts.compress`), through the grouped
    MoE kernel (tiles decoded in registers by either decode, escapes added by the tile's program — scaled
    by the routing weight in the down projection) and through the per-expert loop that decodes each
    chosen expert's rows: both equal the plain bfloat16 experts' loop up to float32 rounding; escapes in
    many experts."""
    import torch.nn.functional as F

    from engine.model.compressed_weight import row_range
    from engine.model.kernels import moe_triton
    from engine.model.moe import grouped_experts, grouped_experts_reference

    monkeypatch.setattr(moe_triton, "EXPERTS_DECODE", decode)
    x, weights, ids, (gu, dn), (cgu, cdn) = _expert_stacks(tokens, top_k, experts, seed=tokens)
    hidden, inter = x.shape[1], gu.shape[1] // 2
    exact = grouped_experts_reference(x.double(), ids, weights.double(), gu.double(), dn.double(), F.silu)
    blocks = {} if CUDA else dict(block_m=16, block_n=32, block_k=32)
    fused = moe_triton.fused_experts(x, ids, weights, cgu, cdn, F.silu, num_experts=experts, **blocks)
    loop = grouped_experts(x.float(), ids, weights.float(), experts,
                           lambda e, r: F.linear(r, row_range(cgu, e * 2 * inter, 2 * inter).float()),
                           lambda e, r: F.linear(r, row_range(cdn, e * hidden, hidden).float()), F.silu)
    for ours in (fused.float(), loop):
        assert _rel(ours, exact) < 1e-2  # (bfloat16 activations between the two projections)
    assert fused.dtype == torch.bfloat16 and _rel(fused.float(), loop) < 1e-2
    with pytest.raises(ValueError, match="num_experts"):
        moe_triton.fused_experts(x, ids, weights, cgu, cdn, F.silu, **blocks)


@pytest.mark.parametrize("chunk_experts", [1, 3, 8])
def test_compressed_stacks_decoded_for_a_prefill_equal_the_plain_stacks_bit_for_bit(chunk_experts, monkeypatch):
    """From DECODED_EXPERTS_MIN_BLOCKS blocks per expert (a prefill) the grouped MoE kernel runs on the
    compressed stacks decoded to bfloat16, a chunk of whole experts at a time: exactly the plain stacks'
    grouped GEMM (the same weights, the same kernel and tiles), whatever the chunk (one expert, some, all);
    below that count (a decode step) the tiles decode in registers."""
    import torch.nn.functional as F

    from engine.model.kernels import compressed_triton, moe_triton

    block_m = 64 if CUDA else 16
    experts, top_k = 5, 2
    tokens = experts * block_m // top_k  # (one block per expert on average)
    x, weights, ids, (gu, dn), (cgu, cdn) = _expert_stacks(tokens, top_k, experts, seed=3)
    hidden, inter = x.shape[1], gu.shape[1] // 2
    blocks = {} if CUDA else dict(block_m=16, block_n=32, block_k=32)
    plain = moe_triton.fused_experts(x, ids, weights, gu, dn, F.silu, **blocks)
    monkeypatch.setattr(compressed_triton, "DECOMPRESS_CHUNK", chunk_experts * 2 * inter * hidden)
    monkeypatch.setattr(moe_triton, "DECODED_EXPERTS_MIN_BLOCKS", 1)
    assert moe_triton.decodes_stacks(tokens * top_k, experts, block_m)
    decoded = moe_triton.fused_experts(x, ids, weights, cgu, cdn, F.silu, num_experts=experts, **blocks)
    assert decoded.dtype == plain.dtype and torch.equal(decoded, plain)
    monkeypatch.setattr(moe_triton, "DECODED_EXPERTS_MIN_BLOCKS", 0)  # (never: the tiles decode in registers)
    assert not moe_triton.decodes_stacks(tokens * top_k, experts, block_m)
    tiles = moe_triton.fused_experts(x, ids, weights, cgu, cdn, F.silu, num_experts=experts, **blocks)
    assert not torch.equal(tiles, plain) and _rel(tiles.float(), plain.float()) < 1e-2
    monkeypatch.setattr(moe_triton, "DECODED_EXPERTS_MIN_BLOCKS", 2)
    assert not moe_triton.decodes_stacks(2 * experts * block_m - 1, experts, block_m)
    assert moe_triton.decodes_stacks(2 * experts * block_m, experts, block_m)


@pytest.mark.skipif(CUDA, reason="the GPU code path on CPU tensors, interpreted")
@pytest.mark.parametrize("tiles_decode", ["select", "fast"])
@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3_moe"])  # (untied head; tied head; experts)
def test_an_engine_with_compressed_weights_decodes_as_with_plain_ones(tmp_path, monkeypatch, family, tiles_decode):
    """`--compress-weights` through the whole engine (every Triton kernel in its seam, interpreted): every
    bfloat16 linear layer and the embedding table hold their weights compressed (a tied LM head the
    table itself), the compressed matmul and row lookup run every step, and greedy tokens equal the same
    engine's on the plain bfloat16 weights."""
    from engine_helpers import drain, make_engine
    from hf_models import make_hf_model

    from common.sampling_params import SamplingParams
    from engine.model.kernels import compressed_triton, kernels, moe_triton
    from engine.model.layers import Linear

    hf = make_hf_model(family, tmp_path / "m")
    monkeypatch.setattr(compressed_triton, "TILES_DECODE", tiles_decode)  # (the prompts' <= 32-row chunks)
    monkeypatch.setattr(moe_triton, "EXPERTS_DECODE", tiles_decode)
    monkeypatch.setenv("SPLITFIRE_KERNELS", "triton")
    kernels.cache_clear()
    try:
        prompts = [list(range(3, 30)), [5, 6, 7]]
        outs = {}
        calls: list[str] = []
        for name in ("compressed_linear", "rows"):
            real = getattr(compressed_triton, name)
            monkeypatch.setattr(compressed_triton, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
        for compress in (False, True):
            calls.clear()
            engine = make_engine(hf.path, dtype="bfloat16", compress_weights=compress, max_num_batched_tokens=32,
                                 max_num_seqs=4)
            model = engine.model
            linears = [m for m in model.modules() if isinstance(m, Linear)]
            assert all((m.compressed is not None) == compress for m in linears)
            assert (model.embed_compressed is not None) == compress
            experts = [m for m in model.modules() if type(m).__name__ == "Experts"]
            assert all((m.compressed is not None) == compress for m in experts)
            if compress and model.cfg.tie_word_embeddings:
                assert model.lm_head.compressed is model.embed_compressed and not model.embed.weight.numel()
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
            done = drain(engine)
            outs[compress] = [done[f"r{i}"].token_ids for i in range(len(prompts))]
            assert set(calls) == ({"compressed_linear", "rows"} if compress else set())
        assert outs[True] == outs[False]
    finally:
        kernels.cache_clear()


def test_rows_of_a_compressed_table_equal_the_reference_lookup():
    """`rows` (an embedding lookup decoding only the rows asked for, each with its escapes) == indexing the
    reference `decompress()` bit for bit: repeated and out-of-order ids, 2-D ids, more ids than a program
    takes, a row full of escapes, none at all."""
    from engine.model.kernels.compressed_triton import rows

    w = with_outliers(normal(50, 70, seed=8), 60)
    w[7] = torch.tensor([1e-30, 5e5, -3.0, 8.0] * 17 + [2.0, 1e-20], dtype=torch.bfloat16)  # row 7: mostly escapes
    c = pack(w).to(DEV)
    ref = c.decompress().view(torch.int16)
    for ids in (torch.tensor([7, 0, 49, 7, 3]), torch.arange(50).flip(0), torch.tensor([[1, 7], [7, 2]]),
                torch.tensor([], dtype=torch.long)):
        ids = ids.to(DEV)
        got = rows(c, ids)
        assert got.shape == (*ids.shape, 70) and torch.equal(got.view(torch.int16), ref[ids])
    assert int((c.esc_rows == 7).sum()) > 30


def test_compress_weights_is_refused_where_it_cannot_run(monkeypatch):
    from engine.engine_config import EngineConfig

    monkeypatch.delenv("SPLITFIRE_KERNELS", raising=False)
    for kw, why in [({"device": "cpu", "dtype": "bfloat16"}, "needs --device cuda"),
                    ({"device": "cpu", "dtype": "float32"}, "needs --dtype bfloat16"),
                    ({"device": "cpu", "dtype": "bfloat16", "quantization": "int8"}, "choose one")]:
        with pytest.raises(ValueError, match=why):
            EngineConfig(model="m", compress_weights=True, **kw).validate()


def test_the_cpu_kernel_decodes_compressed_weights_as_the_reference_does():
    """`cpu_ops.gemv_cbf16` (one row against a `CompressedBF16`, weights rebuilt in registers; the CPU's
    answer to whether decoding in the kernel keeps up with memory: loadtest/bench_compressed_cpu.py) and
    its plain-bfloat16 twin `gemv_bf16` against a float64 product: full runs of 32 columns and a scalar
    tail, escapes (a NaN spoiling only its own row), one thread or two."""
    from engine.model.kernels import cpu_ops

    if cpu_ops.library() is None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    for n, k in ((37, 70), (64, 512), (5, 33), (3, 16)):
        w = with_outliers(normal(n, k, seed=k), n)
        w[n // 2, k // 3] = float("nan")
        c = pack(w)
        x = torch.randn(k, generator=torch.Generator().manual_seed(n))
        ref = x.double() @ w.double().T
        good = [i for i in range(n) if i != n // 2]
        for threads in (1, 2):
            y, plain = cpu_ops.gemv_cbf16(x, c, threads), cpu_ops.gemv_bf16(x, w, threads)
            for out in (y, plain):
                assert _rel(out[good], ref[good]) < 1e-5 and not bool(out[good].isnan().any())
                assert bool(out[n // 2].isnan())
        assert c.num_escapes > 0
