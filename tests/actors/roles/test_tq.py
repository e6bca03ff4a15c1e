"""TQ's store: staging rows, canonical rows, lineage, and a save/load round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
from parkway.actors.roles.tq import TransferStore, logical_id
from parkway.protocol.errors import ProtocolError
from parkway.protocol.messages import StagingRow


def row(key: str, turn: int, tokens: tuple[int, ...] = (1, 2)) -> StagingRow:
    return StagingRow(capture_key=key, turn=turn, token_ids=tokens, logprobs=(-0.5,) * len(tokens))


def test_logical_ids() -> None:
    assert logical_id("t0001_g2") == "t0001_g2"
    assert logical_id("t0001_g2-a3") == "t0001_g2"


def test_duplicates_are_dropped_and_regenerations_counted() -> None:
    store = TransferStore()
    assert store.add(row("g_g0", 0)) and store.add(row("g_g0", 1))
    assert not store.add(row("g_g0", 1))  # the same row delivered twice
    assert store.duplicates == 1 and store.turns_regenerated == 0
    assert store.add(row("g_g0-a1", 0, (9,)))  # attempt 1 generates turn 0 again
    assert store.turns_regenerated == 1


def test_sealing_builds_the_canonical_row_in_turn_order_once() -> None:
    store = TransferStore()
    for turn in (2, 0, 1):
        store.add(row("g_g0-a1", turn, (turn,)))
    canonical = store.seal("g_g0", 1, "g_g0-a1", 0.5)
    assert [t.turn for t in canonical.turns] == [0, 1, 2] and canonical.reward == 0.5
    assert store.seal("g_g0", 1, "g_g0-a1", 0.5) is canonical
    with pytest.raises(ProtocolError, match="no staging rows"):
        store.seal("g_g1", 0, "g_g1", 1.0)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    store = TransferStore()
    store.add(row("g_g0", 0))
    store.add(row("g_g0-a1", 0, (7, 7)))
    store.seal("g_g0", 1, "g_g0-a1", 1.0)
    digests = store.save(tmp_path)
    assert [d.path for d in digests] == ["staging.msgpack", "canonical.msgpack", "lineage.msgpack"]
    loaded = TransferStore.load(tmp_path)
    assert loaded.staging == store.staging and loaded.canonical == store.canonical
    assert loaded.turns_regenerated == store.turns_regenerated == 1
    assert loaded.digest() == store.digest()


def test_release_drops_what_the_trainer_consumed_and_keeps_the_regeneration_count(tmp_path: Path) -> None:
    store = TransferStore()
    store.add(row("g_g0", 0))
    store.add(row("g_g0", 1))
    store.add(row("g_g0-a1", 1, (5,)))  # turn 1 generated again by attempt 1: one regeneration
    store.seal("g_g0", 1, "g_g0-a1", 1.0, staging_keys=("g_g0:0", "g_g0-a1:1"))
    store.add(row("g_g1", 0))
    assert store.release(("g_g0",)) == 3  # every attempt's staging rows, and the canonical row
    assert set(store.staging) == {"g_g1"} and not store.canonical
    assert store.turns_regenerated == 1
    assert set(store.generations) == {("g_g0", 1), ("g_g1", 0)}  # only the turn generated twice stays
    store.save(tmp_path)
    loaded = TransferStore.load(tmp_path)
    assert loaded.turns_regenerated == 1 and set(loaded.staging) == {"g_g1"}
    assert loaded.release(("g_g1",)) == 1 and not loaded.staging


def test_unsealing_drops_only_the_row_of_that_attempt() -> None:
    store = TransferStore()
    store.add(row("g_g0", 0))
    store.seal("g_g0", 0, "g_g0", 1.0)
    assert store.unseal("g_g0", 1) is None and "g_g0" in store.canonical  # another attempt's fence
    assert store.unseal("g_g0", 0) is not None and "g_g0" not in store.canonical
    assert store.has("g_g0:0")  # its staging row stays: a continuation may build on it
    assert store.unseal("g_g0", 0) is None
