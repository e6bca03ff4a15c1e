"""A typo on the command line is a clear message and exit 2, never a traceback (no broker needed)."""

from __future__ import annotations

import pytest
from parkway.actors.tools.cli import main


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["snapshot", "--checkpoint-id", "bad id!"], "checkpoint id 'bad id!' does not match"),
        (
            ["publish", "prepare", "--to", "tq/0", "--checkpoint-id", "../x"],
            "checkpoint id '../x' does not match",
        ),
        (
            ["publish", "prepare", "--to", "nowhere", "--checkpoint-id", "ok"],
            "address 'nowhere' is not ROLE/REPLICA",
        ),
    ],
)
def test_a_bad_argument_is_named_and_exits_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PARKWAY_SECRET", "s")
    assert main(argv) == 2
    assert says in capsys.readouterr().err
