"""How many of each byte value an array holds — the histogram every entropy coder here starts from."""

from __future__ import annotations

import numpy as np


def count_bytes(data: np.ndarray) -> np.ndarray:
    """How many of each byte value `data` (uint8) holds (256, int64): the C kernel (`cpu_ops.c`
    sf_count_bytes; numpy's bincount widens every byte to 8 first, several times slower) where it is built,
    else np.bincount — the reference a test holds it equal to."""
    from engine.model.kernels import cpu_ops

    lib = cpu_ops.library()
    data = np.ascontiguousarray(data, np.uint8).reshape(-1)
    if lib is None:
        return np.bincount(data, minlength=256).astype(np.int64)
    counts = np.zeros(256, np.int64)
    lib.sf_count_bytes(data.ctypes.data, data.size, counts.ctypes.data)
    return counts
