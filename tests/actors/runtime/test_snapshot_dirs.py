"""A restore's sources: which saved replicas' records a participant may read, and the Restore field."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
from parkway.actors.runtime.snapshot_dirs import check_sources
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.messages import Restore


def restore(sources: tuple[int, ...] | None) -> Restore:
    return Restore(checkpoint_id="rs-1", deadline=time.time() + 10, location="snapshot_3", sources=sources)


def test_a_role_that_cannot_take_over_reads_only_its_own(tmp_path: Path) -> None:
    for sources in (None, (1,)):
        check_sources(restore(sources), role="policy", replica=1, takes_over=False, run_dir=tmp_path)
    with pytest.raises(ProtocolError) as refused:
        check_sources(restore((0, 1)), role="policy", replica=1, takes_over=False, run_dir=tmp_path)
    assert refused.value.code is ErrorCode.INVALID_MESSAGE
    assert "a policy restores only its own records, not replicas [0, 1]" in str(refused.value)


def test_an_agent_takes_over_any_or_none_of_a_snapshot_that_is_there(tmp_path: Path) -> None:
    with pytest.raises(ProtocolError, match="snapshot_3 cannot be restored: no such snapshot"):
        check_sources(restore(()), role="agent", replica=1, takes_over=True, run_dir=tmp_path)
    (tmp_path / "snapshot_3").mkdir()
    for sources in (None, (), (0, 1, 2)):
        check_sources(restore(sources), role="agent", replica=1, takes_over=True, run_dir=tmp_path)


def test_sources_are_checked_at_the_edge() -> None:
    assert restore(None).sources is None and restore(()).sources == ()
    with pytest.raises(ValueError, match="each once"):
        restore((1, 1))
    wire = msgspec.json.encode(restore((2, 0)))
    assert msgspec.json.decode(wire, type=Restore).sources == (2, 0)
    for bad in (b'"sources":[-1]', b'"sources":[1,1]', b'"sources":"01"'):
        body = wire.replace(b'"sources":[2,0]', bad)
        with pytest.raises((msgspec.ValidationError, ProtocolError)):
            msgspec.json.decode(body, type=Restore)
