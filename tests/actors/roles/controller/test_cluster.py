"""Who must answer before a run starts: a cluster that never does is named, typed, and exit 3."""

from __future__ import annotations

import functools
import uuid
from pathlib import Path

import pytest
from parkway.actors.roles.controller import ClusterUnavailable, Controller
from parkway.actors.roles.tq import TransferQueue
from parkway.actors.run.config import from_dict
from parkway.actors.tools.cli import main
from parkway.brokers.memory import MemoryBroker, MemoryHub

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
async def test_run_against_a_cluster_that_never_answers_exits_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = f"nobody-{uuid.uuid4().hex[:8]}"
    # The controller waits 120 s for its cluster; half a second tells the same story.
    monkeypatch.setattr(
        Controller, "wait_for_cluster", functools.partialmethod(Controller.wait_for_cluster, timeout=0.5)
    )
    for name, value in {
        "PARKWAY_SECRET": "s",
        "PARKWAY_STATE_DIR": str(tmp_path),
        "PARKWAY_RUN": run,
    }.items():
        monkeypatch.setenv(name, value)
    try:
        code = await _main_in_thread(
            ["run", "--config", str(ROOT / "examples" / "quickstart.yaml"), "--broker", AMQP_URL]
        )
    finally:
        await delete_run(AMQP_URL, run, ["controller/0"])
    assert code == 3
    err = capsys.readouterr().err
    assert "parkway: cluster: no answer from tq/0, policy/0" in err and "Traceback" not in err


async def _main_in_thread(argv: list[str]) -> int:
    import asyncio

    return await asyncio.to_thread(main, argv)  # main runs its own event loop
