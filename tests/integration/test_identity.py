"""Who may command a participant, over the real RabbitMQ with real ``parkway actor`` processes.

Each process holds its own role's private key only (the launcher's ``own_keys``). An agent's
credentials, read from the agent process itself, cannot make any participant accept a control
command, whatever sender it claims; nor can the old shared secret. A message signed for one queue and
republished unchanged to another replica's is refused there.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from pathlib import Path

import pytest
from parkway.actors.launch.processes import Process
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.settings import PUBLIC_KEYS_ENV, SIGNING_KEY_ENV
from parkway.brokers.base import Envelope
from parkway.protocol import codec
from parkway.protocol.errors import ErrorCode
from parkway.protocol.layout import tmp_dir_name
from parkway.protocol.messages import (
    Abort,
    Commit,
    ControlCommand,
    Error,
    Forget,
    LoadWeights,
    Prepare,
    Prepared,
    Probe,
    ProbeResult,
    Renew,
    Restore,
    Resume,
    Retire,
    Snapshot,
    StatusReport,
)
from parkway.protocol.signing import (
    KEY_HEADER,
    MESSAGE_ID_HEADER,
    SENDER_HEADER,
    SIGNATURE_HEADER,
    TO_HEADER,
    TYPE_HEADER,
    Keyring,
    signing_input,
)

from tests.support.processes import SECRET, status_of, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

PARTICIPANTS = ("agent/0", "resources/0", "policy/0", "tq/0", "trainer/0")


def control_commands(cid: str) -> list[ControlCommand]:
    deadline = time.time() + 30
    return [
        Prepare(checkpoint_id=cid, deadline=deadline),
        Renew(checkpoint_id=cid, deadline=deadline),
        Commit(checkpoint_id=cid, deadline=deadline, location=tmp_dir_name(cid)),
        Resume(checkpoint_id=cid, deadline=deadline),
        Abort(checkpoint_id=cid, deadline=deadline, reason="forged"),
        Restore(checkpoint_id=cid, deadline=deadline, location="snapshot_1", epoch=9),
        Retire(checkpoint_id=cid, deadline=deadline),
        Forget(checkpoint_id=cid, deadline=deadline),
        Snapshot(checkpoint_id=cid, deadline=deadline),
        LoadWeights(checkpoint_id=cid, deadline=deadline, directory="/tmp", policy_version=2),
    ]


def environ_of(process: Process) -> dict[str, str]:
    """What the running process was given: its own /proc environment."""
    raw = Path(f"/proc/{process.pid}/environ").read_bytes()
    return dict(item.decode().partition("=")[::2] for item in raw.split(b"\0") if item)


def forged(
    keys: Keyring, command: ControlCommand, *, run: str, to: str, sender: str, key_role: str, signer: str
) -> Envelope:
    """``command`` claiming ``sender`` and ``key_role``'s key, signed with ``signer``'s private key."""
    body = codec.encode(command)
    message_id = f"forged-{time.monotonic_ns()}"
    data = signing_input(
        run=run,
        sender=sender,
        key_role=key_role,
        to=to,
        message_type=type(command).__name__,
        correlation_id=command.checkpoint_id,
        message_id=message_id,
        content_type=codec.MSGPACK,
        body=body,
    )
    headers = {
        SENDER_HEADER: sender,
        KEY_HEADER: key_role,
        TO_HEADER: to,
        TYPE_HEADER: type(command).__name__,
        MESSAGE_ID_HEADER: message_id,
        SIGNATURE_HEADER: keys.sign(signer, data),
    }
    return Envelope(body, codec.MSGPACK, command.checkpoint_id, headers)


def old_shared_secret(command: ControlCommand, *, run: str, sender: str) -> Envelope:
    """``command`` signed the way every process could before: HMAC with the run's shared secret."""
    body = codec.encode(command)
    head = "\n".join(("parkway-v1", run, sender, command.checkpoint_id, codec.MSGPACK)).encode()
    signature = hmac.new(SECRET.encode(), head + b"\n" + body, hashlib.sha256).hexdigest()
    headers = {SENDER_HEADER: sender, SIGNATURE_HEADER: signature}
    return Envelope(body, codec.MSGPACK, command.checkpoint_id, headers)


async def answer(client: Client, address: str, envelope: Envelope) -> object:
    """The reply to ``envelope``, verified as the reply to its sender (it is signed for that sender)."""
    reply = await client.broker.request(address, envelope, deadline=time.time() + 15)
    opener = Client(client.broker, secret=SECRET.encode(), sender=envelope.headers[SENDER_HEADER])
    return opener.open_reply(reply, requested=address)


async def test_an_agent_key_or_the_old_secret_cannot_command_any_participant(
    spawn, client: Client, run_name: str
) -> None:
    processes = {
        address: spawn(address.split("/")[0], int(address.split("/")[1])) for address in PARTICIPANTS
    }
    for process in processes.values():
        await wait_ready(client, process, timeout=60)
    before = {address: await status_of(client, address) for address in PARTICIPANTS}

    # The agent's credentials, as the agent process holds them: its own key and the public table only.
    agent_env = environ_of(processes["agent/0"])
    assert "PARKWAY_SECRET" not in agent_env
    assert agent_env[SIGNING_KEY_ENV].startswith("agent:") and "," not in agent_env[SIGNING_KEY_ENV]
    stolen = Keyring.from_text(agent_env[SIGNING_KEY_ENV], agent_env[PUBLIC_KEYS_ENV])
    assert set(stolen.private) == {"agent"}

    refusals: dict[str, list[str]] = {}
    for address in PARTICIPANTS:
        for command in control_commands(f"ck-forged-{address[0]}{address[-1]}"):
            attempts = {
                "as itself": forged(
                    stolen,
                    command,
                    run=run_name,
                    to=address,
                    sender="agent/0",
                    key_role="agent",
                    signer="agent",
                ),
                "as the controller": forged(
                    stolen,
                    command,
                    run=run_name,
                    to=address,
                    sender="controller/0",
                    key_role="agent",
                    signer="agent",
                ),
                "claiming the controller key": forged(
                    stolen,
                    command,
                    run=run_name,
                    to=address,
                    sender="controller/0",
                    key_role="controller",
                    signer="agent",
                ),
                "as a tool": forged(
                    stolen,
                    command,
                    run=run_name,
                    to=address,
                    sender="cli/7",
                    key_role="agent",
                    signer="agent",
                ),
                "with the old shared secret": old_shared_secret(command, run=run_name, sender="controller/0"),
            }
            for how, envelope in attempts.items():
                reply = await answer(client, address, envelope)
                assert isinstance(reply, Error), (address, type(command).__name__, how, reply)
                assert reply.code is ErrorCode.UNAUTHORIZED, (address, how, reply)
                refusals.setdefault(address, []).append(reply.detail)
    sent = len(control_commands("ck-x")) * 5
    for address in PARTICIPANTS:
        after = await status_of(client, address)
        assert after.phase == before[address].phase, address  # nothing prepared, restored, retired
        assert after.counts.get("refused:unauthorized") == sent, (address, after.counts)
        changed = {name for name, n in after.counts.items() if n != before[address].counts.get(name, 0)}
        handled = {name for name in changed if not name.startswith(("refused:", "Status", "error:"))}
        assert handled <= {"replayed"} and after.handled == before[address].handled, (address, after.counts)
    details = refusals["tq/0"]
    assert "the agent role may not send Prepare (only controller)" in details[0]
    assert (
        details[1] == "sender controller/0 is a controller address but the message is signed by the agent key"
    )
    assert "does not verify" in details[2] and "does not verify" in details[4]

    # The same command with the controller's key is accepted: the refusals were the identity's.
    prepared = await client.request("agent/0", Prepare(checkpoint_id="ck-real", deadline=time.time() + 30))
    assert isinstance(prepared, Prepared)
    await client.request("agent/0", Abort(checkpoint_id="ck-real", deadline=time.time() + 30))


async def test_a_probe_republished_to_another_replica_is_refused(spawn, client: Client) -> None:
    first, second = spawn("resources", 0), spawn("resources", 1)
    await wait_ready(client, first)
    await wait_ready(client, second)
    probe = Probe(checkpoint_id="ck-moved", deadline=time.time() + 30, note="once")
    captured = client.envelope(probe, correlation_id=probe.checkpoint_id, to="resources/0")
    ran = client.open_reply(
        await client.broker.request("resources/0", captured, deadline=time.time() + 15),
        requested="resources/0",
    )
    assert isinstance(ran, ProbeResult) and ran.executions == 1 and ran.pid == first.pid
    # The captured envelope, unchanged, on the other replica's queue.
    moved = client.open_reply(
        await client.broker.request("resources/1", captured, deadline=time.time() + 15),
        requested="resources/1",
    )
    assert isinstance(moved, Error) and moved.code is ErrorCode.UNAUTHORIZED, moved
    assert moved.detail == "a message from controller/0 signed for resources/0 was delivered to resources/1"
    report = await status_of(client, "resources/1")
    assert isinstance(report, StatusReport) and "Probe" not in report.counts
    assert report.counts["refused:unauthorized"] == 1
    # resources/1 still runs a Probe signed for it.
    own = await client.request("resources/1", probe)
    assert isinstance(own, ProbeResult) and own.executions == 1 and own.pid == second.pid
