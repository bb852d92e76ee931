"""EAGLE-3 heads (engine/spec/eagle3.py): the head's forward pass equals a plain-torch reading of the
published layout (Hugging Face RoPE convention, [embedding | hidden] attention input, d2t ids),
and serving with a randomly initialised head is lossless — greedy and seeded output identical to
no speculation, colocated (with chunked prefill and a prefix hit) and on a disaggregated decode
worker, where the head starts without the prompt's features. No published head exists for the
test models, so acceptance here says nothing about a trained head's."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch
from engine_helpers import drain, make_engine
from grpc_client import generate, greedy, wait_blocks_free
from procs import address, start_worker
from safetensors.torch import save_file

from common.errors import ModelLoadError
from common.sampling_params import SamplingParams
from engine.model.model_config import ModelConfig
from engine.spec.eagle3 import load_head, read_config
from loadtest.random_models import write_eagle3_head

HIDDEN, HEADS, KV_HEADS, DRAFT_VOCAB = 64, 4, 2, 150  # the tiny target's shape; the head's vocabulary


def make_head(out: Path, target_dir: Path, *, aux: tuple[int, ...] | None = (0, 1), **kw) -> Path:
    """A random head for the tiny 2-layer target (its default aux layers would not exist)."""
    return write_eagle3_head(out, target_dir, aux=aux, draft_vocab=DRAFT_VOCAB, **kw)


def _prompts() -> list[list[int]]:
    return [[(7 * i + j) % 50 + 3 for j in range(40 + 13 * i)] for i in range(4)] + [[5, 6, 7, 8] * 20]


def _run(model_dir, prompts, sampling=None, **kw) -> tuple[dict[str, list[int]], object]:
    eng = make_engine(model_dir, **kw)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, sampling or SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    out = drain(eng)
    assert eng.blocks.stats().used == 0
    if eng.eagle is not None:  # every head block back, rejected drafts' included
        assert len(eng.eagle.free) == eng.eagle.kv.layout.num_blocks
    return {k: v.token_ids for k, v in out.items()}, eng


def _rope_half(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Hugging Face's RoPE: dim i pairs with i + d/2 (rotate_half)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float(), torch.cat([ang.sin(), ang.sin()], -1).float()
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def _reference(w: dict[str, torch.Tensor], embeds, hidden, positions, norm_before_residual=False):
    """The head over one sequence's slots, causal, from the checkpoint tensors as published."""
    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w[name]

    p = "midlayer."
    e = rms(embeds, p + "input_layernorm.weight")
    if norm_before_residual:
        h = rms(hidden, p + "hidden_norm.weight")
        residual = h
    else:
        residual, h = hidden, rms(hidden, p + "hidden_norm.weight")
    x = torch.cat([e, h], -1)
    d, t = HIDDEN // HEADS, x.shape[0]
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(t, HEADS, d)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(t, KV_HEADS, d)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, KV_HEADS, d)
    q, k = _rope_half(q, positions, 10000.0), _rope_half(k, positions, 10000.0)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    a = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
    residual = residual + a
    x = rms(residual, p + "post_attention_layernorm.weight")
    m = (torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T))
    residual = residual + m @ w[p + "mlp.down_proj.weight"].T
    return rms(residual, "norm.weight"), residual


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_head_forward_equals_the_published_layout_read_plainly(tiny_model_dir, tmp_path, norm_before_residual):
    from safetensors.torch import load_file

    from engine.batch.model_runner import ModelRunner
    from engine.batch.scheduler import ScheduledSeq
    from engine.model.kv_cache import KVCache, KVLayout
    from engine.model.rope import rope_cache
    from engine.spec.eagle3 import HeadSeq

    head_dir = make_head(tmp_path / "head", tiny_model_dir, norm_before_residual=norm_before_residual)
    target = ModelConfig.from_dir(tiny_model_dir)
    head = load_head(head_dir, target, torch.device("cpu"), torch.float32)
    head.rope = rope_cache(head.cfg.layers[0].rope, head.cfg.head_dim, 256, torch.device("cpu"))
    kv = KVCache(KVLayout(1, 8, 4, KV_HEADS, HIDDEN // HEADS, torch.float32, 2), torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    n = 11
    seq = HeadSeq(all_token_ids=list(range(5, 5 + n)), positions=list(range(30, 30 + n)), block_table=[6, 2, 5])
    _, _, meta, _ = ModelRunner(head, kv, torch.device("cpu")).prepare([ScheduledSeq(seq, n)])  # type: ignore[arg-type]
    embeds, hidden = torch.randn(n, HIDDEN, generator=g), torch.randn(n, HIDDEN, generator=g)
    positions = torch.arange(30, 30 + n)  # slots 0..10 hold absolute positions 30..40: RoPE uses the latter
    with torch.inference_mode():
        normed, prenorm = head(embeds.clone(), hidden.clone(), positions, kv, meta)
    ref_normed, ref_prenorm = _reference(load_file(str(head_dir / "model.safetensors")), embeds, hidden, positions,
                                         norm_before_residual)
    torch.testing.assert_close(normed, ref_normed, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(prenorm, ref_prenorm, rtol=1e-4, atol=1e-5)
    # Draft ids map to target ids through d2t.
    w = load_file(str(head_dir / "model.safetensors"))
    draft = torch.tensor([0, 7, DRAFT_VOCAB - 1])
    assert head.to_target_ids(draft).tolist() == (draft + w["d2t"][draft]).tolist()
    assert all(w["t2d"][i] for i in head.to_target_ids(draft).tolist())


def test_eagle3_speculation_is_lossless(tiny_model_dir, tmp_path):
    head = make_head(tmp_path / "head", tiny_model_dir)
    prompts = _prompts()
    base, _ = _run(tiny_model_dir, prompts)
    spec = dict(speculative="eagle3", draft_model=str(head), speculative_max_batch=8)
    got, eng = _run(tiny_model_dir, prompts, **spec)
    assert got == base
    assert eng.drafter.drafted > 0 and eng.model.aux_layers == (0, 1)
    # Chunked prefill (16-token steps: the head gets the prompt's features chunk by chunk), the
    # head's own embedding table, and the other residual order.
    head2 = make_head(tmp_path / "head2", tiny_model_dir, embed=True, norm_before_residual=True, seed=5)
    chunked, eng = _run(tiny_model_dir, prompts, max_num_batched_tokens=16, max_num_seqs=8,
                        **{**spec, "draft_model": str(head2)})
    assert chunked == base and eng.drafter.drafted > 0 and eng.eagle.head.embed is not None
    # A second turn served partly from the prefix cache: the head has no features for the cached part.
    turn2 = [prompts[1] + base["1"] + [7, 8, 9]]
    want, _ = _run(tiny_model_dir, turn2)
    eng = make_engine(tiny_model_dir, **spec)
    eng.add_request("t1", prompts[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    drain(eng)
    eng.add_request("t2", turn2[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    out = drain(eng)
    assert out["t2"].token_ids == want["0"] and out["t2"].cached_tokens > 0
    assert len(eng.eagle.free) == eng.eagle.kv.layout.num_blocks


def test_eagle3_with_seeded_sampling_and_aborts(tiny_model_dir, tmp_path):
    head = make_head(tmp_path / "head", tiny_model_dir)
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=30, ignore_eos=True)
    base, _ = _run(tiny_model_dir, _prompts(), sp)
    got, eng = _run(tiny_model_dir, _prompts(), sp, speculative="eagle3", draft_model=str(head), speculative_max_batch=8)
    assert got == base and eng.drafter.drafted > 0
    eng = make_engine(tiny_model_dir, speculative="eagle3", draft_model=str(head), speculative_max_batch=8)
    for i, p in enumerate(_prompts()):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(12):
        eng.step()
    assert eng.drafter.steps > 0 and len(eng.eagle.free) < eng.eagle.kv.layout.num_blocks
    for i in range(len(_prompts())):
        eng.abort(str(i))
    assert eng.blocks.stats().used == 0 and len(eng.eagle.free) == eng.eagle.kv.layout.num_blocks


async def test_disaggregated_decode_worker_with_an_eagle3_head(tiny_model_dir, tmp_path):
    head = make_head(tmp_path / "head", tiny_model_dir)
    pre = start_worker("prefill", tiny_model_dir, tmp_path, name="eagle-pre")
    dec = start_worker("decode", tiny_model_dir, tmp_path, "--local-prefill-max-tokens", "0", "--speculative", "eagle3",
                       "--draft-model", str(head), "--speculative-max-batch", "8", name="eagle-dec")
    try:
        prompts = _prompts()
        want, _ = _run(tiny_model_dir, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        got = await asyncio.gather(*(generate(address(dec), p, greedy(30), prefill=address(pre)) for p in prompts))
        assert [g.token_ids for g in got] == [want[str(i)] for i in range(len(prompts))]
        assert all(g.prefill_mode == "remote" for g in got)
        await wait_blocks_free(address(dec))
        import urllib.request

        body = urllib.request.urlopen(f"http://127.0.0.1:{dec.ports['metrics']}/metrics", timeout=5).read().decode()
        drafted = [line for line in body.splitlines() if line.startswith('splitfire_worker_spec_tokens{kind="drafted"')]
        assert drafted and float(drafted[0].rsplit(" ", 1)[1]) > 0
    finally:
        for p in (dec, pre):
            p.stop()


def test_heads_that_do_not_fit_are_refused(tiny_model_dir, tmp_path):
    target = ModelConfig.from_dir(tiny_model_dir)
    with pytest.raises(ModelLoadError, match="not an EAGLE-3 head"):
        read_config(tiny_model_dir, target)
    with pytest.raises(ModelLoadError, match="auxiliary layers"):
        read_config(make_head(tmp_path / "a", tiny_model_dir, aux=(0, 5)), target)
    with pytest.raises(ModelLoadError, match="auxiliary layers"):  # 2 layers: the default (2, 1, -1) does not exist
        read_config(make_head(tmp_path / "b", tiny_model_dir, aux=None), target)
    with pytest.raises(ModelLoadError, match="hidden size"):
        read_config(make_head(tmp_path / "c", tiny_model_dir, extra={"target_hidden_size": 128}), target)
    deep = ModelConfig.from_dict({**json.loads((tiny_model_dir / "config.json").read_text()), "num_hidden_layers": 32})
    assert read_config(make_head(tmp_path / "d", tiny_model_dir, aux=None), deep).aux_layers == (2, 16, 29)
    bare = make_head(tmp_path / "e", tiny_model_dir)
    (bare / "model.safetensors").rename(bare / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="convert once"):
        load_head(bare, target, torch.device("cpu"), torch.float32)
    extra = make_head(tmp_path / "f", tiny_model_dir)
    from safetensors.torch import load_file

    w = load_file(str(extra / "model.safetensors"))
    w["midlayer.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(w, str(extra / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="does not account for"):
        load_head(extra, target, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="--draft-model"):
        make_engine(tiny_model_dir, speculative="eagle3")


def test_the_head_reads_the_targets_hidden_states_at_the_right_positions(tiny_model_dir, tmp_path):
    """What the head is fed, checked against transformers running the target: at each proposal's
    catch-up, the features of positions P are transformers' hidden states entering the aux layers
    at P (hidden_states[i] = the input of layer i), the token fed at P is the sequence's token P + 1,
    and RoPE sees P. Losslessness cannot catch a misalignment here; this can."""
    import transformers

    head_dir = make_head(tmp_path / "head", tiny_model_dir)
    eng = make_engine(tiny_model_dir, speculative="eagle3", draft_model=str(head_dir))
    head = eng.eagle.head
    events: list[tuple[str, torch.Tensor]] = []
    fc_forward, head_forward, embed = head.fc.forward, head.forward, eng.model.embed_tokens
    head.fc.forward = lambda x: events.append(("features", x.clone())) or fc_forward(x)
    eng.model.embed_tokens = lambda ids: events.append(("ids", ids.clone())) or embed(ids)
    head.forward = lambda e, h, pos, kv, meta: events.append(("positions", pos.clone())) or head_forward(e, h, pos, kv, meta)
    prompt = _prompts()[4]
    eng.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    tokens = prompt + drain(eng)["a"].token_ids
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        hs = ref(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[0][0], hs[1][0]], dim=-1)  # aux layers (0, 1)
    catch_ups = 0
    for i, (kind, value) in enumerate(events):
        if kind != "features":  # each proposal: fc(features), then the round's token lookup and forward
            continue
        ids, positions = events[i + 1][1], events[i + 2][1]
        assert events[i + 1][0] == "ids" and events[i + 2][0] == "positions"
        p = positions.tolist()
        assert p == list(range(p[0], p[0] + len(p))) and value.shape[0] == len(p)
        torch.testing.assert_close(value, want[p], rtol=1e-4, atol=1e-4)
        assert ids.tolist() == [tokens[q + 1] for q in p]
        catch_ups += 1
    assert catch_ups >= 5 and eng.drafter.drafted > 0
    # the first catch-up covers the whole prompt (colocated: every prompt position was computed here)
    first = next(v for k, v in events if k == "positions")
    assert first.tolist() == list(range(len(prompt)))
