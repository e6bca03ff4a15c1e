"""A throwaway Ray cluster on this machine: a head and worker nodes started with ``ray start``, each
worker with a custom resource that names it (``{"worker_node": 1}``), so that work asked to run there
can be seen to run there.

Its processes keep their files under a temporary directory of their own (``--temp-dir``), and
``stop`` kills exactly the processes that name that directory, never another Ray on the machine
(``ray stop`` would stop them all). Authentication is off in every process of it
(``RAY_AUTH_MODE=disabled``): a client that joins it needs the same (``env``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parkway.actors.launch.rabbit_node import free_port

AUTH_ENV = {"RAY_AUTH_MODE": "disabled"}


class RayClusterError(Exception):
    """A node could not be started; the message has its output."""


class RayCluster:
    def __init__(self, workers: int = 1, *, cpus_per_node: int = 1) -> None:
        self.workers, self.cpus_per_node = workers, cpus_per_node
        # Short: Ray's socket paths under it must stay within the kernel's 107 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="pkray-", dir="/tmp"))
        self.port = free_port()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @staticmethod
    def env() -> dict[str, str]:
        """The environment of a process that joins this cluster."""
        return {**os.environ, **AUTH_ENV}

    def _ray(self, *args: str) -> None:
        ray = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
        result = subprocess.run(
            [ray, "start", *args, "--disable-usage-stats", f"--num-cpus={self.cpus_per_node}"],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            raise RayClusterError(
                f"ray start {' '.join(args)}: {result.stdout[-1500:]}{result.stderr[-1500:]}"
            )

    def start(self) -> RayCluster:
        self._ray(
            "--head",
            f"--port={self.port}",
            "--include-dashboard=false",
            f"--temp-dir={self.temp_dir}",
            # Out of the workers' port range (10002-19999), and not another cluster's.
            f"--ray-client-server-port={free_port()}",
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
        )
        for index in range(self.workers):
            self._ray(
                f"--address={self.address}",
                f"--resources={json.dumps({'worker_node': 1, f'worker_{index}': 1})}",
                f"--node-manager-port={free_port()}",
                f"--object-manager-port={free_port()}",
            )
        return self

    def nodes(self) -> list[dict[str, object]]:
        """Every live node: its id and resources, as ``ray.nodes()`` says (asked from a process of its own)."""
        script = (
            f"import json, ray; ray.init(address={self.address!r}, log_to_driver=False); "
            "print(json.dumps([{'id': n['NodeID'], 'resources': n['Resources']} "
            "for n in ray.nodes() if n['Alive']]))"
        )
        result = subprocess.run(
            [sys.executable, "-c", script], env=self.env(), capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            raise RayClusterError(f"cannot list the nodes: {result.stderr[-2000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        """Kill every process of this cluster (those that name its directory), then delete it."""
        marker = str(self.temp_dir)
        for _ in range(3):
            found = False
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit() or int(entry.name) == os.getpid():
                    continue
                try:
                    cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                if marker in cmdline or f"127.0.0.1:{self.port}" in cmdline:
                    found = True
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(entry.name), signal.SIGKILL)
            if not found:
                break
            time.sleep(0.5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> RayCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
