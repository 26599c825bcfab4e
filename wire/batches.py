"""OpenAI's Files (purpose ``batch``) and Batch APIs: the objects as the openai SDK reads them."""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

BatchEndpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]


class FileObject(Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: Literal["file"] = "file"
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None


class FileList(Struct, kw_only=True):
    data: list[FileObject]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
    object: Literal["list"] = "list"


class FileDeleted(Struct, kw_only=True):
    id: str
    deleted: bool = True
    object: Literal["file"] = "file"


class BatchCreate(Struct, kw_only=True, forbid_unknown_fields=False):
    input_file_id: str
    endpoint: BatchEndpoint
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None


class RequestCounts(Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrorItem(Struct, kw_only=True, omit_defaults=True):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(Struct, kw_only=True):
    data: list[BatchErrorItem]
    object: Literal["list"] = "list"


class Batch(Struct, kw_only=True):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    request_counts: RequestCounts
    object: Literal["batch"] = "batch"
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    metadata: dict[str, str] | None = None


class BatchList(Struct, kw_only=True):
    data: list[Batch]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
    object: Literal["list"] = "list"


class LineResponse(Struct, kw_only=True):
    status_code: int
    request_id: str
    body: Any


class LineError(Struct, kw_only=True):
    code: str
    message: str


class OutputLine(Struct, kw_only=True):
    """One line of a batch's output or error file (OpenAI's format): ``response`` when an engine or the gateway
    answered the request (a 4xx/5xx one goes to the error file), ``error`` when the line could not be sent."""

    id: str
    custom_id: str | None
    response: LineResponse | None
    error: LineError | None
