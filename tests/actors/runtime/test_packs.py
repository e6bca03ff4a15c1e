"""Record files written incrementally (actors/runtime/packs.py): a write links the packs of the
snapshot before that still hold its records and writes only what changed, and reads give the records
back in order whatever packs they lie in."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import pytest
from parkway.actors.runtime import packs
from parkway.actors.runtime.packs import (
    PackedRecords,
    PackWriter,
    UnreadablePacks,
    packs_dir,
    read_records,
    struct_parts,
)


class Row(msgspec.Struct, frozen=True):
    key: str
    tokens: tuple[int, ...]


def rows(prefix: str, n: int, size: int = 50) -> list[Row]:
    return [Row(key=f"{prefix}{i}", tokens=tuple(range(i, i + size))) for i in range(n)]


def write(
    writer: PackWriter, directory: Path, records: list[Row], base: Path | None
) -> dict[str, msgspec.Struct]:
    entries = writer.write(directory / "rows.msgpack", records, base=base)
    return {e.path: e for e in entries}


def pack_files(directory: Path) -> list[Path]:
    return sorted(packs_dir(directory / "rows.msgpack").glob("*.pack"))


def test_the_first_write_packs_every_record_and_reads_back_in_order(tmp_path: Path) -> None:
    records = rows("a", 20)
    entries = write(PackWriter(), tmp_path / "s1", records, base=None)
    assert read_records(tmp_path / "s1" / "rows.msgpack", Row) == records
    [pack] = pack_files(tmp_path / "s1")
    index = entries["rows.msgpack"]
    assert index.records == 20 and not index.linked
    assert entries[f"rows.packs/{pack.name}"].records == 20
    assert pack.stat().st_size == sum(len(msgspec.msgpack.encode(r)) for r in records)


def test_what_did_not_change_is_linked_and_only_the_changes_are_written(tmp_path: Path) -> None:
    writer = PackWriter()
    first = rows("a", 20)
    write(writer, tmp_path / "s1", first, base=None)
    changed = rows("b", 3)
    second = first[:15] + changed  # five records gone (sealed), three new
    entries = write(writer, tmp_path / "s2", second, base=tmp_path / "s1")

    assert read_records(tmp_path / "s2" / "rows.msgpack", Row) == second
    old, new = (e for e in entries.values() if e.path != "rows.msgpack")
    assert old.linked and not new.linked
    assert new.size == sum(len(msgspec.msgpack.encode(r)) for r in changed)  # nothing else written
    [linked_in_s1] = pack_files(tmp_path / "s1")
    linked_in_s2 = tmp_path / "s2" / old.path
    assert os.stat(linked_in_s2).st_ino == os.stat(linked_in_s1).st_ino  # a hard link: no data written

    shutil.rmtree(tmp_path / "s1")  # pruning the snapshot before removes a name, not the records
    assert read_records(tmp_path / "s2" / "rows.msgpack", Row) == second


def test_a_mostly_dead_pack_is_written_again_not_linked(tmp_path: Path) -> None:
    writer = PackWriter()
    first = rows("a", 20)
    write(writer, tmp_path / "s1", first, base=None)
    second = first[:4] + rows("b", 2)  # 4 of 20 live: under half
    entries = write(writer, tmp_path / "s2", second, base=tmp_path / "s1")
    assert not any(e.linked for e in entries.values())
    [pack] = pack_files(tmp_path / "s2")
    assert pack.stat().st_size == sum(len(msgspec.msgpack.encode(r)) for r in second)
    assert read_records(tmp_path / "s2" / "rows.msgpack", Row) == second


def test_a_base_that_is_gone_means_writing_everything(tmp_path: Path) -> None:
    writer = PackWriter()
    records = rows("a", 10)
    write(writer, tmp_path / "s1", records, base=None)
    shutil.rmtree(tmp_path / "s1")
    entries = write(writer, tmp_path / "s2", records, base=tmp_path / "s1")
    assert not any(e.linked for e in entries.values())
    assert read_records(tmp_path / "s2" / "rows.msgpack", Row) == records


def test_the_packs_a_file_links_stay_bounded(tmp_path: Path) -> None:
    writer = PackWriter(max_packs=4)
    records = rows("a", 40)
    base = None
    for n in range(12):  # every snapshot changes one record: each adds a small pack
        records = [*records[1:], Row(key=f"n{n}", tokens=(n,))]
        write(writer, tmp_path / f"s{n}", records, base=base)
        base = tmp_path / f"s{n}"
        assert len(pack_files(base)) <= 4
        assert read_records(base / "rows.msgpack", Row) == records


def test_an_unchanged_record_is_not_encoded_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = PackWriter()
    records = rows("a", 10)
    write(writer, tmp_path / "s1", records, base=None)
    encoded: list[object] = []
    real = packs._encode
    monkeypatch.setattr(packs, "_encode", lambda r: encoded.append(r) or real(r))
    extra = Row(key="new", tokens=(1,))
    write(writer, tmp_path / "s2", [*records, extra], base=tmp_path / "s1")
    assert encoded == [extra]


def test_equal_records_and_raw_records(tmp_path: Path) -> None:
    same = Row(key="x", tokens=(1, 2))
    raw = [msgspec.Raw(msgspec.msgpack.encode(same)), msgspec.Raw(msgspec.msgpack.encode(same))]
    write(PackWriter(), tmp_path / "s1", raw, base=None)  # type: ignore[arg-type]
    assert read_records(tmp_path / "s1" / "rows.msgpack", Row) == [same, same]


def test_the_plain_format_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "rows.msgpack"
    path.write_bytes(msgspec.msgpack.encode(rows("a", 3)))
    assert read_records(path, Row) == rows("a", 3)


def test_broken_indexes_are_typed_errors(tmp_path: Path) -> None:
    write(PackWriter(), tmp_path, rows("a", 3), base=None)
    path = tmp_path / "rows.msgpack"
    index = msgspec.msgpack.decode(path.read_bytes(), type=PackedRecords)
    path.write_bytes(msgspec.msgpack.encode(PackedRecords(packs=index.packs, spans=((0, 10**6, 5),))))
    with pytest.raises(UnreadablePacks):
        read_records(path, Row)
    path.write_bytes(msgspec.msgpack.encode(PackedRecords(packs=("gone.pack",), spans=((0, 0, 5),))))
    with pytest.raises(FileNotFoundError):
        read_records(path, Row)


def test_the_fault_point_runs_halfway_through_the_new_pack(tmp_path: Path) -> None:
    def disk_full(path: Path) -> None:
        raise OSError(28, "No space left on device", str(path))

    with pytest.raises(OSError, match="No space"):
        PackWriter().write(tmp_path / "rows.msgpack", rows("a", 3), base=None, halfway=disk_full)
    assert not (tmp_path / "rows.msgpack").exists()  # no index names a torn pack


class Transcript(msgspec.Struct, frozen=True, kw_only=True):
    run: Row
    model: tuple[Row, ...]
    tools: tuple[Row, ...]
    boundaries: int


@pytest.mark.parametrize("steps", [0, 1, 15, 16, 300])
def test_struct_parts_join_to_the_struct_s_own_encoding(steps: int) -> None:
    value = Transcript(run=Row(key="r", tokens=()), model=tuple(rows("m", steps)), tools=(), boundaries=steps)
    parts = struct_parts(value, split=("model", "tools"))
    joined = b"".join(p if isinstance(p, bytes) else msgspec.msgpack.encode(p) for p in parts.pieces)
    assert joined == msgspec.msgpack.encode(value)


@pytest.mark.parametrize("n", [15, 16, 65535, 65536])
def test_array_headers_are_msgpack_s(n: int) -> None:
    assert packs._array_header(n) + b"" == msgspec.msgpack.encode([None] * n)[: len(packs._array_header(n))]


def test_a_transcript_that_grew_writes_its_new_steps_only(tmp_path: Path) -> None:
    writer = PackWriter()
    run = Row(key="r", tokens=tuple(range(100)))
    steps = rows("m", 12, size=200)
    before = [Transcript(run=run, model=tuple(steps[:n]), tools=(), boundaries=n) for n in (6, 8)]
    write(writer, tmp_path / "s1", [struct_parts(t, split=("model", "tools")) for t in before], base=None)
    after = [before[0], Transcript(run=run, model=tuple(steps[:9]), tools=(), boundaries=9)]
    entries = write(
        writer,
        tmp_path / "s2",
        [struct_parts(t, split=("model", "tools")) for t in after],
        base=tmp_path / "s1",
    )

    assert read_records(tmp_path / "s2" / "rows.msgpack", Transcript) == after
    [new] = [e for e in entries.values() if e.path != "rows.msgpack" and not e.linked]
    assert new.size == len(msgspec.msgpack.encode(steps[8]))  # the one step it took since
    assert any(e.linked for e in entries.values())


def test_a_struct_whose_encoding_is_not_a_plain_map_is_refused() -> None:
    class Tagged(msgspec.Struct, frozen=True, tag=True):
        items: tuple[int, ...]

    with pytest.raises(TypeError, match="plain map"):
        struct_parts(Tagged(items=(1,)), split=("items",))
