from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton reads this when it is first imported, and libraries the tests use (peft) import it early:
    # without a GPU every Triton kernel in the tests runs in the interpreter (tests/test_triton_kernels.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_model import make_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, fetched and converted once (slow tests only)."""
    from engine.loading.model_store import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_float_dir() -> Path:
    """The same GGUF with every tensor dequantized to float32: what transformers can load."""
    from engine.loading.model_store import fetch_builtin

    return fetch_builtin("smollm2-135m-instruct", keep_quantized=False)


@pytest.fixture(autouse=True, scope="session")
def _quiet_env() -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


@pytest.fixture(autouse=True, scope="session")
def _no_orphans():
    """A failing test must not leave workers running: kill whatever is still alive at the end."""
    yield
    from procs import STARTED

    for p in STARTED:
        if p.poll() is None:
            p.kill()
            p.wait(10)
from multi_rank import engines  # noqa: E402,F401  (the model-parallel tests' fixture: tests/multi_rank.py)
