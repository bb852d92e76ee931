"""Engine speed on this machine: against Hugging Face transformers on the same weights, and every
model family side by side on same-size random weights.

Default mode prints one table: prefill tokens/s (128/512/2048-token prompts), decode tokens/s
at batch 1/8/16/32, and the batch-1 decode step split into time inside torch ops vs Python
overhead. `--families` prints prefill-512 and decode batch 1/16 for every family (random
models built by transformers, loadtest/random_models.py) and each mixture-of-experts model's
step time against the dense model with its active parameter count. Medians over --rounds;
every number comes from this one run.

    python -m loadtest.bench_engine                     # SmolLM2, float32, 2 threads
    python -m loadtest.bench_engine --dtypes float32,bfloat16
    python -m loadtest.bench_engine --families          # all families, float32
    python -m loadtest.bench_engine --grammar           # constrained decoding cost
    python -m loadtest.bench_engine --quant             # float32 vs int8 vs int4 vs the GGUF's Q4_1
    python -m loadtest.bench_engine --gemm              # one quantized matmul: C tiles vs panel GEMM vs float GEMM
    python -m loadtest.bench_engine --kv-dtypes         # float32 vs float16 KV cache: decode speed, perplexity
    python -m loadtest.bench_engine --mla               # DeepSeek-V3 latent attention: absorbed vs up-projecting
    python -m loadtest.bench_engine --parallel          # tensor parallel: TP=2 (a thread a rank) vs TP=1
    python -m loadtest.bench_engine --lora              # LoRA: batch 16 over 8 rank-16 adapters vs the base
    python -m loadtest.bench_engine --quant --vs-llama-server /path/to/llama-server
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from common.sampling_params import SamplingParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from loadtest.engine_runs import decode_rate, ours_prefill, prefill_all, prompt_ids, random_ids

PREFILL_LENGTHS = (128, 512, 2048)
BATCHES = (1, 8, 16, 32)
DECODE_TOKENS = 48


def ours_decode(engine: LLMEngine, prompts: list[list[int]], salt: int) -> float:
    batch = len(prompts)
    for i, ids in enumerate(prompts):
        engine.add_request(f"d{batch}-{salt}-{i}", ids,
                           SamplingParams(max_tokens=DECODE_TOKENS + 2, temperature=0, ignore_eos=True))
    prefill_all(engine)
    engine.step()
    t0, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    return batch * steps / (time.perf_counter() - t0)


def ours_step_split(engine: LLMEngine) -> tuple[float, float]:
    """Batch-1 decode step: (ms inside torch ops, ms of Python around them), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    engine.add_request("split", prompt_ids(engine.tokenizer, 32), SamplingParams(max_tokens=40, temperature=0,
                                                                                   ignore_eos=True))
    for _ in range(5):
        engine.step()
    n = 20
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            engine.step()
        wall = (time.perf_counter() - t0) / n
    while engine.has_work:
        engine.step()
    # Top-level ops only (an op's children are inside its time already).
    ops = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith(("aten::", "mkldnn::"))]
    inside = sum(e.time_range.elapsed_us() for e in ops) / 1e3 / n
    return inside, wall * 1e3 - inside


def theirs(model_dir: str, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out: dict[str, float] = {}

    class _T:
        def encode(self, s: str) -> list[int]:
            return tok.encode(s, add_special_tokens=False)

    with torch.inference_mode():
        for n in PREFILL_LENGTHS:
            ids = torch.tensor([prompt_ids(_T(), n)])
            runs = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                model(ids)
                runs.append(n / (time.perf_counter() - t0))
            out[f"prefill_{n}"] = statistics.median(runs)
        for b in BATCHES:
            ids = torch.tensor([prompt_ids(_T(), 32, i) for i in range(b)])
            mask = torch.ones_like(ids)
            runs = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                model.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False)
                t1 = time.perf_counter()
                model.generate(ids, attention_mask=mask, max_new_tokens=DECODE_TOKENS + 2,
                               min_new_tokens=DECODE_TOKENS + 2, do_sample=False)
                t2 = time.perf_counter()
                runs.append(b * DECODE_TOKENS / ((t2 - t1) - (t1 - t0)))
            out[f"decode_{b}"] = statistics.median(runs)
    return out


def bench_ours(args: argparse.Namespace, dt: str) -> tuple[str, dict[str, float]]:
    engine = LLMEngine(EngineConfig(model=args.model, device="cpu", dtype=dt, threads=args.threads,
                                    max_num_batched_tokens=2048, kv_cache_gb=1.0))
    tok = engine.tokenizer

    def decode_prompts(b: int, salt: int) -> list[list[int]]:
        return [prompt_ids(tok, 32, salt * 100 + i) for i in range(b)]

    ours_decode(engine, decode_prompts(4, 999), 999)  # warm-up: oneDNN primitives, allocator
    work = [(f"prefill_{n}", lambda n=n, s=s: ours_prefill(engine, prompt_ids(tok, n, s), s)) for n in PREFILL_LENGTHS
            for s in range(args.rounds)]
    work += [(f"decode_{b}", lambda b=b, s=s: ours_decode(engine, decode_prompts(b, s), s)) for b in BATCHES
             for s in range(args.rounds)]
    samples: dict[str, list[float]] = {}
    for key, fn in tqdm(work, desc=f"splitfire {dt}", file=sys.stderr):
        samples.setdefault(key, []).append(fn())
    r = {k: statistics.median(v) for k, v in samples.items()}
    splits = [ours_step_split(engine) for _ in range(args.rounds)]
    r["step_torch_ms"] = statistics.median(s[0] for s in splits)
    r["step_python_ms"] = statistics.median(s[1] for s in splits)
    return str(engine.model_dir), r


FAMILY_BATCHES = (1, 16)


def family_engine(family: str, args: argparse.Namespace, quantization: str | None = None) -> LLMEngine:
    from loadtest.random_models import model_dir

    engine = LLMEngine(EngineConfig(model=str(model_dir(family)), device="cpu", dtype=args.dtypes.split(",")[0],
                                    threads=args.threads, max_num_batched_tokens=512, kv_cache_gb=0.5,
                                    quantization=quantization))
    vocab = engine.model_config.vocab_size
    ours_decode(engine, [random_ids(vocab, 32, 999 + i) for i in range(4)], 999)  # warm-up
    return engine


def family_round(engine: LLMEngine, s: int) -> dict[str, float]:
    vocab = engine.model_config.vocab_size
    out = {"prefill_512": ours_prefill(engine, random_ids(vocab, 512, s), s)}
    for b in FAMILY_BATCHES:
        out[f"decode_{b}"] = ours_decode(engine, [random_ids(vocab, 32, 1000 * s + 10 * b + i) for i in range(b)], s)
    return out


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights occupy as loaded: float parameters, packed copies and quantized codes."""
    from engine.model.layers import Linear
    from engine.model.moe import Experts

    seen: set[int] = set()

    def size(t: torch.Tensor | None) -> int:
        if t is None or id(t) in seen:
            return 0
        seen.add(id(t))
        return t.numel() * t.element_size()

    total = sum(size(p) for p in model.parameters())
    for m in model.modules():
        quantized = (m.quantized or []) if isinstance(m, Linear) else []
        if isinstance(m, Experts) and m.quantized is not None:
            quantized = m.quantized[0] + m.quantized[1]
        total += sum(size(w.q) + size(w.scales) + size(w.mins) for w in quantized)
        if isinstance(m, Linear) and m.packed is not None:
            total += size(m.packed)
        if isinstance(m, Experts) and m.packed is not None:
            total += sum(size(w) for w in m.packed[0] + m.packed[1])
    return total


def main_parallel(args: argparse.Namespace) -> int:
    """Tensor parallel on this machine's cores: decode tok/s at batch 1 and 16 of TP=2 (one thread a
    rank, two processes) against TP=1 (the same threads in one process), on the same-size random Llama
    (`random_models.SHAPE`), rounds interleaved; and the bytes all-reduced per token beside the minimum."""
    from loadtest.random_models import FAMILIES, SHAPE, model_dir

    family = args.family_list or "llama"
    path = model_dir(family)
    threads = args.threads
    layouts = {"TP=1": dict(threads=threads), f"TP={threads}": dict(threads=1, tensor_parallel_size=threads)}
    if "num_experts" in FAMILIES[family][1] or "num_local_experts" in FAMILIES[family][1]:
        layouts[f"EP={threads}"] = dict(threads=1, tensor_parallel_size=threads, enable_expert_parallel=True)
    engines = {name: LLMEngine(EngineConfig(model=str(path), device="cpu", max_num_seqs=32, kv_cache_gb=1.0,
                                            speculative="off", **kw)) for name, kw in layouts.items()}
    batches = [1, 16]
    rng = random.Random(0)
    samples: dict[str, dict[int, list[float]]] = {n: {b: [] for b in batches} for n in engines}
    try:
        for r in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
            for b in batches:
                prompts = [[rng.randrange(3, 30000) for _ in range(64)] for _ in range(b)]
                for name, eng in engines.items():
                    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
                    samples[name][b].append(decode_rate(eng, prompts, sp, f"{name}-{r}-{b}"))
    finally:
        for eng in engines.values():
            eng.close()
    hidden, layers = SHAPE["hidden_size"], SHAPE["num_hidden_layers"]
    n = threads
    minimum = 2 * layers * hidden * 4  # two all-reduces of a float32 hidden state per layer
    ring = minimum * 2 * (n - 1) / n + hidden * 4 * 2 * (n - 1) / n  # + the embedding's; each a ring all-reduce
    print(f"\nrandom {family} (hidden {hidden}, {layers} layers, float32), {threads} cores, medians of {args.rounds}")
    names = list(engines)
    print(f"{'decode tok/s':<16}" + "".join(f"{n:>12}" for n in names)
          + "".join(f"{n + ' / TP=1':>14}" for n in names[1:]))
    for b in batches:
        med = [statistics.median(samples[nm][b]) for nm in names]
        print(f"{'batch ' + str(b):<16}" + "".join(f"{m:>12.1f}" for m in med)
              + "".join(f"{m / med[0]:>14.2f}" for m in med[1:]))
    print(f"bytes all-reduced per token per rank: {ring:,.0f} sent (ring), minimum 2 x layers x hidden x 4 = "
          f"{minimum:,}; plus the logits' all-gather ({SHAPE['vocab_size'] // n * 4 * (n - 1):,} B received "
          "per sampled token)")
    return 0


def main_families(args: argparse.Namespace) -> int:
    from loadtest.random_models import FAMILIES, MOE_BASELINES, SHAPE

    families = args.family_list.split(",") if args.family_list else list(FAMILIES)
    quants = [None if q == "none" else q for q in args.quantizations.split(",")]
    engines = {(f if q is None else f"{f} {q}"): family_engine(f, args, q)
               for f in tqdm(families, desc="loading", file=sys.stderr) for q in quants}
    # Rounds interleave the families, so drift on a shared machine lands on all of them alike.
    samples: dict[str, dict[str, list[float]]] = {f: {} for f in engines}
    for s in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        for f, engine in engines.items():
            for k, v in family_round(engine, s).items():
                samples[f].setdefault(k, []).append(v)
    rows = {f: {k: statistics.median(v) for k, v in kv.items()} for f, kv in samples.items()}
    keys = ["prefill_512"] + [f"decode_{b}" for b in FAMILY_BATCHES]
    print(f"\nCPU: {torch.get_num_threads()} threads, torch {torch.__version__}, {args.dtypes.split(',')[0]}, "
          f"random weights, shape {SHAPE['num_hidden_layers']} layers x {SHAPE['hidden_size']} hidden")
    print(f"{'family':<20}{'weights MB':>12}" + "".join(f"{k.replace('_', ' ') + ' tok/s':>22}" for k in keys))
    for f, r in rows.items():
        mb = weight_bytes(engines[f].model) / 1e6
        print(f"{f:<20}{mb:>12.1f}" + "".join(f"{r[k]:>22.1f}" for k in keys))
    for moe, dense in MOE_BASELINES.items():
        if moe in rows and dense in rows:
            # tok/s ratio dense/moe = step time ratio moe/dense
            ratio = "".join(f"{rows[dense][k] / rows[moe][k]:>22.2f}" for k in keys)
            print(f"{moe + ' / ' + dense + ' step':<12}{ratio}")
    for name in rows:
        base = name.split(" ")[0]
        if name != base and base in rows:  # a quantized variant against its float model
            mb = weight_bytes(engines[name].model) / weight_bytes(engines[base].model)
            print(f"{name + ' / float':<20}{mb:>12.2f}" + "".join(f"{rows[name][k] / rows[base][k]:>22.2f}" for k in keys))
    return 0


def grammar_schema(props: int = 20) -> dict:
    """A 20-property object of the kinds agents ask for: bounded strings, integers, enums, arrays."""
    kinds = [{"type": "string", "maxLength": 16}, {"type": "integer", "minimum": 0, "maximum": 100000},
             {"enum": ["low", "medium", "high"]}, {"type": "array", "items": {"type": "number"}, "maxItems": 4},
             {"type": "boolean"}]
    return {"type": "object", "properties": {f"field_{i}": kinds[i % len(kinds)] for i in range(props)},
            "required": [f"field_{i}" for i in range(props)], "additionalProperties": False}


def main_grammar(args: argparse.Namespace) -> int:
    """Constrained (json_schema) vs unconstrained decode, interleaved rounds, and grammar compile time."""
    import json

    from common import grammar

    engine = LLMEngine(EngineConfig(model=args.model, device="cpu", threads=args.threads,
                                    max_num_batched_tokens=512, kv_cache_gb=1.0))
    t0 = time.perf_counter()
    engine.grammar._llg()  # the tokenizer llguidance matches against, built once per engine
    tokenizer_ms = (time.perf_counter() - t0) * 1e3
    schema = grammar_schema()
    t0 = time.perf_counter()
    text = grammar.json_schema(schema, "bench")
    build_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    engine.grammar.matcher(text)
    compile_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    engine.grammar.matcher(text)
    cached_ms = (time.perf_counter() - t0) * 1e3
    ask = engine.tokenizer.encode_chat([{"role": "user", "content": "Fill in this record as JSON: " + json.dumps(schema)}])
    n = DECODE_TOKENS
    free = SamplingParams(max_tokens=n, temperature=0.8, seed=1, ignore_eos=True)
    bound = SamplingParams(max_tokens=n, temperature=0.8, seed=1, ignore_eos=True, grammar=text)
    decode_rate(engine, [ask] * 2, bound, "warm")
    rates: dict[str, list[float]] = {}
    for r in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        for b in (1, 16):
            rates.setdefault(f"free_{b}", []).append(decode_rate(engine, [ask] * b, free, f"f{r}{b}"))
            rates.setdefault(f"json_{b}", []).append(decode_rate(engine, [ask] * b, bound, f"j{r}{b}"))
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\nCPU: {torch.get_num_threads()} threads, torch {torch.__version__}, model {engine.model_dir}")
    print(f"llguidance tokenizer: {tokenizer_ms:.0f} ms once per engine; 20-property schema: grammar built and "
          f"validated {build_ms:.1f} ms, compiled {compile_ms:.1f} ms, cached {cached_ms:.3f} ms")
    print(f"{'decode tok/s':<22}{'unconstrained':>16}{'json_schema':>16}{'slowdown':>12}")
    for b in (1, 16):
        print(f"{'batch ' + str(b):<22}{med[f'free_{b}']:>16.1f}{med[f'json_{b}']:>16.1f}"
              f"{1 - med[f'json_{b}'] / med[f'free_{b}']:>12.1%}")
    return 0


AGENT_RECORD = {"service": "checkout", "replicas": 3, "image": "registry.local/checkout:2.14.1", "port": 8080,
                "env": {"LOG_LEVEL": "info", "DB_POOL": 16, "FEATURE_FLAGS": ["fast-path", "new-cart"]},
                "probes": {"liveness": "/healthz", "readiness": "/ready", "period_s": 10}, "retries": 2}


def main_speculative(args: argparse.Namespace) -> int:
    """Prompt-lookup speculation vs none, same engine (the drafter switched on and off), greedy:
    an agent-shaped reply that repeats a JSON block from its prompt, a free-text reply, batch 16."""
    import json

    from engine.spec.speculative import NgramDrafter

    draft = args.draft_model
    engine = LLMEngine(EngineConfig(model=args.model, device="cpu", threads=args.threads, max_num_batched_tokens=512,
                                    kv_cache_gb=1.0, speculative="draft" if draft else "ngram", draft_model=draft))
    drafters = {"ngram": NgramDrafter(engine.config.num_speculative_tokens, engine.config.speculative_max_batch)}
    if draft:
        drafters["draft"] = engine.drafter
    eagle = None
    if args.eagle3_head:
        from engine.loading.model_store import home
        from engine.spec.eagle3 import Eagle3Drafter
        from loadtest.random_models import write_eagle3_head

        head = Path(args.eagle3_head)
        if args.eagle3_head == "random":
            head = write_eagle3_head(home() / "bench-models" / f"eagle3-random-{engine.model_dir.name}", engine.model_dir)
        c = engine.config
        eagle = Eagle3Drafter(head, engine.model, c.num_speculative_tokens, c.speculative_max_batch, engine.device,
                              engine.dtype, c.block_size, engine.kv.layout.num_blocks,
                              engine.max_model_len + c.num_speculative_tokens + 1)
        drafters["eagle3"] = eagle
    drafter = drafters["ngram"]
    tok = engine.tokenizer
    record = json.dumps(AGENT_RECORD, indent=2)
    agent = tok.encode_chat([{"role": "user", "content": "Here is a deployment record:\n" + record +
                              "\nReturn exactly the same JSON record, unchanged."}])
    story = tok.encode_chat([{"role": "user", "content": "Write a short story about a lighthouse keeper who "
                              "finds a message in a bottle."}])
    sp = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=128, temperature=0.7, top_p=0.95, seed=3, ignore_eos=True)
    cases = [("agent JSON, batch 1", [agent], sp), ("agent JSON, T=0.7, batch 1", [agent], sampled),
             ("free text, batch 1", [story], sp), ("agent JSON, batch 16", [agent] * 16, sp)]
    rates: dict[tuple[str, str], list[float]] = {}
    accept: dict[tuple[str, str], tuple[int, int, int]] = {}
    modes = ["off", *drafters]
    for r in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        for name, prompts, params in cases:
            for mode in modes:
                d = drafters.get(mode)
                engine.drafter = engine.scheduler.drafter = d
                engine.eagle = eagle if mode == "eagle3" else None  # the target captures its features only then
                engine.model.aux_layers = eagle.aux_layers if mode == "eagle3" and eagle is not None else ()
                before = (d.drafted, d.accepted, d.steps) if d else (0, 0, 0)
                rates.setdefault((name, mode), []).append(decode_rate(engine, prompts, params, f"s{r}{mode}{name[:3]}"))
                if d is not None:
                    delta = (d.drafted - before[0], d.accepted - before[1], d.steps - before[2])
                    accept[(name, mode)] = tuple(a + b for a, b in zip(accept.get((name, mode), (0, 0, 0)), delta,
                                                                        strict=True))
    print(f"\nCPU: {torch.get_num_threads()} threads, torch {torch.__version__}, model {engine.model_dir}"
          + (f", draft model {draft}" if draft else "") + (f", EAGLE-3 head {args.eagle3_head}" if eagle else "")
          + f", 128 output tokens, {args.rounds} interleaved rounds (medians)")
    print(f"{'decode tok/s':<28}{'mode':>7}{'tok/s':>10}{'vs off':>9}{'accepted':>10}{'tokens/verify':>15}")
    for name, _, _ in cases:
        off = statistics.median(rates[(name, "off")])
        print(f"{name:<28}{'off':>7}{off:>10.1f}")
        for mode in drafters:
            on = statistics.median(rates[(name, mode)])
            drafted, accepted, steps = accept[(name, mode)]
            ratio = f"{accepted / drafted:.0%}" if drafted else "-"
            per = f"{(accepted + steps) / steps:.2f}" if steps else "-"
            print(f"{'':<28}{mode:>7}{on:>10.1f}{on / off:>9.2f}{ratio:>10}{per:>15}")
    print("targets (ngram): agent JSON batch 1 >= 1.8x; free text batch 1 >= 0.95x; batch 16 >= 0.95x")
    engine.drafter = engine.scheduler.drafter = drafter
    engine.eagle, engine.model.aux_layers = None, ()
    if args.spec_crossover:
        # The batch size above which verification costs more than it saves: drafting forced on.
        drafter.max_batch = 1 << 10
        print("\ncrossover (drafting at every batch size; agent JSON / free text):")
        print(f"{'batch':<8}{'agent speedup':>15}{'text speedup':>15}")
        for b in (1, 2, 4, 8, 16):
            row = []
            for prompt in (agent, story):
                runs: dict[bool, list[float]] = {}
                for r in range(args.rounds):
                    for on in (False, True):
                        engine.drafter = engine.scheduler.drafter = drafter if on else None
                        runs.setdefault(on, []).append(decode_rate(engine, [prompt] * b, sp, f"x{b}{r}{on}"))
                row.append(statistics.median(runs[True]) / statistics.median(runs[False]))
            print(f"{b:<8}{row[0]:>15.2f}{row[1]:>15.2f}", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: $SPLITFIRE_MODEL or smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtypes", default="float32", help="our engine's dtypes, comma-separated")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--families", action="store_true", help="every family on same-size random weights")
    p.add_argument("--parallel", action="store_true", help="tensor parallel: TP=threads (a thread a rank) vs TP=1")
    p.add_argument("--family-list", default="", help="with --families: a comma-separated subset; with --parallel: one "
                   "family (default llama; a MoE family adds an expert-parallel column)")
    p.add_argument("--quantizations", default="none", help="with --families: none,int8,int4 variants of each family")
    p.add_argument("--grammar", action="store_true", help="json_schema-constrained vs free decode, compile time")
    p.add_argument("--speculative", action="store_true", help="prompt-lookup speculation vs none, greedy decode")
    p.add_argument("--spec-crossover", action="store_true", help="with --speculative: speedup at batch 1-16 with "
                   "drafting forced on (where speculation stops paying)")
    p.add_argument("--draft-model", default=None, help="with --speculative: also a draft-model column (e.g. the "
                   "4-bit smollm2-135m-instruct drafting for its float32 conversion)")
    p.add_argument("--eagle3-head", default=None, metavar="DIR|random",
                   help="with --speculative: also an EAGLE-3 column (a head trained for the model, or 'random': "
                        "a random head of the model's shape, which measures what drafting costs, not what it gains)")
    p.add_argument("--lora", action="store_true", help="LoRA adapters: decode batch 16 over N adapters and "
                   "prefill 512 under one, against the base alone; adapter load time")
    p.add_argument("--lora-adapters", type=int, default=8, help="with --lora: adapters (the batch spread over them)")
    p.add_argument("--lora-rank", type=int, default=16, help="with --lora: their rank")
    p.add_argument("--lora-tokens", type=int, default=48, help="with --lora: decode steps measured per round")
    p.add_argument("--lora-dtype", default="float32", choices=["float32", "float16"],
                   help="with --lora: the factors the CPU decode loop reads")
    p.add_argument("--json", default="", help="with --compression: write the numbers here")
    p.add_argument("--compression", action="store_true", help="lossless bf16 weight compression: size vs the entropy "
                   "bound, compress/decode GB/s, cold load vs the plain checkpoint (loadtest/bench_compression.py)")
    p.add_argument("--mla", action="store_true", help="DeepSeek-V3 latent attention: absorbed vs up-projecting decode")
    p.add_argument("--mla-context", type=int, default=1024, help="with --mla: tokens of context per sequence")
    p.add_argument("--mla-tokens", type=int, default=16, help="with --mla: decode steps measured per round")
    p.add_argument("--quant", action="store_true", help="quantized weights vs float32: speed, perplexity, agreement")
    p.add_argument("--gemm", action="store_true", help="one quantized matmul at SmolLM2 shapes: C tiles vs panel "
                   "GEMM vs dequantize + float32 GEMM, by activation rows")
    p.add_argument("--kv-dtypes", action="store_true", help="float32 vs float16 KV cache: decode tok/s at "
                   "256/1024-token contexts, perplexity")
    p.add_argument("--gemm-rows", default="1,2,5,8,16,32,64,128,256,512", help="with --gemm: row counts")
    p.add_argument("--vs-llama-server", nargs="?", const="", default=None, metavar="BINARY",
                   help="with --quant: also serve the same GGUF over HTTP against llama.cpp's llama-server at this "
                        "path (no path: splitfire's rows only)")
    p.add_argument("--streams", default="1,16", help="with --vs-llama-server: closed-loop concurrency levels")
    p.add_argument("--duration", type=float, default=30.0, help="with --vs-llama-server: seconds per level")
    p.add_argument("--splitfire-arg", action="append", help="with --vs-llama-server: extra `splitfire up` argument")
    p.add_argument("--sampling", action="store_true", help="the sampler's ms per step on real logits: batched vs "
                   "the row-by-row reference, common settings (loadtest/bench_sampling.py)")
    p.add_argument("--sampling-batches", default="1,16,64,256", help="with --sampling: rows per step")
    p.add_argument("--sampling-groups", type=int, default=8, help="with --sampling: steps (row groups) per cell")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.json and not args.compression:
        p.error("--json is written by --compression only")
    # Each mode flag and the module:function that runs it (the first given runs; none: the default table).
    modes: list[tuple[str, str | Callable[[argparse.Namespace], int]]] = [
        ("kv_dtypes", "loadtest.bench_quant:main_kv"), ("gemm", "loadtest.bench_quant:main_gemm"),
        ("quant", "loadtest.bench_quant:main_quant"), ("families", main_families),
        ("lora", "loadtest.bench_lora:main_lora"), ("compression", "loadtest.bench_compression:main_compression"),
        ("mla", "loadtest.bench_mla:main_mla"), ("grammar", main_grammar),
        ("sampling", "loadtest.bench_sampling:main_sampling"), ("speculative", main_speculative),
        ("parallel", main_parallel)]
    for flag, target in modes:
        if getattr(args, flag):
            if isinstance(target, str):  # (a module of its own, imported only when asked)
                import importlib

                module, fn = target.split(":")
                target = getattr(importlib.import_module(module), fn)
            return target(args)

    cols: dict[str, dict[str, float]] = {}
    model_dir = ""
    for dt in args.dtypes.split(","):
        model_dir, cols[f"splitfire {dt}"] = bench_ours(args, dt)
    if not args.no_transformers:
        print("running transformers ...", file=sys.stderr, flush=True)
        cols["transformers float32"] = theirs(model_dir, torch.float32, args.rounds)

    names = list(cols)
    base = cols.get("transformers float32")
    print(f"\nCPU: {torch.get_num_threads()} threads, torch {torch.__version__}, model {model_dir}")
    header = f"{'metric':<26}" + "".join(f"{n:>22}" for n in names) + ("" if base is None else f"{'ours/transformers':>20}")
    print(header)
    rows = [(f"prefill {n} tok/s", f"prefill_{n}") for n in PREFILL_LENGTHS]
    rows += [(f"decode batch {b} tok/s", f"decode_{b}") for b in BATCHES]
    for label, key in rows:
        line = f"{label:<26}" + "".join(f"{cols[n].get(key, float('nan')):>22.1f}" for n in names)
        if base is not None:
            line += f"{cols[names[0]][key] / base[key]:>20.2f}"
        print(line)
    ours = cols[names[0]]
    step = ours["step_torch_ms"] + ours["step_python_ms"]
    print(f"{'batch-1 step: torch ops ms':<26}{ours['step_torch_ms']:>22.1f}")
    print(f"{'batch-1 step: Python ms':<26}{ours['step_python_ms']:>22.1f}   ({ours['step_python_ms'] / step:.0%} of the step)")
    print(f"{'batch 32 / batch 1':<26}{ours['decode_32'] / ours['decode_1']:>22.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
