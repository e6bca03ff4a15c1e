"""Parkway's own commands as separate OS processes: ``parkway actor ROLE --replica N`` and ``parkway run``.

The one launcher that tests, benchmarks and the chaos harness start clusters of processes with. Every
process runs this interpreter's parkway (``python -m parkway.actors``, so a virtual environment or a
``PYTHONPATH`` checkout is the one that runs) with the run's environment: the inherited one without any
``PARKWAY_*`` variable (one left in the caller's shell would silently change what the child does) plus
the run's own settings. An actor process gets its own role's key only (``own_keys``): the run's
secret stays with the launcher, which derives every role's key pair from it (so a ``Client`` given the
secret, a test's or a driver's, is the operator and may act as any role). Each process gets a handle to signal, kill, stop gracefully (SIGTERM, then
SIGKILL) and reap, and its stderr, where its structured log goes, in a file of its own. ``wait_ready``
polls ``Status`` until that very process answers: its queue may still exist from an earlier one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from parkway.actors.run.config import RunConfig
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.settings import DEFAULT_RUN, PUBLIC_KEYS_ENV, SECRET_ENV, SIGNING_KEY_ENV
from parkway.actors.runtime.tracing_sdk import TRACE_FILE_ENV
from parkway.brokers.base import BrokerError
from parkway.protocol.ids import Role
from parkway.protocol.messages import Status, StatusReport
from parkway.protocol.signing import Keyring

PARKWAY_PREFIX = "PARKWAY_"

# Where a child's output goes: a file (its path), inherited from this process (None), or a
# ``subprocess`` constant (DEVNULL, PIPE).
Output = Path | int | None


class ProcessExited(RuntimeError):
    """A process that was expected to answer has exited; the message carries its log."""


class UnexpectedReply(RuntimeError):
    """An actor answered ``Status`` with something other than a ``StatusReport`` (an ``Error``)."""


def clean_environment(
    base: Mapping[str, str] | None = None, *, strip: Sequence[str] = (PARKWAY_PREFIX,)
) -> dict[str, str]:
    """``base`` (default: this process's environment) without the variables whose names start with one
    of ``strip``; everything else (``PATH``, ``PYTHONPATH``, ``HOME``...) is kept."""
    prefixes = tuple(strip)
    return {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(prefixes)}


def run_variables(
    *, run: str, secret: str, state: Path, broker_url: str | None = None, **extra: str
) -> dict[str, str]:
    """The ``PARKWAY_*`` settings of one run's processes: its name, its secret, its state directory, the
    broker (when given) and ``extra`` (``PARKWAY_FAULTS=...``)."""
    variables = {"PARKWAY_RUN": run, "PARKWAY_SECRET": secret, "PARKWAY_STATE_DIR": str(state)}
    if broker_url is not None:
        variables["PARKWAY_BROKER_URL"] = broker_url
    variables.update(extra)
    return variables


def run_environment(
    *, run: str, secret: str, state: Path, broker_url: str | None = None, **extra: str
) -> dict[str, str]:
    """The environment of one run's processes: this process's, without ``PARKWAY_*``
    (``clean_environment``) but with the file exporter's ``PARKWAY_TRACE_FILE`` (the ``OTEL_*``
    settings are kept, and a process told ``OTEL_TRACES_EXPORTER=file`` refuses to start without its
    file), plus ``run_variables``."""
    traced = {TRACE_FILE_ENV: os.environ[TRACE_FILE_ENV]} if TRACE_FILE_ENV in os.environ else {}
    return {
        **clean_environment(),
        **traced,
        **run_variables(run=run, secret=secret, state=state, broker_url=broker_url, **extra),
    }


def own_keys(env: Mapping[str, str], roles: Sequence[str]) -> dict[str, str]:
    """``env`` for a process of ``roles``: ``PARKWAY_SECRET`` replaced by those roles' private keys
    (``PARKWAY_SIGNING_KEY``) and every role's public key (``PARKWAY_PUBLIC_KEYS``), derived from the
    secret and the run. An ``env`` that already names its keys, or has no secret, is returned as is."""
    chosen = dict(env)
    secret = chosen.get(SECRET_ENV)
    if not secret or SIGNING_KEY_ENV in chosen:
        return chosen
    keyring = Keyring.derive(secret.encode(), chosen.get("PARKWAY_RUN") or DEFAULT_RUN)
    del chosen[SECRET_ENV]
    chosen[SIGNING_KEY_ENV] = keyring.private_text(roles)
    chosen[PUBLIC_KEYS_ENV] = keyring.public_text()
    return chosen


def parkway_command(*args: str) -> list[str]:
    """The command line of ``parkway ARGS`` run by this interpreter."""
    return [sys.executable, "-m", "parkway.actors", *args]


@dataclass(eq=False)
class Process:
    """One started process: its name (an actor's address, ``tq/0``, or a label such as ``controller``),
    its ``Popen`` and the file its stderr goes to, if any."""

    name: str
    popen: subprocess.Popen[Any]
    log_path: Path | None = None

    @property
    def address(self) -> str:
        return self.name

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` if the process still runs (one that exited is not signalled by mistake)."""
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout: float | None = 20.0) -> int:
        return self.popen.wait(timeout)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL and reap. A stopped (SIGSTOPped) process dies of it without running again."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.kill()
        self.popen.wait(timeout)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM (an actor finishes the handler in progress, a policy shuts its Ray down), then SIGKILL
        if it has not exited within ``grace`` seconds."""
        stop_all([self], grace=grace)

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def start(
    args: Sequence[str],
    *,
    env: Mapping[str, str],
    name: str,
    stderr: Output = None,
    stdout: Output = subprocess.DEVNULL,
    stdin: Output = None,
    text: bool = False,
    cwd: Path | None = None,
) -> Process:
    """``parkway ARGS`` as a new process with exactly ``env``. A path for ``stderr`` or ``stdout`` is a
    file written from the start (the parent's copy is closed once the child has it)."""
    with contextlib.ExitStack() as files:

        def target(output: Output) -> int | IO[Any] | None:
            if isinstance(output, Path):
                output.parent.mkdir(parents=True, exist_ok=True)
                return files.enter_context(open(output, "wb"))  # the child keeps its own copy
            return output

        popen = subprocess.Popen(
            parkway_command(*args),
            env=dict(env),
            stdin=target(stdin),
            stdout=target(stdout),
            stderr=target(stderr),
            text=text,
            cwd=cwd,
        )
    return Process(name, popen, stderr if isinstance(stderr, Path) else None)


def service_roles(config: RunConfig) -> list[tuple[str, int]]:
    """The ``parkway actor`` processes a configuration's workload needs, as (role, replica), in the
    order to start them: TQ's shards, the policy replicas, the tool servers, the agents, and the trainer when it is a
    service (``trainer.host: service``; inline, the controller's process hosts it)."""
    topology = config.topology
    started = [("tq", i) for i in range(topology.tq_shards)] + [
        ("policy", i) for i in range(topology.policies)
    ]
    started += [("resources", i) for i in range(topology.resources)]
    started += [("agent", i) for i in range(topology.agents)]
    if config.trainer.host == "service":
        started.append(("trainer", 0))
    return started


def start_actor(
    role: str,
    replica: int,
    *,
    env: Mapping[str, str],
    stderr: Output = None,
    stdout: Output = subprocess.DEVNULL,
    broker_url: str | None = None,
    config: Path | None = None,
    log_level: str | None = None,
    args: Sequence[str] = (),
) -> Process:
    """``parkway actor ROLE --replica N`` (the service one compose container runs), named by its address."""
    command = ["actor", role, "--replica", str(replica)]
    if broker_url is not None:
        command += ["--broker", broker_url]
    if config is not None:
        command += ["--config", str(config)]
    if log_level is not None:
        command += ["--log-level", log_level]
    return start(
        [*command, *args], env=own_keys(env, [role]), name=f"{role}/{replica}", stderr=stderr, stdout=stdout
    )


def start_run(
    config: Path,
    *,
    env: Mapping[str, str],
    name: str = "controller",
    stderr: Output = None,
    stdout: Output = subprocess.PIPE,
    summary_json: bool = True,
    log_level: str | None = "info",
    text: bool = False,
    args: Sequence[str] = (),
) -> Process:
    """``parkway run --config CONFIG`` (the controller driving the run's actors): its summary on stdout,
    as JSON unless ``summary_json`` is off. It holds the controller's key and the trainer's (it hosts
    the trainer actor with ``trainer.host: inline``)."""
    command = ["run", "--config", str(config)]
    if summary_json:
        command.append("--json")
    if log_level is not None:
        command += ["--log-level", log_level]
    return start(
        [*command, *args],
        env=own_keys(env, [Role.CONTROLLER.value, Role.TRAINER.value]),
        name=name,
        stderr=stderr,
        stdout=stdout,
        text=text,
    )


def stop_all(processes: Iterable[Process], *, grace: float = 20.0) -> None:
    """Graceful stop of them all at once: SIGCONT and SIGTERM to each that runs, then wait for each in
    turn up to ``grace`` seconds; one still running then is SIGKILLed."""
    chosen = list(processes)
    for process in chosen:
        if process.alive():
            with contextlib.suppress(ProcessLookupError):
                process.popen.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                process.popen.terminate()
    for process in chosen:
        try:
            process.popen.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()


def kill_all(processes: Iterable[Process], *, timeout: float = 30.0) -> None:
    """SIGKILL every one that runs, all at once (a crash of the whole cluster), then reap each. None is
    continued first: a paused process must not run on, even for a moment, after the crash."""
    chosen = list(processes)
    for process in chosen:
        if process.alive():
            with contextlib.suppress(ProcessLookupError):
                process.popen.kill()
    for process in chosen:
        process.popen.wait(timeout)


def reap(processes: Iterable[Process], *, timeout: float = 10.0) -> None:
    """The last clean-up, whatever happened before: no process survives it and none is left a zombie.
    Never raises for a process that will not die in time (it is SIGKILLed; the kernel ends it)."""
    chosen = list(processes)
    for process in chosen:
        if process.alive():
            with contextlib.suppress(ProcessLookupError):
                process.popen.send_signal(signal.SIGCONT)
                process.popen.kill()
    for process in chosen:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.popen.wait(timeout)


async def status_of(client: Client, address: str, *, timeout: float = 5.0) -> StatusReport:
    """The ``StatusReport`` of the actor at ``address``."""
    reply = await client.request(
        address, Status(checkpoint_id=f"st-{time.monotonic_ns()}", deadline=time.time() + timeout)
    )
    if not isinstance(reply, StatusReport):
        raise UnexpectedReply(f"{address} answered Status with {reply!r}")
    return reply


async def wait_ready(
    client: Client, process: Process, *, address: str | None = None, timeout: float = 30.0
) -> StatusReport:
    """Poll ``Status`` at ``address`` (default: the process's name) until this very process answers
    (the pid in the report is its pid). Raises ``ProcessExited`` if it exits first, ``TimeoutError``
    after ``timeout`` seconds; either message ends with the process's log."""
    at = address or process.address
    deadline = time.monotonic() + timeout
    while True:
        if not process.alive():
            raise ProcessExited(f"{at} exited ({process.returncode}):\n{process.log_text()}")
        with contextlib.suppress(BrokerError):  # not consuming yet: the request times out
            reply = await client.request(
                at, Status(checkpoint_id=f"ready-{time.monotonic_ns()}", deadline=time.time() + 1.0)
            )
            if isinstance(reply, StatusReport) and reply.pid == process.pid:
                return reply
        if time.monotonic() > deadline:
            raise TimeoutError(f"{at} did not answer within {timeout}s:\n{process.log_text()}")
        await asyncio.sleep(0.1)
