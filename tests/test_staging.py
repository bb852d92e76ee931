"""Device loads through pinned staging buffers (engine/loading/staging.py), run on CPU with small buffers so
tensors span several chunks and the ring wraps many times: every family's loaded tensors equal a
direct load bit for bit (dtype conversions included), and no buffer is refilled before the event
behind its last copy has been waited on."""

from __future__ import annotations

import pytest
import torch
from hf_models import make_hf_model

from common.errors import ModelLoadError
from engine.loading import weight_cache, weights
from engine.loading.staging import Staging


class Recorder:
    """Events that log when each was recorded and waited on, in one shared order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def make(self) -> RecordedEvent:
        return RecordedEvent(self, sum(1 for kind, _ in self.log if kind == "record"))


class RecordedEvent:
    def __init__(self, rec: Recorder, n: int):
        self.rec, self.n = rec, n

    def record(self) -> None:
        self.rec.log.append(("record", self.n))

    def synchronize(self) -> None:
        self.rec.log.append(("wait", self.n))


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and every quantized weight's codes, scales and mins."""
    return weight_cache._state(model)[0]


def _load(path, dtype, staging=None):
    return weights.load_model(path, torch.device("cpu"), dtype, staging=staging)


@pytest.fixture(autouse=True)
def unpacked(monkeypatch):
    """Compare the tensors as loaded (CPU packing would turn them into opaque oneDNN layouts)."""
    monkeypatch.setattr(weights, "_finish", lambda model, device, dropped=None, compress_weights=False: model)
    monkeypatch.setenv("SPLITFIRE_WEIGHT_CACHE", "0")


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mixtral", "deepseek_v3", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_load_equals_direct_load(family, dtype, tmp_path):
    hf = make_hf_model(family, tmp_path / family)
    direct = _tensors(_load(hf.path, dtype))
    rec = Recorder()
    staging = Staging(torch.device("cpu"), buffer_bytes=4096, buffers=3, make_event=rec.make)
    staged = _tensors(_load(hf.path, dtype, staging))
    assert direct.keys() == staged.keys()
    for name, t in direct.items():
        assert t.dtype == staged[name].dtype and torch.equal(t, staged[name]), name
    # Most of the checkpoint went through the ring, many tensors over several chunks.
    ckpt_bytes = sum(f.stat().st_size for f in hf.path.glob("*.safetensors"))
    assert staging.bytes > 0.8 * ckpt_bytes and staging.chunks > staging.uploads + 10
    assert all(ev is None for ev in staging.pending)  # finish() waited on every copy


def _compare_staged(path, dtype=torch.float32) -> Staging:
    direct = _tensors(_load(path, dtype))
    staging = Staging(torch.device("cpu"), buffer_bytes=2048, buffers=2)
    staged = _tensors(_load(path, dtype, staging))
    assert direct.keys() == staged.keys()
    for name, t in direct.items():
        assert t.dtype == staged[name].dtype and torch.equal(t, staged[name]), name
    return staging


def test_quantized_checkpoint_is_staged_too(tmp_path, monkeypatch):
    """A converted GGUF (int4 codes, int8 embedding): its codes, scales and mins come through the ring
    (on a GPU they are unpacked there) and equal a direct load's."""
    pytest.importorskip("gguf")
    from gguf_writer import write_gguf

    from engine.loading.model_store import resolve_model

    monkeypatch.setenv("SPLITFIRE_HOME", str(tmp_path / "home"))
    hf = make_hf_model("qwen3", tmp_path / "hf")
    gguf = tmp_path / "q4.gguf"
    write_gguf(hf.path, gguf, quantize="Q4_0", embedding_quantize="Q8_0")
    staging = _compare_staged(resolve_model(str(gguf)))
    assert staging.uploads > 3 * 7 * 2  # every layer's codes and scales at least


def test_fp8_checkpoint_is_staged(tmp_path):
    from test_model_loading import _write_fp8

    hf = make_hf_model("llama3", tmp_path / "hf")
    _write_fp8(hf.path, tmp_path / "fp8", block=8)
    _compare_staged(tmp_path / "fp8")


def test_a_buffer_is_refilled_only_after_its_copy_was_waited_on(tmp_path):
    hf = make_hf_model("llama3", tmp_path / "m")
    rec = Recorder()
    buffers = 2
    staging = Staging(torch.device("cpu"), buffer_bytes=1024, buffers=buffers, make_event=rec.make)
    _load(hf.path, torch.float32, staging)
    records = [n for kind, n in rec.log if kind == "record"]
    assert records == list(range(staging.chunks)) and staging.chunks > 50
    # Chunk k reuses the buffer of chunk k - buffers: that chunk's event was waited on before chunk
    # k's copy was queued (its record), and each event is waited on exactly once.
    position = {entry: i for i, entry in enumerate(rec.log)}
    for k in range(buffers, staging.chunks):
        assert position[("wait", k - buffers)] < position[("record", k)], k
    waits = [n for kind, n in rec.log if kind == "wait"]
    assert sorted(waits) == records


def test_a_file_shorter_than_its_header_says_is_named(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(bytes(range(256)) * 10)  # 2560 bytes
    staging = Staging(torch.device("cpu"), buffer_bytes=1024)
    dst = torch.empty(640, dtype=torch.float32)
    staging.upload(str(f), 0, 2560, torch.float32, dst)
    assert torch.equal(dst.view(torch.uint8), torch.tensor(list(range(256)) * 10, dtype=torch.uint8))
    with pytest.raises(ModelLoadError, match="truncated at byte 2560"):
        staging.upload(str(f), 512, 2560, torch.float32, dst)
    with pytest.raises(ModelLoadError, match="do not fill"):
        staging.upload(str(f), 0, 2556, torch.float32, dst)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned buffers and asynchronous copies")
def test_cuda_load_uses_pinned_staging(tmp_path):
    hf = make_hf_model("llama3", tmp_path / "m")
    staging = Staging(torch.device("cuda"), buffer_bytes=4096)
    assert all(b.is_pinned() for b in staging.buffers)
    on_gpu = _tensors(weights.load_model(hf.path, torch.device("cuda"), torch.bfloat16, staging=staging))
    on_cpu = _tensors(_load(hf.path, torch.bfloat16))
    for name, t in on_cpu.items():
        assert torch.equal(t, on_gpu[name].cpu()), name
