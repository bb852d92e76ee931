"""The CPU images `make image` builds, run under podman: the worker image brings up `splitfire up
--colocated` (router, worker) on SmolLM2 from the mounted model cache and answers a streamed chat through
the official client; it loads Mooncake's transfer engine and has mooncake_master; the router image
starts and reports its version; both run as a non-root user.
Opt-in (`make test-image`): it needs podman and the built images."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import tomllib
from procs import free_port

ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
_NOFILE, _NPROC = resource.getrlimit(resource.RLIMIT_NOFILE)[1], min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
# runc here: the containers' limits must be set explicitly, and at most this process's hard limits.
ULIMITS = ["--ulimit", f"nofile={_NOFILE}:{_NOFILE}", "--ulimit", f"nproc={_NPROC}:{_NPROC}"]

pytestmark = pytest.mark.skipif(os.environ.get("SPLITFIRE_TEST_IMAGE") != "1" or not shutil.which("podman"),
                                reason="opt-in: make test-image (podman and the images from make image)")


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check, timeout=timeout)


def test_images_run_as_a_non_root_user():
    for target in ("worker", "router"):
        image = f"localhost/splitfire-{target}:{VERSION}"
        out = podman("run", "--rm", *ULIMITS, "--entrypoint", "id", image, "-u").stdout.strip()
        assert out == "1000", (image, out)
        assert "splitfire" in podman("run", "--rm", *ULIMITS, image, "--help").stdout


def test_the_worker_image_loads_the_mooncake_transfer_engine_and_master():
    """Disaggregated workers need Mooncake's engine (engine.so links libcurl, which the base once lacked:
    the decode pods crashed on a real node) and the KV store pod runs mooncake_master."""
    image = f"localhost/splitfire-worker:{VERSION}"
    out = podman("run", "--rm", *ULIMITS, "--entrypoint", "python", image, "-c",
                 "from mooncake.engine import TransferEngine; from mooncake.store import MooncakeDistributedStore; "
                 "print('ok')", check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    out = podman("run", "--rm", *ULIMITS, "--entrypoint", "sh", image, "-c", "command -v mooncake_master", check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_worker_image_serves_a_streamed_chat(smollm2_dir, tmp_path):
    openai = pytest.importorskip("openai")
    # The model cache volume as a cluster would mount it: owned by the image's user (1000), which writes
    # its weight cache there; the model was fetched beforehand (nothing is downloaded at run time).
    cache = tmp_path / "cache"
    shutil.copytree(smollm2_dir, cache / "models" / smollm2_dir.name)
    subprocess.run(["chown", "-R", "1000:1000", str(cache)], check=True)
    port = free_port()
    name = f"sf-image-test-{port}"
    run = podman("run", "-d", "--rm", "--name", name, *ULIMITS, "--network", "host",
                 "-v", f"{cache}:/cache", f"localhost/splitfire-worker:{VERSION}", "up", "--colocated", "--no-redis",
                 "--no-kv-store", "--model", "smollm2-135m-instruct", "--port", str(port), "--kv-cache-gb", "0.2",
                 "--served-model-name", "smol")
    try:
        deadline = time.monotonic() + 240
        while "splitfire is ready" not in podman("logs", name, check=False).stdout + podman("logs", name,
                                                                                             check=False).stderr:
            state = podman("inspect", "--format", "{{.State.Running}}", name, check=False).stdout.strip()
            assert state == "true", podman("logs", name, check=False).stderr[-3000:]
            assert time.monotonic() < deadline, "the container did not get ready in 240 s"
            time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        stream = client.chat.completions.create(model="smol", stream=True, max_tokens=12, temperature=0,
                                                messages=[{"role": "user", "content": "What is the capital of France?"}])
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert "Paris" in text, text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["smol"]
    finally:
        podman("stop", "-t", "20", name, check=False, timeout=60)
    assert run.returncode == 0
