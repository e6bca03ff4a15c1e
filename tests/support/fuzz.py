"""Hypothesis strategies for hostile and broken input: what a buggy client or an attacker sends.

``fuzzed()`` draws one delivery: a body (a message of any type in the union with fuzzed fields, a
mutated or hand-written one, or junk bytes), a content type, a correlation id and how it is signed
(correctly, not at all, with a wrong secret, or for another run). ``typed_messages`` derives each
message type's fields from its msgspec definition, so a message type added later is fuzzed too: field
values are mostly well typed and plausible (ids from small pools, so commands meet each other) and
sometimes of the wrong type, missing, or joined by an unknown field.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st
from parkway.brokers.base import Envelope
from parkway.protocol import codec
from parkway.protocol import messages as m
from parkway.protocol.ids import CHECKPOINT_ID_PATTERN
from parkway.protocol.signing import SENDER_HEADER

from tests.support.signed import signed_raw

# The status counters of messages an actor refused at its edge (each of these is also dead-lettered).
REFUSALS = (
    "refused:unauthorized",
    "refused:invalid_message",
    "refused:unsupported_version",
    "refused:internal",
)

# How a delivery is signed: correctly, not at all, with another secret, or by the same secret for another run.
SIGNINGS = ("ok", "ok", "ok", "ok", "ok", "ok", "ok", "none", "wrong_secret", "other_run")

checkpoint_ids = st.from_regex(CHECKPOINT_ID_PATTERN, fullmatch=True)
rollout_ids = st.text(min_size=1, max_size=20)
small_ints = st.integers(min_value=0, max_value=5)
deadlines = st.floats(min_value=0, max_value=4e9, allow_nan=False)

# A few ids every drawn command picks from, so that Prepare, Commit, Resume and Abort of one id meet.
CHECKPOINT_POOL = ("ck-a", "ck-b", "ck-c", "fz.1")
# Ids and paths that must never become a path outside the snapshot root.
HOSTILE_IDS = (
    "",
    ".",
    "..",
    "../../etc",
    "ck/../../x",
    "/etc/passwd",
    "ck\x00x",
    "ck\u2215..\u2215x",  # a unicode division slash
    "\uff43\uff4b",  # fullwidth "ck"
    "ck-" + "x" * 200,
    "-ck",
)
HOSTILE_LOCATIONS = (
    "../../outside",
    "/tmp",
    "tmp_../../x",
    "snapshot_1/../../x",
    "tmp_ck-a/../../x",
    "tmp_ck\u2215..",
    "snapshot_-1",
    "tmp_",
    "",
    "tmp_" + "x" * 200,
)
# (Not the workload's own ids, "t0000_g0" and so on: a signed message about a real rollout is the
# controller's word, and the workload run after the fuzz would rightly obey it.)
ROLLOUT_POOL = ("fz_g0", "fz_g1", "fz-a1", "x")
ENV_POOL = ("bank", "counter", "workplace", "nope", "")
TOOL_POOL = ("transfer", "balance", "increment", "get", "add_todo", "verify", "release", "nope", "")
EXTREME_INTS = (-1, -(2**63), 2**63 - 1, 2**64 - 1, 10**6)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)


def _deadlines() -> st.SearchStrategy[float]:
    """Mostly a fraction of a second ahead (a command that holds ends soon), else past or absurd."""
    return _mostly(
        st.floats(min_value=0.05, max_value=1.0).map(lambda d: time.time() + d),
        st.one_of(
            st.floats(min_value=-1e6, max_value=-0.001).map(lambda d: time.time() + d),
            st.sampled_from([0.0, -1.0, math.inf, 4e9]),
        ),
    )


@st.composite
def _mostly(draw: st.DrawFn, good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> Any:
    """``good`` about nine times in ten (a plain one_of leans on its branches unevenly)."""
    return draw(bad) if draw(st.integers(0, 2**32 - 1)) % 10 == 7 else draw(good)


def _ints(name: str) -> st.SearchStrategy[int]:
    if name in ("epoch", "policy_version"):
        # A higher epoch or version is a newer controller: valid, and it would fence the real one.
        return st.one_of(st.integers(0, 1), st.sampled_from([-1, -(2**63)]))
    if name == "max_turns":  # (a signed Run of a billion turns would be obeyed too)
        return st.one_of(st.integers(0, 6), st.just(-1))
    if name == "max_tokens":
        return st.one_of(st.integers(0, 64), st.sampled_from([-1, 2**63 - 1, 10**9]))
    if name in ("token_ids", "stop_token_ids"):
        return _mostly(st.integers(0, 300), st.sampled_from(EXTREME_INTS))
    return _mostly(small_ints, st.sampled_from(EXTREME_INTS))


def _strings(name: str) -> st.SearchStrategy[str]:
    pools: dict[str, st.SearchStrategy[str]] = {
        "checkpoint_id": _mostly(
            st.one_of(st.sampled_from(CHECKPOINT_POOL), checkpoint_ids), st.sampled_from(HOSTILE_IDS)
        ),
        "location": _mostly(
            st.sampled_from(["snapshot_1", "snapshot_2"]), st.sampled_from(HOSTILE_LOCATIONS)
        ),
        "rollout_id": _mostly(st.sampled_from(ROLLOUT_POOL), st.text(max_size=12)),
        "capture_key": _mostly(st.sampled_from(ROLLOUT_POOL), st.text(max_size=12)),
        "env": st.sampled_from(ENV_POOL),
        "tool": st.sampled_from(TOOL_POOL),
        "directory": st.sampled_from(["/nonexistent/weights", "", "../../", "/", "weights"]),
    }
    return pools.get(name, st.text(max_size=16))


def _value(t: Any, name: str, depth: int = 0) -> st.SearchStrategy[Any]:
    """A plausible, well-typed value of msgspec type ``t`` for the field ``name``."""
    kind = type(t).__name__
    if kind == "IntType":
        return _ints(name)
    if kind == "FloatType":
        if name == "deadline":
            return _deadlines()
        return st.one_of(st.floats(0, 10), st.sampled_from([-1.0, 1e308, math.inf]))
    if kind == "StrType":
        return _strings(name)
    if kind == "BoolType":
        return st.booleans()
    if kind == "NoneType":
        return st.none()
    if kind == "EnumType":
        return st.one_of(st.sampled_from([e.value for e in t.cls]), st.just("no_such_code"))
    if kind == "UnionType":
        return st.one_of(*(_value(x, name, depth) for x in t.types))
    if kind == "VarTupleType":
        if depth > 2:
            return st.just([])
        return st.lists(_value(t.item_type, name, depth + 1), max_size=3)
    if kind == "DictType":
        return st.dictionaries(st.text(max_size=8), json_values, max_size=3)
    if kind == "StructType":
        if depth > 2:
            return st.just({})
        return _fields(t, depth + 1)
    return json_values  # CustomType(object) and anything new


@st.composite
def _fields(draw: st.DrawFn, info: Any, depth: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in info.fields:
        if field.name == "v":
            continue
        if not field.required and draw(st.booleans()):
            continue  # leave an optional field to its default
        out[field.encode_name] = draw(_value(field.type, field.name, depth))
    return out


@st.composite
def typed_messages(draw: st.DrawFn, focus: tuple[str, ...] = ()) -> dict[str, Any]:
    """A message of any type as a plain document: mostly well typed, sometimes broken on purpose.
    Most of them are of the ``focus`` types (those the target handles), when given."""
    # Rates from a drawn seed: hypothesis leans towards the first choice of a draw, which would make
    # "broken" the common case; the values themselves still come from hypothesis.
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    names = focus if focus and rng.random() < 0.7 else tuple(m.MESSAGE_TYPES)
    name = names[rng.randrange(len(names))]
    info = cast(mi.StructType, mi.type_info(m.MESSAGE_TYPES[name]))  # every message is a Struct
    document: dict[str, Any] = {"type": name, "v": 1 if rng.random() < 0.95 else rng.choice([0, 2, -1])}
    document.update(draw(_fields(info)))
    if name == "Commit" and isinstance(document.get("checkpoint_id"), str) and rng.random() < 0.8:
        document["location"] = f"tmp_{document['checkpoint_id']}"  # the one place a commit may write
    fields = [f.encode_name for f in info.fields if f.name != "v"]
    damage = rng.random()
    if damage < 0.05 and fields:  # a field of the wrong type
        document[rng.choice(fields)] = draw(json_values)
    elif damage < 0.10 and fields:  # a required field missing
        document.pop(rng.choice(fields), None)
    elif damage < 0.15:  # a field this type does not have
        document[rng.choice(["x", "checkpoint", "episodes", "token_ids"])] = draw(json_values)
    return document


# Valid messages built through their constructors (their own checks pass), as the old fuzzer drew them.
episodes = st.builds(m.EpisodeRef, rollout_id=rollout_ids, attempt=small_ints, replica=small_ints)
attempts = st.builds(m.AttemptRef, rollout_id=rollout_ids, attempt=small_ints)
locations = st.sampled_from(["tmp_x", "snapshot_1", "tmp_ck-9"])

valid_messages = st.one_of(
    st.builds(m.Status, checkpoint_id=checkpoint_ids, deadline=deadlines),
    st.builds(m.Discover, checkpoint_id=checkpoint_ids, deadline=deadlines),
    st.builds(m.Probe, checkpoint_id=checkpoint_ids, deadline=deadlines),
    st.builds(m.Ack, receipts=st.lists(attempts, max_size=4).map(tuple)),
    st.builds(m.Ok, detail=st.text(max_size=10)),
)

type_names = st.sampled_from([*m.MESSAGE_TYPES, "Bogus", "", "prepare"])
versions = st.sampled_from([1, 1, 1, 0, 2, -1, 10**12])
field_names = st.sampled_from(
    ["checkpoint_id", "deadline", "location", "episodes", "rollout_id", "attempt", "reason", "receipts", "x"]
)


@dataclass(frozen=True)
class Fuzzed:
    body: bytes
    content_type: str
    correlation_id: str
    signing: str  # one of SIGNINGS
    reply: bool  # whether it carries a reply address


def _encode(document: dict[str, Any], content_type: str) -> bytes:
    try:
        if content_type == codec.JSON:
            return msgspec.json.encode(document)
        return msgspec.msgpack.encode(document)
    except (OverflowError, TypeError, ValueError):
        return json.dumps(document, default=str).encode()


@st.composite
def fuzzed(draw: st.DrawFn, focus: tuple[str, ...] = ()) -> Fuzzed:
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    kind = rng.choice(["typed"] * 8 + ["valid", "mutated", "mutated", "json", "bytes"])
    # A data request's reply is cached by its correlation id: mostly fresh ones, sometimes a repeat.
    correlation_id = rng.choice(CHECKPOINT_POOL) if rng.random() < 0.2 else f"fz-{rng.getrandbits(40):010x}"
    content_type = rng.choice([codec.MSGPACK, codec.MSGPACK, codec.JSON])
    if kind in ("typed", "mutated"):
        document = draw(typed_messages(focus))
        if isinstance(document.get("checkpoint_id"), str) and rng.random() < 0.9:
            correlation_id = document["checkpoint_id"]  # what a well-behaved sender does
        body = _encode(document, content_type)
        if kind == "mutated":
            raw = bytearray(body)
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            body = bytes(raw)
    elif kind == "valid":
        message = draw(valid_messages)
        body = codec.encode(message, content_type)
        if isinstance(message, m.ControlCommand):
            correlation_id = message.checkpoint_id
    elif kind == "json":
        document = {"type": draw(type_names), "v": draw(versions)}
        document.update(draw(st.dictionaries(field_names, json_values, max_size=4)))
        content_type = codec.JSON
        body = json.dumps(document).encode()
    else:
        body = draw(st.binary(max_size=200))
        content_type = draw(st.sampled_from([codec.MSGPACK, codec.JSON, "", "text/xml"]))
    return Fuzzed(body, content_type, correlation_id, rng.choice(SIGNINGS), reply=rng.random() < 0.8)


def envelope_of(item: Fuzzed, run: str, secret: bytes, to: str) -> Envelope:
    """The delivery for ``to`` as its (hostile) sender would publish it."""
    if item.signing == "none":
        return Envelope(item.body, item.content_type, item.correlation_id, {SENDER_HEADER: "fuzz/0"})
    return signed_raw(
        "another-run" if item.signing == "other_run" else run,
        item.body,
        correlation_id=item.correlation_id,
        to=to,
        content_type=item.content_type,
        sender="fuzz/0",
        secret=b"not-the-secret" if item.signing == "wrong_secret" else secret,
    )
