"""Triton kernels for the GPU path, each a drop-in for a torch reference elsewhere in `engine/`
(attention: `triton_ops.py` for `attention.py`; experts: `moe_triton.py` for `moe.py`).

Tested on CPU with the Triton interpreter (`TRITON_INTERPRET=1`) against the torch reference;
on CUDA they run compiled. `kernels()` decides which path runs.
"""

from __future__ import annotations

import importlib
import os
from functools import cache
from types import ModuleType


def backend() -> str:
    """SPLITFIRE_KERNELS=auto|triton|torch (SPLITFIRE_ATTENTION_BACKEND is its older name)."""
    return os.environ.get("SPLITFIRE_KERNELS") or os.environ.get("SPLITFIRE_ATTENTION_BACKEND") or "auto"


@cache
def kernels(name: str, device_type: str) -> ModuleType | None:
    """`engine.model.kernels.<name>` when its Triton kernels should run on `device_type`: on CUDA by default,
    anywhere (the CPU interpreter, in tests) with SPLITFIRE_KERNELS=triton. None means the torch path:
    SPLITFIRE_KERNELS=torch, another device, or (with auto) no triton installed."""
    choice = backend()
    if choice == "torch" or (device_type != "cuda" and choice != "triton"):
        return None
    try:
        return importlib.import_module(f"engine.model.kernels.{name}")
    except ImportError:
        if choice == "triton":
            raise
        return None


@cache
def norm_rope_kernels() -> bool:
    """Whether RMSNorm and RoPE take their Triton kernels where `kernels()` runs Triton: yes unless
    SPLITFIRE_NORM_ROPE_KERNELS=0 (the A/B of `gpu_check.sh normrope` until they are timed on a GPU)."""
    return os.environ.get("SPLITFIRE_NORM_ROPE_KERNELS", "1") != "0"
