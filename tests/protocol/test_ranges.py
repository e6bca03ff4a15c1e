"""Numeric ranges at decode (``protocol.ranges``), and decoding as a total function: whatever the
bytes, ``codec.decode`` returns a message or raises ``ProtocolError``, nothing else (issue 21)."""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from parkway.protocol import codec, ranges
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.messages import MESSAGE_TYPES, Message

from tests.support.fuzz import deep_document, hostile_bodies


class _Bounded(msgspec.Struct):
    x: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)]


class _LowerOnly(msgspec.Struct):
    x: Annotated[float, msgspec.Meta(ge=0.0)]


@pytest.mark.parametrize(
    ("value", "bounded", "lower_only"),
    [
        (5.0, True, True),
        (math.nan, False, False),  # every comparison with NaN is false: refused by any bound
        (math.inf, False, True),  # +inf passes a lower bound: a float needs an upper bound too
        (-math.inf, False, False),
        (1e300, False, True),
    ],
)
def test_msgspec_refuses_nan_against_any_bound_and_inf_only_against_that_side(
    value: float, bounded: bool, lower_only: bool
) -> None:
    """What ``ranges`` relies on: every float there has both bounds."""
    body = msgspec.msgpack.encode({"x": value})
    for cls, accepted in ((_Bounded, bounded), (_LowerOnly, lower_only)):
        try:
            msgspec.msgpack.decode(body, type=cls)
            assert accepted, (cls.__name__, value)
        except msgspec.ValidationError:
            assert not accepted, (cls.__name__, value)


def _numeric_fields(info: Any, path: str) -> list[tuple[str, Any]]:
    """Every int and float type in a message's fields, with where it is (through tuples, unions,
    nested structs; ``dict[str, object]`` tool arguments carry no meaning to range)."""
    kind = type(info).__name__
    if kind in ("IntType", "FloatType"):
        return [(path, info)]
    if kind == "UnionType":
        return [found for t in info.types for found in _numeric_fields(t, path)]
    if kind == "VarTupleType":
        return _numeric_fields(info.item_type, f"{path}[]")
    if kind == "StructType":
        return [
            found
            for field in info.fields
            if field.name != "v"  # the schema version: any int, an unknown one is unsupported_version
            for found in _numeric_fields(field.type, f"{path}.{field.name}")
        ]
    if kind == "DictType":
        return _numeric_fields(info.value_type, f"{path}{{}}")
    return []


def test_every_numeric_field_of_every_message_has_a_range() -> None:
    unbounded = []
    for name, cls in MESSAGE_TYPES.items():
        for path, t in _numeric_fields(mi.type_info(cls), name):
            if type(t).__name__ == "IntType":
                ok = t.ge is not None and t.le is not None  # msgspec decodes a JSON int of any size
            else:  # a float: NaN and +inf refused (le); -inf only where it means something (a logprob)
                ok = t.le is not None and (t.ge is not None or path.endswith(".logprobs[]"))
            # Exceptions, each on purpose: a status's counters (any size they grow to) and a trainer's
            # loss (NaN when training diverged: a fact to report, not a message to refuse).
            if not ok and not path.startswith("StatusReport.counts") and path != "Trained.loss":
                unbounded.append(path)
    assert unbounded == []


def _prepare(deadline: object) -> bytes:
    return msgspec.msgpack.encode({"type": "Prepare", "v": 1, "checkpoint_id": "ck-1", "deadline": deadline})


@pytest.mark.parametrize(
    "body",
    [
        _prepare(math.inf),
        _prepare(-math.inf),
        _prepare(math.nan),
        _prepare(1e300),
        _prepare(-1.0),
        _prepare(ranges.MAX_DEADLINE + 1),
        b'{"type": "Prepare", "v": 1, "checkpoint_id": "ck-1", "deadline": 1e400}',
        b'{"type": "Prepare", "v": 1, "checkpoint_id": "ck-1", "deadline": Infinity}',
        msgspec.msgpack.encode(
            {
                "type": "Run",
                "v": 1,
                "rollout_id": "r",
                "attempt": 0,
                "group_id": "g",
                "env": "e",
                "prompt": "p",
                "max_turns": 10**9,
            }
        ),
        msgspec.msgpack.encode(
            {
                "type": "Generate",
                "v": 1,
                "rollout_id": "r",
                "attempt": 0,
                "call_index": 0,
                "token_ids": [1],
                "max_tokens": 2**63 - 1,
            }
        ),
        msgspec.msgpack.encode(
            {
                "type": "SealRows",
                "v": 1,
                "rollout_id": "r",
                "attempt": 0,
                "capture_key": "r",
                "reward": math.nan,
            }
        ),
        msgspec.msgpack.encode(
            {"type": "Probe", "v": 1, "checkpoint_id": "ck-1", "deadline": 1.0, "work_s": math.inf}
        ),
        msgspec.msgpack.encode({"type": "Ack", "v": 1, "receipts": [{"rollout_id": "r", "attempt": -1}]}),
    ],
)
def test_out_of_range_values_are_invalid_message(body: bytes) -> None:
    with pytest.raises(ProtocolError) as caught:
        codec.decode(body, codec.JSON if body[:1] == b"{" else codec.MSGPACK)
    assert caught.value.code is ErrorCode.INVALID_MESSAGE


def test_a_deadline_in_range_decodes() -> None:
    message = codec.decode(_prepare(2e9), codec.MSGPACK)
    assert getattr(message, "deadline", None) == 2e9


@pytest.mark.parametrize("content_type", [codec.JSON, codec.MSGPACK])
@pytest.mark.parametrize("depth", [10, 1_000, 200_000])
def test_nesting_at_any_depth_is_a_typed_refusal(content_type: str, depth: int) -> None:
    body = deep_document(
        {"type": "Status", "v": 1, "checkpoint_id": "ck-1", "deadline": 1.0}, depth, content_type
    )
    with pytest.raises(ProtocolError) as caught:
        codec.decode(body, content_type)
    assert caught.value.code is ErrorCode.INVALID_MESSAGE  # an unknown field at depth 10, too deep beyond


@settings(max_examples=600, derandomize=True, database=None, deadline=None)
@given(body=hostile_bodies(), content_type=st.sampled_from([codec.MSGPACK, codec.JSON, None, "text/xml"]))
def test_decoding_any_bytes_is_a_message_or_a_typed_refusal(body: bytes, content_type: str | None) -> None:
    try:
        message = codec.decode(body, content_type)
    except ProtocolError as err:
        assert err.code in (ErrorCode.INVALID_MESSAGE, ErrorCode.UNSUPPORTED_VERSION)
    else:
        assert isinstance(message, Message)


def test_a_refusal_quotes_a_huge_bad_value_only_in_part() -> None:
    """Found by fuzzing: a megabyte checkpoint id was echoed whole into the Error reply and the log."""
    body = msgspec.msgpack.encode(
        {"type": "Prepare", "v": 1, "checkpoint_id": "\u00e9" * 500_000, "deadline": 1.0}
    )
    with pytest.raises(ProtocolError) as caught:
        codec.decode(body, codec.MSGPACK)
    assert caught.value.code is ErrorCode.INVALID_MESSAGE
    assert len(caught.value.detail) < codec.MAX_DETAIL_CHARS + 100 and "characters)" in caught.value.detail
    with pytest.raises(ProtocolError) as caught:
        codec.decode(msgspec.msgpack.encode({"type": "T" * 100_000, "v": 1}), codec.MSGPACK)
    assert len(caught.value.detail) < codec.MAX_DETAIL_CHARS + 100
