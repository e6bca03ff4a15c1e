"""Replies cached per (correlation id, command, sender): a redelivered or retried command gets the
same reply and is not executed twice.

With a state directory the cache is also a journal (one msgpack record per control reply, fsynced
before the reply leaves), so the promise holds across a SIGKILL between executing a command and acking
it. The journal is an append-only file compacted (rewritten to the replies still kept, to a temporary
file, fsynced, renamed over it) when any of these is passed:

- ``max_bytes`` (``PARKWAY_REPLY_JOURNAL_MAX_BYTES``): the file's size. The rewrite keeps at most half
  of it, newest first; the older replies are forgotten, in memory too.
- ``max_age_s`` (``PARKWAY_REPLY_MAX_AGE_S``): a reply is forgotten once older than this; the file is
  rewritten when its oldest record is a quarter past it.
- twice ``capacity`` records (tombstones included); the cache itself holds at most ``capacity``.

In memory the cache holds at most ``capacity`` replies and at most ``max_memory_bytes``
(``PARKWAY_REPLY_CACHE_MAX_BYTES``) of their content, the oldest forgotten first: an actor whose
replies are large (TQ's rows for the trainer) would otherwise fill ``capacity`` with megabytes each.

Each bound leaves at least half its allowance (a quarter of the age) before the next rewrite, so the
rewrites cost a constant share of what is appended, not a rewrite per reply.

Forgetting a rollout (``evict_rollouts``) drops the replies of its calls: the correlation ids of a
rollout's attempt are its capture key (``Run``, the receipt), ``<capture key>:<suffix>`` (model and tool
calls, their release) and ``seal:<capture key>``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

import msgspec
from parkway.actors.runtime.settings import reply_cache_max_bytes, reply_journal_max_bytes, reply_max_age_s
from parkway.protocol.ids import capture_key
from parkway.protocol.messages import AttemptRef

ReplyKey = tuple[str, str, str]  # (correlation id, message type, sender)
SEAL_PREFIX = "seal:"  # the controller's seal of a capture key at TQ (roles/controller/receipts.py)
_RECORD_HEAD = 4  # bytes of the big-endian length in front of each record
AGE_SLACK = 0.25  # a rewrite for age waits until the oldest record is this share past the age


class _Record(msgspec.Struct, array_like=True):
    correlation_id: str
    message_type: str
    sender: str
    content: bytes  # the reply, msgpack-encoded; empty: a tombstone
    at: float = 0.0  # when it was cached (Unix time); 0 in journals written before it was recorded


class _Entry(NamedTuple):
    content: bytes
    at: float
    durable: bool  # journalled (a control reply), else memory only


class ReplyCache:
    def __init__(
        self,
        *,
        capacity: int = 4096,
        journal: Path | None = None,
        max_bytes: int = 4 << 20,
        max_age_s: float = 7200.0,
        max_memory_bytes: int = 16 << 20,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.capacity = capacity
        self.max_memory_bytes = max_memory_bytes
        self._memory_bytes = 0  # content held in memory, of every entry
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._clock = clock
        self._entries: OrderedDict[ReplyKey, _Entry] = OrderedDict()  # oldest stored first
        # The same keys by owner (a rollout attempt's capture key, or a checkpoint id): eviction looks
        # up what it drops instead of scanning every reply.
        self._by_owner: dict[str, dict[ReplyKey, None]] = {}
        self._running: dict[ReplyKey, asyncio.Future[bytes | None]] = {}
        self._journal = journal
        self._journal_records = 0
        self._journal_bytes = 0
        self._journal_oldest: float | None = None  # when the oldest record in the file was cached
        self.compactions = 0
        self._encoder = msgspec.msgpack.Encoder()
        if journal is not None:
            self._load(journal)

    @classmethod
    def from_env(cls, *, journal: Path | None, environ: Mapping[str, str] | None = None) -> ReplyCache:
        """With the bounds of ``PARKWAY_REPLY_JOURNAL_MAX_BYTES`` and ``PARKWAY_REPLY_MAX_AGE_S``."""
        return cls(
            journal=journal,
            max_bytes=reply_journal_max_bytes(environ),
            max_age_s=reply_max_age_s(environ),
            max_memory_bytes=reply_cache_max_bytes(environ),
        )

    def __len__(self) -> int:
        return len(self._entries)

    def sizes(self) -> dict[str, int]:
        """Entries of each of its structures (``Actor.structure_sizes``)."""
        return {
            "reply_cache": len(self._entries),
            "reply_cache_running": len(self._running),
            "reply_cache_bytes": self._memory_bytes,
            "reply_journal_records": self._journal_records,
            "reply_journal_bytes": self._journal_bytes,
        }

    def get(self, key: ReplyKey) -> bytes | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.content

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

    def evict(
        self, correlation_id: str, *, keep: frozenset[str] = frozenset(), journaled: bool = True
    ) -> int:
        """Forget the replies of one id (except message types in ``keep``); returns how many.
        ``journaled=False`` leaves the journaled ones to the journal's own bounds (no tombstone, so no
        fsync: for a checkpoint long ended, off every critical path)."""
        doomed = [
            k
            for k in self._by_owner.get(_capture_key_of(correlation_id), ())
            if k[0] == correlation_id and k[1] not in keep and (journaled or not self._entries[k].durable)
        ]
        return self._drop(doomed)

    def evict_rollouts(self, attempts: Iterable[AttemptRef]) -> int:
        """Forget every reply of these attempts' calls (``Forget``): ``Run``, model and tool calls, their
        release, the receipt and the seal. Returns how many; the index by capture key finds them, so the
        cost is theirs, not the cache's size."""
        doomed: list[ReplyKey] = []
        for ref in attempts:
            doomed.extend(self._by_owner.get(capture_key(ref.rollout_id, ref.attempt), ()))
        return self._drop(doomed)

    def evict_all(self, *, keep: frozenset[str] = frozenset()) -> int:
        """Forget every reply except those of the message types in ``keep``; returns how many."""
        doomed = [k for k in self._entries if k[1] not in keep]
        for key in doomed:
            self._remove(key)
        if doomed and self._journal is not None:
            self._rewrite(self._journal)
        return len(doomed)

    def _drop(self, doomed: list[ReplyKey]) -> int:
        journalled = [key for key in doomed if self._remove(key).durable]
        if journalled and self._journal is not None:
            # Tombstones, so a restart does not revive them: one write and one fsync for all of them.
            self._append(*(_Record(*key, b"") for key in journalled))
        return len(doomed)

    def _store(self, key: ReplyKey, content: bytes, *, durable: bool) -> None:
        now = self._clock()
        self._put(key, _Entry(content, now, durable))
        self._expire(now)
        self._bound()
        if durable and self._journal is not None:
            self._append(_Record(*key, content, now))

    def _expire(self, now: float) -> None:
        """Forget the replies older than the age, oldest first: the order of the cache is their age."""
        horizon = now - self.max_age_s
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.at >= horizon:
                break
            self._remove(next(iter(self._entries)))

    def _put(self, key: ReplyKey, entry: _Entry) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._memory_bytes -= len(old.content)
        self._entries[key] = entry  # the newest last
        self._memory_bytes += len(entry.content)
        self._by_owner.setdefault(_capture_key_of(key[0]), {})[key] = None

    def _remove(self, key: ReplyKey) -> _Entry:
        entry = self._entries.pop(key)
        self._memory_bytes -= len(entry.content)
        owner = _capture_key_of(key[0])
        keys = self._by_owner[owner]
        del keys[key]
        if not keys:
            del self._by_owner[owner]
        return entry

    def _bound(self) -> None:
        """At most ``capacity`` replies and ``max_memory_bytes`` of them; the newest always stays."""
        while len(self._entries) > self.capacity or (
            self._memory_bytes > self.max_memory_bytes and len(self._entries) > 1
        ):
            self._remove(next(iter(self._entries)))

    # -- journal -------------------------------------------------------------------------------
    def _load(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            return
        data = path.read_bytes()
        decoder = msgspec.msgpack.Decoder(_Record)
        loaded_at = self._clock()
        offset = 0
        while offset + _RECORD_HEAD <= len(data):
            size = int.from_bytes(data[offset : offset + _RECORD_HEAD], "big")
            chunk = data[offset + _RECORD_HEAD : offset + _RECORD_HEAD + size]
            if len(chunk) < size:
                break  # a torn last record from a crash mid-write: everything before it is intact
            try:
                record = decoder.decode(chunk)
            except msgspec.DecodeError:
                break
            key = (record.correlation_id, record.message_type, record.sender)
            if record.content:
                # A record of a journal older than timestamps is taken as cached now: kept its full age.
                self._put(key, _Entry(record.content, record.at or loaded_at, True))
            elif key in self._entries:
                self._remove(key)
            offset += _RECORD_HEAD + size
        self._expire(loaded_at)
        self._bound()
        self._rewrite(path)

    def _append(self, *records: _Record) -> None:
        assert self._journal is not None
        data = b"".join(_framed(self._encoder.encode(record)) for record in records)
        with open(self._journal, "ab") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        self._journal_records += len(records)
        self._journal_bytes += len(data)
        if self._journal_oldest is None:
            self._journal_oldest = min(r.at or self._clock() for r in records)
        if self._due():
            self._rewrite(self._journal, budget=self.max_bytes // 2)

    def _due(self) -> bool:
        if self._journal_bytes > self.max_bytes or self._journal_records > 2 * self.capacity:
            return True
        oldest = self._journal_oldest
        return oldest is not None and self._clock() - oldest > self.max_age_s * (1 + AGE_SLACK)

    def _rewrite(self, path: Path, *, budget: int | None = None) -> None:
        """Compact the journal to the control replies kept, atomically: at most ``budget`` bytes (the
        whole budget unless said; half of it when the budget was passed), newest first (those that do
        not fit are forgotten in memory too), none past the age."""
        budget = self.max_bytes if budget is None else budget
        self._expire(self._clock())
        kept: list[bytes] = []
        written = 0
        for key in reversed(self._entries):  # newest first: what does not fit is the oldest
            entry = self._entries[key]
            if not entry.durable:
                continue
            record = _framed(self._encoder.encode(_Record(*key, entry.content, entry.at)))
            if kept and written + len(record) > budget:
                break  # the newest is always kept: a duplicate of the command just answered is likely
            kept.append(record)
            written += len(record)
        durable = [key for key in self._entries if self._entries[key].durable]
        for key in durable[: len(durable) - len(kept)]:  # the oldest, beyond the budget
            self._remove(key)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as handle:
            handle.write(b"".join(reversed(kept)))  # oldest first, the order a load replays them in
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # the rename itself survives a power loss
        self._journal_records = len(kept)
        self._journal_bytes = written
        self._journal_oldest = min((e.at for e in self._entries.values() if e.durable), default=None)
        self.compactions += 1


def _framed(payload: bytes) -> bytes:
    return len(payload).to_bytes(_RECORD_HEAD, "big") + payload


def _capture_key_of(correlation_id: str) -> str:
    """The capture key a per-rollout correlation id belongs to (see the module's docstring); others
    (checkpoint ids, ``ack-...``) come out as themselves and match no capture key."""
    if correlation_id.startswith(SEAL_PREFIX):
        return correlation_id[len(SEAL_PREFIX) :]
    return correlation_id.partition(":")[0]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
