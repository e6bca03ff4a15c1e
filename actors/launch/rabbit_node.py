"""A throwaway RabbitMQ node that one chaos run owns: started, restarted and stopped at will.

Its own node name, ports, data and log directories (under a temporary directory), and its own Erlang
cookie (``HOME`` there): restarting or killing it touches nobody else's broker or queues. It needs the
``rabbitmq-server`` and ``rabbitmqctl`` scripts of a local RabbitMQ installation (the ones under
``/usr/lib/rabbitmq/bin``, which run the node as the calling user; ``PARKWAY_RABBITMQ_BIN`` names another
directory).

Two ways to bring the broker down and up again:

- ``restart_app``: ``rabbitmqctl stop_app`` then ``start_app``: every client connection drops, durable
  queues and their persistent messages stay (a broker restart, as an operator does it);
- ``kill_and_start``: SIGKILL the node's VM, then start the node again on the same data directory (a
  crash: what survives is what RabbitMQ had on disk).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BIN_ENV = "PARKWAY_RABBITMQ_BIN"
_CANDIDATES = ("/usr/lib/rabbitmq/bin", "/usr/local/lib/rabbitmq/bin", "/opt/rabbitmq/sbin")


class BrokerNodeError(Exception):
    """The throwaway node could not be started, restarted or stopped; the message says which step."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rabbitmq_bin() -> Path | None:
    """The directory with ``rabbitmq-server`` and ``rabbitmqctl``, or None when there is none."""
    configured = os.environ.get(BIN_ENV)
    for candidate in ([configured] if configured else []) + list(_CANDIDATES):
        path = Path(candidate)
        if (path / "rabbitmq-server").is_file() and (path / "rabbitmqctl").is_file():
            return path
    return None


class RabbitNode:
    """One RabbitMQ node on 127.0.0.1 with a random AMQP port. Use as a context manager."""

    def __init__(self, name: str, *, start_timeout_s: float = 90.0, cookie: str | None = None) -> None:
        binary = rabbitmq_bin()
        if binary is None:
            raise BrokerNodeError(
                f"no RabbitMQ scripts found (looked in {', '.join(_CANDIDATES)}; set {BIN_ENV})"
            )
        self.bin = binary
        self.name = f"{name}@localhost"
        self.start_timeout_s = start_timeout_s
        self.directory = Path(tempfile.mkdtemp(prefix=f"parkway-{name}-"))
        self.port = free_port()
        self.dist_port = free_port()
        self.pid_file = self.directory / "node.pid"
        if cookie is not None:  # the nodes of one cluster share theirs (Erlang's distribution secret)
            cookie_file = self.directory / ".erlang.cookie"
            cookie_file.write_text(cookie)
            cookie_file.chmod(0o400)
        self.started_s: list[float] = []  # how long each start took

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update(
            HOME=str(self.directory),  # its own Erlang cookie
            RABBITMQ_NODENAME=self.name,
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(self.directory / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.directory / "log"),
            RABBITMQ_CONFIG_FILE=str(self.directory / "rabbitmq.conf"),
            RABBITMQ_CONF_ENV_FILE=str(self.directory / "rabbitmq-env.conf"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.directory / "enabled_plugins"),
            RABBITMQ_PID_FILE=str(self.pid_file),
            ERL_EPMD_ADDRESS="127.0.0.1",
            ERL_CRASH_DUMP=str(self.directory / "erl_crash.dump"),
        )
        return env

    def ctl(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """``rabbitmqctl -n <this node> ARGS``, as this node's own user and cookie."""
        return self._ctl(*args, timeout=timeout)

    def _ctl(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / "rabbitmqctl"), "-n", self.name, *args],
            env=self._env(),
            cwd=self.directory,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(self) -> RabbitNode:
        if not (self.directory / "rabbitmq.conf").exists():
            (self.directory / "rabbitmq.conf").write_text(
                f"listeners.tcp.local = 127.0.0.1:{self.port}\nloopback_users = none\n"
            )
            (self.directory / "rabbitmq-env.conf").write_text("")
            (self.directory / "enabled_plugins").write_text("[].\n")
        started = time.monotonic()
        result = subprocess.run(
            [str(self.bin / "rabbitmq-server"), "-detached"],
            env=self._env(),
            cwd=self.directory,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if result.returncode != 0:
            raise BrokerNodeError(f"rabbitmq-server -detached failed: {result.stderr[-2000:]}")
        self._await_startup()
        self.started_s.append(time.monotonic() - started)
        return self

    def _await_startup(self) -> None:
        waited = self._ctl(
            "wait",
            str(self.pid_file),
            "--timeout",
            str(int(self.start_timeout_s)),
            timeout=self.start_timeout_s + 10,
        )
        if waited.returncode != 0:
            raise BrokerNodeError(
                f"node {self.name} did not start: {waited.stderr[-2000:]}\n{self.log_tail()}"
            )

    def set_env(self, key: str, value: int | str) -> None:
        """Set one of the ``rabbit`` application's settings on the running node (``rabbitmqctl eval``):
        what channels opened afterwards use, e.g. ``consumer_timeout`` (ms)."""
        result = self._ctl("eval", f"application:set_env(rabbit, {key}, {value}).")
        if result.returncode != 0 or result.stdout.strip() != "ok":
            raise BrokerNodeError(
                f"set_env {key}={value} failed: {result.stdout[-500:]} {result.stderr[-2000:]}"
            )

    def restart_app(self) -> None:
        """``stop_app`` then ``start_app``: connections drop, durable queues stay."""
        self.stop_app()
        self.start_app()

    def stop_app(self) -> None:
        """The broker application stops (every connection drops); the node and its data stay."""
        self._app("stop_app")

    def start_app(self) -> None:
        self._app("start_app")

    def _app(self, command: str) -> None:
        result = self._ctl(command)
        if result.returncode != 0:
            raise BrokerNodeError(f"rabbitmqctl {command} failed: {result.stderr[-2000:]}")

    def vm_pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def kill_and_start(self) -> None:
        """SIGKILL the node's VM, wait until it is gone, and start the node again on its data."""
        self.kill()
        self.start()

    def kill(self) -> None:
        """SIGKILL the node's VM and wait until it is gone (``start`` brings it back on its data)."""
        pid = self.vm_pid()
        if pid is None:
            raise BrokerNodeError(f"node {self.name} has no pid file")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _alive(pid):
            if time.monotonic() > deadline:
                raise BrokerNodeError(f"node {self.name} (pid {pid}) did not die")
            time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)

    def stop(self) -> None:
        """Stop the node (SIGKILL if it does not stop) and delete its directory."""
        pid = self.vm_pid()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._ctl("stop", str(self.pid_file), timeout=60)
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.directory, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        logs = sorted((self.directory / "log").glob("*.log"))
        if not logs:
            return "(no node log)"
        return "\n".join(logs[0].read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> RabbitNode:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (dead, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False
