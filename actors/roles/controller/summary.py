"""What a run did, summed up at its end: the controller's counters and every participant's."""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import msgspec
from parkway.actors.roles.controller.cluster import participant_addresses
from parkway.actors.roles.controller.metrics import SnapshotMetrics
from parkway.actors.roles.controller.receipts import FAILED_PREFIX
from parkway.actors.roles.controller.state import RunState
from parkway.actors.run.config import RunConfig
from parkway.actors.runtime.client import Client
from parkway.brokers.base import BrokerError
from parkway.protocol.errors import ProtocolError
from parkway.protocol.ids import Role
from parkway.protocol.messages import Status, StatusReport


class RunSummary(msgspec.Struct, kw_only=True):
    session: str  # new, continued (a snapshot restored) or afresh (live actors served the run: new ids)
    # The run's generations from the policy's own records (every timeline, dead ones too), split into
    # the turns the sealed rollouts kept, generations of a turn already generated (work a recovery
    # or a retry redid) and the rest thrown away (failed or replaced attempts): docs/operations.md.
    generations_total: int
    turns_kept: int
    generations_regenerated: int
    generations_discarded: int
    replayed_from_cache: int  # replies participants sent again from their cache: never counted as work
    rollouts_expected: int
    rollouts_sealed: int
    rollouts_failed: int
    attempts_dispatched: int
    attempts_failed: int
    attempts_failed_by_code: dict[str, int] = {}  # e.g. replay_diverged: a black-box program that diverged
    rollouts_redone: int
    attempts_abandoned: int
    attempts_retired: int
    turns_generated: int
    turns_regenerated: int
    model_calls: int
    tokens_generated: int  # sampled by the engines (a continued call's kept prefix is not)
    # Prefix recovery: model calls a restore continued from a snapshot's cut, the tokens they kept
    # from it, and the cut's tokens generated again (a restore below prefix, or a call that could not
    # be continued: prefix_fallbacks). docs/recovery.md#prefix.
    calls_continued: int = 0
    prefix_tokens_kept: int = 0
    prefix_tokens_regenerated: int = 0
    prefix_fallbacks: int = 0
    # Restored rollouts a restore onto fewer agents moved to another agent than the one that saved
    # them (docs/recovery.md#another-topology).
    rollouts_moved: int = 0
    tool_calls: int
    tool_mutations_applied: int
    tool_duplicates_absorbed: int
    tool_mutations_duplicated: int  # from the resources' own records: must be 0
    sessions_leaked: int  # tool sessions opened and never retired (must be 0 at the end of a run)
    receipts_duplicate: int
    receipts_stale: int
    acks_sent: int
    ack_batches: int
    train_steps: int
    policy_version: int
    mean_reward: float
    wall_s: float
    rollouts_per_s: float
    model_calls_per_s: float
    transcripts_sha256: str
    snapshots_published: int
    snapshots_failed: int
    snapshots_skipped: int
    pause_ms: dict[str, float]  # admission-closed window per snapshot: p50, p95, max
    snapshot_steps_ms: dict[str, float]  # median duration of each save step
    snapshot_bytes: dict[str, float]  # bytes each snapshot holds: p50, p95, max
    restores: int
    rollouts_restored: int
    # Attempts a snapshot saved SEALING (their receipt in, their seal on its way) that the restore
    # sealed (docs/snapshots.md#receipts-in-the-cut).
    seals_finished_at_restore: int = 0
    rollouts_by_agent: dict[str, int]  # attempts each agent replica finished (sealed or not)
    tool_calls_by_resources: dict[str, int]
    model_calls_by_policy: dict[str, int] = {}  # model calls each policy replica answered
    # Bytes each snapshot wrote: what it holds less the packs linked from the one before (p50, p95, max).
    snapshot_bytes_written: dict[str, float] = {}


# Data messages a participant handles only for a run's work: a count of one at a session's start
# means live actors served this run before (``served_before``). ``generations``: the policy's own
# records of the run, kept across its processes.
_WORK_COUNTS = ("Run", "Generate", "ToolCall", "Rows", "SealRows", "generations")
# Counts that are not sums of this process's events: the run's lineage (the policy's records, TQ's
# rows), taken as they are at the end rather than as a difference from the start.
# Sessions opened less retired, and mutations applied twice, are states of the tool servers: a leak
# or a duplicate from an earlier session is still one.
_RUN_WIDE = frozenset(
    {
        "tq.turns_regenerated",
        "policy.generations",
        "policy.generations_repeated",
        "resources.sessions_opened",
        "resources.sessions_retired",
        "resources.tool_mutations_duplicated",
    }
)


async def participant_counts(client: Client, config: RunConfig) -> dict[str, StatusReport]:
    """Every participant's report as it stands now (one that does not answer is left out)."""
    reports: dict[str, StatusReport] = {}
    for address in participant_addresses(config):
        try:
            reply = await client.request(
                address, Status(checkpoint_id=f"sum-{time.monotonic_ns()}", deadline=time.time() + 10)
            )
        except (BrokerError, ProtocolError):  # gone, or its reply unreadable: it adds nothing
            continue
        if isinstance(reply, StatusReport):
            reports[address] = reply
    return reports


def served_before(baseline: dict[str, StatusReport]) -> list[str]:
    """The participants that already did work of this run (before this session started)."""
    return sorted(a for a, r in baseline.items() if any(r.counts.get(k, 0) > 0 for k in _WORK_COUNTS))


def _session_counts(report: StatusReport, before: StatusReport | None) -> dict[str, int]:
    """What this participant counted during this session: its counts less those at the session's
    start, when it is the same process (a replica that came back as a new one counts from zero)."""
    same = before is not None and (before.pid, before.started_at) == (report.pid, report.started_at)
    if not same or before is None:
        return dict(report.counts)
    return {
        key: value if f"{report.role}.{key}" in _RUN_WIDE else value - before.counts.get(key, 0)
        for key, value in report.counts.items()
    }


async def summarize(
    client: Client,
    config: RunConfig,
    *,
    expected: int,
    wall: float,
    state: RunState,
    counts: Counter[str],
    metrics: SnapshotMetrics,
    baseline: dict[str, StatusReport] | None = None,
    session: str = "new",
) -> RunSummary:
    """The summary of a finished session of a run: ``counts`` are the controller's (the run's, kept
    across restores in the anchor), the participants are asked for what they did since ``baseline``
    (one that does not answer adds nothing)."""
    theirs: dict[str, int] = defaultdict(int)
    by_agent: dict[str, int] = {}
    by_resources: dict[str, int] = {}
    by_policy: dict[str, int] = {}
    for address, report in (await participant_counts(client, config)).items():
        mine = _session_counts(report, (baseline or {}).get(address))
        for key, value in mine.items():
            theirs[f"{report.role}.{key}"] += value
        if report.role == Role.AGENT:
            by_agent[address] = mine.get("rollouts_completed", 0) + mine.get("rollouts_failed", 0)
        elif report.role == Role.RESOURCES:
            by_resources[address] = mine.get("tool_calls", 0)
        elif report.role == Role.POLICY:
            by_policy[address] = mine.get("model_calls", 0)
    sealed = state.sealed
    generations = theirs["policy.generations"]
    repeated = theirs["policy.generations_repeated"]
    return RunSummary(
        session=session,
        generations_total=generations,
        turns_kept=counts["turns_kept"],
        generations_regenerated=repeated,
        generations_discarded=generations - repeated - counts["turns_kept"],
        replayed_from_cache=sum(v for k, v in theirs.items() if k.endswith(".replayed")),
        rollouts_expected=expected,
        rollouts_sealed=sealed,
        rollouts_failed=counts["rollouts_failed"],
        attempts_dispatched=counts["attempts_dispatched"],
        attempts_failed=counts["attempts_failed"],
        attempts_failed_by_code={
            key[len(FAILED_PREFIX) :]: value
            for key, value in sorted(counts.items())
            if key.startswith(FAILED_PREFIX)
        },
        rollouts_redone=counts["rollouts_redone"],
        attempts_abandoned=counts["attempts_abandoned"],
        attempts_retired=counts["attempts_retired"],
        turns_generated=theirs["tq.staging_rows"],
        turns_regenerated=theirs["tq.turns_regenerated"],
        model_calls=theirs["policy.model_calls"],
        tokens_generated=theirs["policy.tokens_generated"],
        calls_continued=theirs["policy.calls_continued"],
        prefix_tokens_kept=theirs["policy.prefix_tokens_kept"],
        prefix_tokens_regenerated=theirs["policy.prefix_tokens_regenerated"],
        prefix_fallbacks=theirs["policy.prefix_fallbacks"],
        tool_calls=theirs["resources.tool_calls"],
        tool_mutations_applied=theirs["resources.tool_mutations_applied"],
        tool_duplicates_absorbed=theirs["resources.tool_duplicates"],
        tool_mutations_duplicated=theirs["resources.tool_mutations_duplicated"],
        sessions_leaked=theirs["resources.sessions_opened"] - theirs["resources.sessions_retired"],
        receipts_duplicate=counts["receipts_duplicate"],
        receipts_stale=counts["receipts_stale"],
        acks_sent=counts["acks_sent"],
        ack_batches=counts["ack_batches"],
        train_steps=counts["train_steps"],
        policy_version=state.policy_version,
        mean_reward=state.mean_reward(),
        wall_s=round(wall, 3),
        rollouts_per_s=round(sealed / wall, 3) if wall else 0.0,
        model_calls_per_s=round(theirs["policy.model_calls"] / wall, 3) if wall else 0.0,
        transcripts_sha256=state.transcripts_sha256(),
        snapshots_published=metrics.published,
        snapshots_failed=metrics.failed,
        snapshots_skipped=metrics.skipped,
        pause_ms=metrics.pause_summary(),
        snapshot_steps_ms=metrics.phases_summary(),
        snapshot_bytes=metrics.bytes_summary(),
        snapshot_bytes_written=metrics.bytes_written_summary(),
        restores=counts["restores"],
        rollouts_restored=counts["rollouts_restored"],
        seals_finished_at_restore=counts["seals_finished_at_restore"],
        rollouts_moved=counts["rollouts_moved"],
        rollouts_by_agent=by_agent,
        tool_calls_by_resources=by_resources,
        model_calls_by_policy=by_policy,
    )
