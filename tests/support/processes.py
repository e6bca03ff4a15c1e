"""Actors as separate OS processes on the real RabbitMQ: start, wait until they answer, signal, restart."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from parkway.actors.runtime.client import Client
from parkway.brokers.base import BrokerError, RequestTimeout
from parkway.protocol.messages import Status, StatusReport

SECRET = "integration-secret-9f2c"


def actor_env(run: str, state_root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARKWAY_")}
    env.update(PARKWAY_RUN=run, PARKWAY_SECRET=SECRET, PARKWAY_STATE_DIR=str(state_root), **extra)
    return env


@dataclass
class ActorProcess:
    role: str
    replica: int
    url: str
    run: str
    state_root: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def address(self) -> str:
        return f"{self.role}/{self.replica}"

    def start(self) -> ActorProcess:
        self.log_path = self.state_root / f"{self.role}-{self.replica}-{time.monotonic_ns()}.log"
        self.state_root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "parkway.actors",
                "actor",
                self.role,
                "--replica",
                str(self.replica),
                "--broker",
                self.url,
                *self.extra_args,
            ],
            env=actor_env(self.run, self.state_root, **self.extra_env),
            stdout=subprocess.DEVNULL,
            stderr=open(self.log_path, "wb"),  # noqa: SIM115 - the child owns it
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 20.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Teardown: SIGTERM first (a policy shuts its Ray down), SIGKILL if it does not go in time."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path else ""


async def wait_ready(client: Client, actor: ActorProcess, timeout: float = 30.0) -> StatusReport:
    """Poll Status until this very process answers (its queue may exist from an earlier process)."""
    deadline = time.monotonic() + timeout
    while True:
        assert actor.proc is not None and actor.proc.poll() is None, (
            f"{actor.address} exited:\n{actor.log_text()}"
        )
        try:
            reply = await client.request(
                actor.address,
                Status(checkpoint_id=f"ready-{time.monotonic_ns()}", deadline=time.time() + 1.0),
            )
            if isinstance(reply, StatusReport) and reply.pid == actor.pid:
                return reply
        except (RequestTimeout, BrokerError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{actor.address} did not answer within {timeout}s:\n{actor.log_text()}")
        await asyncio.sleep(0.1)


async def status_of(client: Client, address: str) -> StatusReport:
    reply = await client.request(
        address, Status(checkpoint_id=f"st-{time.monotonic_ns()}", deadline=time.time() + 5)
    )
    assert isinstance(reply, StatusReport), reply
    return reply


async def wait_handling(client: Client, address: str, timeout: float = 20.0) -> None:
    """Return once the actor at ``address`` reports a handler in progress (besides the Status asking)."""
    async with asyncio.timeout(timeout):
        while (await status_of(client, address)).in_flight < 1:  # noqa: ASYNC110 - polls another process
            await asyncio.sleep(0.02)


async def embedded_digest(config_path: Path, state: Path) -> str:
    """The transcripts digest of the same configuration run embedded, uncrashed, without snapshots."""
    from parkway.actors.launch.workload import run_workload
    from parkway.actors.run.config import load
    from parkway.actors.run.tasks import load_tasks
    from parkway.brokers.memory import MemoryBroker, MemoryHub

    config = load(config_path, environ={})
    async with MemoryBroker(MemoryHub(), config.run) as broker:
        summary = await run_workload(
            broker,
            b"embedded",
            config,
            load_tasks(config.tasks),
            embedded=True,
            state_root=state,
            snapshots=False,
        )
    return summary.transcripts_sha256


async def run_driver(config: Path, run: str, state: Path, url: str, faults: str = "") -> tuple[int, str, str]:
    """`parkway run --json` driving the actors of ``run`` to its end (or its fault): exit code, stdout, stderr."""
    env = actor_env(run, state, PARKWAY_BROKER_URL=url, **({"PARKWAY_FAULTS": faults} if faults else {}))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "parkway.actors",
            "run",
            "--config",
            str(config),
            "--json",
            "--log-level",
            "info",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = await asyncio.to_thread(proc.communicate, timeout=240)
    return proc.returncode, out, err
