"""Where the policy's engine replicas run on Ray: which cluster, and what each replica asks for.

``RayPlacement`` comes from the configuration (``policy.ray_address``, ``policy.gpus_per_engine``,
``policy.cpus_per_engine``, ``policy.engine_resources``). With no address the policy starts a Ray of its
own in its process, as it always did; with one (``auto``, ``host:port`` or ``ray://host:port``) it joins
that cluster and leaves it running when it stops. Each replica asks Ray for its GPUs, CPUs and custom
resources (``{"worker_node": 1}`` puts it on the node started with that resource), so Ray places it on a
node that has them. A replica that needs several GPUs (vLLM's ``tensor_parallel_size`` > 1 with GPUs)
gets a placement group of one bundle per GPU, packed on one node, and runs inside it, so the workers
vLLM starts for its tensor-parallel ranks land on that group's GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RayPlacement:
    address: str | None = None  # None: a Ray of the policy's own, in its process
    gpus_per_engine: float = 0.0
    cpus_per_engine: float = 0.0  # 0: the deterministic engine needs no reservation
    resources: dict[str, float] = field(default_factory=dict)  # custom resources per replica

    def bundles(self, tensor_parallel_size: int) -> list[dict[str, float]] | None:
        """The placement group's bundles of one replica, or None when it needs no group."""
        if self.gpus_per_engine <= 0 or tensor_parallel_size <= 1:
            return None
        per_rank = self.gpus_per_engine / tensor_parallel_size
        return [{"GPU": per_rank} for _ in range(tensor_parallel_size)]

    def actor_options(self, tensor_parallel_size: int = 1) -> dict[str, Any]:
        """``.options(...)`` of one replica's Ray actor, before any placement group."""
        options: dict[str, Any] = {"num_cpus": self.cpus_per_engine}
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.bundles(tensor_parallel_size) is None and self.gpus_per_engine > 0:
            options["num_gpus"] = self.gpus_per_engine
        return options

    def place(self, tensor_parallel_size: int) -> tuple[dict[str, Any], Any]:
        """A replica's actor options and its placement group (None when it needs none); the group is
        created here and must be removed with the replica (``remove``)."""
        options = self.actor_options(tensor_parallel_size)
        bundles = self.bundles(tensor_parallel_size)
        if bundles is None:
            return options, None
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles[0].update(self.resources)  # the replica's own actor runs in the group: its resources too
        group = placement_group(bundles, strategy="STRICT_PACK")
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_capture_child_tasks=True
        )
        return options, group


def remove(group: Any) -> None:
    if group is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
