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

A record may be given as ``Parts``: pieces packed each on its own and joined when read. An agent's
rollout is its fields and each step of its transcript: a rollout that passed a boundary writes its new
steps, and its earlier ones stay in the packs they are in.

The writer remembers, per file, each piece's digest and place from its last write, and the last
pieces themselves (by identity: an immutable value that is the same object is not encoded again).
A participant that starts (or restarts) remembers nothing: its first snapshot writes everything.

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
    """A records file's index. ``spans``: every piece of every record, in order, as (pack index,
    offset, length), pack index -1 for bytes of ``literals``; ``pieces``: how many pieces each record
    has, in order (empty: one each). A record is its pieces' bytes joined, decoded as one value."""

    packs: tuple[str, ...]
    spans: tuple[tuple[int, int, int], ...]
    pieces: tuple[int, ...] = ()
    literals: bytes = b""


class UnreadablePacks(ValueError):
    """An index whose spans leave its packs or its literals, or whose pieces do not add up."""


@dataclass(frozen=True)
class Parts:
    """A record given as pieces whose bytes, joined, are its msgpack encoding: ``bytes`` pieces are
    framing kept in the index, every other piece a value encoded on its own and packed like a record.
    So a value that did not change (a transcript's earlier steps) is linked, not written again, even
    when the record around it changed (``struct_parts``)."""

    pieces: tuple[Any, ...]


def struct_parts(value: msgspec.Struct, *, split: tuple[str, ...]) -> Parts:
    """``value`` (a map-encoded Struct) as pieces: each field its own piece, and each item of the
    ``split`` fields (tuples or lists) its own piece; scalars are framing. Joined, they are
    ``msgpack.encode(value)``."""
    pieces: list[Any] = []
    for name, framing, whole in _layout(type(value), split):
        pieces.append(framing)
        item = getattr(value, name)
        if not whole:
            pieces.append(_array_header(len(item)))
            pieces.extend(item)
        elif isinstance(item, msgspec.Struct | tuple | list | dict):
            pieces.append(item)
        else:  # a scalar (a count, a name): framing, not worth a piece of its own
            pieces.append(msgspec.msgpack.encode(item))
    return Parts(tuple(pieces))


@functools.cache
def _layout(kind: type[msgspec.Struct], split: tuple[str, ...]) -> tuple[tuple[str, bytes, bool], ...]:
    """Per field of ``kind``: its name, the bytes before its value (the map's header before the
    first, then its encoded name) and whether its value is one piece (not split)."""
    config = kind.__struct_config__
    if config.array_like or config.omit_defaults or config.tag is not None:
        raise TypeError(f"{kind.__name__} is not encoded as a plain map: its pieces would not join")
    names, encoded = kind.__struct_fields__, kind.__struct_encode_fields__
    header = _map_header(len(names))
    return tuple(
        (name, (header if i == 0 else b"") + msgspec.msgpack.encode(key), name not in split)
        for i, (name, key) in enumerate(zip(names, encoded, strict=True))
    )


def _map_header(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else (b"\xde" + n.to_bytes(2, "big"))


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + n.to_bytes(2, "big") if n < 65536 else b"\xdd" + n.to_bytes(4, "big")


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
    literals = memoryview(head.literals)
    pieces = head.pieces or (1,) * len(head.spans)
    if any(n < 1 for n in pieces) or sum(pieces) != len(head.spans):
        raise UnreadablePacks(f"{path.name}: its records' pieces do not add up to its spans")

    def piece(index: int, offset: int, length: int) -> memoryview:
        blob = literals if index == -1 else blobs[index] if 0 <= index < len(blobs) else None
        if blob is None or offset < 0 or length < 1 or offset + length > len(blob):
            raise UnreadablePacks(f"{path.name}: span ({index}, {offset}, {length}) is outside its packs")
        return blob[offset : offset + length]

    decoder = msgspec.msgpack.Decoder(kind)
    records, at = [], 0
    for n in pieces:
        spans = head.spans[at : at + n]
        at += n
        data = piece(*spans[0]) if n == 1 else b"".join(piece(*span) for span in spans)
        records.append(decoder.decode(data))
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
    records: int  # pieces it holds


Piece = tuple[Any, bytes, bytes | None]  # (value, digest, its encoding where it had to be made)


@dataclass
class _LastWrite:
    """What one file's last write left: its packs, each piece's place, and the pieces themselves."""

    packs: dict[str, _Pack]
    place: dict[bytes, tuple[str, int, int]]  # piece digest -> (pack, offset, length)
    by_identity: dict[int, tuple[Any, bytes]]  # id(value) -> (value, digest); the value kept alive


@dataclass
class PackWriter:
    """One participant's packed files and what its last write of each left (see the module's text)."""

    max_packs: int = MAX_PACKS
    min_live: float = MIN_LIVE
    _last: dict[str, _LastWrite] = field(default_factory=dict)

    def write(
        self,
        path: Path,
        records: Sequence[Any],
        *,
        base: Path | None,
        halfway: Callable[[Path], None] | None = None,
    ) -> tuple[FileDigest, ...]:
        """Write ``records`` (values, or ``Parts``) to ``path`` (the index) and its packs, linking from
        ``base`` (the same participant's directory in the newest published snapshot) the packs that
        still hold enough of them. The entries of every file, the linked packs marked. ``halfway`` runs
        with half of the new pack (or of the index, when nothing is new) flushed: the ``commit_write``
        fault point."""
        path.parent.mkdir(parents=True, exist_ok=True)
        last = self._last.get(path.name)
        rows: list[list[Piece | bytes]] = [
            [p if isinstance(p, bytes) else self._identify(p, last) for p in record.pieces]
            if isinstance(record, Parts)
            else [self._identify(record, last)]
            for record in records
        ]
        items = [p for row in rows for p in row if not isinstance(p, bytes)]

        linked = self._link(path, items, last, base)
        place: dict[bytes, tuple[str, int, int]] = {
            digest: last.place[digest]
            for _, digest, _ in items
            if last and last.place.get(digest, ("",))[0] in linked
        }
        chunks: list[bytes] = []
        offset = 0
        fresh: dict[bytes, tuple[int, int]] = {}
        for value, digest, data in items:
            if digest in place or digest in fresh:
                continue
            data = data if data is not None else _encode(value)
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

        index = _index(packs, place, rows)
        write_durably(path, index, halfway=functools.partial(halfway, path) if halfway else None)
        entries.insert(
            0,
            FileDigest(
                path=path.name, sha256=hashlib.sha256(index).hexdigest(), records=len(rows), size=len(index)
            ),
        )
        self._last[path.name] = _LastWrite(
            packs=packs,
            place=place,
            by_identity={
                id(value): (value, digest) for value, digest, _ in items if not isinstance(value, msgspec.Raw)
            },
        )
        return tuple(entries)

    @staticmethod
    def _identify(value: Any, last: _LastWrite | None) -> Piece:
        """The same object as last time is not encoded again (records are immutable)."""
        if last is not None:
            known = last.by_identity.get(id(value))
            if known is not None and known[0] is value:
                return value, known[1], None
        data = _encode(value)
        return value, _digest(data), data

    def _link(
        self, path: Path, items: list[Piece], last: _LastWrite | None, base: Path | None
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


def _index(
    packs: dict[str, _Pack], place: dict[bytes, tuple[str, int, int]], rows: list[list[Piece | bytes]]
) -> bytes:
    """The encoded ``PackedRecords`` of records laid out as ``rows`` (each record's pieces)."""
    number = {name: i for i, name in enumerate(packs)}
    literals = bytearray()
    spans: list[tuple[int, int, int]] = []
    for row in rows:
        for p in row:
            if isinstance(p, bytes):
                spans.append((-1, len(literals), len(p)))
                literals += p
            else:
                name, offset, length = place[p[1]]
                spans.append((number[name], offset, length))
    split = any(len(row) != 1 for row in rows)
    return msgspec.msgpack.encode(
        PackedRecords(
            packs=tuple(packs),
            spans=tuple(spans),
            pieces=tuple(len(row) for row in rows) if split else (),
            literals=bytes(literals),
        )
    )


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
