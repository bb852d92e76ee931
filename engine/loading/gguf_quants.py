"""GGUF quantized blocks read straight into `engine.model.quant`'s int8 / int4 layout, without float32.

Each supported GGML type is an exact re-expression (same codes, same scales as float32):
- Q8_0 (32 x int8, fp16 d):                  int8, group 32, scale d
- Q5_0 (32 x 5-bit, fp16 d, w = d (q - 16)): int8, group 32, codes q - 16
- Q6_K (256 = 16 x 16 x 6-bit, int8 sub-scales, fp16 d, w = d sc (q - 32)): int8, group 16
- Q4_0 (32 x 4-bit, fp16 d, w = d (q - 8)):  int4, group 32, min -8 d
- Q4_1 (32 x 4-bit, fp16 d and m):           int4, group 32, min m
- Q4_K (256 = 8 x 32 x 4-bit, 6-bit sub-scales and mins, fp16 d, dmin): int4, group 32,
  scale d sc, min -dmin m
Other types (Q2_K, Q3_K, Q5_1, Q5_K, IQ*) return None and are dequantized to float32 as before.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.model.quant import pack_int4

# GGML type names -> (bytes per block, weights per block)
_BLOCKS = {"Q8_0": (34, 32), "Q5_0": (22, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256),
           "Q6_K": (210, 256)}
SUPPORTED = tuple(_BLOCKS)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block -> 32 codes in weight order (low nibbles first, then high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def convert(raw: np.ndarray, type_name: str, rows: int, cols: int) -> dict[str, np.ndarray] | None:
    """`raw`: the tensor's bytes ([rows, row bytes] uint8). Returns {"qweight", "scales"[, "mins"]}
    in `engine.model.quant`'s checkpoint layout, or None for a type not re-expressible exactly."""
    if type_name not in _BLOCKS:
        return None
    size, per = _BLOCKS[type_name]
    if cols % per:
        return None
    b = raw.reshape(rows * cols // per, size)
    if type_name == "Q8_0":
        d, q = _f16(b[:, :2]), b[:, 2:].view(np.int8)
        return {"qweight": q.reshape(rows, cols), "scales": d.reshape(rows, -1)}
    if type_name == "Q5_0":
        d, qh, qs = _f16(b[:, :2]), b[:, 2:6], b[:, 6:]
        high = (np.ascontiguousarray(qh).view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        q = _nibbles(qs).astype(np.int16) | (high.astype(np.int16) << 4)
        return {"qweight": (q - 16).astype(np.int8).reshape(rows, cols), "scales": d.reshape(rows, -1)}
    if type_name == "Q6_K":
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _f16(b[:, 208:210])
        # Two halves of 128 weights; in each, 64 low-nibble bytes and 32 high-bit bytes give four
        # runs of 32: run j takes nibble (j // 2) of ql[j % 2] and bits 2j..2j+1 of qh.
        out = np.empty((b.shape[0], 2, 4, 32), dtype=np.int8)
        for half in range(2):
            lo = ql[:, 64 * half : 64 * half + 64].reshape(-1, 2, 32)
            hi = qh[:, 32 * half : 32 * half + 32]
            for j in range(4):
                nib = (lo[:, j % 2] >> (4 * (j // 2))) & 0x0F
                out[:, half, j] = (nib | (((hi >> (2 * j)) & 0x03) << 4)).astype(np.int8) - 32
        scales = d * sc.astype(np.float32)  # [blocks, 16]: one per 16 weights
        return {"qweight": out.reshape(rows, cols), "scales": scales.reshape(rows, -1)}
    if type_name in ("Q4_0", "Q4_1"):
        d = _f16(b[:, :2])
        m = _f16(b[:, 2:4]) if type_name == "Q4_1" else -8.0 * d
        qs = b[:, 4:] if type_name == "Q4_1" else b[:, 2:]
        # The block's bytes already are the int4 layout (byte j = w[j] | w[j + 16] << 4).
        return {"qweight": np.ascontiguousarray(qs).reshape(rows, cols // 2), "scales": d.reshape(rows, -1),
                "mins": m.reshape(rows, -1)}
    # Q4_K
    d, dmin, sm, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:16], b[:, 16:]
    sc = np.concatenate([sm[:, 0:4] & 0x3F, (sm[:, 8:12] & 0x0F) | ((sm[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([sm[:, 4:8] & 0x3F, (sm[:, 8:12] >> 4) | ((sm[:, 4:8] >> 6) << 4)], axis=1)
    # Four chunks of 32 bytes: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1.
    chunks = qs.reshape(-1, 4, 32)
    codes = np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(rows, cols)
    return {"qweight": pack_int4(torch.from_numpy(codes)).numpy(),
            "scales": (d * sc.astype(np.float32)).reshape(rows, -1),
            "mins": -(dmin * mn.astype(np.float32)).reshape(rows, -1)}
