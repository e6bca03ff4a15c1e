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
from parkway.actors.runtime.client import Client
from parkway.brokers.base import Broker, Envelope
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol import codec
from parkway.protocol import messages as m
from parkway.protocol.ids import CHECKPOINT_ID_PATTERN
from parkway.protocol.signing import SENDER_HEADER

from tests.support.signed import type_label

# The status counters of messages an actor refused at its edge (each of these is also dead-lettered).
REFUSALS = (
    "refused:unauthorized",
    "refused:invalid_message",
    "refused:unsupported_version",
    "refused:internal",
)

# How a delivery is signed: correctly, not at all, with another secret, or by the same secret for another run.
SIGNINGS = ("ok", "none", "wrong_secret", "other_run")

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

# What a delivery tries, as the fuzz report's rows: body kinds first, then signing, then delivery.
CATEGORIES = (
    "typed",  # a message of any type, mostly well typed, sometimes a field wrong, missing or unknown
    "valid",  # a valid message built through its constructor
    "bit_flipped",  # an encoded message with a few bits flipped
    "truncated",  # an encoded message cut short
    "random_bytes",
    "wrong_content_type",  # a good body under another content type (or a foreign one)
    "unknown_type",
    "wrong_version",
    "deep_nesting",  # a field nested hundreds to hundreds of thousands deep
    "extreme_number",  # inf, NaN, 1e300, 1e400, 2**64 - 1, negative counts in a numeric field
    "huge_string",  # a string field of up to a megabyte
    "unsigned",
    "wrong_secret",
    "other_run",  # signed with the run's secret, for another run
    "replayed",  # the previous delivery to that address, exactly again
    "odd_reply_to",  # a reply address that is no reply queue
    "burst",  # many valid requests at once, every one to be answered
)
# How often each is drawn, in that order (weights): typed messages are what finds handler bugs.
_WEIGHTS = (14, 3, 3, 2, 2, 2, 2, 2, 2, 3, 1, 1, 1, 1, 1, 1, 1)
BURST_SIZE = 25
# Reply addresses no reply queue has: unknown names, one that looks like a server-named queue, junk.
ODD_REPLY_TOS = ("no-such-queue", "amq.gen-nonexistent0000000000", "x" * 255, " ", "\u00e9t\u00e9")
# Values that are no value of a meaningful numeric field (the JSON ones are written by hand: 1e400).
EXTREME_NUMBERS: tuple[object, ...] = (
    math.inf,
    -math.inf,
    math.nan,
    1e300,
    -1e300,
    2**64 - 1,
    -(2**63),
    -1,
    -1.0,
    2**63,
    1e-320,
)
DEEP = (600, 1_000, 5_000, 200_000)


@dataclass(frozen=True)
class Fuzzed:
    body: bytes
    content_type: str
    correlation_id: str
    signing: str  # one of SIGNINGS
    reply: bool  # whether it carries a reply address
    category: str = "typed"  # one of CATEGORIES
    reply_to: str | None = None  # an odd reply address instead of the sender's reply queue
    replay: bool = False  # send the previous delivery to that address again instead
    copies: int = 1  # a burst: this many deliveries of the body, each its own request


def _encode(document: dict[str, Any], content_type: str) -> bytes:
    try:
        if content_type == codec.JSON:
            return msgspec.json.encode(document)
        return msgspec.msgpack.encode(document)
    except (OverflowError, TypeError, ValueError):
        return json.dumps(document, default=str).encode()


_PLACEHOLDER = "\x00fuzz-placeholder\x00"


def _with_value(document: dict[str, Any], field: str, value: bytes, content_type: str) -> bytes:
    """``document`` encoded with ``field`` set to the already encoded ``value`` (what no encoder writes:
    a list nested 200,000 deep, JSON's ``1e400`` or ``Infinity``)."""
    placeholder = _encode({**document, field: _PLACEHOLDER}, content_type)
    encoder = msgspec.json.encode if content_type == codec.JSON else msgspec.msgpack.encode
    return placeholder.replace(encoder(_PLACEHOLDER), value, 1)


def _nested(depth: int, content_type: str) -> bytes:
    return b"[" * depth + b"]" * depth if content_type == codec.JSON else b"\x91" * depth + b"\x90"


def _number(value: object, content_type: str) -> bytes:
    if content_type != codec.JSON:
        return msgspec.msgpack.encode(value)
    return json.dumps(value).encode()  # inf and NaN as Infinity and NaN: not JSON, what Python writes


def _fields_of(document: dict[str, Any], kinds: tuple[str, ...]) -> list[str]:
    """The fields of ``document``'s type whose msgspec type is one of ``kinds`` (IntType, ...)."""
    cls = m.MESSAGE_TYPES.get(str(document.get("type")))
    if cls is None:
        return []
    info = cast(mi.StructType, mi.type_info(cls))
    return [f.encode_name for f in info.fields if f.name != "v" and type(f.type).__name__ in kinds]


def _hostile(document: dict[str, Any], category: str, content_type: str, rng: random.Random) -> bytes:
    """``document`` with one hostile value, as ``category`` says."""
    if category == "deep_nesting":
        depth = rng.choice(DEEP)
        fields = _fields_of(document, ("DictType", "CustomType", "VarTupleType", "StructType"))
        field = rng.choice(fields) if fields and rng.random() < 0.5 else "x"  # a known field, or one more
        return _with_value(document, field, _nested(depth, content_type), content_type)
    if category == "extreme_number":
        fields = _fields_of(document, ("IntType", "FloatType")) or ["deadline"]
        field = rng.choice(fields)
        if content_type == codec.JSON and rng.random() < 0.2:
            return _with_value(document, field, b"1e400", content_type)  # beyond any double
        return _with_value(document, field, _number(rng.choice(EXTREME_NUMBERS), content_type), content_type)
    # huge_string
    fields = _fields_of(document, ("StrType",)) or ["note"]
    size = rng.choice([10_000, 100_000, 1_000_000])
    return _encode({**document, rng.choice(fields): "\u00e9" * (size // 2)}, content_type)


@st.composite
def hostile_bodies(draw: st.DrawFn) -> bytes:
    """A body of any kind ``fuzzed`` draws (typed, mutated, hostile values, junk): for the codec alone."""
    return draw(fuzzed()).body


@st.composite
def fuzzed(draw: st.DrawFn, focus: tuple[str, ...] = (), category: str | None = None) -> Fuzzed:
    """One hostile delivery; ``category`` forces one of ``CATEGORIES`` (drawn by weight otherwise)."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    drawn = rng.choices(CATEGORIES, weights=_WEIGHTS)[0]
    category = category if category is not None else drawn
    # A data request's reply is cached by its correlation id: mostly fresh ones, sometimes a repeat.
    correlation_id = rng.choice(CHECKPOINT_POOL) if rng.random() < 0.2 else f"fz-{rng.getrandbits(40):010x}"
    content_type = rng.choice([codec.MSGPACK, codec.MSGPACK, codec.JSON])
    signing, reply, reply_to, copies = "ok", rng.random() < 0.8, None, 1
    if category in ("valid", "burst"):
        message = draw(valid_messages)
        body = codec.encode(message, content_type)
        if isinstance(message, m.ControlCommand):
            correlation_id = message.checkpoint_id
        if category == "burst":  # a question every role answers, many at once
            reply, copies = True, BURST_SIZE
            message = m.Status(checkpoint_id=f"burst-{rng.getrandbits(32):08x}", deadline=time.time() + 60)
            body, correlation_id = codec.encode(message, content_type), message.checkpoint_id
    elif category == "random_bytes":
        body = draw(st.binary(max_size=200))
        content_type = draw(st.sampled_from([codec.MSGPACK, codec.JSON, "", "text/xml"]))
    elif category in ("unknown_type", "wrong_version"):
        document = draw(typed_messages(focus))
        if category == "unknown_type":
            document["type"] = rng.choice(
                ["Bogus", "", "prepare", "Message", "ControlCommand", 5, None, "T" * 10**5]
            )
        else:
            document["v"] = rng.choice([0, 2, -1, 10**12, 2**64 - 1, "1", None, 1.5])
        body = _encode(document, content_type)
    else:
        document = draw(typed_messages(focus))
        if isinstance(document.get("checkpoint_id"), str) and rng.random() < 0.9:
            correlation_id = document["checkpoint_id"]  # what a well-behaved sender does
        if category in ("deep_nesting", "extreme_number", "huge_string"):
            body = _hostile(document, category, content_type, rng)
        else:
            body = _encode(document, content_type)
        if category == "bit_flipped":
            raw = bytearray(body)
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            body = bytes(raw)
        elif category == "truncated":
            body = body[: rng.randrange(len(body))]
        elif category == "wrong_content_type":
            content_type = rng.choice(
                [
                    codec.JSON if content_type == codec.MSGPACK else codec.MSGPACK,
                    "text/xml",
                    "",
                    "text/plain",
                    "application/json; charset=utf-16",
                    "APPLICATION/X-MSGPACK",
                    "application/octet-stream",
                ]
            )
        elif category in ("unsigned", "wrong_secret", "other_run"):
            signing = "none" if category == "unsigned" else category
        elif category == "odd_reply_to":
            reply, reply_to = True, rng.choice(ODD_REPLY_TOS)
    return Fuzzed(
        body,
        content_type,
        correlation_id,
        signing,
        reply,
        category=category,
        reply_to=reply_to,
        replay=category == "replayed",
        copies=copies,
    )


@dataclass(frozen=True)
class Signers:
    """How a fuzzer signs: through the public ``Client``, as the run's own senders do, with the run's
    secret (``ok``), another secret, or the run's secret for another run."""

    ok: Client
    wrong_secret: Client
    other_run: Client

    @classmethod
    def of(cls, broker: Broker, secret: bytes, sender: str = "fuzz/0") -> Signers:
        other = MemoryBroker(MemoryHub(), "another-run")  # only its run name is used: nothing is sent
        return cls(
            ok=Client(broker, secret=secret, sender=sender),
            wrong_secret=Client(broker, secret=b"not-the-secret", sender=sender),
            other_run=Client(other, secret=secret, sender=sender),
        )


def deep_document(document: dict[str, Any], depth: int, content_type: str) -> bytes:
    """``document`` (a small map) with one more field, ``x``: a list nested ``depth`` deep."""
    if content_type == codec.JSON:
        return msgspec.json.encode(document)[:-1] + b',"x":' + b"[" * depth + b"]" * depth + b"}"
    body = msgspec.msgpack.encode(document)
    assert body[0] & 0xF0 == 0x80 and len(document) < 15  # a fixmap: its count is in its first byte
    return bytes([body[0] + 1]) + body[1:] + msgspec.msgpack.encode("x") + b"\x91" * depth + b"\x90"


def signed_bytes(client: Client, body: bytes, *, correlation_id: str, content_type: str, to: str) -> Envelope:
    """Any bytes, signed by ``client`` for ``to`` as it signs a message of its own, as the type the body
    says it is (so the receiver judges the body itself)."""
    return client.signed(
        body,
        message_type=type_label(body, content_type),
        correlation_id=correlation_id,
        to=to,
        content_type=content_type,
    )


def envelope_of(item: Fuzzed, signers: Signers, to: str) -> Envelope:
    """The delivery for ``to`` as its (hostile) sender would publish it (without its reply address)."""
    if item.signing == "none":
        return Envelope(item.body, item.content_type, item.correlation_id, {SENDER_HEADER: "fuzz/0"})
    client = getattr(signers, item.signing)
    return signed_bytes(
        client, item.body, correlation_id=item.correlation_id, content_type=item.content_type, to=to
    )
