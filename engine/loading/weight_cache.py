"""A model's loaded tensors, saved once and memory-mapped on later starts (CPU).

Loading a checkpoint reads every tensor into fresh memory and then reshapes it for the engine:
q/k/v and gate/up concatenated, q/k rows reordered for interleaved RoPE, GGUF blocks re-expressed,
float weights quantized with `--quantization`. For SmolLM2's 112 MB that took 0.14 s against
0.009 s to read the files from the page cache (measured, `loadtest/bench_coldstart.py`). After the
first load the final tensors are written to one safetensors file under
`$SPLITFIRE_HOME/weight-cache/`; later starts map that file copy-on-write and make every
parameter and quantized weight a view of the mapping: nothing is copied, pages come from the
page cache as the first forward touches them, and processes on one machine share them.

The key covers everything the tensors depend on: the checkpoint files (names, sizes, mtimes),
config.json, the dtype and `--quantization`, and the source of the code that builds them, so an
upgrade or a changed file loads from the checkpoint again. A cache that fails to map or to
match the model is logged, removed and rebuilt. It costs a second copy of the weights on disk:
`SPLITFIRE_WEIGHT_CACHE=0` turns it off; checkpoints under `SPLITFIRE_WEIGHT_CACHE_MIN_MB` (32) skip
it. GPU loads do not use it (the tensors are copied to the device either way).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from common.errors import ModelLoadError
from engine.loading import model_store
from engine.loading.checkpoint import read_header
from engine.model import quant
from engine.model.layers import Linear
from engine.model.moe import Experts
from engine.model.parallel import ONE, WHOLE, Shard, Stage

log = logging.getLogger("splitfire.engine")

FORMAT = 2
# Whatever decides the loaded tensors' values and layout.
_SOURCES = ("loading/weights.py", "model/quant.py", "loading/gguf_quants.py", "model/decoder.py", "model/layers.py",
            "model/moe.py", "model/mla.py", "model/model_config.py", "loading/checkpoint.py", "loading/weight_cache.py")


def enabled(model_dir: Path) -> bool:
    """On unless SPLITFIRE_WEIGHT_CACHE=0, for checkpoints of at least SPLITFIRE_WEIGHT_CACHE_MIN_MB
    (default 32: smaller ones load in milliseconds either way, and would only litter the cache)."""
    if os.environ.get("SPLITFIRE_WEIGHT_CACHE", "1") == "0":
        return False
    floor = float(os.environ.get("SPLITFIRE_WEIGHT_CACHE_MIN_MB", "32")) * 2**20
    return sum(f.stat().st_size for f in weight_files(model_dir)) >= floor


def weight_files(model_dir: Path) -> list[Path]:
    """The files holding a model's weights: safetensors, or a compressed directory's data files."""
    return sorted([*model_dir.glob("*.safetensors"), *model_dir.glob("*.sfz")])


def cache_path(model_dir: Path, dtype: torch.dtype, quantization: str | None, shard: Shard = ONE,
               stage: Stage = WHOLE) -> Path:
    """One file per model, dtype, quantization, code version, tensor-parallel rank (its shard) and
    pipeline stage (its layers)."""
    h = hashlib.sha256(f"format {FORMAT} {dtype} {quantization} {torch.__version__}".encode())
    if shard.parallel:
        h.update(f"tensor parallel {shard.rank}/{shard.size}".encode())
    if stage.count > 1:
        h.update(f"pipeline stage {stage.index}/{stage.count} layers {stage.layers}".encode())
    here = Path(__file__).parent.parent  # engine/
    for name in _SOURCES:
        h.update((here / name).read_bytes())
    h.update((model_dir / "config.json").read_bytes())
    for f in weight_files(model_dir):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    dt = str(dtype).removeprefix("torch.")
    tp = f"-tp{shard.rank}of{shard.size}" if shard.parallel else ""
    tp += f"-pp{stage.index}of{stage.count}" if stage.count > 1 else ""
    return cache_dir() / f"{model_dir.name}-{dt}-{quantization or 'asis'}{tp}-{h.hexdigest()[:16]}.safetensors"


def cache_dir() -> Path:
    return model_store.home() / "weight-cache"


def _stale(path: Path) -> list[Path]:
    """Earlier caches of the same model, dtype and quantization (older checkpoint or code)."""
    prefix = path.name[: path.name.rindex("-") + 1]
    dashes = path.name.count("-")  # (a one-rank cache and a tensor-parallel rank's share a prefix)
    return [p for p in path.parent.glob(prefix + "*.safetensors") if p != path and p.name.count("-") == dashes]


def _state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor the loaded model holds, by name, and how to put them back: parameters (tied ones
    once, with their aliases), and each quantized weight's parts."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases[name] = seen[id(p)]
            continue
        seen[id(p)] = name
        tensors[name] = p.detach()
    layout: dict = {"aliases": aliases, "quantized": {}}

    def put(prefix: str, parts: list[quant.QuantizedWeight]) -> list:
        out = []
        for i, w in enumerate(parts):
            key = f"{prefix}.{i}"
            tensors[key + ".q"], tensors[key + ".scales"] = w.q, w.scales
            if w.mins is not None:
                tensors[key + ".mins"] = w.mins
            out.append([key, w.kind, w.group_size])
        return out

    embed_q = getattr(model, "embed_quantized", None)
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.quantized is not None:
            if embed_q is not None and any(p.q.data_ptr() == embed_q.q.data_ptr() for p in m.quantized):
                continue  # the tied LM head: restored with the embedding

            layout["quantized"][name] = {"kind": "linear", "parts": put(f"quantized:{name}", m.quantized)}
        elif isinstance(m, Experts) and m.quantized is not None:
            gu, dn = m.quantized
            layout["quantized"][name] = {"kind": "experts", "gate_up": put(f"quantized:{name}.gate_up", gu),
                                         "down": put(f"quantized:{name}.down", dn)}
    if embed_q is not None:
        layout["embed_quantized"] = put("quantized:embed", [embed_q])[0]
    return tensors, layout


def nbytes(model: nn.Module) -> int:
    """Bytes of every tensor the loaded model holds (tied and shared ones once)."""
    seen: dict[int, int] = {}
    for t in _state(model)[0].values():
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def save(model: nn.Module, path: Path) -> None:
    """Write the loaded model's tensors (atomically: a concurrent start maps a complete file or none)."""
    from safetensors.torch import save_file

    tensors, layout = _state(model)
    storages: set[int] = set()
    for k, v in tensors.items():  # safetensors refuses tensors sharing memory (e.g. experts split from one block)
        ptr = v.untyped_storage().data_ptr()
        if ptr in storages and v.numel():
            tensors[k] = v.clone()
        storages.add(ptr)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"layout": json.dumps(layout)})
        os.replace(tmp, path)
        for old in _stale(path):  # (a process still mapping one keeps its pages until it exits)
            old.unlink(missing_ok=True)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def restore(model: nn.Module, path: Path) -> mmap.mmap:
    """Make `model` (freshly allocated, unloaded) hold the cached tensors as views of a copy-on-write
    mapping of `path`, which is returned: it must live as long as the model."""
    infos = read_header(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        header = json.loads(f.read(int.from_bytes(raw, "little")))
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    layout = json.loads(header.get("__metadata__", {}).get("layout", "null") or "null")
    if not isinstance(layout, dict):
        raise ModelLoadError(f"{path}: no layout metadata")

    def tensor(name: str) -> torch.Tensor:
        t = infos.get(name)
        if t is None:
            raise ModelLoadError(f"{path}: missing {name!r}")
        size = t.dtype.itemsize
        numel = t.nbytes // size
        if numel == 0:
            return torch.empty(t.shape, dtype=t.dtype)
        if t.offset % size:  # (safetensors orders tensors by alignment; never seen, but never assume)
            return torch.frombuffer(mapping, dtype=torch.uint8, count=t.nbytes, offset=t.offset).clone().view(
                t.dtype).view(t.shape)
        return torch.frombuffer(mapping, dtype=t.dtype, count=numel, offset=t.offset).view(t.shape)

    def parts(entries: list) -> list[quant.QuantizedWeight]:
        out = []
        for key, kind, group in entries:
            mins = tensor(key + ".mins") if key + ".mins" in infos else None
            out.append(quant.QuantizedWeight(kind, tensor(key + ".q"), tensor(key + ".scales"), mins, group))
        return out

    modules = dict(model.named_modules())
    if "embed_quantized" in layout:  # (first: tied, it is the LM head's weight too)
        model.set_embedding_quantized(parts([layout["embed_quantized"]])[0])  # type: ignore[operator]
    for name, entry in layout["quantized"].items():
        m = modules.get(name)
        if entry["kind"] == "linear" and isinstance(m, Linear):
            if m.quantized is None:
                m.set_quantized(parts(entry["parts"]))
        elif entry["kind"] == "experts" and isinstance(m, Experts):
            m.set_quantized(parts(entry["gate_up"]), parts(entry["down"]))
        else:
            raise ModelLoadError(f"{path}: quantized {name!r} does not fit the model")
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    stored = {n for n in infos if not n.startswith("quantized:")}
    if expected != stored | set(layout["aliases"]):
        missing, extra = sorted(expected - stored - set(layout["aliases"])), sorted(stored - expected)
        raise ModelLoadError(f"{path}: parameters do not match the model (missing {missing[:3]}, extra {extra[:3]})")
    for name in stored:
        owner, _, attr = name.rpartition(".")
        setattr(modules[owner], attr, nn.Parameter(tensor(name), requires_grad=False))
    for name, canonical in layout["aliases"].items():
        owner, _, attr = name.rpartition(".")
        c_owner, _, c_attr = canonical.rpartition(".")
        setattr(modules[owner], attr, getattr(modules[c_owner], c_attr))
    return mapping


class PageRelease:
    """Gives back to the kernel the mapping's pages under tensors the model no longer holds.

    CPU packing (`Linear.pack_for_cpu`) copies each float matmul weight into oneDNN's layout and lets go
    of the mapped original, but the pages it read stay mapped and counted in RSS for as long as the
    mapping lives: float32 SmolLM2 added 1,026 MiB of RSS mapped vs 627 MiB read from the checkpoint.
    `__call__` on each dropped original advises MADV_DONTNEED over the whole pages inside its bytes;
    the pages are clean copies of the file, so a later read would only fault them in again.
    """

    def __init__(self, mapping: mmap.mmap):
        self.mapping = mapping
        base = torch.frombuffer(mapping, dtype=torch.uint8)
        self.start, self.size = base.data_ptr(), base.numel()
        self.released = 0

    def __call__(self, t: torch.Tensor) -> None:
        lo = t.data_ptr() - self.start
        if not 0 <= lo < self.size:
            return  # not a view of the mapping
        page = mmap.PAGESIZE
        first, last = -(-lo // page) * page, (lo + t.numel() * t.element_size()) // page * page
        if last > first:
            self.mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
            self.released += last - first
