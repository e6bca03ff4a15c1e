"""Who must answer before a run starts: a cluster that never does is named, typed, and exit 3."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from parkway.actors.roles.controller import ClusterUnavailable, Controller
from parkway.actors.roles.tq import TransferQueue
from parkway.actors.run.config import from_dict
from parkway.actors.runtime.settings import SettingsError, cluster_wait_s
from parkway.brokers.memory import MemoryBroker, MemoryHub

from tests.support.cli import parkway
from tests.support.paths import ROOT
from tests.support.rabbit import AMQP_URL, delete_run

SECRET = b"cluster-test"


async def test_participants_that_never_answer_are_named(tmp_path: Path) -> None:
    config = from_dict({"run": "lonely", "topology": {"agents": 1, "resources": 1}})
    async with MemoryBroker(MemoryHub(), "lonely") as broker:
        tq = TransferQueue(broker, secret=SECRET, snapshot_root=tmp_path)
        await tq.start()  # the only one there
        controller = Controller(broker, secret=SECRET)
        await controller.start()
        with pytest.raises(ClusterUnavailable) as missing:
            await controller.wait_for_cluster(config, timeout=0.3)
        await controller.stop()
        await tq.stop()
    assert "policy/0, resources/0, agent/0" in str(missing.value) and "tq/0" not in str(missing.value)


@pytest.mark.rabbitmq
@pytest.mark.slow  # runs `parkway run` as a process
async def test_run_against_a_cluster_that_never_answers_exits_3(tmp_path: Path) -> None:
    run = f"nobody-{uuid.uuid4().hex[:8]}"
    try:
        result = await asyncio.to_thread(
            parkway,
            "run",
            "--config",
            str(ROOT / "examples" / "quickstart.yaml"),
            "--broker",
            AMQP_URL,
            PARKWAY_SECRET="s",
            PARKWAY_STATE_DIR=str(tmp_path),
            PARKWAY_RUN=run,
            PARKWAY_CLUSTER_WAIT_S="0.5",  # the default is 120 s
        )
    finally:
        await delete_run(AMQP_URL, run, ["controller/0"])
    assert result.returncode == 3, result.stderr
    assert "parkway: cluster: no answer from tq/0, policy/0" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf", "nan"])
def test_a_bad_cluster_wait_is_refused_by_name(value: str) -> None:
    with pytest.raises(SettingsError, match="PARKWAY_CLUSTER_WAIT_S"):
        cluster_wait_s({"PARKWAY_CLUSTER_WAIT_S": value})
    assert cluster_wait_s({}) == 120.0 and cluster_wait_s({"PARKWAY_CLUSTER_WAIT_S": "2.5"}) == 2.5
