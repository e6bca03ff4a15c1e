"""Bad input at every actor, one kind at a time: each gets a typed ``Error`` (and, when refused at the
edge, a dead letter with the code), none is silently accepted, none kills the actor.

Oversized bodies (both brokers), wrong secrets and other runs' messages (every role), checkpoint ids
and locations that try to leave the snapshot root (patterns, symlinks planted on the way), a restore
from a snapshot a participant cannot read, receipts of attempts that never existed.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from parkway.actors.launch.roles import ROLES
from parkway.actors.launch.workload import role_options
from parkway.actors.roles.controller.controller import Controller
from parkway.actors.roles.tq import TransferQueue
from parkway.actors.run.config import from_dict
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.participant import Participant
from parkway.actors.runtime.settings import (
    DEFAULT_MAX_DEADLINE_S,
    MAX_BODY_ENV,
    MAX_DEADLINE_ENV,
    NICE_ENV,
    SettingsError,
    max_body_bytes,
    max_deadline_s,
    nice_increment,
    parse_nice,
)
from parkway.brokers.base import Broker, DeadLetter, Envelope
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol import codec
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.ledger import Granularity, Ledger
from parkway.protocol.messages import (
    Abort,
    Commit,
    Committed,
    Completed,
    Error,
    FetchRows,
    Ok,
    Persist,
    Persisted,
    Prepare,
    Prepared,
    Probe,
    ProbeResult,
    Restore,
    Rows,
    StagingRow,
    Status,
    StatusReport,
)
from parkway.protocol.signing import SENDER_HEADER

from tests.support.signed import SECRET, raw_request, signed_raw
from tests.support.waiting import until

RUN = "bad"


def soon(seconds: float = 10.0) -> float:
    return time.time() + seconds


async def alive(client: Client, address: str) -> StatusReport:
    report = await client.request(
        address, Status(checkpoint_id=f"alive-{time.monotonic_ns()}", deadline=soon())
    )
    assert isinstance(report, StatusReport), report
    return report


async def dead_letters(broker: Broker, count: int) -> list[DeadLetter]:
    """The next ``count`` dead letters (an actor replies first, then dead-letters: wait for them)."""
    taken: list[DeadLetter] = []

    async def take() -> None:
        while len(taken) < count:
            taken.extend(await broker.read_dead_letters(limit=count - len(taken)))
            await asyncio.sleep(0.01)

    await asyncio.wait_for(take(), 30)
    assert await broker.read_dead_letters() == []  # and no more than that
    return taken


def error_of(reply: Envelope) -> Error:
    message = codec.decode(reply.body, reply.content_type)
    assert isinstance(message, Error), message
    return message


# -- oversized bodies -------------------------------------------------------------------------------


@pytest.fixture
async def tq_on(
    make_broker: Callable[..., Broker], tmp_path: Path
) -> AsyncIterator[tuple[TransferQueue, Client]]:
    """A TQ actor on the parametrised broker (in memory and the real RabbitMQ)."""
    broker = make_broker()
    await broker.start()
    actor = TransferQueue(broker, secret=SECRET, snapshot_root=tmp_path)
    await actor.start()
    yield actor, Client(broker, secret=SECRET, sender="test/0")
    await actor.stop()


@pytest.mark.parametrize("signed", [True, False])
async def test_an_oversized_body_is_refused_at_the_edge_naming_its_size(
    tq_on: tuple[TransferQueue, Client], signed: bool
) -> None:
    actor, client = tq_on
    limit = codec.MAX_BODY_BYTES
    assert limit == 16 * 1024 * 1024
    body = (
        b'{"type": "Probe", "v": 1, "checkpoint_id": "big", "deadline": 1e10, "note": "'
        + b"x" * limit
        + b'"}'
    )
    envelope = (
        signed_raw(actor.run, body, correlation_id="big", to="tq/0")
        if signed
        else Envelope(body, codec.JSON, "big", {SENDER_HEADER: "stranger/0"})
    )
    reply = await client.broker.request("tq/0", envelope, deadline=soon(30))
    error = error_of(reply)
    # Refused for its size before anything reads it: even unsigned, it is the size that is named.
    assert error.code is ErrorCode.INVALID_MESSAGE and not error.retryable
    assert error.detail == f"body of {len(body)} bytes exceeds the limit of {limit} bytes"
    [letter] = await dead_letters(client.broker, 1)
    assert (letter.code, letter.detail, letter.origin) == ("invalid_message", error.detail, "tq/0")
    assert len(letter.envelope.body) == len(body)  # nothing is lost: the dead letter holds it all
    report = await alive(client, "tq/0")
    assert report.counts["refused:invalid_message"] == 1 and "Probe" not in report.counts
    assert isinstance(
        await client.request("tq/0", Probe(checkpoint_id="small", deadline=soon())), ProbeResult
    )


async def test_the_limit_is_configurable_and_guards_both_directions(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(MAX_BODY_ENV, "4096")
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = TransferQueue(broker, secret=SECRET, snapshot_root=tmp_path)
        await actor.start()
        client = Client(broker, secret=SECRET, sender="test/0")
        assert client.max_bytes == actor.client.max_bytes == 4096
        # Sending: the client refuses a message the receiver would refuse, and sends nothing.
        with pytest.raises(ProtocolError, match=r"Probe of \d+ bytes exceeds the limit of 4096 bytes"):
            await client.request("tq/0", Probe(checkpoint_id="p", deadline=soon(), note="x" * 5000))
        # Receiving: what another client sends over the limit is refused at the edge.
        body = codec.encode(Probe(checkpoint_id="p", deadline=soon(), note="x" * 5000), codec.JSON)
        error = error_of(
            await broker.request(
                "tq/0", signed_raw(RUN, body, correlation_id="p", to="tq/0"), deadline=soon()
            )
        )
        assert error.detail == f"body of {len(body)} bytes exceeds the limit of 4096 bytes"
        # Replying: an answer that would be over the limit becomes an error that says so.
        for turn in range(8):
            row = StagingRow(capture_key="g_g0", turn=turn, token_ids=tuple(range(250)) * 2)
            await client.send("tq/0", Rows(rows=(row,)), correlation_id=f"g_g0:{turn}")
        await client.call(
            "tq/0",
            msgspec_seal("g_g0", [f"g_g0:{t}" for t in range(8)]),
            correlation_id="seal:g_g0",
        )
        reply = await client.request("tq/0", FetchRows(rollout_ids=("g_g0",)), correlation_id="fetch:1")
        assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_MESSAGE
        assert reply.detail.startswith("the reply was not sent: CanonicalRows of ")
        assert reply.detail.endswith("bytes exceeds the limit of 4096 bytes; ask for less")
        assert isinstance(await alive(client, "tq/0"), StatusReport)
        await actor.stop()


def msgspec_seal(rollout: str, keys: list[str]) -> Any:
    from parkway.protocol.messages import SealRows

    return SealRows(rollout_id=rollout, attempt=0, capture_key=rollout, reward=1.0, staging_keys=tuple(keys))


@pytest.mark.parametrize("value", ["lots", "12.5", "-1", "100"])
def test_a_limit_that_is_not_a_number_of_bytes_is_refused(value: str) -> None:
    with pytest.raises(SettingsError, match=f"{MAX_BODY_ENV}={value!r}"):
        max_body_bytes({MAX_BODY_ENV: value})
    assert max_body_bytes({}) == codec.MAX_BODY_BYTES and max_body_bytes({MAX_BODY_ENV: "65536"}) == 65536


@pytest.mark.parametrize("value", ["-3", "20", "1.5", "ten", "\u00b2", "+4"])
def test_a_niceness_that_would_raise_the_priority_or_is_not_a_step_is_refused(value: str) -> None:
    with pytest.raises(
        SettingsError, match=re.escape(f"{NICE_ENV}={value!r}: want a niceness increment, 0 to 19")
    ):
        nice_increment({NICE_ENV: value})
    with pytest.raises(SettingsError, match=re.escape(f"--nice={value!r}")):
        parse_nice(value)
    assert nice_increment({}) == 0 and nice_increment({NICE_ENV: " 10 "}) == 10 and parse_nice("19") == 19


@pytest.mark.parametrize("value", ["soon", "0", "-5", "inf", "nan"])
def test_a_deadline_horizon_that_is_not_a_number_of_seconds_is_refused(value: str) -> None:
    with pytest.raises(SettingsError, match=f"{MAX_DEADLINE_ENV}={value!r}"):
        max_deadline_s({MAX_DEADLINE_ENV: value})
    assert max_deadline_s({}) == DEFAULT_MAX_DEADLINE_S and max_deadline_s({MAX_DEADLINE_ENV: "30"}) == 30.0


# -- every role: wrong secret, another run, no signature ----------------------------------------------

CONFIG = from_dict({"run": RUN, "policy": {"host": "inline"}, "topology": {"agents": 1, "resources": 1}})
ROLE_NAMES = ("controller", "agent", "resources", "policy", "tq")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[MemoryHub, MemoryBroker, dict[str, Any]]]:
    hub = MemoryHub()
    async with MemoryBroker(hub, RUN) as broker:
        actors: dict[str, Any] = {}
        for role in ROLE_NAMES:
            cls = ROLES[role]
            kwargs: dict[str, Any] = {"secret": SECRET, **role_options(role, CONFIG)}
            if issubclass(cls, Participant):
                kwargs["snapshot_root"] = tmp_path / "snapshots"
            actors[role] = cls(broker, **kwargs)
            await actors[role].start()
        yield hub, broker, actors
        for actor in actors.values():
            await actor.stop()


@pytest.mark.parametrize("role", ROLE_NAMES)
@pytest.mark.parametrize("who", ["wrong secret", "another run", "unsigned"])
async def test_a_message_that_is_not_signed_for_this_run_is_unauthorized_at_every_role(
    cluster: tuple[MemoryHub, MemoryBroker, dict[str, Any]], role: str, who: str
) -> None:
    hub, broker, _ = cluster
    probe = Probe(checkpoint_id="p-1", deadline=soon())
    address = f"{role}/0"
    if who == "wrong secret":
        guess = Client(broker, secret=b"a guess", sender="test/0")
        envelope = guess.envelope(probe, correlation_id="p-1", to=address)
    elif who == "another run":  # same secret, same queue name, another run: the run is signed too
        async with MemoryBroker(hub, "other") as other:
            foreign = Client(other, secret=SECRET, sender="test/0")
            envelope = foreign.envelope(probe, correlation_id="p-1", to=address)
    else:
        envelope = Envelope(codec.encode(probe), codec.MSGPACK, "p-1", {SENDER_HEADER: "test/0"})
    error = error_of(await broker.request(address, envelope, deadline=soon()))
    assert error.code is ErrorCode.UNAUTHORIZED and "does not verify for run 'bad'" in error.detail
    [letter] = await dead_letters(broker, 1)
    assert (letter.code, letter.origin) == ("unauthorized", address)
    client = Client(broker, secret=SECRET, sender="test/0")
    report = await alive(client, address)
    assert report.counts["refused:unauthorized"] == 1 and "Probe" not in report.counts  # not run
    assert isinstance(await client.request(address, probe), ProbeResult)  # the same command, signed


# -- paths: nothing from a message leaves the snapshot root -------------------------------------------


@pytest.fixture
async def resources(tmp_path: Path) -> AsyncIterator[tuple[Participant, Client, Path, Path]]:
    """A participant, its snapshot root, and a directory outside it that must stay untouched."""
    root, outside = tmp_path / "snapshots", tmp_path / "outside"
    (root / RUN).mkdir(parents=True)
    outside.mkdir()
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = ROLES["resources"](broker, secret=SECRET, snapshot_root=root)
        await actor.start()
        yield actor, Client(broker, secret=SECRET, sender="controller/0"), root, outside
        await actor.stop()


@pytest.mark.parametrize(
    "body",
    [
        b'{"type": "Commit", "v": 1, "checkpoint_id": "ck-1", "deadline": 2e9, "location": "../../outside"}',
        b'{"type": "Commit", "v": 1, "checkpoint_id": "ck-1", "deadline": 2e9, "location": "/tmp"}',
        b'{"type": "Commit", "v": 1, "checkpoint_id": "..", "deadline": 2e9, "location": "tmp_.."}',
        b'{"type": "Commit", "v": 1, "checkpoint_id": "ck-1", "deadline": 2e9, "location": "snapshot_1"}',
        b'{"type": "Restore", "v": 1, "checkpoint_id": "rs-1", "deadline": 2e9, "location": "tmp_ck-1"}',
        '{"type": "Restore", "v": 1, "checkpoint_id": "rs-1", "deadline": 2e9, "location": "snapshot_1\u2215.."}'.encode(),
        b'{"type": "Prepare", "v": 1, "checkpoint_id": "ck/../../x", "deadline": 2e9}',
        b'{"type": "Prepare", "v": 1, "checkpoint_id": "' + b"c" * 129 + b'", "deadline": 2e9}',
    ],
)
async def test_hostile_ids_and_locations_are_refused_before_the_disk(
    resources: tuple[Participant, Client, Path, Path], body: bytes
) -> None:
    _, client, root, outside = resources
    reply = await raw_request(
        client, "resources/0", signed_raw(RUN, body, correlation_id="hostile", to="resources/0")
    )
    assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_MESSAGE
    assert any(word in reply.detail for word in ("location", "checkpoint"))
    [letter] = await dead_letters(client.broker, 1)
    assert letter.code == "invalid_message"
    assert list(root.rglob("*")) == [root / RUN] and list(outside.iterdir()) == []
    assert (await alive(client, "resources/0")).phase == "idle"


async def prepare(client: Client, cid: str) -> None:
    assert isinstance(
        await client.request("resources/0", Prepare(checkpoint_id=cid, deadline=soon())), Prepared
    )


@pytest.mark.parametrize("planted", ["tmp_ck-1", "tmp_ck-1/participants"])
async def test_a_symlink_planted_on_the_way_out_is_refused(
    resources: tuple[Participant, Client, Path, Path], planted: str
) -> None:
    _, client, root, outside = resources
    link = root / RUN / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside, target_is_directory=True)
    await prepare(client, "ck-1")
    reply = await client.request(
        "resources/0", Commit(checkpoint_id="ck-1", deadline=soon(), location="tmp_ck-1")
    )
    assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_MESSAGE, reply
    assert "outside the snapshot directory" in reply.detail and str(outside) in reply.detail
    assert list(outside.rglob("*")) == []  # nothing was written through the link
    assert (await alive(client, "resources/0")).phase == "prepared"  # the commit did not happen
    assert await client.request("resources/0", Abort(checkpoint_id="ck-1", deadline=soon())) == Ok(
        detail="aborted in phase prepared"
    )


async def test_a_restore_through_a_planted_symlink_reads_nothing(
    resources: tuple[Participant, Client, Path, Path],
) -> None:
    _, client, root, outside = resources
    (outside / "participants" / "resources" / "0").mkdir(parents=True)
    (outside / "participants" / "resources" / "0" / "sessions.msgpack").write_bytes(b"\x90")
    (root / RUN / "snapshot_1").symlink_to(outside, target_is_directory=True)
    reply = await client.request(
        "resources/0", Restore(checkpoint_id="rs-1", deadline=soon(), location="snapshot_1")
    )
    assert isinstance(reply, Error) and "outside the snapshot directory" in reply.detail
    assert (await alive(client, "resources/0")).phase == "idle"


async def test_a_run_directory_that_is_itself_a_link_is_fine(tmp_path: Path) -> None:
    # Moving a run's snapshots to another disk and linking them back is a user's choice, not an escape.
    elsewhere, root = tmp_path / "big-disk" / RUN, tmp_path / "snapshots"
    elsewhere.mkdir(parents=True)
    root.mkdir()
    (root / RUN).symlink_to(elsewhere, target_is_directory=True)
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        actor = ROLES["resources"](broker, secret=SECRET, snapshot_root=root)
        await actor.start()
        client = Client(broker, secret=SECRET, sender="controller/0")
        await prepare(client, "ck-1")
        committed = await client.request(
            "resources/0", Commit(checkpoint_id="ck-1", deadline=soon(), location="tmp_ck-1")
        )
        assert isinstance(committed, Committed)
        persisted = await client.request(
            "resources/0", Persist(checkpoint_id="ck-1", deadline=soon(), location="tmp_ck-1")
        )
        assert isinstance(persisted, Persisted)
        assert (elsewhere / "tmp_ck-1" / "participants" / "resources" / "0" / "sessions.msgpack").is_file()
        await actor.stop()


# -- a restore a participant cannot read ---------------------------------------------------------------


@pytest.mark.parametrize("role", ["agent", "resources", "policy", "tq"])
@pytest.mark.parametrize("damage", ["missing", "not msgpack", "wrong records"])
async def test_a_snapshot_a_participant_cannot_read_is_a_typed_refusal_that_changes_nothing(
    cluster: tuple[MemoryHub, MemoryBroker, dict[str, Any]], role: str, damage: str
) -> None:
    _, broker, actors = cluster
    actor = actors[role]
    directory = actor.participant_dir("snapshot_1")
    if damage != "missing":
        directory.mkdir(parents=True)
        for name in ("rollouts", "sessions", "participant", "staging", "canonical", "lineage"):
            (directory / f"{name}.msgpack").write_bytes(b"\xc1" if damage == "not msgpack" else b"\x91\x07")
    before = (getattr(actor, "epoch", None), getattr(actor, "policy_version", None))
    client = Client(broker, secret=SECRET, sender="controller/0")
    reply = await client.request(
        f"{role}/0", Restore(checkpoint_id="rs-1", deadline=soon(), location="snapshot_1", epoch=9)
    )
    assert isinstance(reply, Error) and reply.code is ErrorCode.INVALID_MESSAGE, reply
    assert reply.detail.startswith("snapshot_1 cannot be restored: ") and str(RUN) in reply.detail
    report = await alive(client, f"{role}/0")
    assert report.phase == "idle" and report.counts.get("refused:internal", 0) == 0
    assert (getattr(actor, "epoch", None), getattr(actor, "policy_version", None)) == before  # untouched
    assert await broker.read_dead_letters() == []  # a verdict on the command, not a broken message


# -- receipts of attempts that never existed ------------------------------------------------------------


async def test_a_receipt_of_an_attempt_never_reserved_is_stale_not_a_bug() -> None:
    async with MemoryBroker(MemoryHub(), RUN) as broker:
        controller = Controller(broker, secret=SECRET)
        controller.ledger = Ledger()
        controller.ledger.add_group("t0000", 0, 2, Granularity.SIBLING)
        await controller.start()
        client = Client(broker, secret=SECRET, sender="agent/0")
        receipt = Completed(rollout_id="t0000_g0", attempt=5, capture_key="t0000_g0-a5", reward=1.0, turns=1)
        await client.send("controller/0", receipt, correlation_id="r-5")  # before: a LedgerError (internal)
        await until(lambda: controller.handled == 1)
        report = await alive(client, "controller/0")
        assert report.counts["receipts_stale"] == 1 and report.counts.get("refused:internal", 0) == 0
        assert await broker.read_dead_letters() == []
        assert controller.ledger.sibling("t0000_g0").current.state.value == "reserved"  # untouched
        await controller.stop()
