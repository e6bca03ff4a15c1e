"""The names parkway gives things on disk, defined once.

Under the state directory (``$PARKWAY_STATE_DIR``): ``snapshots/<run>/`` (below), ``history/<run>/``
(each process's history file, with ``PARKWAY_HISTORY=1``) and ``state/<run>/<role>/<replica>/`` (an
actor's reply journal, for actors started durable). A snapshot root:

    <root>/<run>/snapshot_<seq>/manifest.json          what the snapshot holds (``protocol/manifest.py``)
                               /ledger.msgpack         the ledger and the controller's anchor
                               /tq/                    TQ's staging, canonical and lineage rows
                               /participants/<role>/<replica>/   every other participant's records
                /tmp_<checkpoint id>/                  a snapshot being written (renamed when published)
                /trainer/fallback_<step>.msgpack       the controller's anchor at a trainer checkpoint
                        /step_<step>.msgpack           the trainer's own state at that step
                /COMPLETED                             the run finished: its next start begins afresh

Pure names: nothing here touches the disk.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

SNAPSHOTS_DIR = "snapshots"  # under the state directory: one folder per run
HISTORY_DIR = "history"
ACTOR_STATE_DIR = "state"
# Under the trainer actor's state directory (``state/<run>/trainer/<replica>/``): one record per step
# (``trainer_state_file_name``) and the controller session it is synced with.
TRAINER_STEPS_DIR = "steps"
TRAINER_FENCE_FILE = "fence.msgpack"
# Under the policy's state directory (``state/<run>/policy/<replica>/``): one line per generation the
# engine finished, ``<rollout id> <call index>``, in every process of it (``actors/roles/generations.py``).
POLICY_GENERATIONS_FILE = "generations.log"

MANIFEST = "manifest.json"
LEDGER = "ledger.msgpack"
COMPLETED = "COMPLETED"
TRAINER_DIR = "trainer"
TQ_DIR = "tq"
PARTICIPANTS_DIR = "participants"
TQ_STAGING = f"{TQ_DIR}/staging.msgpack"  # the staging rows every saved turn references (shard 0's)
AGENT_ROLLOUTS = "rollouts.msgpack"  # an agent's saved rollouts, in its participant directory

SNAPSHOT_PREFIX = "snapshot_"
TMP_PREFIX = "tmp_"
FALLBACK_PREFIX = "fallback_"
TRAINER_STATE_PREFIX = "step_"
RECORDS_SUFFIX = ".msgpack"

# A snapshot location (what a Commit or a Restore names) is one path component of these shapes:
# ``tmp_<id>`` while written, ``snapshot_<seq>`` after. Nothing from a message becomes a path unless
# it matches.
LOCATION_PATTERN = re.compile(r"^(tmp_[A-Za-z0-9][A-Za-z0-9._-]{0,127}|snapshot_[0-9]{1,12})$")
SNAPSHOT_LOCATION = re.compile(r"^snapshot_[0-9]{1,12}$")  # a published one: what a Restore names


def snapshot_dir_name(seq: int) -> str:
    """``snapshot_<seq>``: a published snapshot's directory."""
    return f"{SNAPSHOT_PREFIX}{seq}"


def parse_snapshot_dir_name(name: str) -> int | None:
    """The sequence number of ``snapshot_<seq>``; None for any other name."""
    suffix = name.removeprefix(SNAPSHOT_PREFIX)
    return int(suffix) if suffix != name and suffix.isascii() and suffix.isdigit() else None


def tmp_dir_name(checkpoint_id: str) -> str:
    """``tmp_<checkpoint id>``: where a snapshot is written before it is published."""
    return f"{TMP_PREFIX}{checkpoint_id}"


def participant_parts(role: str, replica: int) -> tuple[str, ...]:
    """Where a participant's records go inside a snapshot directory. TQ's rows sit at the top level
    (``tq/``, and shard ``n`` > 0 of a sharded TQ in ``tq/<n>/``), beside the ledger they are cut with;
    every other participant has its own directory."""
    if role == TQ_DIR:
        return (TQ_DIR,) if replica == 0 else (TQ_DIR, str(replica))
    return (PARTICIPANTS_DIR, role, str(replica))


def participant_dir(role: str, replica: int) -> PurePosixPath:
    """``participant_parts`` as one relative path."""
    return PurePosixPath(*participant_parts(role, replica))


def writer_of(path: str) -> str:
    """Who wrote a snapshot file: ``participants/agent/0/x`` -> ``agent/0``; ``tq/x`` -> ``tq/0``;
    ``tq/2/x`` -> ``tq/2``; the ledger (and anything else at the top) -> ``controller/0``."""
    parts = path.split("/")
    if parts[0] == PARTICIPANTS_DIR and len(parts) >= 4:
        return f"{parts[1]}/{parts[2]}"
    if parts[0] == TQ_DIR:
        shard = parts[1] if len(parts) >= 3 and parts[1].isascii() and parts[1].isdigit() else "0"
        return f"{TQ_DIR}/{shard}"
    return "controller/0"


def fallback_file_name(step: int) -> str:
    """``fallback_<step>.msgpack``: the controller's anchor written at trainer checkpoint ``step``."""
    return f"{FALLBACK_PREFIX}{step}{RECORDS_SUFFIX}"


def trainer_state_file_name(step: int) -> str:
    """``step_<step>.msgpack``: the trainer's state at checkpoint ``step``."""
    return f"{TRAINER_STATE_PREFIX}{step}{RECORDS_SUFFIX}"


def parse_trainer_state_file_name(name: str) -> int | None:
    """The step of ``step_<step>.msgpack``; None for any other name."""
    stem = name.removesuffix(RECORDS_SUFFIX)
    suffix = stem.removeprefix(TRAINER_STATE_PREFIX)
    if stem == name or suffix == stem or not (suffix.isascii() and suffix.isdigit()):
        return None
    return int(suffix)
