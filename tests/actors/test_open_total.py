"""Nothing any sender can put on an actor's queue reaches the actor's ``decode_failed`` guard.

``Actor._handle`` keeps a guard for an exception other than ``ProtocolError`` out of ``_open``
(size, signature, decode, correlation id, deadline horizon): it would refuse the delivery as
``internal``. This proves the guard unreachable for fuzzed deliveries of every kind, signed or not.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parkway.actors.launch.roles import ROLES
from parkway.actors.runtime.actor import Actor
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.errors import ProtocolError
from parkway.protocol.messages import Message

from tests.support.fuzz import Fuzzed, Signers, envelope_of, fuzzed
from tests.support.signed import SECRET

BROKER = MemoryBroker(MemoryHub(), "open")  # never started: ``_open`` only reads its run name
ACTORS = [ROLES[role](BROKER, secret=SECRET) for role in ("controller", "agent", "resources", "policy", "tq")]
SIGNERS = Signers.of(BROKER, SECRET)


@settings(
    max_examples=1500,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(item=fuzzed(), actor=st.sampled_from(ACTORS))
def test_opening_any_delivery_is_a_message_or_a_typed_refusal(item: Fuzzed, actor: Actor) -> None:
    envelope = envelope_of(item, SIGNERS, actor.address)
    try:
        message = actor._open(envelope)
    except ProtocolError:
        return
    assert isinstance(message, Message)
