"""The committed generated gRPC code matches `protos/splitfire.proto`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current(tmp_path):
    (tmp_path / "protos").mkdir()
    (tmp_path / "protos" / "splitfire.proto").write_bytes((ROOT / "protos" / "splitfire.proto").read_bytes())
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--grpc_python_out=.",
                    "--pyi_out=.", "protos/splitfire.proto"], cwd=tmp_path, check=True)
    for name in ("splitfire_pb2.py", "splitfire_pb2_grpc.py", "splitfire_pb2.pyi"):
        fresh = (tmp_path / "protos" / name).read_text()
        assert (ROOT / "protos" / name).read_text() == fresh, f"protos/{name} is stale: run `make protos`"


def test_sampling_params_cross_the_proto_unchanged():
    """Every field the router sets reaches the engine as set: the conversion is derived from the
    dataclass and the message, so a field added to one and not the other cannot slip through."""
    import dataclasses

    from common.sampling_params import SamplingParams
    from protos import sampling
    from protos import splitfire_pb2 as pb

    assert {f.name for f in dataclasses.fields(SamplingParams)} == {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
    every = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.75, top_k=3, min_p=0.125, repetition_penalty=1.25,
                           frequency_penalty=-0.5, presence_penalty=0.25, seed=2**40 + 3, stop=["x", "yz"],
                           stop_token_ids=[4, 9], ignore_eos=True, logprobs=2, grammar="start: /a+/", resumed_tokens=5,
                           logit_bias={11: -2.5, 12: 100.0}, min_tokens=6,
                           grammar_release="[")
    wire = pb.SamplingParams.FromString(sampling.to_proto(every).SerializeToString())
    assert sampling.from_proto(wire) == every
    # Defaults, including the ones the proto spells as "unset" (temperature 1.0, top_p 1.0, no seed,
    # logprobs off, no grammar): an empty message is the default settings.
    assert sampling.from_proto(pb.SamplingParams()) == SamplingParams()
    assert sampling.from_proto(sampling.to_proto(SamplingParams())) == SamplingParams()
    # Zero values that are not defaults survive: temperature 0 (greedy), logprobs 0, seed 0.
    edge = SamplingParams(temperature=0.0, logprobs=0, seed=0, repetition_penalty=1.0)
    assert sampling.from_proto(pb.SamplingParams.FromString(sampling.to_proto(edge).SerializeToString())) == edge
