"""A throwaway RabbitMQ cluster on this machine: several ``RabbitNode``s on loopback ports, joined.

The nodes share an Erlang cookie of their own (no other broker on the machine can join them), start in
parallel, and the second and later join the first (``stop_app``, ``join_cluster``, ``start_app``). A
node can be stopped and started again while the others run (``stop_node``, ``start_node``), which is
what a test of failover does; ``urls`` lists every node's AMQP URL, in node order, the way
``PARKWAY_BROKER_URL`` takes several (comma-separated).
"""

from __future__ import annotations

import contextlib
import re
import secrets
from concurrent.futures import ThreadPoolExecutor

from parkway.actors.launch.rabbit_node import BrokerNodeError, RabbitNode


class RabbitCluster:
    """``size`` nodes named ``<name>0@localhost`` ... joined into one cluster. A context manager."""

    def __init__(self, name: str, size: int = 3) -> None:
        if size < 1:
            raise ValueError("a cluster has at least one node")
        cookie = secrets.token_hex(16)
        self.nodes = [RabbitNode(f"{name}{index}", cookie=cookie) for index in range(size)]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url_list(self) -> str:
        """Every node's URL, comma-separated: ``PARKWAY_BROKER_URL`` for a client that fails over."""
        return ",".join(self.urls)

    def start(self) -> RabbitCluster:
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(RabbitNode.start, self.nodes))
        first = self.nodes[0]
        for node in self.nodes[1:]:
            for step in (("stop_app",), ("join_cluster", first.name), ("start_app",)):
                result = node.ctl(*step)
                if result.returncode != 0:
                    raise BrokerNodeError(
                        f"{node.name}: rabbitmqctl {' '.join(step)}: {result.stderr[-2000:]}"
                    )
        running = self.running_nodes()
        if sorted(running) != sorted(node.name for node in self.nodes):
            raise BrokerNodeError(f"the cluster runs {running}, not every node")
        return self

    def running_nodes(self, via: int = 0) -> list[str]:
        """The cluster's running nodes, as node ``via`` sees them."""
        result = self.nodes[via].ctl("eval", "rabbit_nodes:all_running().")
        if result.returncode != 0:
            raise BrokerNodeError(f"cannot read the running nodes: {result.stderr[-2000:]}")
        # An Erlang list of atoms, maybe wrapped: quoted ('a-b@host') or not (ab@host).
        return [a or b for a, b in re.findall(r"'([^']+)'|([\w.]+@[\w.-]+)", result.stdout)]

    def stop_node(self, index: int) -> None:
        """Stop node ``index``'s broker (its clients' connections drop); its data and membership stay."""
        self.nodes[index].stop_app()

    def start_node(self, index: int) -> None:
        self.nodes[index].start_app()

    def stop(self) -> None:
        for node in reversed(self.nodes):
            with contextlib.suppress(Exception):
                node.stop()

    def __enter__(self) -> RabbitCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
