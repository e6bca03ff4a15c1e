"""Hypothesis strategies for hostile and broken input: what a buggy client or an attacker sends."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from hypothesis import strategies as st
from parkway.protocol import codec
from parkway.protocol import messages as m
from parkway.protocol.ids import CHECKPOINT_ID_PATTERN

# The status counters of messages an actor refused (each of these is also dead-lettered).
REFUSALS = (
    "refused:unauthorized",
    "refused:invalid_message",
    "refused:unsupported_version",
    "refused:internal",
)

checkpoint_ids = st.from_regex(CHECKPOINT_ID_PATTERN, fullmatch=True)
rollout_ids = st.text(min_size=1, max_size=20)
small_ints = st.integers(min_value=0, max_value=5)
deadlines = st.floats(min_value=0, max_value=4e9, allow_nan=False)

episodes = st.builds(m.EpisodeRef, rollout_id=rollout_ids, attempt=small_ints, replica=small_ints)
attempts = st.builds(m.AttemptRef, rollout_id=rollout_ids, attempt=small_ints)
locations = st.sampled_from(["tmp_x", "snapshot_1", "tmp_ck-9"])

valid_messages = st.one_of(
    st.builds(m.Status, checkpoint_id=checkpoint_ids, deadline=deadlines),
    st.builds(m.Discover, checkpoint_id=checkpoint_ids, deadline=deadlines),
    st.builds(m.Prepare, checkpoint_id=checkpoint_ids, deadline=deadlines),
    st.builds(m.Renew, checkpoint_id=checkpoint_ids, deadline=deadlines),
    st.builds(m.Abort, checkpoint_id=checkpoint_ids, deadline=deadlines, reason=st.text(max_size=20)),
    st.builds(m.Resume, checkpoint_id=checkpoint_ids, deadline=deadlines),
    st.builds(
        m.Commit,
        checkpoint_id=checkpoint_ids,
        deadline=deadlines,
        location=locations,
        episodes=st.lists(episodes, max_size=3).map(tuple),
    ),
    st.builds(
        m.Retire,
        checkpoint_id=checkpoint_ids,
        deadline=deadlines,
        attempts=st.lists(attempts, max_size=3).map(tuple),
    ),
    st.builds(m.Probe, checkpoint_id=checkpoint_ids, deadline=deadlines),
    st.builds(
        m.Run,
        rollout_id=rollout_ids,
        attempt=small_ints,
        group_id=st.text(max_size=8),
        env=st.text(max_size=8),
        prompt=st.text(max_size=20),
    ),
    st.builds(m.Ack, receipts=st.lists(attempts, max_size=4).map(tuple)),
    st.builds(m.Ok, detail=st.text(max_size=10)),
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
type_names = st.sampled_from([*m.MESSAGE_TYPES, "Bogus", "", "prepare"])
versions = st.sampled_from([1, 1, 1, 0, 2, -1, 10**12])
fields = st.sampled_from(
    [
        "checkpoint_id",
        "deadline",
        "location",
        "episodes",
        "rollout_id",
        "attempt",
        "reason",
        "receipts",
        "work_s",
        "x",
    ]
)


@dataclass(frozen=True)
class Fuzzed:
    body: bytes
    content_type: str
    correlation_id: str
    signed: bool


@st.composite
def fuzzed(draw: st.DrawFn) -> Fuzzed:
    kind = draw(st.sampled_from(["valid", "valid", "mutated", "json", "json", "bytes"]))
    correlation_id = draw(checkpoint_ids)
    content_type = codec.MSGPACK
    if kind in ("valid", "mutated"):
        message = draw(valid_messages)
        content_type = draw(st.sampled_from([codec.MSGPACK, codec.JSON]))
        body = codec.encode(message, content_type)
        if isinstance(message, m.ControlCommand) and draw(st.booleans()):
            correlation_id = message.checkpoint_id
        if kind == "mutated":
            rng = random.Random(draw(st.integers(0, 2**32)))
            raw = bytearray(body)
            for _ in range(draw(st.integers(1, 4))):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            body = bytes(raw)
    elif kind == "json":
        document = {"type": draw(type_names), "v": draw(versions)}
        document.update(draw(st.dictionaries(fields, json_values, max_size=4)))
        content_type = codec.JSON
        body = json.dumps(document).encode()
    else:
        body = draw(st.binary(max_size=200))
        content_type = draw(st.sampled_from([codec.MSGPACK, codec.JSON, "", "text/xml"]))
    signed = draw(st.sampled_from([True] * 9 + [False]))
    return Fuzzed(body, content_type, correlation_id, signed)
