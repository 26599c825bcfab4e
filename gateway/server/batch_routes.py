"""OpenAI's Files API (purpose ``batch``) and Batch API: /v1/files and /v1/batches, each key seeing only its own
(another key's file or batch is a 404, as a missing one). Thin: storage is gateway/batches/store.py, the runner
gateway/batches/service.py."""

from __future__ import annotations

import email.parser
import email.policy
from typing import Annotated, Literal

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.datastructures import State
from litestar.params import FromPath, FromQuery, QueryParameter

from gateway.auth import owner
from gateway.batches.service import BatchService
from gateway.domain_errors import Invalid
from gateway.errors import APIError, body_error
from wire.batches import Batch, BatchCreate, BatchList, FileDeleted, FileList, FileObject

MULTIPART_SLACK = 64 * 1024  # a multipart body's own bytes beside the file's
PURPOSES = ("batch",)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The file is larger than this server's limit of {limit} bytes.", code="file_too_large")


async def _read_capped(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + MULTIPART_SLACK:
        raise _too_large(limit)
    pieces, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit + MULTIPART_SLACK:
            raise _too_large(limit)
        pieces.append(chunk)
    return b"".join(pieces)


def _multipart(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """The form's fields: name -> (filename, bytes)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise APIError(415, "Upload a file as multipart/form-data (fields `file` and `purpose`).",
                       code="unsupported_media_type")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise Invalid("the multipart body could not be read", param="file")
    fields = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name:
            fields[str(name)] = (part.get_filename(), part.get_payload(decode=True) or b"")
    return fields


@post("/v1/files", status_code=200, request_max_body_size=None)  # capped by [files] max_file_bytes below
async def upload_file(request: Request, state: State) -> FileObject:
    limit = state.gateway.config.files.max_file_bytes
    fields = _multipart(request.headers.get("content-type", ""), await _read_capped(request, limit))
    purpose = fields.get("purpose", (None, b""))[1].decode(errors="replace").strip()
    if purpose not in PURPOSES:
        raise Invalid(f"purpose {purpose!r} is not served here: upload files with purpose 'batch'", param="purpose")
    if "file" not in fields:
        raise Invalid("the form has no `file` field", param="file")
    filename, data = fields["file"]
    if len(data) > limit:
        raise _too_large(limit)
    return await state.batches.storage.put_file(owner(request), filename or "upload.jsonl", purpose, data)


@get("/v1/files")
async def list_files(request: Request, state: State, purpose: FromQuery[str | None] = None,
                     limit: Annotated[int, QueryParameter(ge=1, le=10_000)] = 10_000,
                     order: FromQuery[Literal["asc", "desc"]] = "desc", after: FromQuery[str | None] = None) -> FileList:
    files = [f for f in await state.batches.storage.files(owner(request)) if purpose is None or f.purpose == purpose]
    if order == "asc":
        files.reverse()
    page, more = _page(files, after, limit)
    return FileList(data=page, has_more=more, first_id=page[0].id if page else None,
                    last_id=page[-1].id if page else None)


def _page(items: list, after: str | None, limit: int) -> tuple[list, bool]:
    if after is not None:
        ids = [item.id for item in items]
        if after not in ids:
            raise Invalid(f"after: no object {after!r} in this list", param="after")
        items = items[ids.index(after) + 1:]
    return items[:limit], len(items) > limit


@get("/v1/files/{file_id:str}")
async def retrieve_file(file_id: FromPath[str], request: Request, state: State) -> FileObject:
    return await state.batches.storage.file(owner(request), file_id)


@get("/v1/files/{file_id:str}/content")
async def file_content(file_id: FromPath[str], request: Request, state: State) -> Response:
    return Response(await state.batches.storage.content(owner(request), file_id), media_type="application/octet-stream")


@delete("/v1/files/{file_id:str}", status_code=200)
async def delete_file(file_id: FromPath[str], request: Request, state: State) -> FileDeleted:
    await state.batches.storage.delete_file(owner(request), file_id)
    return FileDeleted(id=file_id)


@post("/v1/batches", status_code=200)
async def create_batch(request: Request, state: State) -> Batch:
    raw = await request.body()
    try:
        data = msgspec.json.decode(raw, type=BatchCreate)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise body_error(exc, raw) from None
    service: BatchService = state.batches
    return await service.create(owner(request), data)


@get("/v1/batches/{batch_id:str}")
async def retrieve_batch(batch_id: FromPath[str], request: Request, state: State) -> Batch:
    return await state.batches.get(owner(request), batch_id)


@get("/v1/batches")
async def list_batches(request: Request, state: State, limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20,
                       after: FromQuery[str | None] = None) -> BatchList:
    page, more = _page(await state.batches.list(owner(request)), after, limit)
    return BatchList(data=page, has_more=more, first_id=page[0].id if page else None,
                     last_id=page[-1].id if page else None)


@post("/v1/batches/{batch_id:str}/cancel", status_code=200)
async def cancel_batch(batch_id: FromPath[str], request: Request, state: State) -> Batch:
    return await state.batches.cancel(owner(request), batch_id)


BATCH_ROUTES = [upload_file, list_files, retrieve_file, file_content, delete_file, create_batch, retrieve_batch,
                list_batches, cancel_batch]
