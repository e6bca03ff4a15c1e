"""The staging-key check reads rows TQ stored from anyone: a key no builder makes is no turn's row."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from parkway.actors.storage.checks import missing_staging_keys
from parkway.protocol.messages import StagingRow


@pytest.mark.parametrize("strict", [True, False])
def test_rows_under_keys_no_builder_makes_do_not_stop_the_check(tmp_path: Path, strict: bool) -> None:
    # TQ keeps what a (hostile or buggy) client staged, a row with an empty capture key included; a
    # save's validation once died on it with a ValueError (found by the live fuzz test).
    (tmp_path / "tq").mkdir()
    rows = [
        StagingRow(capture_key="", turn=0, token_ids=(1,)),
        StagingRow(capture_key="t0000_g0", turn=0, token_ids=(2,)),
    ]
    (tmp_path / "tq" / "staging.msgpack").write_bytes(msgspec.msgpack.encode(rows))
    (tmp_path / "participants" / "agent" / "0").mkdir(parents=True)
    (tmp_path / "participants" / "agent" / "0" / "rollouts.msgpack").write_bytes(msgspec.msgpack.encode([]))
    assert missing_staging_keys(tmp_path, strict=strict) == {}
