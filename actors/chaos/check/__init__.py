"""The history checker: a run's invariants, verified over what every actor recorded.

Pure: it takes the typed records (``parkway.protocol.history``) and what a snapshot check found on disk
(``RunHistory``; ``load_run`` reads both) and returns a ``Verdict``. Each invariant is one named check,
in a module of its own kind; a failed one carries violations, each with a precise message and the
records that show it, and ``Verdict.report`` prints the shortest slice of the history around each one:
the offending rollout's records in time order, up to the evidence.

The checks (a run is correct when all pass):

- ``run_completed`` (``seals``): the last controller finished the run, every expected rollout sealed,
  none failed.
- ``sealed_exactly_once`` (``seals``): along the timeline that survived (the final controller, the
  snapshot it restored, the controller that published that snapshot up to its capture, and so on
  back), every expected rollout was sealed exactly once, and TQ never replaced a canonical row it held.
- ``no_turn_regenerated`` (``turns``): a rollout continued after a restore from ``k`` saved model calls
  never asks for (agent) or gets (policy) calls ``0..k-1`` again; only the call that was in flight is
  redone.
- ``mutations_exactly_once`` (``turns``): no tool mutation is applied twice in one session (whatever
  the redeliveries), and every sealed rollout's session verified with exactly the mutations its agent
  recorded: as many applied as recorded, revision equal, reward 1.0 (none lost, none doubled).
- ``fenced_attempts_stay_fenced`` (``fences``): once attempt N+1 of a rollout exists (dispatched, or
  created by a restore's fence), nothing of attempt N is accepted anywhere: no seal, no Run, no model
  call admitted or staged, no tool session opened or mutated, no TQ row.
- ``snapshots_verify`` (``snapshots``): every snapshot a controller published is on disk and verifies
  (manifest, digests, records, ledger, staging keys), and every restore read a published snapshot.
- ``progress`` (``progress``): work was done: rollouts sealed, model calls generated, tool mutations
  applied; in a chaos run, faults were injected and each one was followed by more work.
"""

from __future__ import annotations

from collections.abc import Callable

from parkway.actors.chaos.check.about import NEMESIS, attempt_of, mentions
from parkway.actors.chaos.check.fences import ACCEPTANCES, check_fenced_attempts
from parkway.actors.chaos.check.progress import PROGRESS_KINDS, check_progress, faults_injected
from parkway.actors.chaos.check.run import RunHistory, load_run
from parkway.actors.chaos.check.seals import check_run_completed, check_sealed_exactly_once
from parkway.actors.chaos.check.snapshots import check_snapshots
from parkway.actors.chaos.check.timeline import Incarnation, incarnations, surviving_seals
from parkway.actors.chaos.check.turns import check_mutations_exactly_once, check_no_turn_regenerated
from parkway.actors.chaos.check.verdict import CheckResult, Verdict, Violation, shortest_slice
from parkway.protocol.history import RestoreFenced

__all__ = [
    "ACCEPTANCES",
    "CHECKS",
    "NEMESIS",
    "PROGRESS_KINDS",
    "CheckResult",
    "Incarnation",
    "RunHistory",
    "Verdict",
    "Violation",
    "attempt_of",
    "check",
    "incarnations",
    "load_run",
    "mentions",
    "shortest_slice",
    "surviving_seals",
]

CHECKS = (
    "run_completed",
    "sealed_exactly_once",
    "no_turn_regenerated",
    "mutations_exactly_once",
    "fenced_attempts_stay_fenced",
    "snapshots_verify",
    "progress",
)


def check(history: RunHistory) -> Verdict:
    """Every check over one run's history."""
    records = sorted(history.records, key=lambda r: (r.t, r.actor, r.inc, r.n))
    history = RunHistory(records, history.snapshots, history.chaos)
    controllers = incarnations(records)
    chain, _ = surviving_seals(controllers)
    runners: list[Callable[[], CheckResult]] = [
        lambda: check_run_completed(records, controllers),
        lambda: check_sealed_exactly_once(records, controllers),
        lambda: check_no_turn_regenerated(records),
        lambda: check_mutations_exactly_once(records, controllers),
        lambda: check_fenced_attempts(records),
        lambda: check_snapshots(history, controllers),
        lambda: check_progress(history, chain),
    ]
    checks = [run() for run in runners]
    stats = {
        "records": len(records),
        "processes": len({(r.actor, r.inc) for r in records}),
        "controllers": len(controllers),
        "seals": len(chain),
        "restores": sum(len(inc.of(RestoreFenced)) for inc in controllers),
        "faults": len(faults_injected(history)),
    }
    return Verdict(checks, stats, records)
