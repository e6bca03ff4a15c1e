"""What each engine replica asks Ray for (``actors/engines/ray_placement.py``), without a Ray."""

from __future__ import annotations

import pytest
from parkway.actors.engines.ray_placement import RayPlacement
from parkway.actors.run.config import ConfigError, from_dict


def test_a_replica_asks_for_its_cpus_gpus_and_resources() -> None:
    assert RayPlacement().actor_options() == {"num_cpus": 0.0}
    placement = RayPlacement(gpus_per_engine=1, cpus_per_engine=2, resources={"worker_node": 0.5})
    assert placement.actor_options() == {"num_cpus": 2, "resources": {"worker_node": 0.5}, "num_gpus": 1}
    assert placement.bundles(1) is None  # one GPU: no placement group


def test_a_tensor_parallel_replica_gets_one_bundle_per_gpu() -> None:
    placement = RayPlacement(gpus_per_engine=4, resources={"a100": 1})
    assert placement.bundles(4) == [{"GPU": 1.0}] * 4
    # Its GPUs are the group's: the actor itself asks for none beside them.
    assert "num_gpus" not in placement.actor_options(4)
    assert RayPlacement().bundles(4) is None  # no GPUs asked for: no group (a CPU engine)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"host": "inline", "ray_address": "auto"}, "only with policy.host: ray"),
        ({"host": "inline", "engine_resources": {"x": 1}}, "only with policy.host: ray"),
        ({"gpus_per_engine": -1}, "must be >= 0"),
        ({"engine_resources": {"worker_node": 0}}, "every amount > 0"),
    ],
)
def test_the_config_check_names_bad_placement_keys(policy: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict({"policy": policy})  # checked as it is read
