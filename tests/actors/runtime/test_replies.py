"""The reply cache and its journal: compacted by size, by age and by count, amortized, crash-safe
(torn tails, an old journal without timestamps), and a forgotten rollout's replies evicted."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path

import msgspec
import pytest
from parkway.actors.runtime.replies import ReplyCache, _Record
from parkway.actors.runtime.settings import (
    SettingsError,
    reply_cache_max_bytes,
    reply_journal_max_bytes,
    reply_max_age_s,
)
from parkway.protocol.messages import AttemptRef


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def reply(
    cache: ReplyCache, correlation_id: str, *, kind: str = "Prepare", durable: bool = True, size: int = 100
) -> None:
    key = (correlation_id, kind, "controller/0")
    cache.finish(key, b"x" * size, remember=True, durable=durable)


def journal_records(path: Path) -> list[_Record]:
    data, offset, records = path.read_bytes(), 0, []
    decoder = msgspec.msgpack.Decoder(_Record)
    while offset < len(data):
        size = int.from_bytes(data[offset : offset + 4], "big")
        records.append(decoder.decode(data[offset + 4 : offset + 4 + size]))
        offset += 4 + size
    return records


def test_the_journal_is_compacted_by_size_and_keeps_the_newest(tmp_path: Path) -> None:
    path = tmp_path / "replies.journal"
    cache = ReplyCache(journal=path, max_bytes=16 << 10, capacity=100_000, clock=Clock())
    for n in range(600):  # about 69 KB appended against a 16 KB budget
        reply(cache, f"ck-{n}", size=100)
        assert path.stat().st_size <= 16 << 10  # never past the budget, at any reply
    assert cache.get(("ck-599", "Prepare", "controller/0")) == b"x" * 100
    assert cache.get(("ck-0", "Prepare", "controller/0")) is None  # the oldest did not fit: forgotten
    # amortized: a rewrite keeps half the budget, so at least half of it is appended before the next
    assert 3 <= cache.compactions <= 600 * 115 // (8 << 10) + 1
    survivors = ReplyCache(journal=path, max_bytes=16 << 10, capacity=100_000, clock=Clock())
    assert len(survivors) == len(cache)  # a restart keeps what the journal held
    assert survivors.get(("ck-599", "Prepare", "controller/0")) == b"x" * 100
    assert cache.sizes()["reply_journal_bytes"] == path.stat().st_size


def test_replies_older_than_the_age_are_forgotten_and_rewritten_away(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "replies.journal"
    cache = ReplyCache(journal=path, max_age_s=100.0, clock=clock)
    reply(cache, "old")
    clock.now += 60
    reply(cache, "young")
    clock.now += 50  # "old" is 110 s old: past the age, not yet past the slack
    reply(cache, "newest")
    assert cache.get(("old", "Prepare", "controller/0")) is None  # forgotten in memory at once
    assert [r.correlation_id for r in journal_records(path)] == ["old", "young", "newest"]
    rewrites = cache.compactions
    clock.now += 20  # the file's oldest record is 130 s old: a quarter past the age, rewritten
    reply(cache, "later")
    assert cache.compactions == rewrites + 1
    assert [r.correlation_id for r in journal_records(path)] == ["young", "newest", "later"]
    for _ in range(50):  # more replies within the slack: no rewrite per reply
        reply(cache, "again")
    assert cache.compactions == rewrites + 1


def test_memory_only_replies_are_not_written_by_a_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "replies.journal"
    cache = ReplyCache(journal=path, clock=Clock())
    reply(cache, "g_g0:0", kind="GenerateTurn", durable=False)
    reply(cache, "ck-1")
    cache.evict_all(keep=frozenset({"Prepare"}))  # a rewrite
    assert cache.get(("ck-1", "Prepare", "controller/0")) is not None
    assert [r.correlation_id for r in journal_records(path)] == ["ck-1"]


def test_a_torn_tail_and_an_old_journal_without_timestamps_load(tmp_path: Path) -> None:
    path = tmp_path / "replies.journal"
    encoder = msgspec.msgpack.Encoder()
    old = encoder.encode(("ck-1", "Prepare", "controller/0", b"reply"))  # the four fields journals had
    path.write_bytes(len(old).to_bytes(4, "big") + old + b"\x00\x00\x01\x00torn")
    clock = Clock()
    cache = ReplyCache(journal=path, max_age_s=100.0, clock=clock)
    assert cache.get(("ck-1", "Prepare", "controller/0")) == b"reply"  # kept, taken as cached at load
    clock.now += 99
    reply(cache, "ck-2")
    assert cache.get(("ck-1", "Prepare", "controller/0")) == b"reply"
    assert [r.correlation_id for r in journal_records(path)] == ["ck-1", "ck-2"]  # the torn tail is gone


def test_forgotten_rollouts_lose_every_cached_reply_of_their_calls(tmp_path: Path) -> None:
    path = tmp_path / "replies.journal"
    cache = ReplyCache(journal=path, clock=Clock())
    for cid in ("g_g1", "g_g1:0", "g_g1:t2", "g_g1:release", "seal:g_g1", "g_g1-a1", "g_g1-a1:0", "g_g2:0"):
        reply(cache, cid, kind="Call", durable=cid.startswith("seal:"))
    reply(cache, "ck-3")
    gone = cache.evict_rollouts([AttemptRef(rollout_id="g_g1", attempt=0)])
    assert gone == 5
    left = sorted(k[0] for k in cache._entries)
    assert left == ["ck-3", "g_g1-a1", "g_g1-a1:0", "g_g2:0"]  # attempt 1 and another rollout stay
    assert cache.evict_rollouts([AttemptRef(rollout_id="g_g1", attempt=1)]) == 2
    assert cache.evict_rollouts([]) == 0
    # the journalled seal got a tombstone: a restart does not bring it back
    again = ReplyCache(journal=path, clock=Clock())
    assert again.get(("seal:g_g1", "Call", "controller/0")) is None
    assert again.get(("ck-3", "Prepare", "controller/0")) is not None


def test_an_id_evicted_in_memory_only_keeps_its_journaled_replies_to_the_journal(tmp_path: Path) -> None:
    # A checkpoint long ended: its memory-only replies (Resume) go, its journaled one (Persist) is left
    # to the journal's bounds, and no tombstone is written (no fsync on that path).
    path = tmp_path / "replies.journal"
    cache = ReplyCache(journal=path, clock=Clock())
    reply(cache, "ck-1", kind="Resume", durable=False)
    reply(cache, "ck-1", kind="Persist")
    reply(cache, "ck-2", kind="Resume", durable=False)
    size = path.stat().st_size
    assert cache.evict("ck-1", journaled=False) == 1
    assert cache.get(("ck-1", "Resume", "controller/0")) is None
    assert cache.get(("ck-1", "Persist", "controller/0")) is not None
    assert cache.get(("ck-2", "Resume", "controller/0")) is not None
    assert path.stat().st_size == size
    assert cache.evict("ck-1") == 1 and cache.get(("ck-1", "Persist", "controller/0")) is None
    assert path.stat().st_size > size  # its tombstone


def test_eviction_finds_its_replies_without_scanning_the_others() -> None:
    # The owner index: evicting one rollout of many looks at its own replies only, and the index ends
    # empty with the cache.
    cache = ReplyCache(capacity=100_000, clock=Clock())
    for n in range(2000):
        reply(cache, f"g_g{n}:0", kind="Call", durable=False)
        reply(cache, f"seal:g_g{n}", kind="SealRows", durable=False)
    seen: list[object] = []

    class Watched(OrderedDict):
        def __iter__(self):  # type: ignore[override]
            seen.append(self)
            return super().__iter__()

    cache._entries = Watched(cache._entries)  # type: ignore[assignment]
    assert cache.evict_rollouts([AttemptRef(rollout_id="g_g7", attempt=0)]) == 2
    assert seen == []  # not one iteration over every reply
    cache._entries = OrderedDict(cache._entries)
    cache.evict_rollouts(AttemptRef(rollout_id=f"g_g{n}", attempt=0) for n in range(2000))
    assert len(cache) == 0 and cache._by_owner == {}


async def test_a_running_command_is_counted_until_it_is_settled() -> None:
    cache = ReplyCache()
    key = ("ck-1", "Prepare", "controller/0")
    future = cache.begin(key)
    assert cache.sizes()["reply_cache_running"] == 1
    cache.finish(key, b"r", remember=True)
    assert await asyncio.wait_for(future, 1) == b"r"
    assert cache.sizes() == {
        "reply_cache": 1,
        "reply_cache_running": 0,
        "reply_cache_bytes": 1,
        "reply_journal_records": 0,
        "reply_journal_bytes": 0,
    }


def test_large_replies_are_bounded_by_bytes_in_memory_and_the_journal_reloads_within_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "replies.journal"
    cache = ReplyCache(journal=path, max_memory_bytes=100 << 10, clock=Clock())
    for n in range(10):  # 30 KiB each: three fit in 100 KiB
        reply(cache, f"fetch-{n}", kind="FetchRows", size=30 << 10)
        assert cache.get((f"fetch-{n}", "FetchRows", "controller/0")) is not None  # the newest stays
    kept = sorted(k[0] for k in cache._entries)
    assert kept == ["fetch-7", "fetch-8", "fetch-9"]
    assert cache.sizes()["reply_cache_bytes"] == 3 * (30 << 10)
    again = ReplyCache(journal=path, max_memory_bytes=70 << 10, clock=Clock())
    assert sorted(k[0] for k in again._entries) == ["fetch-8", "fetch-9"]
    assert again.sizes()["reply_cache_bytes"] == 2 * (30 << 10)
    again.evict("fetch-9")
    assert again.sizes()["reply_cache_bytes"] == 30 << 10
    # One reply larger than the whole budget is still kept (alone): its duplicate is the likely one.
    reply(again, "huge", kind="FetchRows", size=200 << 10)
    assert [k[0] for k in again._entries] == ["huge"]


def test_the_settings_have_defaults_and_refuse_bad_values() -> None:
    assert reply_cache_max_bytes({}) == 16 << 20
    assert reply_cache_max_bytes({"PARKWAY_REPLY_CACHE_MAX_BYTES": "65536"}) == 64 << 10
    with pytest.raises(SettingsError, match="at least"):
        reply_cache_max_bytes({"PARKWAY_REPLY_CACHE_MAX_BYTES": "-1"})
    assert reply_journal_max_bytes({}) == 4 << 20
    assert reply_max_age_s({}) == 7200.0
    assert reply_max_age_s({"PARKWAY_MAX_DEADLINE_S": "5000"}) == 10000.0
    assert reply_journal_max_bytes({"PARKWAY_REPLY_JOURNAL_MAX_BYTES": "1048576"}) == 1 << 20
    with pytest.raises(SettingsError, match="at least"):
        reply_journal_max_bytes({"PARKWAY_REPLY_JOURNAL_MAX_BYTES": "100"})
    with pytest.raises(SettingsError, match="above 0"):
        reply_max_age_s({"PARKWAY_REPLY_MAX_AGE_S": "soon"})
    with pytest.raises(SettingsError, match="below PARKWAY_MAX_DEADLINE_S"):
        reply_max_age_s({"PARKWAY_REPLY_MAX_AGE_S": "60"})
