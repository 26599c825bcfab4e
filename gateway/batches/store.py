"""Files and batch records on disk, behind one small class (``BatchStorage``) so that they can move onto the
gateway's state seam later. Layout under the directory:

  files/<id>.json          the file's object and its owner (a hash of its API key)
  files/<id>.data          its bytes
  batches/<id>.json        the batch's object, its owner and state
  batches/<id>.out.jsonl   result lines appended as they finish (the output file when the batch ends)
  batches/<id>.err.jsonl   error lines, likewise

Every record is written whole to a temporary file then renamed, so a crash leaves the old one or the new one;
result lines are appended and a torn last line (a crash mid-write) is ignored when read back."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import TypeVar

import msgspec

from gateway.domain_errors import NotFound
from wire.batches import Batch, FileObject

T = TypeVar("T", bound=msgspec.Struct)  # a stored record: it names its owner


class StoredFile(msgspec.Struct, kw_only=True):
    owner: str
    file: FileObject


class StoredBatch(msgspec.Struct, kw_only=True):
    owner: str
    batch: Batch


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def _valid_id(id_: str) -> bool:
    return id_.replace("-", "").replace("_", "").isalnum() and len(id_) < 100


class BatchStorage:
    def __init__(self, directory: str | Path):
        self.root = Path(directory)
        self._files = self.root / "files"
        self._batches = self.root / "batches"
        self._files.mkdir(parents=True, exist_ok=True)
        self._batches.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ files

    def put_file(self, owner: str, filename: str, purpose: str, data: bytes) -> FileObject:
        file = FileObject(id=new_file_id(), bytes=len(data), created_at=int(time.time()), filename=filename,
                          purpose=purpose)
        _write(self._files / f"{file.id}.data", data)
        _write(self._files / f"{file.id}.json", msgspec.json.encode(StoredFile(owner=owner, file=file)))
        return file

    def file(self, owner: str, file_id: str) -> FileObject:
        """The file, if ``owner``'s; another key's file is not found, as a missing one."""
        return _owned(self._files, owner, file_id, StoredFile, "File", "file").file

    def files(self, owner: str) -> list[FileObject]:
        """``owner``'s files, newest first."""
        found = []
        for path in self._files.glob("*.json"):
            try:
                stored = msgspec.json.decode(path.read_bytes(), type=StoredFile)
            except (OSError, msgspec.DecodeError):
                continue
            if stored.owner == owner:
                found.append(stored.file)
        return sorted(found, key=lambda f: (f.created_at, f.id), reverse=True)

    def content(self, owner: str, file_id: str) -> bytes:
        self.file(owner, file_id)
        return (self._files / f"{file_id}.data").read_bytes()

    def delete_file(self, owner: str, file_id: str) -> None:
        self.file(owner, file_id)
        (self._files / f"{file_id}.json").unlink(missing_ok=True)
        (self._files / f"{file_id}.data").unlink(missing_ok=True)

    # ------------------------------------------------------------ batches

    def save_batch(self, stored: StoredBatch) -> None:
        _write(self._batches / f"{stored.batch.id}.json", msgspec.json.encode(stored))

    def batch(self, owner: str, batch_id: str) -> StoredBatch:
        return _owned(self._batches, owner, batch_id, StoredBatch, "Batch", "batch")

    def all_batches(self) -> list[StoredBatch]:
        found = []
        for path in self._batches.glob("*.json"):
            try:
                found.append(msgspec.json.decode(path.read_bytes(), type=StoredBatch))
            except (OSError, msgspec.DecodeError):
                continue
        return sorted(found, key=lambda s: (s.batch.created_at, s.batch.id), reverse=True)

    def append_result(self, batch_id: str, kind: str, line: bytes) -> None:
        """Appends one result line (``kind`` "out" or "err") of a batch."""
        with open(self._batches / f"{batch_id}.{kind}.jsonl", "ab") as out:
            out.write(line + b"\n")
            out.flush()

    def results(self, batch_id: str, kind: str) -> list[bytes]:
        """The whole result lines written so far (a torn last line left out)."""
        path = self._batches / f"{batch_id}.{kind}.jsonl"
        if not path.exists():
            return []
        data = path.read_bytes()
        lines = data.split(b"\n")
        if not data.endswith(b"\n"):
            lines = lines[:-1]
        return [line for line in lines if line]

    def drop_torn_results(self, batch_id: str, kind: str) -> None:
        """Rewrites a result file without its torn last line, before lines are appended to it again."""
        path = self._batches / f"{batch_id}.{kind}.jsonl"
        if path.exists() and not path.read_bytes().endswith(b"\n") and path.stat().st_size:
            _write(path, b"".join(line + b"\n" for line in self.results(batch_id, kind)))


def _owned(directory: Path, owner: str, record_id: str, kind: type[T], name: str, noun: str) -> T:
    """The record ``record_id`` of ``kind`` in ``directory`` if it is ``owner``'s: another key's is not found, as
    a missing one is."""
    path = directory / f"{record_id}.json"
    stored = msgspec.json.decode(path.read_bytes(), type=kind) if _valid_id(record_id) and path.exists() else None
    if stored is None or stored.owner != owner:
        raise NotFound(f"No such {name} object: {record_id}", param=f"{noun}_id", code=f"{noun}_not_found")
    return stored
