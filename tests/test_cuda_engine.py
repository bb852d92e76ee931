"""The whole engine on a real GPU (skipped without CUDA): every family in bfloat16, Triton attention
compiled, decode steps replayed from CUDA graphs, against transformers in float32 on the CPU.

bfloat16 cannot reproduce float32's greedy tokens exactly, so the bar is the one
tests/test_model_families.py sets for bfloat16: the engine's last-position logits are no further from
float32 than transformers' own bfloat16 model is (on the same GPU), and every token the engine
generates is a greedy choice up to that error — teacher-forced through the float32 model, its logit is
within the bound of the largest one at every position. A wrong kernel (a bad page index, a lost
softmax rescale, a graph replaying stale inputs) moves logits by far more than bfloat16's rounding.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

from engine_helpers import drain, make_engine  # noqa: E402
from hf_models import FAMILIES, HFModel, make_hf_model  # noqa: E402
from test_model_families import engine_logits, prompts  # noqa: E402  (the same prompts and logits read)

from common.sampling_params import SamplingParams  # noqa: E402

N = 12
# Each engine's KV cache: 2% of the free memory (not --gpu-memory-fraction's 85%: a test makes several).
GPU = dict(device="cuda", dtype="bfloat16", gpu_memory_fraction=0.02)


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> HFModel:
    return make_hf_model(request.param, tmp_path_factory.mktemp(request.param) / "model")


@torch.no_grad()
def bf16_bound(family: HFModel, ps: list[list[int]]) -> float:
    """Twice transformers' own bfloat16 error on this GPU (largest over the prompts), plus a floor."""
    ref = copy.deepcopy(family.model).to("cuda", torch.bfloat16)
    worst = 0.0
    for p in ps:
        theirs = ref(torch.tensor([p], device="cuda")).logits[0, -1].float().cpu()
        worst = max(worst, (theirs - family.logits(p)).abs().max().item())
    return 2 * worst + 0.02


def _logits_within_bound(family: HFModel, engine) -> None:
    bound = bf16_bound(family, prompts())
    for p in prompts():
        err = (engine_logits(engine, p).float().cpu() - family.logits(p)).abs().max().item()
        assert err <= bound, f"{family.name}: {len(p)}-token prompt, bf16 error {err:.3f} > bound {bound:.3f}"


@torch.no_grad()
def _graph_tokens_are_greedy_choices(family: HFModel, engine, same_weights=None) -> None:
    """Every graph-decoded greedy token is, teacher-forced through the float32 model, within the bfloat16
    bound of its largest logit — or, given `same_weights` (an engine on the same weights stored another
    way), exactly that engine's greedy choice after the same tokens: a mixture-of-experts router's near
    tie can choose another expert in any bfloat16 engine (measured on the H200: the plain engine 4.5 off
    float32 after a prefix whose second and third experts score 3.1007 and 3.0951), and the storage
    under test must not be blamed for what the plain weights do too."""
    graphs = engine.runner.graphs
    assert graphs is not None, f"{family.name}: decode graphs were not captured (see event=decode_graphs_off)"
    assert engine.async_scheduling  # (auto: decode steps queued ahead of the last one's read on CUDA)
    ps = prompts()
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))
    out = drain(engine)
    assert graphs.replays > 0, f"{family.name}: no decode step replayed a graph"
    bound = bf16_bound(family, ps)
    for i, p in enumerate(ps):
        toks = out[f"r{i}"].token_ids
        assert len(toks) == N
        logits = family.model(torch.tensor([p + toks])).logits[0, len(p) - 1:-1].float()
        gap = logits.max(dim=-1).values - logits[torch.arange(N), torch.tensor(toks)]
        if same_weights is not None:
            for j in (gap > bound).nonzero().flatten().tolist():
                if int(engine_logits(same_weights, p + toks[:j]).argmax()) == toks[j]:
                    gap[j] = 0.0  # (the plain engine's own choice after the same tokens)
        worst = int(gap.argmax())
        assert gap.max().item() <= bound, (
            f"{family.name}: prompt {i}, token {worst} ({toks[worst]}) is {gap.max().item():.3f} below the "
            f"float32 argmax ({int(logits[worst].argmax())}); bfloat16 bound {bound:.3f}")


def test_bfloat16_logits_on_the_gpu_within_transformers_own_error(family):
    _logits_within_bound(family, make_engine(family.path, **GPU))


def test_graph_decoded_tokens_are_greedy_choices_up_to_bfloat16(family):
    _graph_tokens_are_greedy_choices(family, make_engine(family.path, **GPU))


@pytest.mark.parametrize("tiles_decode", ["select", "fast"])
def test_compressed_weights_on_the_gpu_hold_the_same_bar(family, tiles_decode, monkeypatch):
    """`--compress-weights` compiled on the device, every family: each bfloat16 matrix (attention, MLPs,
    routed experts through the grouped kernel, routers, LM head) and the embedding table stay compressed
    and are decoded inside the kernels; the weights are bit-identical, only the matmuls' summation order
    differs from cuBLAS, so logits and graph-decoded greedy tokens meet the same bfloat16 bar — with the
    tiles' and experts' select decode and with their fast one."""
    from engine.model.kernels import compressed_triton, moe_triton
    from engine.model.layers import Linear

    monkeypatch.setattr(compressed_triton, "TILES_DECODE", tiles_decode)
    monkeypatch.setattr(moe_triton, "EXPERTS_DECODE", tiles_decode)

    engine = make_engine(family.path, **GPU, compress_weights=True)
    model = engine.model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    plain = [n for n, m in linears.items() if m.compressed is None and m.weight is not None
             and m.weight.dtype == torch.bfloat16 and m.weight.numel()]
    assert not plain and any(m.compressed is not None for m in linears.values()), (family.name, plain)
    assert model.embed_compressed is not None, family.name
    experts = [m for m in model.modules() if type(m).__name__ == "Experts"]
    assert all(m.compressed is not None for m in experts), family.name
    _logits_within_bound(family, engine)
    _graph_tokens_are_greedy_choices(family, engine, same_weights=make_engine(family.path, **GPU))


@torch.no_grad()
def test_graph_replay_equals_eager_decode_on_the_gpu(family):
    """Same device, dtype and kernels, graphs on vs off: the replayed step runs the same kernels on the
    same inputs (a full bucket, so even the matmuls' shapes match), so the tokens must be identical."""
    ps = prompts() + [[(5 * j + 3) % 390 + 3 for j in range(17)]]  # 4 streams: a bucket's size, no padding rows
    runs = []
    for graphs in ("on", "off"):
        engine = make_engine(family.path, **GPU, decode_graphs=graphs)
        for i, p in enumerate(ps):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))
        runs.append({k: v.token_ids for k, v in drain(engine).items()})
    assert runs[0] == runs[1], family.name



# FP8 (#57) on the device. The tiny shapes of tests/test_fp8.py: every matmul reads whole 128-column blocks.
# Random tiny models have flat logits (bfloat16 alone moves DeepSeek-V3-shaped top-1 at ~19% of positions on
# the CPU), so FP8 is held to bfloat16's own error here, not to a top-1 rate; the agreements are printed.
FP8_SHAPES = {
    "qwen3": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64),
    "deepseek_v3": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
                        qk_rope_head_dim=32, v_head_dim=64, moe_intermediate_size=256, n_routed_experts=16),
}
FORCED = [(5 * j * j + 11 * j) % 390 + 3 for j in range(129)]  # 128 teacher-forced positions
CPU_EXACT = dict(device="cpu", kv_cache_gb=0.02)  # float32 on the CPU: what the weights and cache mean


@torch.no_grad()
def _forced_logits(engine) -> torch.Tensor:
    from loadtest.quality import window_hidden

    return engine.model.logits(window_hidden(engine, FORCED)[:-1]).float().cpu()


def _errors(ours: torch.Tensor, exact: torch.Tensor) -> tuple[float, float, float]:
    """(top-1 agreement over the positions, max |logit error|, mean |logit error| / the exact logits' std)."""
    agree = (ours.argmax(-1) == exact.argmax(-1)).float().mean().item()
    err = (ours - exact).abs()
    return agree, err.max().item(), (err.mean() / exact.std()).item()


def _graph_decode(engine) -> None:
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))
    out = drain(engine)
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    assert all(len(r.token_ids) == N for r in out.values())


@torch.no_grad()
def _w8a8_simulated_logits(path, monkeypatch) -> torch.Tensor:
    """The exact model's w8a8 numerics in float32 on the CPU: every FP8 matmul by `fp8_triton.w8a8_reference`
    (activations rounded to e4m3 per token per group, as the device's kernel does)."""
    from engine_helpers import simulate_w8a8

    with monkeypatch.context() as m:
        simulate_w8a8(m)
        engine = make_engine(path, **CPU_EXACT)
        engine.model.cpu_layers_off = "every matmul through quant.linear"
        return _forced_logits(engine)


@pytest.mark.parametrize("method", ["weight-only", "w8a8"])
@pytest.mark.parametrize("name", list(FP8_SHAPES))
def test_block_fp8_weights_on_the_gpu_compute_their_dequantized_model(name, method, tmp_path, monkeypatch):
    """A block-FP8 checkpoint on the device, bfloat16 activations, every matmul by `method` (weight-only:
    e4m3 widened in the kernel; w8a8: activations quantized per token per 128 columns for the FP8 tensor
    cores, forced at every row count), held as e4m3 codes. Teacher-forced logits (128 positions) against the
    dequantized weights in float32 on the CPU: weight-only within twice the error of the same dequantized
    weights in bfloat16 on the device (+0.02); w8a8's mean error at most w8a8's own (its numerics computed in
    float32 on the CPU: e4m3 activations move this random DeepSeek-V3-shaped model's logits by 0.41 of their
    spread) plus that bfloat16 engine's, + 0.1. Graph-decoded greedy tokens run too."""
    from hf_models import write_block_fp8, write_dequantized

    from engine.model.kernels import fp8_triton

    monkeypatch.setattr(fp8_triton, "W8A8_MIN_ROWS", 1 if method == "w8a8" else 1 << 30)
    monkeypatch.setattr(fp8_triton, "W8A8_MAX_ROWS", 1 << 30)
    hf = make_hf_model(name, tmp_path / "hf", **FP8_SHAPES[name])
    write_block_fp8(hf.path, tmp_path / "fp8", block=128)
    write_dequantized(tmp_path / "fp8", tmp_path / "deq")
    fp8 = make_engine(tmp_path / "fp8", **GPU)
    o = fp8.model.layers[-1].attn.o.quantized
    assert o is not None and o[0].kind == "fp8" and o[0].q.device.type == "cuda"
    calls: list[int] = []
    gemm = fp8_triton.w8a8_gemm
    monkeypatch.setattr(fp8_triton, "w8a8_gemm", lambda *a, **kw: calls.append(1) or gemm(*a, **kw))
    ours = _forced_logits(fp8)
    assert bool(calls) == (method == "w8a8")
    bf16 = _forced_logits(make_engine(tmp_path / "deq", **GPU))
    exact = _forced_logits(make_engine(tmp_path / "deq", **CPU_EXACT))
    (a, worst, mean), (ra, rworst, rmean) = _errors(ours, exact), _errors(bf16, exact)
    print(f"{name} fp8 {method}: top-1 {a:.3f}, max |err| {worst:.3f}, mean {mean:.3f} std; dequantized "
          f"bfloat16: top-1 {ra:.3f}, max {rworst:.3f}, mean {rmean:.3f} std")
    if method == "weight-only":
        assert worst <= 2 * rworst + 0.02, (name, worst, rworst)
    else:
        sa, _, smean = _errors(_w8a8_simulated_logits(tmp_path / "fp8", monkeypatch), exact)
        print(f"{name} w8a8 in float32 on the CPU: top-1 {sa:.3f}, mean {smean:.3f} std")
        assert mean <= smean + rmean + 0.1, (name, mean, smean, rmean)
    _graph_decode(fp8)


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_an_e4m3_kv_cache_on_the_gpu_reads_what_the_cpu_reads(name, tmp_path):
    """`--kv-cache-dtype fp8` compiled on the device (paged or latent attention reading e4m3): teacher-forced
    logits against the float32 model over the same e4m3 cache on the CPU, within three times the bfloat16
    engine's own error (bfloat16 cache vs float32) + 0.05 — a key computed in bfloat16 can round to the
    neighbouring e4m3 value. Graph-decoded greedy tokens run too."""
    hf = make_hf_model(name, tmp_path / "hf", **FP8_SHAPES.get(name, {}))
    fp8 = make_engine(hf.path, **GPU, kv_cache_dtype="fp8")
    assert fp8.kv.layout.dtype == torch.float8_e4m3fn
    ours = _forced_logits(fp8)
    exact = _forced_logits(make_engine(hf.path, **CPU_EXACT, kv_cache_dtype="fp8"))
    bf16 = _forced_logits(make_engine(hf.path, **GPU))
    plain = _forced_logits(make_engine(hf.path, **CPU_EXACT))
    (a, worst, mean), (ra, rworst, rmean) = _errors(ours, exact), _errors(bf16, plain)
    e4 = _errors(exact, plain)
    print(f"{name} e4m3 KV on the device vs the CPU's: top-1 {a:.3f}, max |err| {worst:.3f}, mean {mean:.3f} std; "
          f"bfloat16 cache vs float32: top-1 {ra:.3f}, max {rworst:.3f}, mean {rmean:.3f} std; e4m3 vs float32 cache on the CPU: "
          f"top-1 {e4[0]:.3f}, mean {e4[2]:.3f} std")
    assert worst <= 3 * rworst + 0.05, (name, worst, rworst)
    _graph_decode(fp8)
