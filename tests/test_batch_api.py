"""OpenAI's Batch API through the official `openai` SDK: files.create / batches.create / retrieve / cancel /
files.content, outputs equal to the same requests sent one by one (greedy), a malformed line failing alone,
a router killed mid-batch losing nothing, tenants kept apart."""

from __future__ import annotations

import json
import time

import openai
import pytest
from procs import address, base_url, start_redis, start_router, start_worker, stop_all

MODEL = "tiny"


def _line(i: int, max_tokens: int = 6, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": url,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about number {i}"}],
                     "max_tokens": max_tokens, "temperature": 0}}


def _upload(c: openai.OpenAI, tmp_path, lines: list, name: str = "in.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with open(path, "rb") as f:
        return c.files.create(file=f, purpose="batch").id


def _wait(c: openai.OpenAI, batch_id: str, until, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = c.batches.retrieve(batch_id)
        if until(b):
            return b
        time.sleep(0.3)
    raise AssertionError(f"batch {batch_id} never got there: {c.batches.retrieve(batch_id)}")


def _results(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines() if x.strip()]


@pytest.fixture
def served(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": {"sk-a": {"tenant": "a"}, "sk-b": {"tenant": "b"}}}))
    worker = start_worker("both", tiny_model_dir, tmp_path)
    files = tmp_path / "files"
    args = ["--served-model-name", MODEL, "--colocated", address(worker), "--api-keys", str(keys), "--files-dir",
            str(files), "--batch-concurrency", "8", "--max-files-per-tenant", "4"]
    router = start_router(tiny_model_dir, tmp_path, *args)
    state = {"worker": worker, "router": router, "args": args}
    yield state
    stop_all(state["router"], worker)


def test_a_batch_of_100_equals_the_requests_one_by_one_and_a_bad_line_fails_alone(served, tmp_path):
    c = openai.OpenAI(base_url=base_url(served["router"]) + "/v1", api_key="sk-a", max_retries=0)
    lines = [_line(i) for i in range(100)]
    lines.insert(40, "{not json")
    lines.insert(70, _line(1000, url="/v1/completions"))
    file_id = _upload(c, tmp_path, lines)
    f = c.files.retrieve(file_id)
    assert f.purpose == "batch" and f.bytes > 0 and f.filename == "in.jsonl"
    batch = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                             metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = _wait(c, batch.id, lambda b: b.status in ("completed", "failed"))
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (102, 100, 2)
    assert done.completed_at and done.in_progress_at and done.finalizing_at
    out, errors = _results(c, done.output_file_id), _results(c, done.error_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(100))
    assert {r["custom_id"] for r in errors} == {None, "req-1000"}
    assert all(r["response"] is None and r["error"]["code"] == "invalid_request" for r in errors)
    by_id = {r["custom_id"]: r for r in out}
    for i in range(0, 100, 7):  # the same requests one by one: the same greedy answers
        one = c.chat.completions.create(**_line(i)["body"])
        r = by_id[f"req-{i}"]
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert r["response"]["body"]["choices"][0]["message"]["content"] == one.choices[0].message.content, i
    # The lines ran at the batch priority (below interactive requests).
    assert "priority=1000000" in served["worker"].log()
    # Another tenant sees none of it; a tenant past its file limit gets a 429.
    other = openai.OpenAI(base_url=base_url(served["router"]) + "/v1", api_key="sk-b", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)
    assert [b.id for b in c.batches.list().data] == [batch.id] and other.batches.list().data == []
    ids = {x.id for x in c.files.list().data}
    assert ids == {file_id, done.output_file_id, done.error_file_id}
    _upload(c, tmp_path, [_line(0)], "fourth.jsonl")
    with pytest.raises(openai.RateLimitError):
        _upload(c, tmp_path, [_line(0)], "fifth.jsonl")
    assert c.files.delete(done.error_file_id).deleted
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.body["param"] == "endpoint"


def test_cancel_mid_batch_keeps_what_finished(served, tmp_path):
    c = openai.OpenAI(base_url=base_url(served["router"]) + "/v1", api_key="sk-a", max_retries=0)
    file_id = _upload(c, tmp_path, [_line(i, max_tokens=40) for i in range(400)])
    batch = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    _wait(c, batch.id, lambda b: b.request_counts.completed >= 10)
    assert c.batches.cancel(batch.id).status == "cancelling"
    done = _wait(c, batch.id, lambda b: b.status == "cancelled")
    assert 10 <= done.request_counts.completed < 400 and done.cancelled_at
    assert len(_results(c, done.output_file_id)) == done.request_counts.completed
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(batch.id)


def test_a_router_killed_mid_batch_loses_nothing(served, tiny_model_dir, tmp_path):
    c = openai.OpenAI(base_url=base_url(served["router"]) + "/v1", api_key="sk-a", max_retries=0)
    file_id = _upload(c, tmp_path, [_line(i, max_tokens=24) for i in range(200)])
    batch = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    _wait(c, batch.id, lambda b: b.request_counts.completed >= 20)
    served["router"].popen.kill()  # no chance to tidy up
    served["router"].popen.wait(10)
    served["router"] = start_router(tiny_model_dir, tmp_path, *served["args"], name="router-again")
    c = openai.OpenAI(base_url=base_url(served["router"]) + "/v1", api_key="sk-a", max_retries=0)
    done = _wait(c, batch.id, lambda b: b.status == "completed")
    out = _results(c, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(200))  # each once
    assert (done.request_counts.completed, done.request_counts.failed) == (200, 0)
    assert "event=batch_taken" in served["router"].log()


def test_two_replicas_share_one_batch_and_the_survivor_finishes_it(tiny_model_dir, tmp_path):
    """Router replicas on one Redis and one files directory (the chart's `router.filesClaim`): a batch created on
    one is seen on the other, exactly one runs it (the Redis lease), and when that one dies without a word the
    other takes the batch over once its lease expires and finishes every line exactly once."""
    redis = start_redis(tmp_path)
    worker = start_worker("both", tiny_model_dir, tmp_path)
    args = ["--served-model-name", MODEL, "--colocated", address(worker), "--files-dir", str(tmp_path / "files"),
            "--redis-url", f"redis://127.0.0.1:{redis.ports['port']}", "--batch-lease", "3",
            "--batch-concurrency", "4"]
    routers = [start_router(tiny_model_dir, tmp_path, *args, name=f"replica-{k}") for k in range(2)]
    try:
        c = [openai.OpenAI(base_url=base_url(r) + "/v1", api_key="none", max_retries=0) for r in routers]
        file_id = _upload(c[0], tmp_path, [_line(i, max_tokens=24) for i in range(120)])
        batch = c[0].batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        _wait(c[1], batch.id, lambda b: b.request_counts.completed >= 10)  # (read through the other replica)
        runs = [k for k, r in enumerate(routers) if f"event=batch_taken batch={batch.id}" in r.log()]
        assert len(runs) == 1, [r.log()[-2000:] for r in routers]
        runner, other = runs[0], 1 - runs[0]
        routers[runner].popen.kill()  # (no chance to drop the lease: it must expire)
        routers[runner].popen.wait(10)
        done = _wait(c[other], batch.id, lambda b: b.status == "completed")
        assert f"event=batch_taken batch={batch.id}" in routers[other].log()
        out = _results(c[other], done.output_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(120))  # each exactly once
        assert (done.request_counts.completed, done.request_counts.failed) == (120, 0)
    finally:
        stop_all(*routers, worker, redis)


def test_a_batch_lease_without_redis_is_refused():
    """`--batch-lease` is the Redis lease's expiry; without Redis a batch's lock is a file lock, so the flag would
    do nothing: refused by name rather than accepted and ignored."""
    from router.core.config import RouterConfig

    with pytest.raises(ValueError, match=r"--batch-lease.*--redis-url"):
        RouterConfig(colocated=["w0:1"], batch_lease_s=5.0).validate()
    assert RouterConfig(colocated=["w0:1"], batch_lease_s=5.0, redis_url="redis://127.0.0.1:1/0").validate()
    with pytest.raises(ValueError, match="--batch-lease must be >= 1"):
        RouterConfig(colocated=["w0:1"], batch_lease_s=0.5, redis_url="redis://127.0.0.1:1/0").validate()
