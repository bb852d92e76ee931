"""Accuracy of a loaded engine, measured rather than assumed: perplexity on a fixed public-domain
text shipped here (`data/prose.txt`, ~2,600 SmolLM2 tokens) and greedy agreement between two
engines over a fixed prompt set."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from common.sampling_params import SamplingParams
from engine.batch.scheduler import ScheduledSeq
from engine.batch.sequence import Sequence
from engine.llm_engine import LLMEngine

PROSE = Path(__file__).with_name("data") / "prose.txt"


@torch.inference_mode()
def window_hidden(engine: LLMEngine, chunk: list[int]) -> torch.Tensor:
    """The final hidden states at every position of `chunk`, computed as one prefill through the
    engine's own model, KV cache and attention (the blocks are freed after)."""
    seq = Sequence(f"window-{len(chunk)}", chunk, SamplingParams(max_tokens=1))
    if not engine.blocks.allocate(seq, len(chunk)):
        raise RuntimeError("KV cache too small for a window; raise kv_cache_gb")
    try:
        seq.num_computed_tokens = 0  # every position, cached prefix or not
        input_ids, positions, meta, _ = engine.runner.prepare([ScheduledSeq(seq, len(chunk))])
        return engine.model(input_ids, positions, engine.kv, meta)
    finally:
        engine.blocks.free_seq(seq)


@torch.inference_mode()
def perplexity(engine: LLMEngine, text: str | None = None, window: int = 512) -> tuple[float, int]:
    """exp(mean next-token NLL) over `text` in non-overlapping windows of `window` tokens, each
    computed as one prefill (`window_hidden`). Returns (perplexity, tokens scored)."""
    ids = engine.tokenizer.encode(text if text is not None else PROSE.read_text())
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        logits = engine.model.logits(window_hidden(engine, chunk)[:-1])
        nll += F.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count), count


def prompt_set(engine: LLMEngine, n: int = 16, length: int = 48) -> list[list[int]]:
    """`n` prompts cut from the prose at fixed offsets."""
    ids = engine.tokenizer.encode(PROSE.read_text())
    step = (len(ids) - length) // n
    return [ids[i * step : i * step + length] for i in range(n)]


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 32) -> list[list[int]]:
    """Each prompt decoded alone: batch 1 is the path whose numerics differ most (the integer-dot
    kernel of --cpu-activations int8 runs only at batch 1-2)."""
    out: list[list[int]] = []
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        tokens: list[int] = []
        while engine.has_work:
            for o in engine.step():
                tokens.extend(o.token_ids)
        out.append(tokens)
    return out


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is 12 times 7?"}],
    [{"role": "user", "content": "Give me a JSON object with keys name and age for a 30-year-old called Ada."}],
    [{"role": "user", "content": "Explain in one sentence what a CPU cache is."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "List the first five prime numbers."}],
]


def chat_set(engine: LLMEngine) -> list[list[int]]:
    """Short chat questions through the model's template: what a served instruct model answers."""
    return [engine.tokenizer.encode_chat(m) for m in CHATS]


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(fraction of continuations identical to the reference's, mean fraction of tokens before the first
    difference)."""
    same = sum(a == b for a, b in zip(ours, reference, strict=True))
    prefix = []
    for a, b in zip(ours, reference, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefix.append(k / max(len(b), 1))
    return same / len(ours), sum(prefix) / len(prefix)
