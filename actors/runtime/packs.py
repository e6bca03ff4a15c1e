"""Record files written incrementally: a snapshot writes only the records that changed since the last.

A participant's large records file (an agent's rollouts, a tool server's sessions, TQ's rows) is an
*index* plus *packs*. A pack (``<stem>.packs/<sha256 prefix>.pack``) is the msgpack encodings of some
records laid end to end, written once and never changed; the index (``<stem>.msgpack``, a
``PackedRecords``) names the packs and where each record lies in them, in the file's record order.

Writing the next snapshot, a record that is the same (the same bytes: most rollouts did not pass a
boundary since, TQ's rows never change) stays where it was: its pack is hard-linked from the newest
published snapshot into this one, and only the records that changed are encoded into one new pack. A
hard link costs no data write and no fsync of data; each snapshot directory stays complete on its own,
so pruning the older one removes a name, not the records. A pack whose live records fill less than
half of it, or beyond the newest ``MAX_PACKS``, is not linked: its live records are written again into
the new pack, so the packs a snapshot holds stay within about twice its records' size. Where a link
cannot be made (the base snapshot pruned, another file system, none yet), the records are written.

The writer remembers, per file, each record's digest and place from its last write, and the last
records themselves (by identity: an immutable record that is the same object is not encoded again).
A restored participant starts with nothing remembered: its first snapshot writes everything.

``read_records`` reads both this and the plain format (one msgpack list), which small files keep.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from parkway.actors.runtime.durable import write_durably
from parkway.actors.runtime.faults import FaultPoints
from parkway.protocol.messages import FileDigest

PACKS_SUFFIX = ".packs"  # rollouts.msgpack's packs are in rollouts.packs/
PACK_SUFFIX = ".pack"
MAX_PACKS = 16  # packs one file may link; beyond them the emptiest are written again
MIN_LIVE = 0.5  # a pack is linked while its live records fill at least this share of it

T = TypeVar("T")


class PackedRecords(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="packed/1", tag_field="format"
):
    """A records file's index: its packs, and each record as (pack index, offset, length), in order."""

    packs: tuple[str, ...]
    spans: tuple[tuple[int, int, int], ...]


class UnreadablePacks(ValueError):
    """An index whose spans leave its packs, or name a pack it does not list."""


def packs_dir(path: Path) -> Path:
    return path.with_suffix(PACKS_SUFFIX)


def read_records(path: Path, kind: Any = Any) -> list[Any]:
    """The records of ``path``, each decoded as ``kind``: packed (an index and its packs) or plain (one
    msgpack list). Raises ``OSError`` (a file or pack missing), ``msgspec.DecodeError`` /
    ``ValidationError`` (not such records) or ``UnreadablePacks``."""
    head = msgspec.msgpack.decode(path.read_bytes(), type=PackedRecords | list[kind])
    if not isinstance(head, PackedRecords):
        return list(head)
    blobs = [memoryview((packs_dir(path) / name).read_bytes()) for name in head.packs]
    decoder = msgspec.msgpack.Decoder(kind)
    records = []
    for index, offset, length in head.spans:
        if not 0 <= index < len(blobs) or offset < 0 or length < 1 or offset + length > len(blobs[index]):
            raise UnreadablePacks(f"{path.name}: span ({index}, {offset}, {length}) is outside its packs")
        records.append(decoder.decode(blobs[index][offset : offset + length]))
    return records


def _encode(record: Any) -> bytes:
    return bytes(record) if isinstance(record, msgspec.Raw) else msgspec.msgpack.encode(record)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass(frozen=True)
class _Pack:
    name: str
    sha256: str
    size: int
    records: int


@dataclass
class _LastWrite:
    """What one file's last write left: its packs, each record's place, and the records themselves."""

    packs: dict[str, _Pack]
    place: dict[bytes, tuple[str, int, int]]  # record digest -> (pack, offset, length)
    by_identity: dict[int, tuple[Any, bytes]]  # id(record) -> (record, digest); the record kept alive


@dataclass
class PackWriter:
    """One participant's packed files and what its last write of each left (see the module's text)."""

    max_packs: int = MAX_PACKS
    min_live: float = MIN_LIVE
    _last: dict[str, _LastWrite] = field(default_factory=dict)

    def forget(self) -> None:
        """After a restore: nothing written before is a base any more."""
        self._last.clear()

    def write(
        self,
        path: Path,
        records: Sequence[Any],
        *,
        base: Path | None,
        halfway: Callable[[Path], None] | None = None,
    ) -> tuple[FileDigest, ...]:
        """Write ``records`` to ``path`` (the index) and its packs, linking from ``base`` (the same
        participant's directory in the newest published snapshot) the packs that still hold enough of
        them. The entries of every file, the linked packs marked. ``halfway`` runs with half of the new
        pack (or of the index, when nothing is new) flushed: the ``commit_write`` fault point."""
        path.parent.mkdir(parents=True, exist_ok=True)
        last = self._last.get(path.name)
        items = [self._identify(record, last) for record in records]

        linked = self._link(path, items, last, base)
        place: dict[bytes, tuple[str, int, int]] = {
            digest: last.place[digest]
            for _, digest, _ in items
            if last and last.place.get(digest, ("",))[0] in linked
        }
        chunks: list[bytes] = []
        offset = 0
        fresh: dict[bytes, tuple[int, int]] = {}
        for record, digest, data in items:
            if digest in place or digest in fresh:
                continue
            data = data if data is not None else _encode(record)
            fresh[digest] = (offset, len(data))
            chunks.append(data)
            offset += len(data)
        entries: list[FileDigest] = [
            FileDigest(
                path=_pack_path(path, p.name), sha256=p.sha256, records=p.records, size=p.size, linked=True
            )
            for p in linked.values()
        ]
        packs = dict(linked)
        if chunks:
            blob = b"".join(chunks)
            sha = hashlib.sha256(blob).hexdigest()
            new = _Pack(name=f"{sha[:32]}{PACK_SUFFIX}", sha256=sha, size=len(blob), records=len(chunks))
            target = packs_dir(path) / new.name
            target.parent.mkdir(exist_ok=True)
            write_durably(target, blob, halfway=functools.partial(halfway, target) if halfway else None)
            halfway = None  # the first file written carries the fault point
            packs[new.name] = new
            place.update({digest: (new.name, o, n) for digest, (o, n) in fresh.items()})
            entries.append(
                FileDigest(path=_pack_path(path, new.name), sha256=sha, records=new.records, size=new.size)
            )

        names = list(packs)
        number = {name: i for i, name in enumerate(names)}
        spans = tuple((number[place[d][0]], place[d][1], place[d][2]) for _, d, _ in items)
        index = msgspec.msgpack.encode(PackedRecords(packs=tuple(names), spans=spans))
        write_durably(path, index, halfway=functools.partial(halfway, path) if halfway else None)
        entries.insert(
            0,
            FileDigest(
                path=path.name, sha256=hashlib.sha256(index).hexdigest(), records=len(items), size=len(index)
            ),
        )
        self._last[path.name] = _LastWrite(
            packs=packs,
            place=place,
            by_identity={
                id(record): (record, digest)
                for record, digest, _ in items
                if not isinstance(record, msgspec.Raw)
            },
        )
        return tuple(entries)

    @staticmethod
    def _identify(record: Any, last: _LastWrite | None) -> tuple[Any, bytes, bytes | None]:
        """(record, digest, its encoding if it had to be made): the same object as last time is not
        encoded again (records are immutable)."""
        if last is not None:
            known = last.by_identity.get(id(record))
            if known is not None and known[0] is record:
                return record, known[1], None
        data = _encode(record)
        return record, _digest(data), data

    def _link(
        self,
        path: Path,
        items: list[tuple[Any, bytes, bytes | None]],
        last: _LastWrite | None,
        base: Path | None,
    ) -> dict[str, _Pack]:
        """The last write's packs worth keeping, hard-linked from ``base`` into this directory."""
        if last is None or base is None:
            return {}
        live: dict[str, int] = {}
        seen: set[bytes] = set()
        for _, digest, _ in items:
            where = last.place.get(digest)
            if where is not None and digest not in seen:
                seen.add(digest)
                live[where[0]] = live.get(where[0], 0) + where[2]
        worth = sorted(
            (name for name, size in live.items() if size >= self.min_live * last.packs[name].size),
            key=lambda name: -live[name],
        )[: self.max_packs - 1]  # room for the new pack
        linked: dict[str, _Pack] = {}
        for name in worth:
            source, target = packs_dir(base / path.name) / name, packs_dir(path) / name
            try:
                target.parent.mkdir(exist_ok=True)
                if target.exists():  # a Persist written again into the same directory
                    target.unlink()
                os.link(source, target)
            except OSError:
                continue  # pruned, elsewhere, or another file system: its records are written instead
            linked[name] = last.packs[name]
        return linked


def _pack_path(path: Path, name: str) -> str:
    return f"{packs_dir(Path(path.name)).as_posix()}/{name}"


def write_records(
    path: Path, records: list[Any], *, faults: FaultPoints | None = None, qualifier: str | None = None
) -> FileDigest:
    """Write msgpack records to ``path`` as one list (the plain format), durably, and return the
    manifest entry. ``faults``: the ``commit_write`` fault point fails this write half-way, as a full
    disk would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = msgspec.msgpack.encode(records)
    reach = functools.partial(faults.reach, "commit_write", qualifier, path=path) if faults else None
    write_durably(path, data, halfway=reach)
    return FileDigest(
        path=path.name, sha256=hashlib.sha256(data).hexdigest(), records=len(records), size=len(data)
    )


@dataclass
class RecordWriter:
    """A participant's record files, its ``commit_write`` fault point armed: plain ones (small), and
    packed ones written incrementally, linking from ``base``: the participant's directory in the
    snapshot its current Persist names as the one before (set for each Persist)."""

    faults: FaultPoints | None
    role: str
    base: Path | None = None
    packs: PackWriter = field(default_factory=PackWriter)

    def plain(self, path: Path, records: list[Any]) -> FileDigest:
        return write_records(path, records, faults=self.faults, qualifier=self.role)

    def packed(self, path: Path, records: Sequence[Any]) -> tuple[FileDigest, ...]:
        faults = self.faults
        halfway = (lambda p: faults.reach("commit_write", self.role, path=p)) if faults else None
        return self.packs.write(path, records, base=self.base, halfway=halfway)
