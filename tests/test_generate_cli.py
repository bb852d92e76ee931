"""`splitfire generate`: JSONL in, JSONL out in the same order, errors per line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from reference import Reference

ROOT = Path(__file__).resolve().parent.parent


def test_generate_jsonl_round_trip(tiny_model_dir, tmp_path):
    ref = Reference(tiny_model_dir)
    lines = [
        {"prompt_token_ids": list(range(3, 30)), "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2},
        {"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 5, "temperature": 0.8, "seed": 7},
        {"prompt": "bad", "max_tokens": -1},
        {"nothing": True},
        {"prompt": "x", "max_tokens": 60, "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                                    "required": ["n"], "additionalProperties": False}}}},
        {"prompt": "x", "max_tokens": 3, "guided_json": {}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    dst = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "splitfire_cli", "generate", "--model", str(tiny_model_dir),
                           "--device", "cpu", "--kv-cache-gb", "0.01", "--input", str(src), "--output", str(dst),
                           "--quiet"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr  # some lines failed, and it says so
    assert "4 request(s) failed" in proc.stderr
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert len(out) == 8
    assert out[0]["token_ids"] == ref.greedy(list(range(3, 30)), 6) and out[0]["finish_reason"] == "length"
    assert len(out[1]["logprobs"]) == 4 and len(out[1]["logprobs"][0]["top"]) == 2
    assert out[2]["finish_reason"] in ("stop", "length") and out[2]["token_ids"]
    assert "max_tokens" in out[3]["error"]
    assert "exactly one of" in out[4]["error"]
    assert out[5]["finish_reason"] == "stop" and json.loads(out[5]["text"])["n"] <= 9
    assert "guided_json" in out[6]["error"]  # never silently ignored
    assert "error" in out[7]
