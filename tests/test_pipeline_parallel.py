"""The layers split into pipeline stages, one process each (and tensor parallel inside each stage): every
family equals transformers token for token and in its logits; stages are balanced by cost; micro-batches
keep them busy; a dead stage takes the worker down."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from engine_helpers import drain
from grpc_client import generate, greedy
from hf_models import make_hf_model
from multi_rank import GREEDY, N, prompts
from procs import address, start_worker, stop_all

from common.errors import ModelLoadError
from common.sampling_params import SamplingParams
from engine.model.model_config import ModelConfig
from engine.model.parallel import split_layers


def pipeline_logits(engine, prompt: list[int]) -> torch.Tensor:
    """Last-position logits of `prompt` through the stages (the runner's own pipeline)."""
    engine.add_request("logits", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    batch = engine.scheduler.schedule()
    plan = engine.runner.prepare(batch)
    with torch.inference_mode():
        out = engine.runner.pipeline([plan])[0][0]
    engine.abort("logits")
    return out


@pytest.mark.parametrize("family", ["llama3", "gemma3", "qwen3_moe", "mixtral", "deepseek_v3"])
def test_two_stages_equal_transformers(tmp_path, engines, family):
    """Gemma 3 ties its LM head to the embedding: the last stage holds the table too."""
    fam = make_hf_model(family, tmp_path / "m")
    engine = engines(fam.path, pipeline_parallel_size=2)
    assert engine.model.stage.count == 2 and len(engine.model.layers) < fam.config["num_hidden_layers"]
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=N, **GREEDY))
    out = drain(engine)
    assert [out[f"r{i}"].token_ids for i in range(3)] == [fam.greedy(p, N) for p in prompts()]
    for p in prompts()[:2]:
        torch.testing.assert_close(pipeline_logits(engine, p), fam.logits(p), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
def test_two_stages_of_two_tensor_parallel_ranks(tmp_path, engines, family):
    fam = make_hf_model(family, tmp_path / "m")
    engine = engines(fam.path, pipeline_parallel_size=2, tensor_parallel_size=2)
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=N, **GREEDY))
    out = drain(engine)
    assert [out[f"r{i}"].token_ids for i in range(3)] == [fam.greedy(p, N) for p in prompts()]


def test_micro_batches_chunked_prefill_and_prefix_hits(tmp_path, engines):
    """A step's batch goes through the stages as micro-batches (each stage busy with one while the
    next takes the previous); chunked prompts and cached prefixes are unchanged by it."""
    fam = make_hf_model("qwen3", tmp_path / "m")
    engine = engines(fam.path, pipeline_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=16)
    seen: list[int] = []
    run = engine.runner.pipeline

    def counting(plans, hook=None):
        seen.append(len(plans))
        return run(plans, hook)

    engine.runner.pipeline = counting
    first = prompts()[2]
    engine.add_request("first", first, SamplingParams(max_tokens=N, **GREEDY))
    assert drain(engine)["first"].token_ids == fam.greedy(first, N)
    second = first[:60] + [9, 8, 7, 6, 5]
    engine.add_request("second", second, SamplingParams(max_tokens=N, **GREEDY))
    engine.add_request("third", prompts()[1], SamplingParams(max_tokens=N, **GREEDY))
    out = drain(engine)
    assert out["second"].cached_tokens == 48
    assert out["second"].token_ids == fam.greedy(second, N)
    assert out["third"].token_ids == fam.greedy(prompts()[1], N)
    assert max(seen) == 2  # two sequences decoding: two micro-batches in flight


def test_quantized_tied_embedding_over_stages_equals_one_rank(tmp_path, engines):
    """int8 on a tied model: the first stage quantizes its embedding as the whole model quantizes the
    shared table, the last stage its LM head: same codes, same tokens."""
    fam = make_hf_model("qwen2", tmp_path / "m", intermediate_size=128)  # (tied, biases)
    one = engines(fam.path, quantization="int8")
    two = engines(fam.path, quantization="int8", pipeline_parallel_size=2)
    for e in (one, two):
        for i, p in enumerate(prompts()):
            e.add_request(f"r{i}", p, SamplingParams(max_tokens=N, **GREEDY))
    assert {k: v.token_ids for k, v in drain(one).items()} == {k: v.token_ids for k, v in drain(two).items()}


def test_stages_are_balanced_by_cost(tmp_path):
    """A large vocabulary's LM head costs the last stage several layers' worth: it gets fewer layers."""
    import json

    fam = make_hf_model("llama3", tmp_path / "m", num_hidden_layers=12)
    cfg = ModelConfig.from_dir(fam.path)
    assert split_layers(cfg, 1) == [range(0, 12)]
    assert split_layers(cfg, 2) == [range(0, 6), range(6, 12)]  # (a ~400-token vocabulary: a cheap head)
    big = json.loads((fam.path / "config.json").read_text())
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(json.dumps({**big, "vocab_size": 8192}))  # head: ~17 layers
    two = split_layers(ModelConfig.from_dir(tmp_path / "big"), 2)
    assert two[0].start == 0 and two[-1].stop == 12 and two[0].stop == two[1].start
    assert len(two[1]) < len(two[0])
    assert all(len(r) >= 1 for r in split_layers(cfg, 12))
    with pytest.raises(ModelLoadError, match="between 1 and the model's 12 layers"):
        split_layers(cfg, 13)


def test_a_served_two_stage_worker_dies_with_a_stage(tmp_path):
    import asyncio

    import grpc

    fam = make_hf_model("llama3", tmp_path / "m")
    worker = start_worker("both", fam.path, tmp_path, "--pipeline-parallel-size", "2")
    try:
        p = prompts()[1]

        async def scenario() -> None:
            got = await generate(address(worker), p, greedy(N, ignore_eos=True))
            assert got.token_ids == fam.greedy(p, N)
            pid = worker.popen.pid
            children = [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
            stages = [c for c in children if b"engine.ranks" in open(f"/proc/{c}/cmdline", "rb").read()]
            assert len(stages) == 1
            long = asyncio.create_task(generate(address(worker), p, greedy(900, ignore_eos=True)))
            await asyncio.sleep(0.5)
            os.kill(stages[0], signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError):
                await asyncio.wait_for(long, 15)

        asyncio.run(scenario())
        t0 = time.monotonic()
        assert worker.popen.wait(15) != 0 and time.monotonic() - t0 < 10
        assert "event=rank_failed rank=1" in worker.log()
    finally:
        stop_all(worker)
