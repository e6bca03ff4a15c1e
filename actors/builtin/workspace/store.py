"""A content-addressed store of file blobs: ``<root>/<first 2 hex>/<sha256>``, written once, durable.

A blob is hashed and copied in one read of its source, written to a temporary name, fsynced and renamed,
so a blob that exists is whole; a snapshot refers to blobs by digest and is published only after the
blobs it names are on disk. Reading one checks its digest, so a corrupt blob is found, never restored.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

CHUNK = 1 << 20


class CorruptBlob(Exception):
    """A blob whose bytes no longer match its name (or that is missing)."""


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.bytes_written = 0  # counters the bench reads
        self.blobs_written = 0

    def path(self, digest: str) -> Path:
        return self.root / digest[:2] / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def put_file(self, source: Path) -> tuple[str, int]:
        """Store ``source``'s bytes; (digest, size). One read: hashed while copied to a temporary file,
        which is dropped when the blob was already there."""
        self.root.mkdir(parents=True, exist_ok=True)
        hasher = hashlib.sha256()
        size = 0
        tmp = self.root / f".tmp-{os.getpid()}-{id(source)}"
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            with os.fdopen(fd, "rb", closefd=False) as reader, open(tmp, "wb") as writer:
                while chunk := reader.read(CHUNK):
                    hasher.update(chunk)
                    writer.write(chunk)
                    size += len(chunk)
                digest = hasher.hexdigest()
                if self.has(digest):
                    writer.close()
                    tmp.unlink()
                    return digest, size
                writer.flush()
                os.fsync(writer.fileno())
        finally:
            os.close(fd)
        self._publish(tmp, digest, size)
        return digest, size

    def put_bytes(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        if self.has(digest):
            return digest
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{os.getpid()}-bytes"
        with open(tmp, "wb") as writer:
            writer.write(data)
            writer.flush()
            os.fsync(writer.fileno())
        self._publish(tmp, digest, len(data))
        return digest

    def _publish(self, tmp: Path, digest: str, size: int) -> None:
        target = self.path(digest)
        target.parent.mkdir(exist_ok=True)
        os.replace(tmp, target)
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.bytes_written += size
        self.blobs_written += 1

    def copy_to(self, digest: str, destination: Path) -> int:
        """Write blob ``digest`` to ``destination`` (which must not exist), checking its digest."""
        hasher = hashlib.sha256()
        size = 0
        try:
            reader = open(self.path(digest), "rb")  # noqa: SIM115 (closed by the with below)
        except FileNotFoundError as exc:
            raise CorruptBlob(f"blob {digest} is missing from {self.root}") from exc
        fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with reader, os.fdopen(fd, "wb") as writer:
            while chunk := reader.read(CHUNK):
                hasher.update(chunk)
                writer.write(chunk)
                size += len(chunk)
        if hasher.hexdigest() != digest:
            raise CorruptBlob(f"blob {digest} in {self.root} does not match its digest")
        return size

    def digests(self) -> Iterator[str]:
        if not self.root.is_dir():
            return
        for fanout in self.root.iterdir():
            if fanout.is_dir() and len(fanout.name) == 2:
                yield from (p.name for p in fanout.iterdir() if not p.name.startswith("."))

    def collect(self, keep: set[str]) -> int:
        """Remove every blob not in ``keep``; how many were removed."""
        removed = 0
        for digest in list(self.digests()):
            if digest not in keep:
                with contextlib.suppress(FileNotFoundError):
                    self.path(digest).unlink()
                    removed += 1
        return removed
