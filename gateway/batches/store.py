"""Files and batch records in the gateway's state store (gateway/state/): on SQLite they survive a restart, on
Redis every replica shares them. Records (no TTL: a file or batch stays until it is deleted):

  file:{id}              meta: the file's object and its owner (a hash of its API key) (StoredFile); data: its bytes
  files:{owner}          {file id: ""}: the key's files
  batch:{id}             rec: the batch's object, its owner and state (StoredBatch)
  batches                {batch id: owner}: every batch
  results:{id}           {"out:N" | "err:N": line}: the result line of the batch's line N, once it is answered (a
                         line answered twice, by a replica that took the batch over, is one line)
  lease:batch:{id}       the replica running the batch (gateway/state/leases.py)
"""

from __future__ import annotations

import secrets
import time
from typing import TypeVar

import msgspec

from gateway.domain_errors import NotFound
from gateway.state import StateStore
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


def batch_lease(batch_id: str) -> str:
    return f"lease:batch:{batch_id}"


class BatchStorage:
    def __init__(self, store: StateStore):
        self.store = store

    # ------------------------------------------------------------ files

    async def put_file(self, owner: str, filename: str, purpose: str, data: bytes) -> FileObject:
        file = FileObject(id=new_file_id(), bytes=len(data), created_at=int(time.time()), filename=filename,
                          purpose=purpose)
        meta = msgspec.json.encode(StoredFile(owner=owner, file=file))
        await self.store.apply([("write", f"file:{file.id}", {"meta": meta, "data": data}, None),
                                ("write", f"files:{owner}", {file.id: b""}, None)])
        return file

    async def file(self, owner: str, file_id: str) -> FileObject:
        """The file, if ``owner``'s; another key's file is not found, as a missing one."""
        raw = await self.store.read_field(f"file:{file_id}", "meta")
        return _owned(raw, owner, file_id, StoredFile, "File", "file").file

    async def files(self, owner: str) -> list[FileObject]:
        """``owner``'s files, newest first."""
        found = []
        for file_id in await self.store.read(f"files:{owner}"):
            raw = await self.store.read_field(f"file:{file_id}", "meta")
            if raw is not None:
                found.append(msgspec.json.decode(raw, type=StoredFile).file)
        return sorted(found, key=lambda f: (f.created_at, f.id), reverse=True)

    async def content(self, owner: str, file_id: str) -> bytes:
        await self.file(owner, file_id)
        return await self.store.read_field(f"file:{file_id}", "data") or b""

    async def delete_file(self, owner: str, file_id: str) -> None:
        await self.file(owner, file_id)
        await self.store.apply([("remove", [f"file:{file_id}"]), ("remove_fields", f"files:{owner}", [file_id])])

    # ------------------------------------------------------------ batches

    async def save_batch(self, stored: StoredBatch, *extra: tuple) -> None:
        """The batch's record (and ``extra`` writes, in the same round trip)."""
        await self.store.apply([("write", f"batch:{stored.batch.id}", {"rec": msgspec.json.encode(stored)}, None),
                                ("write", "batches", {stored.batch.id: stored.owner.encode()}, None), *extra])

    async def batch(self, owner: str, batch_id: str) -> StoredBatch:
        raw = await self.store.read_field(f"batch:{batch_id}", "rec")
        return _owned(raw, owner, batch_id, StoredBatch, "Batch", "batch")

    async def all_batches(self, owner: str | None = None) -> list[StoredBatch]:
        """Every batch (``owner``'s only, if given), newest first."""
        found = []
        for batch_id, batch_owner in (await self.store.read("batches")).items():
            if owner is not None and batch_owner != owner.encode():
                continue
            raw = await self.store.read_field(f"batch:{batch_id}", "rec")
            if raw is not None:
                found.append(msgspec.json.decode(raw, type=StoredBatch))
        return sorted(found, key=lambda s: (s.batch.created_at, s.batch.id), reverse=True)

    async def put_result(self, batch_id: str, kind: str, index: int, line: bytes) -> None:
        """The result line (``kind`` "out" or "err") of the batch's line ``index``."""
        await self.store.write(f"results:{batch_id}", {f"{kind}:{index}": line})

    async def results(self, batch_id: str) -> dict[str, dict[int, bytes]]:
        """The result lines written so far: {"out": {index: line}, "err": {...}}; a line answered both ways (by
        two replicas) counts as its success."""
        found: dict[str, dict[int, bytes]] = {"out": {}, "err": {}}
        for name, line in (await self.store.read(f"results:{batch_id}")).items():
            kind, _, index = name.partition(":")
            if kind in found and index.isdigit():
                found[kind][int(index)] = line
        for index in found["out"].keys() & found["err"].keys():
            del found["err"][index]
        return found


def _owned(raw: bytes | None, owner: str, record_id: str, kind: type[T], name: str, noun: str) -> T:
    """The record ``raw`` of ``kind`` if it is ``owner``'s: another key's is not found, as a missing one is."""
    stored = msgspec.json.decode(raw, type=kind) if raw is not None else None
    if stored is None or stored.owner != owner:
        raise NotFound(f"No such {name} object: {record_id}", param=f"{noun}_id", code=f"{noun}_not_found")
    return stored
