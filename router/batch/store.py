"""Files and batches on disk: the state of OpenAI's `/v1/files` and `/v1/batches`.

Everything lives under one directory (`--files-dir`), which router replicas share (in Kubernetes a
ReadWriteMany volume; one replica can use any volume): `files/<id>.data` holds a file's bytes and
`files/<id>.json` what the API says of it; `batches/<id>.json` a batch's object, `batches/<id>.cancel` a
cancel asked for, and `batches/<id>.output.jsonl` / `.errors.jsonl` its results while it runs (moved into
`files/` when it ends). Why a volume and not Redis: batch input files run to hundreds of megabytes, which a
volume holds at disk prices and streams, while Redis would hold them in memory; what replicas must agree on
at once — who runs a batch — is a Redis lease (`runner.py`). Every JSON write is a write to a temporary file
then a rename, so a reader (or a restarted router) never sees half of one.

Files and batches belong to the tenant that made them: another tenant's id is a 404.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from router.api.errors import APIError, bad_request, not_found

FILE_PURPOSES = ("batch",)  # what clients may upload (batch outputs are written here with purpose batch_output)
TERMINAL = ("completed", "failed", "expired", "cancelled")


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _too_many(what: str, limit: int) -> APIError:
    return APIError(429, f"this tenant already has {limit} {what} (the router's limit); delete some first",
                    type_="rate_limit_error", code="limit_reached", headers={"Retry-After": "60"})


@dataclass
class FileMeta:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    tenant: str

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


class Files:
    def __init__(self, root: Path, max_bytes: int, max_per_tenant: int):
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_per_tenant = max_per_tenant

    def data(self, meta: FileMeta) -> Path:
        return self.dir / f"{meta.id}.data"

    def all(self, tenant: str) -> list[FileMeta]:
        out = []
        for p in self.dir.glob("*.json"):
            try:
                meta = FileMeta(**json.loads(p.read_text()))
            except (OSError, ValueError, TypeError):
                continue  # (deleted while listing, or not ours)
            if meta.tenant == tenant:
                out.append(meta)
        return sorted(out, key=lambda m: (m.created_at, m.id))

    def get(self, tenant: str, file_id: str) -> FileMeta:
        path = self.dir / f"{file_id}.json"
        if "/" in file_id or not path.is_file():
            raise not_found(f"No such File object: {file_id}")
        meta = FileMeta(**json.loads(path.read_text()))
        if meta.tenant != tenant:
            raise not_found(f"No such File object: {file_id}")
        return meta

    def _room(self, tenant: str) -> None:
        if len(self.all(tenant)) >= self.max_per_tenant:
            raise _too_many("files", self.max_per_tenant)

    async def stage(self, chunks: AsyncIterator[bytes]) -> tuple[Path, int]:
        """Stream an upload to a temporary file: (its path, bytes); nothing is kept past `max_bytes` (413)."""
        tmp = self.dir / f".upload-{secrets.token_hex(8)}"
        size = 0
        try:
            with open(tmp, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise APIError(413, f"file exceeds {self.max_bytes} bytes (--max-file-bytes)",
                                       code="file_too_large", param="file")
                    f.write(chunk)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, size

    def commit(self, tenant: str, staged: Path, size: int, filename: str, purpose: str) -> FileMeta:
        """A staged upload becomes `tenant`'s file (or is deleted, when its purpose or the tenant's room says no)."""
        try:
            if purpose not in FILE_PURPOSES:
                raise bad_request(f"purpose {purpose!r} is not served; files here are for batches (purpose 'batch')",
                                  param="purpose")
            self._room(tenant)
            meta = FileMeta(f"file-{secrets.token_hex(12)}", size, int(time.time()), filename or "upload.jsonl",
                            purpose, tenant)
            os.replace(staged, self.data(meta))
        finally:
            staged.unlink(missing_ok=True)
        _write_json(self.dir / f"{meta.id}.json", asdict(meta))
        return meta

    def adopt(self, tenant: str, filename: str, path: Path) -> FileMeta:
        """Make a finished batch's output (written elsewhere under the root) a file of `tenant`'s."""
        meta = FileMeta(f"file-{secrets.token_hex(12)}", path.stat().st_size, int(time.time()), filename,
                        "batch_output", tenant)
        os.replace(path, self.data(meta))
        _write_json(self.dir / f"{meta.id}.json", asdict(meta))
        return meta

    def delete(self, tenant: str, file_id: str) -> None:
        meta = self.get(tenant, file_id)
        (self.dir / f"{meta.id}.json").unlink(missing_ok=True)
        self.data(meta).unlink(missing_ok=True)


@dataclass
class Batch:
    """A batch's object as the API shows it, and what the runner needs (its tenant and key's id)."""

    id: str
    endpoint: str
    input_file_id: str
    tenant: str
    key_id: str
    completion_window: str = "24h"
    status: str = "validating"
    created_at: int = field(default_factory=lambda: int(time.time()))
    metadata: dict[str, str] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: dict[str, Any] | None = None
    request_counts: dict[str, int] = field(default_factory=lambda: {"total": 0, "completed": 0, "failed": 0})
    times: dict[str, int] = field(default_factory=dict)  # in_progress_at, finalizing_at, completed_at, ...

    @property
    def expires_at(self) -> int:
        return self.created_at + 24 * 3600

    def public(self, cancelling: bool = False) -> dict[str, Any]:
        status = "cancelling" if cancelling and self.status not in TERMINAL else self.status
        out: dict[str, Any] = {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": self.errors,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window, "status": status,
            "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "expires_at": self.expires_at, "request_counts": self.request_counts,
            "metadata": self.metadata}
        for name in ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
                     "cancelled_at"):
            out[name] = self.times.get(name)
        return out


class Batches:
    def __init__(self, root: Path, max_per_tenant: int):
        self.dir = root / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_per_tenant = max_per_tenant

    def _path(self, batch_id: str) -> Path:
        if "/" in batch_id:
            raise not_found(f"No such Batch object: {batch_id}")
        return self.dir / f"{batch_id}.json"

    def results(self, batch_id: str, kind: str) -> Path:
        """Where a running batch appends its output (`output`) or error (`errors`) lines."""
        return self.dir / f"{batch_id}.{kind}.jsonl"

    def load(self, batch_id: str) -> Batch:
        path = self._path(batch_id)
        if not path.is_file():
            raise not_found(f"No such Batch object: {batch_id}")
        return Batch(**json.loads(path.read_text()))

    def get(self, tenant: str, batch_id: str) -> Batch:
        b = self.load(batch_id)
        if b.tenant != tenant:
            raise not_found(f"No such Batch object: {batch_id}")
        return b

    def save(self, b: Batch) -> None:
        _write_json(self._path(b.id), asdict(b))

    def all(self, skip: Collection[str] = ()) -> list[Batch]:
        """Every batch (oldest first), but those named in `skip`, whose files are not read."""
        out = []
        for p in self.dir.glob("*.json"):
            if p.stem in skip:
                continue
            try:
                out.append(Batch(**json.loads(p.read_text())))
            except (OSError, ValueError, TypeError):
                continue
        return sorted(out, key=lambda b: (b.created_at, b.id))

    def of(self, tenant: str) -> list[Batch]:
        return [b for b in self.all() if b.tenant == tenant]

    def create(self, tenant: str, key_id: str, endpoint: str, input_file_id: str, metadata: dict[str, str] | None
               ) -> Batch:
        if sum(b.status not in TERMINAL for b in self.of(tenant)) >= self.max_per_tenant:
            raise _too_many("unfinished batches", self.max_per_tenant)
        b = Batch(f"batch_{secrets.token_hex(12)}", endpoint, input_file_id, tenant, key_id, metadata=metadata)
        self.save(b)
        return b

    def cancel(self, b: Batch) -> None:
        """Ask for a cancel (whichever replica runs the batch sees the marker and stops)."""
        marker = self.dir / f"{b.id}.cancel"
        if not marker.exists():
            marker.write_text(str(int(time.time())))

    def cancel_asked(self, batch_id: str) -> int | None:
        marker = self.dir / f"{batch_id}.cancel"
        try:
            return int(marker.read_text() or 0)
        except (OSError, ValueError):
            return None
