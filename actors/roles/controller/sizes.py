"""What the controller holds per rollout and per snapshot, by name: the entries of each structure, for
``Actor.structure_sizes`` (the ``parkway_structure_entries`` gauge and ``StatusReport.structures``).
Each is bounded by the rollouts in play, or per snapshot by ``metrics.METRICS_KEEP``; the bounds are
in docs/memory.md#controller-and-trainer."""

from __future__ import annotations

from parkway.actors.roles.controller.dispatch import Dispatcher
from parkway.actors.roles.controller.forget import Forgetting
from parkway.actors.roles.controller.metrics import SnapshotMetrics
from parkway.actors.roles.controller.outbox import AckOutbox
from parkway.actors.roles.controller.state import RunState


def controller_sizes(
    state: RunState,
    outbox: AckOutbox,
    forgetting: Forgetting,
    dispatcher: Dispatcher | None,
    metrics: SnapshotMetrics | None,
) -> dict[str, int]:
    ledger = state.ledger
    sizes = {
        "ledger_groups": len(ledger.groups),
        "ledger_attempts": sum(len(s.attempts) for g in ledger.groups.values() for s in g.siblings),
        "trained_groups": len(state.trained_groups),
        **outbox.sizes(),
        **forgetting.sizes(),
    }
    if dispatcher is not None:
        sizes.update(dispatcher.sizes())
    if metrics is not None:
        sizes.update(metrics.sizes())
    return sizes
