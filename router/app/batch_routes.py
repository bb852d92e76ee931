"""OpenAI's `/v1/files` and `/v1/batches` routes over `router/batch/` (the store on the shared directory and
the runner that sends the lines). Every object belongs to the caller's tenant; another's id is a 404."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from aiohttp import BodyPartReader, web

from router.api.errors import APIError, bad_request
from router.app.body import read_json
from router.app.serving import BATCH_ENDPOINTS
from router.batch.store import TERMINAL, Batches, Files
from router.tenancy.tenants import Tenants

_BATCH_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}


def _page(items: list[dict[str, Any]], request: web.Request) -> dict[str, Any]:
    """OpenAI's list shape, with `limit` (1-10000, default 10000 for files, 20 for batches) and `after`."""
    q = request.query
    try:
        limit = int(q.get("limit", "20" if request.path.startswith("/v1/batches") else "10000"))
    except ValueError:
        raise bad_request("'limit' must be an integer", param="limit") from None
    if not 1 <= limit <= 10000:
        raise bad_request("'limit' must be between 1 and 10000", param="limit")
    after = q.get("after")
    if after:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise bad_request(f"'after' names no object here: {after}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


class BatchRoutes:
    def __init__(self, tenants: Tenants, files: Files, batches: Batches):
        self.tenants = tenants
        self.files = files
        self.batches = batches

    def routes(self) -> list[tuple[str, str, Any]]:
        return [("POST", "/v1/files", self.upload), ("GET", "/v1/files", self.list_files),
                ("GET", "/v1/files/{file_id}", self.retrieve_file), ("DELETE", "/v1/files/{file_id}", self.delete_file),
                ("GET", "/v1/files/{file_id}/content", self.file_content),
                ("POST", "/v1/batches", self.create_batch), ("GET", "/v1/batches", self.list_batches),
                ("GET", "/v1/batches/{batch_id}", self.retrieve_batch),
                ("POST", "/v1/batches/{batch_id}/cancel", self.cancel_batch)]

    # -- files --------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        """multipart/form-data with `purpose` and `file` (either order); the file streams to disk."""
        caller = self.tenants.caller(request)
        if not request.content_type.startswith("multipart/"):
            raise bad_request("upload a file as multipart/form-data with fields 'file' and 'purpose'", param="file")
        reader = await request.multipart()
        purpose, staged, filename, size = None, None, "", 0
        try:
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    raise bad_request("nested multipart bodies are not supported", param="file")
                name = part.name
                if name == "purpose":
                    purpose = (await part.text()).strip()
                elif name == "file":
                    filename = part.filename or "upload.jsonl"

                    async def chunks(p: BodyPartReader = part) -> AsyncIterator[bytes]:
                        while chunk := await p.read_chunk(2**16):
                            yield chunk

                    staged, size = await self.files.stage(chunks())
                else:
                    raise bad_request(f"unknown form field {name!r} (file, purpose)", param=name)
            if staged is None:
                raise bad_request("'file' is required", param="file")
            if purpose is None:
                raise bad_request("'purpose' is required", param="purpose")
            meta = self.files.commit(caller.tenant, staged, size, filename, purpose)
            staged = None
        finally:
            if staged is not None:
                staged.unlink(missing_ok=True)
        return web.json_response(meta.public())

    async def list_files(self, request: web.Request) -> web.Response:
        caller = self.tenants.caller(request)
        purpose = request.query.get("purpose")
        items = [m.public() for m in self.files.all(caller.tenant) if purpose is None or m.purpose == purpose]
        if request.query.get("order", "desc") == "desc":
            items.reverse()
        return web.json_response(_page(items, request))

    async def retrieve_file(self, request: web.Request) -> web.Response:
        caller = self.tenants.caller(request)
        return web.json_response(self.files.get(caller.tenant, request.match_info["file_id"]).public())

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        caller = self.tenants.caller(request)
        meta = self.files.get(caller.tenant, request.match_info["file_id"])
        return web.FileResponse(self.files.data(meta), headers={"Content-Type": "application/jsonl"})

    async def delete_file(self, request: web.Request) -> web.Response:
        caller = self.tenants.caller(request)
        file_id = request.match_info["file_id"]
        in_use = [b.id for b in self.batches.of(caller.tenant) if b.input_file_id == file_id and b.status not in TERMINAL]
        if in_use:
            raise bad_request(f"file {file_id} is the input of unfinished batch {in_use[0]}; cancel it first",
                              param="file_id")
        self.files.delete(caller.tenant, file_id)
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    # -- batches ------------------------------------------------------------------------

    async def create_batch(self, request: web.Request) -> web.Response:
        caller = self.tenants.caller(request)
        body = await read_json(request)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        for name in body:
            if name not in _BATCH_FIELDS:
                raise bad_request(f"Unrecognized request argument supplied: {name}", param=name)
        endpoint = body.get("endpoint")
        if endpoint not in BATCH_ENDPOINTS:
            raise bad_request(f"'endpoint' must be one of {sorted(BATCH_ENDPOINTS)}", param="endpoint")
        if body.get("completion_window") != "24h":
            raise bad_request("'completion_window' must be '24h'", param="completion_window")
        if body.get("output_expires_after") is not None:
            raise bad_request("'output_expires_after' is not supported: outputs are kept until deleted",
                              param="output_expires_after")
        meta = body.get("metadata")
        if meta is not None and not (isinstance(meta, dict) and len(meta) <= 16
                                     and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
            raise bad_request("'metadata' must be at most 16 string keys with string values", param="metadata")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise bad_request("'input_file_id' is required", param="input_file_id")
        try:
            source = self.files.get(caller.tenant, file_id)
        except APIError:
            raise bad_request(f"input file {file_id} does not exist", param="input_file_id") from None
        if source.purpose != "batch":
            raise bad_request(f"input file {file_id} has purpose {source.purpose!r}, not 'batch'",
                              param="input_file_id")
        b = self.batches.create(caller.tenant, caller.key_id, endpoint, file_id, meta)
        return web.json_response(b.public())

    async def list_batches(self, request: web.Request) -> web.Response:
        caller = self.tenants.caller(request)
        items = [b.public(self.batches.cancel_asked(b.id) is not None) for b in reversed(self.batches.of(caller.tenant))]
        return web.json_response(_page(items, request))

    async def retrieve_batch(self, request: web.Request) -> web.Response:
        caller = self.tenants.caller(request)
        b = self.batches.get(caller.tenant, request.match_info["batch_id"])
        return web.json_response(b.public(self.batches.cancel_asked(b.id) is not None))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        caller = self.tenants.caller(request)
        b = self.batches.get(caller.tenant, request.match_info["batch_id"])
        if b.status in TERMINAL:
            raise APIError(409, f"batch {b.id} is already {b.status}", code="batch_finished")
        self.batches.cancel(b)
        out = b.public(True)
        out["cancelling_at"] = self.batches.cancel_asked(b.id)
        return web.json_response(out)
