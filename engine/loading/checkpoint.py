"""Reading tensors out of a directory of safetensors files, one tensor at a time.

The `safetensors` library maps each file into memory; every page it touches stays in the
process's RSS until the file is closed, so loading through it peaks at about twice the model
(the filled parameters plus the mapped file). The format is a little-endian u64 header
length, a JSON header (name -> dtype, shape, byte range) and the raw bytes, so here each
tensor is read with one `readinto` into a fresh buffer that is copied into its parameter and
dropped: peak RSS is the model plus its largest tensor. Names not read by the end are
reported, so a checkpoint holding weights the config does not account for is caught.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.errors import ModelLoadError
from engine.loading import compressed
from engine.loading.staging import Staging

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class TensorInfo:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ModelLoadError(f"{path}: corrupt safetensors file (shorter than its header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise ModelLoadError(f"{path}: corrupt safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: corrupt safetensors file (header is not JSON: {e})") from e
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e}") from e
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors file (header is not an object)")
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: corrupt safetensors entry for {name!r}: {meta!r}") from e
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if end - begin != nbytes or 8 + n + end > size or begin < 0:
            raise ModelLoadError(f"{path}: tensor {name!r} has a byte range that does not match its shape "
                                 f"{shape} ({meta['dtype']}) or lies past the end of the file (truncated?)")
        out[name] = TensorInfo(path, dtype, shape, 8 + n + begin, nbytes)
    return out


# Compressed checkpoints: tensors decoded ahead of the loader's requests, at most this many bytes at a time.
LOOKAHEAD_BYTES = 256 * 2**20
AHEAD_THREADS = 2


class Checkpoint:
    """Every tensor of a model directory, by name, read on demand.

    A compressed directory's tensors are decoded a little ahead: each read also starts decoding the next
    unread tensors of one chunk pair in the manifest's order (up to `LOOKAHEAD_BYTES`, on `AHEAD_THREADS`
    threads beside the loader's; larger tensors are decoded across the pool when asked for), so a model of
    small tensors keeps the cores decoding and the reads of one
    overlap the decoding of another. A tensor asked for before its turn came is decoded by the caller;
    one decoded ahead is handed over (`get`) or copied out; its errors surface then."""

    def __init__(self, model_dir: Path, staging: Staging | None = None, direct: bool = False):
        """`direct`: a compressed directory's data files are read with O_DIRECT (past the page cache)."""
        self.model_dir = model_dir
        self.direct = direct
        # A compressed directory (`splitfire compress`): tensors decoded bit-exact at read (compressed.py).
        self.compressed: dict[str, Any] = {}
        if (model_dir / compressed.MANIFEST).is_file():
            self.compressed = compressed.read_manifest(model_dir)
            self.tensors = {n: TensorInfo(model_dir / e.file, DTYPES[e.dtype], tuple(e.shape), e.plane[0],
                                          e.numel * DTYPES[e.dtype].itemsize) for n, e in self.compressed.items()}
        else:
            self.tensors = self._index(model_dir)
        self.unread = set(self.tensors)
        self.staging = staging  # device loads: through pinned buffers, copies overlapped with reads
        self._names = list(self.compressed)  # the manifest's order
        self._order = {n: i for i, n in enumerate(self._names)}
        self._next = 0  # the first name the lookahead has not considered yet
        self._ahead: dict[str, Future[torch.Tensor]] = {}  # compressed tensors being (or) decoded ahead
        self._ahead_pool: ThreadPoolExecutor | None = None

    @staticmethod
    def _index(model_dir: Path) -> dict[str, TensorInfo]:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{index}: corrupt shard index: {e}") from e
            files = sorted({model_dir / shard for shard in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise ModelLoadError(f"{model_dir}: shard {f.name} listed in {index.name} is missing")
        else:
            weight_map = None
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(f"{model_dir}: no *.safetensors weights")
        out: dict[str, TensorInfo] = {}
        for f in files:
            out.update(read_header(f))
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(out))
            if missing:
                raise ModelLoadError(f"{index}: lists tensors no shard holds: {missing[:5]}")
        return out

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.model_dir}: missing tensor {name!r}")
        return t

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored: on the staging device when the checkpoint has staging buffers (so a
        quantized or FP8 weight is unpacked there), else in CPU memory."""
        t = self.info(name)
        if self.staging is not None:
            out = torch.empty(t.shape, dtype=t.dtype, device=self.staging.device)
            self._stage(name, out)
            return out
        if name in self.compressed:
            return self._read_compressed(name, None)
        out = torch.empty(t.shape, dtype=t.dtype)
        self._read(name, out)
        return out

    def read_into(self, name: str, dst: torch.Tensor) -> None:
        """Fill `dst` (same shape) with the tensor: through the staging buffers when the checkpoint has
        them (a device load; converted there), else straight from the file when dtype and device
        match and `dst` is contiguous, else through one temporary."""
        t = self.info(name)
        if self.staging is not None and dst.is_contiguous():
            self._stage(name, dst)
        elif dst.dtype == t.dtype and dst.device.type == "cpu" and dst.is_contiguous():
            self._read(name, dst)
        else:
            dst.copy_(self.get(name))

    def read_part(self, name: str, rows: range | None, cols: range | None) -> torch.Tensor:
        """Rows and columns of a 1-D or 2-D tensor as stored (a tensor-parallel rank's slice): only those
        bytes are read (a row slice is one contiguous range; a column slice one range per row)."""
        t = self.info(name)
        if len(t.shape) not in (1, 2) or (cols is not None and len(t.shape) != 2):
            raise ModelLoadError(f"{t.path}: tensor {name!r} of shape {t.shape} cannot be sliced this way")
        if name in self.compressed:
            e = self.compressed[name]
            if rows is not None and name not in self._ahead and compressed.decodes_ranges(e):
                # A row slice is one range of weights: only the chunks holding it are decoded.
                width = t.shape[1] if len(t.shape) == 2 else 1
                if rows.stop > t.shape[0]:
                    raise ModelLoadError(f"{t.path}: tensor {name!r} of shape {t.shape} has no rows {rows}")
                mine = torch.empty((len(rows), *t.shape[1:]), dtype=t.dtype)
                compressed.decode_range_into(self.model_dir, e, rows.start * width, rows.stop * width, mine,
                                             self.direct)
                self.unread.discard(name)
                return mine[:, cols.start : cols.stop].contiguous() if cols is not None else mine
            whole = torch.empty(t.shape, dtype=t.dtype)  # decoded whole (or handed over), then sliced
            self._read(name, whole)
            part = whole[rows.start : rows.stop] if rows is not None else whole
            if cols is not None:
                part = part[:, cols.start : cols.stop]
            return part.contiguous()
        n_rows, n_cols = t.shape[0], (t.shape[1] if len(t.shape) == 2 else 1)
        r, c = rows or range(n_rows), cols or range(n_cols)
        if r.stop > n_rows or c.stop > n_cols:
            raise ModelLoadError(f"{t.path}: tensor {name!r} of shape {t.shape} has no rows {r} / columns {c}")
        esz = t.dtype.itemsize
        try:
            mm = np.memmap(t.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(n_rows, n_cols * esz))
            part = np.array(mm[r.start : r.stop, c.start * esz : c.stop * esz])  # (a writable copy)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{t.path}: cannot read tensor {name!r}: {e}") from e
        self.unread.discard(name)
        out = torch.from_numpy(part).view(t.dtype)
        return out.reshape(len(r), len(c)) if len(t.shape) == 2 else out.reshape(len(r))

    def _read_compressed(self, name: str, out: torch.Tensor | None) -> torch.Tensor:
        """A compressed tensor into `out` (None: a tensor of its own): handed over when it was decoded
        ahead, else decoded here (a lookahead not started yet is cancelled: the ahead threads stay on the
        tensors after it); the next ones are started either way."""
        ahead = self._ahead.pop(name, None)
        self._decode_ahead(name)
        if ahead is not None and not ahead.cancel():
            got = ahead.result()  # (its checksum was checked when it was decoded)
            if out is None:
                out = got
            else:
                out.copy_(got)
        else:
            if out is None:
                t = self.tensors[name]
                out = torch.empty(t.shape, dtype=t.dtype)
            compressed.decode_into(self.model_dir, self.compressed[name], out, self.direct)
        self.unread.discard(name)
        return out

    def _decode_ahead(self, name: str) -> None:
        """Start decoding the unread tensors after `name` in the manifest, within `LOOKAHEAD_BYTES` (with
        what is already being decoded ahead). Each name is considered once (`_next` only moves forward)."""
        budget = LOOKAHEAD_BYTES - sum(self.tensors[n].nbytes for n in self._ahead)
        i = max(self._next, self._order[name] + 1)
        while i < len(self._names):
            nxt = self._names[i]
            if nxt not in self._ahead and nxt in self.unread and len(self.compressed[nxt].chunks) <= 2:
                # (a tensor of several chunk pairs is decoded across the pool when asked for)
                size = self.tensors[nxt].nbytes
                if size > budget:
                    break
                if self._ahead_pool is None:
                    self._ahead_pool = ThreadPoolExecutor(AHEAD_THREADS, thread_name_prefix="sf-decode-ahead")
                self._ahead[nxt] = self._ahead_pool.submit(self._decoded, nxt)
                budget -= size
            i += 1
        self._next = i

    def _decoded(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        out = torch.empty(t.shape, dtype=t.dtype)
        compressed.decode_into(self.model_dir, self.compressed[name], out, self.direct)
        return out

    def close(self) -> None:
        """Stop decoding ahead (what was decoded and never asked for is dropped)."""
        for f in self._ahead.values():
            f.cancel()
        self._ahead.clear()
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown(wait=True)
            self._ahead_pool = None

    def _stage(self, name: str, dst: torch.Tensor) -> None:
        assert self.staging is not None
        t = self.info(name)
        if name in self.compressed:  # decoded on the host, then copied (and converted) on the device
            host = torch.empty(t.shape, dtype=t.dtype)
            self._read(name, host)
            dst.copy_(host)
            return
        self.staging.upload(str(t.path), t.offset, t.nbytes, t.dtype, dst)
        self.unread.discard(name)

    def _read(self, name: str, out: torch.Tensor) -> None:
        t = self.info(name)
        if name in self.compressed:
            self._read_compressed(name, out)
            return
        buf = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if t.nbytes else memoryview(bytearray())
        try:
            with open(t.path, "rb") as f:
                f.seek(t.offset)
                got = f.readinto(buf)
        except OSError as e:
            raise ModelLoadError(f"{t.path}: cannot read tensor {name!r}: {e}") from e
        if got != t.nbytes:
            raise ModelLoadError(f"{t.path}: tensor {name!r} is truncated ({got} of {t.nbytes} bytes)")
        self.unread.discard(name)

    def skip(self, name: str) -> None:
        """Mark a tensor as deliberately not used (e.g. an lm_head that is tied to the embedding)."""
        self.unread.discard(name)
        ahead = self._ahead.pop(name, None)
        if ahead is not None:
            ahead.cancel()


def model_fingerprint(model_dir: Path) -> str:
    """An identity for the weights, for keys of KV shared across processes: config.json and, per
    safetensors file, its size and its first and last MiB (two fine-tunes of one architecture
    differ there; reading the whole model would cost a full pass over it)."""
    import hashlib

    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    if (model_dir / compressed.MANIFEST).is_file():  # the original tensors' checksums name the weights
        for part in compressed.fingerprint_parts(model_dir):
            h.update(part.encode())
        return h.hexdigest()[:16]
    for f in sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(size - (1 << 20), 0))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]
