"""LoRA adapters with `peft` as the oracle: a tiny random base built by transformers, random adapters made
by peft (every attention and MLP projection targeted, B not zero); requests of several adapters and the
base in one batch equal peft's greedy tokens each; the grouped deltas equal the per-segment reference;
KV is never shared across adapters; bad adapters are refused by name and leave the others serving;
adapters load and unload at run time, an adapter in use finishing its requests first."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from engine_helpers import drain, make_engine
from hf_models import make_hf_model

from common.errors import RequestError
from common.sampling_params import SamplingParams
from engine.model.lora import LoRARows, grouped_deltas, padded_deltas, segment_deltas

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_hf_model("llama3", tmp_path_factory.mktemp("base") / "model")


@cache
def _peft_model(base_dir: str, out: str, seed: int, r: int, rslora: bool, targets: tuple[str, ...]):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False,
                          use_rslora=rslora, lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg).eval()
    with torch.no_grad():  # B scaled down: an adapter that moves the logits without swamping the base
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    pm.save_pretrained(out)
    return pm


def adapter(base, tmp_path_factory, name: str, seed: int, r: int = 8, rslora: bool = False,
            targets: tuple[str, ...] = tuple(TARGETS)):
    out = Path(tmp_path_factory.getbasetemp()) / f"adapter-{name}-{seed}-{r}-{rslora}-{len(targets)}"
    pm = _peft_model(str(base.path), str(out), seed, r, rslora, targets)
    return out, pm


@torch.no_grad()
def peft_greedy(pm, ids: list[int], n: int) -> list[int]:
    ids, out = list(ids), []
    for _ in range(n):
        tok = int(pm(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


def prompt(i: int, n: int) -> list[int]:
    return [(31 * i + 7 * j) % 390 + 3 for j in range(n)]


def batch_equals_peft(eng, base, which: dict, lengths: list[int], n: int, first: int = 0) -> tuple[dict, dict]:
    """Every request of `which` (id -> (adapter, its peft model); "" the base) queued at once, prompts of
    `lengths`: each one's greedy tokens equal peft's (the base model's for ""). Returns (prompts, outputs)."""
    prompts = {rid: prompt(i + first, k) for i, (rid, k) in enumerate(zip(which, lengths, strict=True))}
    for rid, (name, _) in which.items():  # all queued at once: prompt chunks and decodes of every adapter mix
        eng.add_request(rid, prompts[rid], SamplingParams(max_tokens=n, **GREEDY), adapter=name)
    got = drain(eng)
    for rid, (name, model) in which.items():
        want = peft_greedy(model, prompts[rid], n) if name else base.greedy(prompts[rid], n)
        assert got[rid].token_ids == want, (rid, name)
    return prompts, got


def test_grouped_deltas_equal_the_segment_reference():
    torch.manual_seed(0)
    t, d_in, d_out, r, slots = 23, 40, 56, 12, 4
    x = torch.randn(t, d_in)
    a, b = torch.randn(slots, r, d_in), torch.randn(slots, d_out, r)
    row_slots = [-1, 0, 0, 2, -1, 2, 1, 1, 1, 0, 3, 3, -1, 2, 0, 0, 0, 1, -1, 3, 2, 2, 0]
    rows = LoRARows.build(row_slots, torch.device("cpu"))
    assert rows is not None
    ref, fast, padded = torch.zeros(t, d_out), torch.zeros(t, d_out), torch.zeros(t, d_out)
    segment_deltas(x, ref, a, b, rows.segments)
    grouped_deltas(x, fast, a, b, rows.groups)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    assert rows.rows is not None and rows.padded is not None and rows.width == 7  # slot 0's rows
    padded_deltas(x, padded, a, b, rows.rows, rows.padded, rows.width)
    torch.testing.assert_close(padded, ref, rtol=1e-5, atol=1e-5)
    assert LoRARows.build(row_slots, torch.device("cpu"), max_width=6).padded is None  # too many rows: grouped
    for i, s in enumerate(row_slots):  # and each row is exactly its own adapter's delta (0 for the base)
        want = (x[i] @ a[s].T) @ b[s].T if s >= 0 else torch.zeros(d_out)
        torch.testing.assert_close(ref[i], want, rtol=1e-5, atol=1e-5)
    assert LoRARows.build([-1, -1], torch.device("cpu")) is None


@pytest.mark.parametrize("mode", ["auto", "grouped", "segments"])
def test_adapters_and_the_base_in_one_batch_equal_peft(base, tmp_path_factory, mode):
    a1, pm1 = adapter(base, tmp_path_factory, "one", seed=1)
    a2, pm2 = adapter(base, tmp_path_factory, "two", seed=2, r=4, rslora=True)
    a3, pm3 = adapter(base, tmp_path_factory, "attn", seed=3, targets=("q_proj", "v_proj"))
    eng = make_engine(base.path, lora_modules={"one": str(a1), "two": str(a2), "attn": str(a3)},
                      max_num_batched_tokens=64, threads=1, quantization=None)
    assert eng.model.lora is not None
    eng.model.lora.mode = mode  # auto: padded for decode steps, grouped for steps with prompt chunks
    which = {"b0": ("", base.model), "o0": ("one", pm1), "t0": ("two", pm2), "b1": ("", base.model),
             "o1": ("one", pm1), "a0": ("attn", pm3), "t1": ("two", pm2)}
    prompts, _ = batch_equals_peft(eng, base, which, [5, 40, 17, 90, 9, 33, 64], 8)
    # The adapters do change the output (B is not zero).
    assert peft_greedy(pm1, prompts["o0"], 8) != base.greedy(prompts["o0"], 8)


def test_kv_is_never_shared_across_adapters(base, tmp_path_factory):
    a1, _ = adapter(base, tmp_path_factory, "one", seed=1)
    a2, _ = adapter(base, tmp_path_factory, "two", seed=2, r=4, rslora=True)
    eng = make_engine(base.path, lora_modules={"one": str(a1), "two": str(a2)}, threads=1)
    p = prompt(9, 70)

    def run(rid: str, name: str) -> int:
        eng.add_request(rid, p, SamplingParams(max_tokens=2, **GREEDY), adapter=name)
        return drain(eng)[rid].cached_tokens

    assert run("first", "one") == 0
    assert run("same-adapter", "one") == 64  # its own blocks are reused
    assert run("other-adapter", "two") == 0
    assert run("base", "") == 0


def test_bad_adapters_are_refused_by_name_and_the_others_keep_serving(base, tmp_path_factory, tmp_path):
    good, pm = adapter(base, tmp_path_factory, "one", seed=1)
    eng = make_engine(base.path, lora_modules={"good": str(good)}, max_lora_rank=8, threads=1)

    def broken(name: str, edit) -> Path:
        d = tmp_path / name
        d.mkdir()
        for f in good.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        edit(d)
        return d

    def config_edit(**changes):
        def edit(d: Path) -> None:
            cfg = json.loads((d / "adapter_config.json").read_text())
            cfg.update(changes)
            (d / "adapter_config.json").write_text(json.dumps(cfg))
        return edit

    high, _ = adapter(base, tmp_path_factory, "high", seed=4, r=16)
    other = make_hf_model("llama3", tmp_path / "other", hidden_size=96, intermediate_size=160)
    alien, _ = adapter(other, tmp_path_factory, "alien", seed=5)
    cases = {
        "missing": (tmp_path / "nowhere", "no adapter_config.json"),
        "rank": (high, "rank 16 is above --max-lora-rank 8"),
        "dora": (broken("dora", config_edit(use_dora=True)), "DoRA"),
        "weights": (broken("weights", lambda d: (d / "adapter_model.safetensors").unlink()),
                    "no adapter_model.safetensors"),
        "corrupt": (broken("corrupt", lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x00" * 64)),
                    "not a readable safetensors file"),
        "alien": (alien, "made for another base model"),
    }
    for name, (path, message) in cases.items():
        with pytest.raises(RequestError, match=message):
            eng.load_adapter(name, str(path))
    assert eng.adapters == ["good"]
    with pytest.raises(RequestError, match="not loaded"):
        eng.add_request("x", prompt(1, 5), SamplingParams(max_tokens=2), adapter="rank")
    eng.add_request("ok", prompt(3, 20), SamplingParams(max_tokens=6, **GREEDY), adapter="good")
    assert drain(eng)["ok"].token_ids == peft_greedy(pm, prompt(3, 20), 6)


def test_adapters_load_and_unload_at_run_time(base, tmp_path_factory):
    a1, pm1 = adapter(base, tmp_path_factory, "one", seed=1)
    a2, pm2 = adapter(base, tmp_path_factory, "two", seed=2, r=4, rslora=True)
    eng = make_engine(base.path, enable_lora=True, max_loras=1, threads=1)
    assert eng.adapters == []
    eng.load_adapter("one", str(a1))
    with pytest.raises(RequestError, match="slots are taken"):
        eng.load_adapter("two", str(a2))
    eng.add_request("r1", prompt(4, 30), SamplingParams(max_tokens=12, **GREEDY), adapter="one")
    first = [t for _ in range(3) for o in eng.step() for t in o.token_ids]
    assert eng.unload_adapter("one") is False  # r1 still runs under it: it finishes with its adapter
    with pytest.raises(RequestError, match="not loaded"):
        eng.add_request("r2", prompt(5, 10), SamplingParams(max_tokens=2), adapter="one")
    got = drain(eng)
    assert eng.adapters == []
    eng.load_adapter("two", str(a2))  # the freed slot, now the other adapter's factors
    eng.add_request("r3", prompt(6, 30), SamplingParams(max_tokens=8, **GREEDY), adapter="two")
    got.update(drain(eng))
    assert eng.unload_adapter("two") is True
    assert first + got["r1"].token_ids == peft_greedy(pm1, prompt(4, 30), 12)
    assert got["r3"].token_ids == peft_greedy(pm2, prompt(6, 30), 8)


def test_adapters_over_an_int8_base_equal_peft_over_the_same_weights(tmp_path, tmp_path_factory):
    """A base whose every matmul weight is exactly representable in int8 groups (each group's values are
    its absmax / 127 times integers), so `--quantization int8` holds the same weights: adapters over the
    quantized base equal peft over the float one."""
    import transformers

    from engine.model.quant import group_size_for

    hf = make_hf_model("llama3", tmp_path / "float")
    with torch.no_grad():
        for module in hf.model.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                n, k = w.shape
                g = w.reshape(n, k // group_size_for(k, "int8"), -1)
                scale = g.abs().amax(-1, keepdim=True) / 127.0
                w.copy_((torch.round(g / scale) * scale).reshape(n, k))
    exact = tmp_path / "int8-exact"
    hf.model.save_pretrained(exact)
    for f in hf.path.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (exact / f.name).write_bytes(f.read_bytes())
    base = transformers.AutoModelForCausalLM.from_pretrained(exact, dtype=torch.float32).eval()
    a1, pm1 = adapter(type(hf)(hf.name, exact, base, hf.config), tmp_path_factory, "int8base", seed=7)
    a2, pm2 = adapter(type(hf)(hf.name, exact, base, hf.config), tmp_path_factory, "int8base2", seed=8, r=4)
    ps = {"b": prompt(1, 30), "o": prompt(2, 45), "o2": prompt(3, 9), "t": prompt(4, 20)}
    which = {"b": "", "o": "one", "o2": "one", "t": "two"}
    outs = {}
    # Decode steps with adapter rows in the fused C loop (float32 factors, then float16 ones), then on the
    # module path.
    for in_c, dtype in ((True, "float32"), (True, "float16"), (False, "float32")):
        eng = make_engine(exact, quantization="int8", lora_modules={"one": str(a1), "two": str(a2)}, threads=1,
                          lora_dtype=dtype)
        eng.model.lora_in_c = in_c
        for rid, p in ps.items():
            eng.add_request(rid, p, SamplingParams(max_tokens=8, **GREEDY), adapter=which[rid])
        outs[(in_c, dtype)] = drain(eng)
        fused_steps = eng.model.cpu_layers.steps if eng.model.cpu_layers is not None else 0
        assert (fused_steps > 0) == in_c, fused_steps  # (every decode step here has adapter rows)
    for got in outs.values():
        assert got["b"].token_ids == peft_greedy(base, ps["b"], 8)
        assert got["o"].token_ids == peft_greedy(pm1, ps["o"], 8)
        assert got["o2"].token_ids == peft_greedy(pm1, ps["o2"], 8)
        assert got["t"].token_ids == peft_greedy(pm2, ps["t"], 8)


def test_adapters_under_two_tensor_parallel_ranks_equal_peft(base, tmp_path_factory):
    """Each rank holds its slices of the factors (A like the base's input side, B like its output side; a
    row-parallel projection's partial delta summed with the rest); an adapter loaded and unloaded at run
    time on rank 0 is mirrored by the other rank in the same slot."""
    a1, pm1 = adapter(base, tmp_path_factory, "one", seed=1)
    a2, pm2 = adapter(base, tmp_path_factory, "two", seed=2, r=4, rslora=True)
    eng = make_engine(base.path, tensor_parallel_size=2, lora_modules={"one": str(a1)}, max_loras=2, threads=1,
                      quantization=None)
    try:
        eng.load_adapter("two", str(a2))
        which = {"b": ("", base.model), "o": ("one", pm1), "t": ("two", pm2), "o2": ("one", pm1)}
        ps, got = batch_equals_peft(eng, base, which, [12, 40, 25, 7], 8)
        assert eng.unload_adapter("one") is True
        eng.load_adapter("one-again", str(a1))  # the freed slot, on both ranks
        eng.add_request("again", ps["o"], SamplingParams(max_tokens=8, **GREEDY), adapter="one-again")
        assert drain(eng)["again"].token_ids == got["o"].token_ids
    finally:
        eng.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_adapters_over_pipeline_stages_equal_peft(base, tmp_path_factory, tp):
    """Pipeline parallel (TP inside each stage): every stage holds its own layers' factors, and each
    micro-batch's adapter rows travel with it; an adapter loaded at run time reaches every stage."""
    a1, pm1 = adapter(base, tmp_path_factory, "one", seed=1)
    a2, pm2 = adapter(base, tmp_path_factory, "two", seed=2, r=4, rslora=True)
    eng = make_engine(base.path, pipeline_parallel_size=2, tensor_parallel_size=tp, lora_modules={"one": str(a1)},
                      max_loras=2, threads=1, quantization=None, max_num_seqs=4, max_num_batched_tokens=32)
    try:
        eng.load_adapter("two", str(a2))
        which = {"b": ("", base.model), "o": ("one", pm1), "t": ("two", pm2), "o2": ("one", pm1)}
        batch_equals_peft(eng, base, which, [12, 40, 25, 7], 6)
    finally:
        eng.close()


def test_an_adapter_a_later_stage_refuses_leaves_every_stage_as_it_was(base, tmp_path_factory, tmp_path):
    """Under pipeline parallelism rank 0 reads only its own stage's layers: an adapter whose last layer does
    not fit is refused by the stage that holds it (the error names the rank and the layer), the stages that
    took it drop it again, and the adapters already loaded serve as before."""
    import shutil

    from safetensors.torch import load_file, save_file

    a1, pm1 = adapter(base, tmp_path_factory, "one", seed=1)
    bad = tmp_path / "bad"
    shutil.copytree(a1, bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    last = base.config["num_hidden_layers"] - 1
    key = next(k for k in tensors if f"layers.{last}.self_attn.q_proj.lora_B" in k)
    tensors[key] = torch.randn(tensors[key].shape[0] + 8, tensors[key].shape[1])  # (a wider model's q_proj)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    eng = make_engine(base.path, pipeline_parallel_size=2, lora_modules={"one": str(a1)}, max_loras=2, threads=1,
                      quantization=None)
    try:
        with pytest.raises(RequestError, match=rf"rank 1: adapter 'bad': layer {last} q_proj factors .* do not fit"):
            eng.load_adapter("bad", str(bad))
        assert eng.loras.names() == ["one"] and len(eng.loras.free) == 1
        eng.load_adapter("bad", str(a1))  # the name and the slot are free again, on every stage
        which = {"o": ("one", pm1), "x": ("bad", pm1), "b": ("", base.model)}
        batch_equals_peft(eng, base, which, [12, 30, 9], 5)
    finally:
        eng.close()


def test_splitfire_generate_runs_lines_under_their_adapters(base, tmp_path_factory, tmp_path):
    """`splitfire generate --lora-modules one=DIR`: a JSONL line's `adapter` picks it; an unknown one is that
    line's error, and the others are unaffected."""
    import json

    from splitfire_cli import main

    a1, pm1 = adapter(base, tmp_path_factory, "one", seed=1)
    lines = [{"prompt_token_ids": prompt(1, 20), "max_tokens": 6, "temperature": 0, "ignore_eos": True},
             {"prompt_token_ids": prompt(2, 20), "max_tokens": 6, "temperature": 0, "ignore_eos": True, "adapter": "one"},
             {"prompt_token_ids": prompt(3, 20), "max_tokens": 6, "adapter": "nope"}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc = main(["generate", "--model", str(base.path), "--device", "cpu", "--kv-cache-gb", "0.01", "--quiet",
               "--lora-modules", f"one={a1}", "--input", str(src), "--output", str(dst)])
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert rc == 1 and "not loaded" in out[2]["error"]
    assert out[0]["token_ids"] == base.greedy(prompt(1, 20), 6)
    assert out[1]["token_ids"] == peft_greedy(pm1, prompt(2, 20), 6)


# The MLP ones named by their parents (the dense first layer's and the shared experts').
MLA_TARGETS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "shared_experts.gate_proj",
               "shared_experts.up_proj", "shared_experts.down_proj", "0.mlp.gate_proj", "0.mlp.up_proj",
               "0.mlp.down_proj")


@pytest.mark.parametrize("family,overrides", [
    ("deepseek_v3", {}),  # q LoRA (q_a + q_b), RoPE dims interleaved in the checkpoint
    ("deepseek_v3", {"rope_interleave": False}),  # the rope rows of q_b and kv_a reordered as the loader does
    ("deepseek_v3", {"q_lora_rank": "none", "rope_interleave": False}),  # a plain q projection, reordered
    ("deepseek_v2", {}),  # two shared experts
])
def test_latent_attention_and_shared_expert_adapters_equal_peft(family, overrides, tmp_path_factory, monkeypatch):
    """DeepSeek-V2/V3 (Kimi-K2's architecture): adapters on the latent attention's projections, the dense
    MLP and the MoE layers' shared experts, two of them and the base in one batch, equal peft."""
    import peft.utils.transformers_weight_conversion as conversion
    from hf_models import NONE

    # peft 0.21 on a transformers-5 MoE model turns every gate/up/down_proj target into LoRA on the fused
    # routed experts' parameters (which splitfire refuses), even when the target names a shared expert or
    # the dense layer's MLP: kept as the plain Linear modules they are, peft adapts exactly those (as it did
    # with transformers 4, whose adapters carry these keys).
    monkeypatch.setattr(conversion, "_convert_peft_config_moe", lambda *a, **kw: None)
    kw = {k: (NONE if v == "none" else v) for k, v in overrides.items()}
    fam = make_hf_model(family, tmp_path_factory.mktemp(f"{family}-lora") / "model", **kw)
    targets = tuple(t for t in MLA_TARGETS if ("q_proj" if overrides.get("q_lora_rank") == "none"
                                                or family == "deepseek_v2" else "q_a_proj") == t
                    or t not in ("q_proj", "q_a_proj"))
    a1, pm1 = adapter(fam, tmp_path_factory, f"{family}-a", seed=11, targets=targets)
    a2, pm2 = adapter(fam, tmp_path_factory, f"{family}-b", seed=12, r=4, targets=targets[:3])
    eng = make_engine(fam.path, lora_modules={"a": str(a1), "b": str(a2)}, max_num_batched_tokens=64,
                      max_num_seqs=8, threads=1, quantization=None)
    which = {"x0": ("", fam.model), "a0": ("a", pm1), "b0": ("b", pm2), "a1": ("a", pm1)}
    prompts, _ = batch_equals_peft(eng, fam, which, [7, 40, 19, 70], 6)
    # The adapter matters, and it adapts the shared experts and the dense MLP as well as the attention.
    assert any(peft_greedy(pm1, prompts[r], 6) != fam.greedy(prompts[r], 6) for r in ("a0", "a1"))
    from safetensors import safe_open

    with safe_open(str(a1 / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any("shared_experts.down_proj" in k for k in keys) and any("layers.0.mlp.up_proj" in k for k in keys)


@pytest.mark.parametrize("absorb", ["absorbed", "expanded", "expanded-chunks"])
def test_latent_attention_kv_b_adapters_equal_peft(absorb, tmp_path_factory):
    """kv_b_proj adapters: W_UK + B_K A folded into the queries and W_UV + B_V A applied to the attended
    latents through the rank-R space (absorbed decode and short chunks), or the context up-projected by
    kv_b + B A (the reference; long chunks) — two adapters of different ranks and the base in one batch."""
    from engine.model.mla import MLAttention

    fam = make_hf_model("deepseek_v3", tmp_path_factory.mktemp("ds-kvb") / "model")
    a1, pm1 = adapter(fam, tmp_path_factory, "kvb", seed=5, targets=("kv_b_proj", "o_proj"))
    a2, pm2 = adapter(fam, tmp_path_factory, "kvb-only", seed=6, r=4, rslora=True, targets=("kv_b_proj",))
    eng = make_engine(fam.path, lora_modules={"a": str(a1), "b": str(a2)}, max_num_batched_tokens=64,
                      max_num_seqs=8, threads=1, quantization=None)
    attns = [m for m in eng.model.modules() if isinstance(m, MLAttention)]
    assert attns and all(m.kv_b_target.lora is not None and m.kv_b_target.lora.held == {0, 1} for m in attns)
    for m in attns:
        m.absorb = absorb == "absorbed"  # (absorbed: decode rows, and chunks below the cost rule's size)
        m.absorb_chunks = absorb != "expanded-chunks"
    which = {"x": ("", fam.model), "a0": ("a", pm1), "b0": ("b", pm2), "a1": ("a", pm1), "b1": ("b", pm2)}
    prompts, _ = batch_equals_peft(eng, fam, which, [7, 40, 3, 70, 12], 6, first=3)
    assert all(peft_greedy(pm, prompts[r], 6) != fam.greedy(prompts[r], 6) for r, pm in (("a0", pm1), ("b1", pm2)))


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": "none", "rope_interleave": False}])
def test_latent_attention_adapters_under_two_tensor_parallel_ranks_equal_peft(overrides, tmp_path_factory,
                                                                              monkeypatch):
    """Latent attention split by heads: each rank's rows of q_b (or a plain q projection) and its columns of
    o; q_a and kv_a whole on every rank; the shared expert's intermediate columns split."""
    import peft.utils.transformers_weight_conversion as conversion
    from hf_models import NONE

    monkeypatch.setattr(conversion, "_convert_peft_config_moe", lambda *a, **kw: None)  # (see above)
    kw = {k: (NONE if v == "none" else v) for k, v in overrides.items()}
    fam = make_hf_model("deepseek_v3", tmp_path_factory.mktemp("ds-tp-lora") / "model", **kw)
    q = "q_proj" if overrides else "q_a_proj"
    targets = tuple(t for t in MLA_TARGETS if t == q or t not in ("q_proj", "q_a_proj"))
    a1, pm1 = adapter(fam, tmp_path_factory, f"ds-tp-{bool(overrides)}", seed=21, targets=targets)
    eng = make_engine(fam.path, tensor_parallel_size=2, lora_modules={"a": str(a1)}, max_loras=2, threads=1,
                      quantization=None, max_num_seqs=8, max_num_batched_tokens=64)
    try:
        batch_equals_peft(eng, fam, {"x": ("", fam.model), "a": ("a", pm1), "a2": ("a", pm1)}, [15, 33, 9], 6, first=1)
    finally:
        eng.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_routed_expert_adapters_equal_peft(family, tmp_path_factory):
    """peft's LoRA on the stacked routed experts (what it makes of gate/up/down_proj targets on a
    transformers-5 MoE model: gate and up fused at twice the rank), beside the attention's, two adapters and
    the base in one batch: equal peft. The grouped expert loop adds each adapter's per-expert deltas."""
    fam = make_hf_model(family, tmp_path_factory.mktemp(f"{family}-experts") / "model")
    attn = ("q_proj", "k_proj", "v_proj", "o_proj") if family == "qwen3_moe" else ("q_a_proj", "o_proj")
    targets = (*attn, "gate_proj", "up_proj", "down_proj")
    a1, pm1 = adapter(fam, tmp_path_factory, f"{family}-ex1", seed=31, targets=targets)
    a2, pm2 = adapter(fam, tmp_path_factory, f"{family}-ex2", seed=32, r=4, rslora=True, targets=targets)
    cfg = json.loads((a1 / "adapter_config.json").read_text())
    assert set(cfg["target_parameters"]) == {"gate_up_proj", "down_proj"}  # peft's expert parameters, not modules
    eng = make_engine(fam.path, lora_modules={"a": str(a1), "b": str(a2)}, max_num_batched_tokens=64,
                      max_num_seqs=8, threads=1, quantization=None)
    which = {"x": ("", fam.model), "a0": ("a", pm1), "b0": ("b", pm2), "a1": ("a", pm1)}
    batch_equals_peft(eng, fam, which, [9, 44, 21, 60], 6, first=7)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_routed_expert_adapters_under_two_ranks_equal_peft(expert_parallel, tmp_path_factory):
    """Each rank's slices of the experts' factors: every expert's intermediate columns (gate/up B's rows,
    down A's columns), or with expert parallel its own experts whole."""
    fam = make_hf_model("qwen3_moe", tmp_path_factory.mktemp("qmoe-tp") / "model")
    targets = ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
    a1, pm1 = adapter(fam, tmp_path_factory, "qmoe-tp", seed=41, targets=targets)
    eng = make_engine(fam.path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                      lora_modules={"a": str(a1)}, max_loras=2, threads=1, quantization=None, max_num_seqs=8,
                      max_num_batched_tokens=64)
    try:
        batch_equals_peft(eng, fam, {"x": ("", fam.model), "a": ("a", pm1), "a2": ("a", pm1)}, [15, 33, 9], 6, first=1)
    finally:
        eng.close()


def test_float16_factors_are_refused_where_the_fused_cpu_loop_does_not_run(base):
    """--lora-dtype float16 sets what the fused CPU decode loop reads; a float-weight model never runs that
    loop, so the setting would do nothing there: refused by name."""
    from common.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"--lora-dtype float16 .*matmul weights not quantized"):
        make_engine(base.path, enable_lora=True, lora_dtype="float16", quantization=None, threads=1)
