"""`splitfire compress`: a model directory's safetensors weights into the compressed format
(`compressed.py` says what it is and reads it back)."""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.errors import ModelLoadError
from engine.loading.checkpoint import DTYPES, Checkpoint
from engine.loading.compressed import (
    CHUNK,
    CODEC_RAW,
    CODERS,
    FORMAT,
    MANIFEST,
    SMALL_CHUNK,
    _pool,
    encode_chunk,
    entropy_bits,
    split,
)

# -- writing ----------------------------------------------------------------------------------


@dataclass
class Stats:
    original_bytes: int = 0
    stored_bytes: int = 0
    by_kind: dict[str, list[float]] = field(default_factory=dict)  # kind -> [original, stored, entropy bits x n]

    def add(self, kind: str, original: int, stored: int, entropy_weighted: float = 0.0) -> None:
        self.original_bytes += original
        self.stored_bytes += stored
        k = self.by_kind.setdefault(kind, [0.0, 0.0, 0.0])
        k[0] += original
        k[1] += stored
        k[2] += entropy_weighted


def compress_dir(model_dir: Path, out_dir: Path, chunk: int = CHUNK, progress: bool = False,
                 coder: str = "huffman") -> Stats:
    """Write the compressed form of `model_dir` (its safetensors weights) to `out_dir`, the exponents coded
    by `coder` (a `compressed.CODERS` key)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if coder not in CODERS:
        raise ValueError(f"coder must be one of {sorted(CODERS)}, got {coder!r}")
    if (model_dir / MANIFEST).is_file():
        raise ModelLoadError(f"{model_dir} is already compressed")
    if out_dir.resolve() == model_dir.resolve():
        raise ModelLoadError(f"{out_dir}: write the compressed copy to another directory, not the model's own")
    ckpt = Checkpoint(model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():  # config, tokenizer, ...: as they are
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)
    names = sorted(ckpt.tensors, key=lambda n: (str(ckpt.tensors[n].path), ckpt.tensors[n].offset))
    dtype_name = {v: k for k, v in DTYPES.items()}
    entries: list[dict[str, Any]] = []
    stats = Stats()
    file_no, written = 0, 0
    out = open(out_dir / f"weights-{file_no:05d}.sfz", "wb")
    iterator: Any = names
    if progress:
        from tqdm import tqdm

        iterator = tqdm(names, desc="compressing", unit="tensor")
    try:
        for name in iterator:
            t = ckpt.get(name)
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
            crc = zlib.crc32(raw)
            if written > (2 << 30):  # ~2 GiB per data file
                out.close()
                file_no, written = file_no + 1, 0
                out = open(out_dir / f"weights-{file_no:05d}.sfz", "wb")
            fname = f"weights-{file_no:05d}.sfz"
            # (rANS's header — 32 lanes' states and counts — outweighs what it saves on a tensor this small)
            codec = CODERS[coder if t.numel() >= SMALL_CHUNK else "huffman"].get(t.dtype, CODEC_RAW)
            e: dict[str, Any] = {"name": name, "dtype": dtype_name[t.dtype], "shape": list(t.shape), "codec": codec,
                                 "file": fname, "crc32": crc}
            start = written
            if codec == CODEC_RAW or t.numel() == 0:
                e["codec"] = CODEC_RAW
                out.write(raw.tobytes())
                e["plane"] = [start, raw.nbytes]
                written += raw.nbytes
                stats.add(str(t.dtype).removeprefix("torch."), raw.nbytes, raw.nbytes)
                entries.append(e)
                continue
            plane, exp = split(t.reshape(-1).view(torch.int16).numpy().view(np.uint16), codec)
            out.write(plane.tobytes())
            e["plane"] = [start, plane.nbytes]
            written += plane.nbytes
            pieces = [exp[i : i + chunk] for i in range(0, exp.size, chunk)]
            if len(pieces) == 1:  # (a pool's hand-off costs more than a small tensor's encoding)
                coded = [encode_chunk(pieces[0], codec)]
            else:
                coded = list(_pool().map(encode_chunk, pieces, [codec] * len(pieces)))
            e["chunks"] = []
            first = 0  # (each chunk's CRC-32 is of its weights' original bytes: a range decodes and checks alone)
            for streams in coded:
                for data, n in streams:
                    e["chunks"].append([written, len(data), n, zlib.crc32(raw[2 * first : 2 * (first + n)])])
                    out.write(data)
                    written += len(data)
                    first += n
            stats.add(str(t.dtype).removeprefix("torch."), raw.nbytes, written - start, entropy_bits(exp) * exp.size)
            entries.append(e)
    finally:
        out.close()
    (out_dir / MANIFEST).write_text(json.dumps({"format": FORMAT, "chunk": chunk, "tensors": entries}))
    return stats


