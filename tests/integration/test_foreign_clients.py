"""Clients that are not ours: a plain pika script publishing JSON, signing with ``cryptography`` alone."""

from __future__ import annotations

import base64
import json
import time
import uuid

import pika
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from parkway.protocol.signing import Keyring

from tests.support.processes import SECRET, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


def pika_request(url: str, run: str, address: str, body: dict, *, sign_it: bool = True) -> dict:
    """What a user's script does: JSON body, an Ed25519 signature by hand with the controller's key
    (its ``PARKWAY_KEY_CONTROLLER`` text: ``controller:<base64 seed>``), its own reply queue, blocking
    wait. Only the key text comes from parkway (the launcher derives the run's keys from its secret)."""
    raw = json.dumps(body).encode()
    correlation_id = body["checkpoint_id"]
    sender, message_id = "script/1", uuid.uuid4().hex
    headers = {"x-parkway-sender": sender}
    if sign_it:
        key_text = Keyring.derive(SECRET.encode(), run).private_text(["controller"])
        key = Ed25519PrivateKey.from_private_bytes(base64.b64decode(key_text.partition(":")[2]))
        fields = ["parkway-v2", run, sender, "controller", address, body["type"], correlation_id, message_id]
        parts = [f.encode() for f in [*fields, "application/json"]] + [raw]
        signed = b"".join(len(part).to_bytes(8, "big") + part for part in parts)
        headers.update(
            {
                "x-parkway-key": "controller",
                "x-parkway-to": address,
                "x-parkway-type": body["type"],
                "x-parkway-message-id": message_id,
                "x-parkway-signature": base64.b64encode(key.sign(signed)).decode(),
            }
        )
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        reply_queue = channel.queue_declare("", exclusive=True).method.queue
        channel.basic_publish(
            exchange=f"pk.{run}",
            routing_key=address,
            body=raw,
            properties=pika.BasicProperties(
                content_type="application/json",
                correlation_id=correlation_id,
                reply_to=reply_queue,
                headers=headers,
            ),
        )
        for _method, properties, reply in channel.consume(reply_queue, auto_ack=True, inactivity_timeout=15):
            assert reply is not None, "no reply within 15 s"
            assert properties.content_type == "application/json"
            assert properties.correlation_id == correlation_id
            return json.loads(reply)
        raise AssertionError("unreachable")
    finally:
        connection.close()


async def test_a_json_command_from_pika_is_accepted_and_answered(spawn, client, amqp_url, run_name) -> None:
    actor = spawn("resources")
    await wait_ready(client, actor)
    deadline = time.time() + 30
    status = pika_request(
        amqp_url,
        run_name,
        "resources/0",
        {"type": "Status", "v": 1, "checkpoint_id": f"s-{uuid.uuid4().hex[:6]}", "deadline": deadline},
    )
    assert status["type"] == "StatusReport" and status["pid"] == actor.pid and status["phase"] == "idle"
    prepared = pika_request(
        amqp_url,
        run_name,
        "resources/0",
        {"type": "Prepare", "v": 1, "checkpoint_id": "by-script-1", "deadline": deadline},
    )
    assert prepared == {
        "type": "Prepared",
        "v": 1,
        "checkpoint_id": "by-script-1",
        "parked": 0,
        "boundaries_passed": 0,
        "restarts": [],
        "waited_s": 0.0,
        "episodes": [],
        "base": "",  # a whole cut (only an agent's answer may name what changed since a base)
        "gone": [],
        "receipts": [],  # (an agent's: its receipts not yet acknowledged)
    }
    resumed = pika_request(
        amqp_url,
        run_name,
        "resources/0",
        {"type": "Abort", "v": 1, "checkpoint_id": "by-script-1", "deadline": deadline},
    )
    assert resumed["type"] == "Ok" and "aborted in phase prepared" in resumed["detail"]


async def test_an_unsigned_json_command_is_refused_with_a_typed_error(
    spawn, client, amqp_url, run_name
) -> None:
    actor = spawn("resources")
    await wait_ready(client, actor)
    reply = pika_request(
        amqp_url,
        run_name,
        "resources/0",
        {"type": "Prepare", "v": 1, "checkpoint_id": "unsigned-1", "deadline": time.time() + 30},
        sign_it=False,
    )
    assert reply["type"] == "Error" and reply["code"] == "unauthorized" and reply["retryable"] is False
    [letter] = await client.broker.read_dead_letters()
    assert (letter.code, letter.envelope.correlation_id) == ("unauthorized", "unsigned-1")
