"""``parkway run`` that fails in a way no typed error names (issue 22: a driver once ended with a bare
``RuntimeError`` traceback): one line naming the failure, exit code 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from parkway.actors.tools import cli
from parkway.actors.tools.commands import workload


async def failing_run(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("TQ has no staging rows for t0001_g0 after retries")


def test_an_unexpected_failure_is_one_line_and_exit_code_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(workload, "run_workload", failing_run)
    # Logging set up into the stream capsys captures would outlive it: later tests would log into a
    # closed file. The failure line is printed by the CLI itself, not logged.
    monkeypatch.setattr(workload, "configure_logging", lambda **_: None)
    monkeypatch.setenv("PARKWAY_STATE_DIR", str(tmp_path))
    code = cli.main(["run", "--broker", "memory://", "--json", "--progress", "never"])
    err = capsys.readouterr().err
    assert code == 1
    assert "parkway: run failed: RuntimeError: TQ has no staging rows for t0001_g0 after retries" in err
    assert "Traceback" not in err
