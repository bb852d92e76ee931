from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # (token id, logprob, top) per token, when asked for
    error: str | None = None
    cached_tokens: int = 0


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_gb", 0.01)
    kw.setdefault("device", "cpu")
    # SPLITFIRE_QUANTIZATION=int8 runs the suite's in-process engines (and, through the environment,
    # its worker processes) with quantized weights.
    kw.setdefault("quantization", os.environ.get("SPLITFIRE_QUANTIZATION") or None)
    # SPLITFIRE_TEST_ASYNC=1 runs the in-process engines that can queue steps (decode graphs, no
    # speculation, one rank, no LoRA) with async scheduling on CPU, whatever the test asked of graphs: a
    # differential run of the engine suites through the queued path (tests that count blocks — graphs keep
    # a scratch block — and test_async_scheduling's in-order references fail by design).
    if os.environ.get("SPLITFIRE_TEST_ASYNC") == "1" and kw.get("decode_graphs") != "off" and not (
            kw.get("speculative", "off") != "off" or kw.get("lora_modules") or kw.get("enable_lora")
            or kw.get("tensor_parallel_size", 1) > 1 or kw.get("pipeline_parallel_size", 1) > 1):
        kw.update(decode_graphs="on", async_scheduling="on")
    return LLMEngine(EngineConfig(model=str(model_dir), **kw))


def drain(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return results
        for o in engine.step():
            r = results.setdefault(o.request_id, Result())
            r.token_ids += o.token_ids
            r.text += o.text
            r.cached_tokens = max(r.cached_tokens, o.num_cached_tokens)
            r.logprobs += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]
            if o.finished:
                r.finish_reason, r.error = o.finish_reason, o.error
    raise AssertionError("engine did not finish")


@dataclass
class LoadMemory:
    mapped: bool  # served from the weight cache's mapping
    rss_added: int  # bytes of RSS the load left
    peak_added: int  # bytes the RSS peaked above where it started


def load_memory(model_dir, env: dict[str, str] | None = None) -> LoadMemory:
    """`load_model` of `model_dir` (float32, CPU) in a fresh process, and what it did to that process's RSS."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import re, torch\n"
        "from engine.loading.weights import load_model\n"
        "from engine.model.layers import cpu_packing_supported\n"
        "def status(key): return int(re.search(key + r':\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
        "cpu_packing_supported(torch.float32)  # oneDNN's one-time set-up is not the model's memory\n"
        "open('/proc/self/clear_refs', 'w').write('5')  # resets the peak (VmHWM) to the current RSS\n"
        "base = status('VmRSS')\n"
        f"m = load_model({str(model_dir)!r}, torch.device('cpu'), torch.float32)\n"
        "print(m.weight_mapping is not None, (status('VmRSS') - base) * 1024, (status('VmHWM') - base) * 1024)\n"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}).stdout.split()
    return LoadMemory(out[-3] == "True", int(out[-2]), int(out[-1]))


def step_tokens(engine: LLMEngine, outs: dict[str, list[int]]) -> set[str]:
    """One engine step; its tokens added to `outs`; the ids of the requests that got tokens."""
    got = set()
    for o in engine.step():
        outs.setdefault(o.request_id, []).extend(o.token_ids)
        if o.token_ids:
            got.add(o.request_id)
    return got


def simulate_w8a8(m) -> None:
    """Within monkeypatch context `m`: `quant.linear` computes every FP8 matmul by `fp8_triton.w8a8_reference`
    (activations rounded to e4m3 per row per group, as the GPU's w8a8 kernel does; float32 in torch), every
    other as before. Engines built inside should set `model.cpu_layers_off` so each matmul goes through it."""
    import torch

    from engine.model import quant
    from engine.model.kernels import fp8_triton

    plain = quant.linear

    def simulated(x, parts, bias, int8_activations=False):
        if all(p.kind == "fp8" for p in parts):
            out = torch.cat([fp8_triton.w8a8_reference(x, p.q, p.scales, p.group_size) for p in parts], -1)
            return (out if bias is None else out + bias.float()).to(x.dtype)
        return plain(x, parts, bias, int8_activations)

    m.setattr(quant, "linear", simulated)
