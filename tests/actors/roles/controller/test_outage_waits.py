"""Storage and broker failures at the edges of a run are waited out, not fatal. A restore that fails transiently (a broker outage: every request of a step fails) is tried again
from its first step under a new restore id, in the same process, and the run completes with the
transcripts of a run that never crashed. Before, the controller gave up at the first failure and
exited (3): a 3 s broker outage at any restore step ended it."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import structlog
from parkway.actors.roles.controller import snapshots
from parkway.actors.roles.controller.controller import RunSummary
from parkway.actors.roles.controller.participants import Participants
from parkway.actors.storage.runs import RunDirectory
from parkway.brokers.base import BrokerError
from parkway.protocol.layout import COMPLETED
from parkway.protocol.messages import Discover, Message
from parkway.protocol.snapshot import SnapshotFailure

from tests.support.embedded import SNAPSHOT_RUN, crashed_run, embedded_run


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return asyncio.run(crashed_run(tmp_path_factory.mktemp("pristine")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> RunSummary:
    return asyncio.run(embedded_run(SNAPSHOT_RUN, tmp_path_factory.mktemp("reference"), snapshots=False))


async def test_a_restore_failing_at_a_step_is_retried_and_the_run_completes(
    pristine: Path, reference: RunSummary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(pristine, tmp_path / "snapshots" / pristine.name)
    monkeypatch.setattr(snapshots, "RESTORE_RETRY_FIRST_S", 0.01)
    real_request = Participants.request
    failed: list[str] = []

    async def request(self: Participants, address: str, message: Message, **kwargs: object) -> Message:
        # The broker is down for the whole first discover step: every request of it fails.
        if isinstance(message, Discover) and len(failed) < 4:
            failed.append(address)
            try:  # what the real request makes of a publish the broker cannot take
                raise BrokerError(f"publish to {address!r} failed: the broker is down (test)")
            except BrokerError as exc:
                raise SnapshotFailure("request", f"{address}: {exc}", transient=True) from exc
        return await real_request(self, address, message, **kwargs)

    monkeypatch.setattr(Participants, "request", request)
    with structlog.testing.capture_logs() as logs:
        resumed = await embedded_run(SNAPSHOT_RUN, tmp_path)
    assert failed, "the outage never happened: nothing was tested"
    retried = [e for e in logs if e["event"] == "restore_retried"]
    assert retried and retried[0]["step"] == "discover"
    started = [e for e in logs if e["event"] == "restore_started"]
    assert len(started) == len(retried) + 1  # each failed try, and the one after the outage
    assert resumed.restores == 1 and resumed.rollouts_restored > 0
    assert resumed.rollouts_sealed == 9 and resumed.rollouts_failed == 0
    assert resumed.transcripts_sha256 == reference.transcripts_sha256


async def test_a_completion_marker_that_cannot_be_written_yet_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state directory unwritable when the last rollout sealed: the run waits for it to write its
    marker (before, ``FileExistsError`` ended the finished run with exit 1)."""
    monkeypatch.setattr(snapshots, "RESTORE_RETRY_FIRST_S", 0.01)
    real_mark = RunDirectory.mark_completed
    failures: list[int] = []

    def mark_completed(self: RunDirectory) -> None:
        if len(failures) < 3:
            failures.append(1)
            raise FileExistsError(17, "File exists", str(self.path))  # the directory is a file now
        real_mark(self)

    monkeypatch.setattr(RunDirectory, "mark_completed", mark_completed)
    with structlog.testing.capture_logs() as logs:
        summary = await embedded_run(SNAPSHOT_RUN, tmp_path)
    assert summary.rollouts_sealed == 9 and summary.rollouts_failed == 0
    assert [e["event"] for e in logs].count("completed_marker_failed") == 3
    assert (tmp_path / "snapshots" / SNAPSHOT_RUN["run"] / COMPLETED).exists()
