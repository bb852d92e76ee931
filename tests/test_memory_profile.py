"""GPU memory accounting before the KV cache is sized (engine/memory_profile.py): the budget
arithmetic, its refusal when nothing is left, and the profiling steps themselves, which run on CPU
(measuring nothing there) for every model family — only the allocator readings are CUDA's."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_engine
from hf_models import make_hf_model

from engine import memory_profile
from engine.batch.graph_runner import DecodeGraphs
from engine.memory_profile import ActivationPeaks, kv_budget


def test_kv_budget_reserves_the_prompt_chunk_and_the_graph_pool():
    gib = 2**30
    peaks = ActivationPeaks(prefill=2 * gib, decode=gib)
    assert kv_budget(40 * gib, 0.9, peaks, graphs=True) == int(36 * gib) - 3 * gib
    assert kv_budget(40 * gib, 0.9, peaks, graphs=False) == int(36 * gib) - 2 * gib
    with pytest.raises(ValueError, match=r"no GPU memory left for the KV cache.*--enforce-eager"):
        kv_budget(3 * gib, 0.9, peaks, graphs=True)


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe", "deepseek_v3", "gemma3"])
def test_the_profiling_steps_run_for_every_family(tmp_path, family):
    d = make_hf_model(family, tmp_path / family).path
    engine = make_engine(d)
    peaks = memory_profile.profile(engine.model, torch.device("cpu"), torch.float32, 16, chunk_tokens=100,
                                   decode_batch=8)
    assert peaks == ActivationPeaks(0, 0)  # CPU: nothing measured, but both steps ran without error
    # The engine's own cache is untouched: it still serves.
    from common.sampling_params import SamplingParams

    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_work:
        engine.step()


def test_graphs_are_captured_largest_bucket_first():
    g = DecodeGraphs(lambda ids, pos, meta: ids, max_num_seqs=24, max_blocks=4, block_size=16, scratch_block=0,
                     device=torch.device("cpu"))
    assert [s.size for s in g.capture_order()] == [24, 16, 8, 4, 2, 1]
