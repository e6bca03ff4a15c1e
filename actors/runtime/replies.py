"""Replies cached per (correlation id, command, sender): a redelivered or retried command gets the
same reply and is not executed twice.

With a state directory the cache is also a journal (one msgpack record per reply, fsynced before the
reply leaves), so the promise holds across a SIGKILL between executing a command and acking it.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from pathlib import Path

import msgspec

ReplyKey = tuple[str, str, str]  # (correlation id, message type, sender)


class _Record(msgspec.Struct, array_like=True):
    correlation_id: str
    message_type: str
    sender: str
    content: bytes  # the reply, msgpack-encoded


class ReplyCache:
    def __init__(self, *, capacity: int = 4096, journal: Path | None = None) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[ReplyKey, bytes] = OrderedDict()
        self._running: dict[ReplyKey, asyncio.Future[bytes | None]] = {}
        self._journal = journal
        self._journal_records = 0
        self._journal_bytes = 0
        self._encoder = msgspec.msgpack.Encoder()
        if journal is not None:
            self._load(journal)

    def __len__(self) -> int:
        return len(self._entries)

    def sizes(self) -> dict[str, int]:
        """Entries of each of its structures (``Actor.structure_sizes``)."""
        return {
            "reply_cache": len(self._entries),
            "reply_cache_running": len(self._running),
            "reply_journal_records": self._journal_records,
            "reply_journal_bytes": self._journal_bytes,
        }

    def get(self, key: ReplyKey) -> bytes | None:
        return self._entries.get(key)

    def running(self, key: ReplyKey) -> asyncio.Future[bytes | None] | None:
        """The future of the same command still being handled, if any (a duplicate waits on it)."""
        return self._running.get(key)

    def begin(self, key: ReplyKey) -> asyncio.Future[bytes | None]:
        future: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        self._running[key] = future
        return future

    def finish(self, key: ReplyKey, content: bytes | None, *, remember: bool, durable: bool = True) -> None:
        """Settle a running command; ``durable`` journals the reply (control commands), else memory only."""
        future = self._running.pop(key, None)
        if remember and content is not None:
            self._store(key, content, durable=durable)
        if future is not None and not future.done():
            future.set_result(content if remember else None)

    def evict(self, correlation_id: str, *, keep: frozenset[str] = frozenset()) -> int:
        """Forget the replies of one id (except message types in ``keep``); returns how many."""
        doomed = [k for k in self._entries if k[0] == correlation_id and k[1] not in keep]
        for key in doomed:
            del self._entries[key]
        if doomed and self._journal is not None:
            # Tombstones, so a restart does not revive them: one write and one fsync for all of them.
            self._append(*(_Record(*key, b"") for key in doomed))
        return len(doomed)

    def evict_all(self, *, keep: frozenset[str] = frozenset()) -> int:
        """Forget every reply except those of the message types in ``keep``; returns how many."""
        doomed = [k for k in self._entries if k[1] not in keep]
        for key in doomed:
            del self._entries[key]
        if doomed and self._journal is not None:
            self._rewrite(self._journal)
        return len(doomed)

    def _store(self, key: ReplyKey, content: bytes, *, durable: bool) -> None:
        self._entries[key] = content
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        if durable and self._journal is not None:
            self._append(_Record(*key, content))

    # -- journal -------------------------------------------------------------------------------
    def _load(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            return
        data = path.read_bytes()
        decoder = msgspec.msgpack.Decoder(_Record)
        offset = 0
        while offset + 4 <= len(data):
            size = int.from_bytes(data[offset : offset + 4], "big")
            chunk = data[offset + 4 : offset + 4 + size]
            if len(chunk) < size:
                break  # a torn last record from a crash mid-write: everything before it is intact
            try:
                record = decoder.decode(chunk)
            except msgspec.DecodeError:
                break
            key = (record.correlation_id, record.message_type, record.sender)
            if record.content:
                self._entries[key] = record.content
                self._entries.move_to_end(key)
            else:
                self._entries.pop(key, None)
            offset += 4 + size
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        self._rewrite(path)

    def _append(self, *records: _Record) -> None:
        assert self._journal is not None
        data = b""
        for record in records:
            payload = self._encoder.encode(record)
            data += len(payload).to_bytes(4, "big") + payload
        with open(self._journal, "ab") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        self._journal_records += len(records)
        self._journal_bytes += len(data)
        if self._journal_records > 2 * self.capacity:
            self._rewrite(self._journal)

    def _rewrite(self, path: Path) -> None:
        """Compact the journal to the entries kept, atomically."""
        tmp = path.with_suffix(".tmp")
        written = 0
        with open(tmp, "wb") as handle:
            for key, content in self._entries.items():
                payload = self._encoder.encode(_Record(*key, content))
                written += handle.write(len(payload).to_bytes(4, "big") + payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        self._journal_records = len(self._entries)
        self._journal_bytes = written
