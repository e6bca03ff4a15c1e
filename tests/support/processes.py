"""Actors as separate OS processes on the real RabbitMQ, for tests: started through the one launcher
(``parkway.actors.launch.processes``) with the test run's environment, each logging to a file of its own
under the test's state directory."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

from parkway.actors.launch import processes
from parkway.actors.launch.processes import Process, status_of, wait_ready
from parkway.actors.runtime.client import Client

__all__ = [
    "SECRET",
    "Process",
    "actor_env",
    "run_driver",
    "run_variables",
    "start_actor_process",
    "start_driver",
    "status_of",
    "wait_handling",
    "wait_ready",
]

SECRET = "integration-secret-9f2c"


def run_variables(run: str, state_root: Path, **extra: str) -> dict[str, str]:
    """The ``PARKWAY_*`` variables of the test run (what an operator's shell has for ``parkway``): the
    run, the tests' secret, the state directory, and ``extra``."""
    return processes.run_variables(run=run, secret=SECRET, state=state_root, **extra)


def actor_env(run: str, state_root: Path, **extra: str) -> dict[str, str]:
    """The whole environment of the test run's processes: no inherited ``PARKWAY_*``, then
    ``run_variables``."""
    return processes.run_environment(run=run, secret=SECRET, state=state_root, **extra)


def start_actor_process(
    role: str,
    replica: int,
    url: str,
    run: str,
    state_root: Path,
    *,
    args: tuple[str, ...] = (),
    **env: str,
) -> Process:
    """``parkway actor ROLE --replica N --broker URL ARGS``, its stderr in a fresh file under
    ``state_root`` (a restarted replica gets a new one)."""
    state_root.mkdir(parents=True, exist_ok=True)
    return processes.start_actor(
        role,
        replica,
        env=actor_env(run, state_root, **env),
        stderr=state_root / f"{role}-{replica}-{time.monotonic_ns()}.log",
        broker_url=url,
        args=args,
    )


async def wait_handling(client: Client, address: str, timeout: float = 20.0) -> None:
    """Return once the actor at ``address`` reports a handler in progress (besides the Status asking)."""
    async with asyncio.timeout(timeout):
        while (await status_of(client, address)).in_flight < 1:  # noqa: ASYNC110 - polls another process
            await asyncio.sleep(0.02)


def start_driver(
    config_path: Path, run_name: str, state: Path, url: str, faults: str = ""
) -> subprocess.Popen[str]:
    """``parkway run --json`` driving the actors of ``run_name``; its stdout and stderr are pipes."""
    env = actor_env(run_name, state, PARKWAY_BROKER_URL=url)
    if faults:
        env["PARKWAY_FAULTS"] = faults
    driver = processes.start_run(
        config_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return driver.popen


async def run_driver(config: Path, run: str, state: Path, url: str, faults: str = "") -> tuple[int, str, str]:
    """`parkway run --json` driving the actors of ``run`` to its end (or its fault): exit code, stdout, stderr."""
    driver = start_driver(config, run, state, url, faults)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    return driver.returncode, out, err
