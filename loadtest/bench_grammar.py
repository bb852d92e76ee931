"""llguidance vs xgrammar on this machine: the per-step cost of constrained decoding (compute the
batch's token masks, apply them to random logits, sample, advance every matcher) at batch 1 and
16, and the compile time of a 20-property JSON schema. The measurement behind the choice in
`engine/batch/constrained.py`; xgrammar is optional (`pip install xgrammar` to compare).

    python -m loadtest.bench_grammar            # SmolLM2's tokenizer (49k vocabulary)
    python -m loadtest.bench_grammar --tools    # the generic tool format's union grammar on free text

`--tools`: SmolLM2 decoding free text (chat answers, greedy) in process, with the generic tool
format's `auto` grammar (free text | calls, router/tool_calls.py) against unconstrained, batch 1
and 16, rounds interleaved: tokens/s and the tokens themselves (the grammar must leave prose unchanged).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from engine.loading.model_store import resolve_model
from loadtest.bench_engine import grammar_schema

STEPS = 80


def llguidance_run(tok_json: str, vocab: int, eos: int, schema: dict, batch: int) -> tuple[float, float]:
    import llguidance as llg

    from common.grammar import JSON_STYLE

    tok = llg.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    text = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    t0 = time.perf_counter()
    matchers = [llg.LLMatcher(tok, text)]
    compile_ms = (time.perf_counter() - t0) * 1e3
    matchers += [matchers[0].deep_copy() for _ in range(batch - 1)]
    ex = llg.LLExecutor(num_threads=2)
    words = (vocab + 31) // 32
    bm = torch.zeros(batch, words, dtype=torch.int32)
    bits = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)
    per = []
    for _ in range(STEPS):
        logits = torch.randn(batch, vocab)
        t0 = time.perf_counter()
        ex.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bm.data_ptr(), words * 4, batch)
        allowed = (bm.unsqueeze(-1) & bits).ne(0).view(batch, -1)[:, :vocab]
        logits.masked_fill_(~allowed, float("-inf"))
        ex.consume_token_par(list(zip(matchers, logits.argmax(-1).tolist(), strict=True)))
        per.append(time.perf_counter() - t0)
    return statistics.median(per) * 1e3, compile_ms


def xgrammar_run(tok_json: str, vocab: int, eos: int, schema: dict, batch: int) -> tuple[float, float]:
    import xgrammar as xgr
    from tokenizers import Tokenizer

    enc = [""] * vocab
    for t, i in Tokenizer.from_str(tok_json).get_vocab(with_added_tokens=True).items():
        enc[i] = t
    info = xgr.TokenizerInfo(enc, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    compile_ms = (time.perf_counter() - t0) * 1e3
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bm = xgr.allocate_token_bitmask(batch, vocab)
    per = []
    for _ in range(STEPS):
        logits = torch.randn(batch, vocab)
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bm, i)
        xgr.apply_token_bitmask_inplace(logits, bm)
        for m, t in zip(matchers, logits.argmax(-1).tolist(), strict=True):
            if not m.is_terminated():
                m.accept_token(t)
        per.append(time.perf_counter() - t0)
    return statistics.median(per) * 1e3, compile_ms


# Questions whose answers run past 48 tokens: every row decodes all of them, with and without the grammar.
QUESTIONS = ["Write a long story about a dragon who learns to bake.", "Explain in detail how a CPU executes code.",
             "Describe the history of Rome in several paragraphs.", "Explain what HTML <div> and <span> tags do.",
             "Give me a detailed recipe for pancakes, step by step.", "Why is the sky blue? Explain at length.",
             "Summarise the plot of Hamlet scene by scene.", "Write a long letter to a friend about your holiday."]


def main_tools(args: argparse.Namespace) -> int:
    from common.sampling_params import SamplingParams
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    from loadtest.engine_runs import decode_rate
    from router.api.tool_calls import GENERIC, Tool, ToolChoice

    weather = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    g = GENERIC.auto_grammar(ToolChoice("auto", (weather,), parallel=True))
    engine = LLMEngine(EngineConfig(model=args.model, device="cpu", threads=2, speculative="off"))
    variants = {"free": (None, None), "union grammar": (g, None), "as served": (g, "[")}  # (grammar, release)
    rows: dict[str, dict[int, list[float]]] = {name: {1: [], 16: []} for name in variants}
    same = total = 0
    for r in range(args.rounds):
        for b in (1, 16):
            prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[(i + r) % len(QUESTIONS)]}])
                       for i in range(b)]
            for name, (grammar_text, release) in variants.items():
                sp = SamplingParams(max_tokens=48, temperature=0, grammar=grammar_text, grammar_release=release)
                rows[name][b].append(decode_rate(engine, prompts, sp, f"{name}-{r}-{b}"))
        for q in QUESTIONS[:4] if r == 0 else []:
            ids = engine.tokenizer.encode_chat([{"role": "user", "content": q}])
            outs = []
            for grammar_text in (None, g):
                engine.add_request("cmp", ids, SamplingParams(max_tokens=48, temperature=0, grammar=grammar_text))
                toks = []
                while engine.has_work:
                    for o in engine.step():
                        toks += o.token_ids
                outs.append(toks)
            same += outs[0] == outs[1]
            total += 1
    print(f"\nSmolLM2 free text, greedy, 48 tokens, 2 threads, medians of {args.rounds} rounds")
    print("('as served': the router's request, the grammar released once the reply opens as prose)")
    print(f"{'decode tok/s':<16}{'free':>12}{'union grammar':>16}{'cost':>8}{'as served':>12}{'cost':>8}")
    for b in (1, 16):
        free, union, served = (statistics.median(rows[n][b]) for n in variants)
        print(f"{'batch ' + str(b):<16}{free:>12.1f}{union:>16.1f}{1 - union / free:>8.1%}{served:>12.1f}"
              f"{1 - served / free:>8.1%}")
    print(f"greedy answers identical with and without the grammar: {same} of {total}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model whose tokenizer to use (default SmolLM2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tools", action="store_true", help="the generic tool format's auto grammar vs none, on free text")
    args = p.parse_args()
    if args.tools:
        return main_tools(args)
    torch.set_num_threads(2)
    model_dir = resolve_model(args.model)
    tok_json = (model_dir / "tokenizer.json").read_text()
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = cfg["vocab_size"]
    eos = cfg["eos_token_id"][0] if isinstance(cfg["eos_token_id"], list) else cfg["eos_token_id"]
    schema = grammar_schema()
    libs = {"llguidance": llguidance_run, "xgrammar": xgrammar_run}
    rows: dict[str, dict[str, float]] = {}
    for name, run in libs.items():
        try:
            results = {b: [run(tok_json, vocab, eos, schema, b) for _ in range(args.rounds)] for b in (1, 16)}
        except ImportError:
            print(f"{name} is not installed: skipped", file=sys.stderr)
            continue
        rows[name] = {f"batch_{b}": statistics.median(r[0] for r in rs) for b, rs in results.items()}
        rows[name]["compile"] = statistics.median(r[1] for rs in results.values() for r in rs)
    print(f"\nCPU: 2 threads, vocabulary {vocab} ({model_dir.name}), 20-property JSON schema, {STEPS} steps, "
          f"medians of {args.rounds} runs")
    print(f"{'library':<14}{'batch 1 ms/step':>18}{'batch 16 ms/step':>18}{'compile ms':>14}")
    for name, r in rows.items():
        print(f"{name:<14}{r['batch_1']:>18.2f}{r['batch_16']:>18.2f}{r['compile']:>14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
