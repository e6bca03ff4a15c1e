"""``parkway`` run as a user runs it: a subprocess of this interpreter's parkway with a clean environment."""

from __future__ import annotations

import subprocess
from pathlib import Path

from parkway.actors.launch.processes import clean_environment, parkway_command


def parkway(
    *args: str,
    cwd: Path | None = None,
    timeout: float = 120.0,
    input: str | None = None,
    **variables: str,
) -> subprocess.CompletedProcess[str]:
    """``parkway ARGS`` to its end: the inherited environment without any ``PARKWAY_*`` (a stray one in
    the developer's shell must not change the outcome) plus ``variables``; stdout and stderr captured."""
    return subprocess.run(
        parkway_command(*args),
        env={**clean_environment(), **variables},
        cwd=cwd,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
