"""The cluster a run needs, before its first dispatch: who must answer, and who cannot save a rollout
mid-way. And, while it runs, which agent replicas came back as new processes."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

import structlog
from parkway.actors.roles.controller.errors import ClusterUnavailable, SetupError, Unauthorized
from parkway.actors.roles.controller.fingerprints import replica_addresses
from parkway.actors.roles.controller.retire import Retirement
from parkway.actors.roles.controller.state import RunState
from parkway.actors.run.config import RunConfig
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.history import History
from parkway.brokers.base import BrokerError
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.history import ReplicaRestarted
from parkway.protocol.ids import Role, actor_address
from parkway.protocol.ledger import AttemptState
from parkway.protocol.messages import AttemptRef, Capabilities, Discover, Error, Status, StatusReport

log = structlog.get_logger("parkway.controller")


def participant_addresses(config: RunConfig) -> list[str]:
    roles = (Role.TQ, Role.POLICY, Role.RESOURCES, Role.AGENT)
    return [address for role in roles for address in replica_addresses(config, role)]


async def restart_only_participants(client: Client, config: RunConfig) -> set[str]:
    """Restart-only participants cannot save a rollout mid-way. At ``turn``/``prefix`` that fails
    setup unless ``recovery.allow_restart_only``; then it is a warning, and their rollouts restart
    from the prompt after a crash (``sibling`` behaviour). Either way, every one is named."""
    restart_only = []
    for address in participant_addresses(config):
        reply = await client.request(
            address, Discover(checkpoint_id=f"setup-{time.monotonic_ns()}", deadline=time.time() + 10)
        )
        if isinstance(reply, Capabilities) and reply.restart_only:
            restart_only.append(address)
    recovery = config.recovery
    if recovery.target_level not in ("turn", "prefix"):
        return set(restart_only)
    if restart_only and not recovery.allow_restart_only:
        raise SetupError(
            f"restart-only participants cannot keep turns at recovery.target_level {recovery.target_level}: "
            f"{', '.join(restart_only)}; set recovery.allow_restart_only: true to restart their rollouts "
            "from the prompt instead"
        )
    if restart_only:
        log.warning(
            "restart_only_participants",
            participants=restart_only,
            effect="their rollouts restart from the prompt after a crash",
        )
    elif recovery.allow_restart_only:
        log.warning(
            "restart_only_allowed_but_none",
            detail="recovery.allow_restart_only is true but no participant is restart-only",
        )
    return set(restart_only)


# What an unauthorized answer at the cluster wait means: waiting never fixes it.
WRONG_KEYS = (
    "this driver's keys are not the actors' (PARKWAY_SECRET, or PARKWAY_SIGNING_KEY and PARKWAY_PUBLIC_KEYS)"
)


class AgentLiveness:
    """An agent replica that comes back as a new process lost the rollouts it was running: they get a
    new attempt from their prompt on that replica (its tool sessions move to the new attempt)."""

    def __init__(
        self,
        client: Client,
        state: RunState,
        counts: Counter[str],
        history: History,
        retirement: Retirement,
        wake: Callable[[], None],
    ) -> None:
        self._client, self._state, self._counts, self._history = client, state, counts, history
        self._retirement, self._wake = retirement, wake
        self._incarnations: dict[str, tuple[int, float]] = {}  # address -> (pid, started_at) last seen

    async def wait_for_cluster(
        self, config: RunConfig, timeout: float = 120.0, *, extra: tuple[str, ...] = ()
    ) -> None:
        """Every participant (and ``extra``) answers Status before the first dispatch (a missing one
        is named)."""
        deadline = time.monotonic() + timeout
        missing = [*participant_addresses(config), *extra]
        while missing:
            still = []
            for address in missing:
                try:
                    reply = await self._client.request(
                        address,
                        Status(checkpoint_id=f"hello-{time.monotonic_ns()}", deadline=time.time() + 2),
                    )
                    if isinstance(reply, StatusReport):
                        self._incarnations[address] = (reply.pid, reply.started_at)
                        self._state.epochs_seen = max(self._state.epochs_seen, reply.epoch)
                    elif isinstance(reply, Error) and reply.code is ErrorCode.UNAUTHORIZED:
                        raise Unauthorized(
                            f"{address} refused this driver's signature ({reply.detail}): {WRONG_KEYS}"
                        )
                    else:
                        still.append(address)
                except ProtocolError as err:
                    if err.code is ErrorCode.UNAUTHORIZED:  # a wrong secret: waiting never fixes it
                        raise Unauthorized(
                            f"{address} answered with a reply that does not verify here ({err.detail}): {WRONG_KEYS}"
                        ) from None
                    still.append(address)
                except BrokerError:
                    still.append(address)
            missing = still
            if missing and time.monotonic() > deadline:
                raise ClusterUnavailable(f"no answer from {', '.join(missing)} within {timeout:.0f}s")
            if missing:
                await asyncio.sleep(0.5)

    async def poll(self, agents: int) -> None:
        """Ask every agent replica who it is now (one that is down or busy is asked again next time)."""
        for replica in range(agents):
            address = actor_address(Role.AGENT, replica)
            try:
                reply = await self._client.request(
                    address, Status(checkpoint_id=f"alive-{time.monotonic_ns()}", deadline=time.time() + 2)
                )
            except BrokerError:
                continue
            if isinstance(reply, StatusReport):
                self.observe(address, reply)

    def observe(self, address: str, report: StatusReport) -> bool:
        """Note an agent's incarnation; True (and its rollouts restarted) when it is a new process."""
        incarnation = (report.pid, report.started_at)
        if self._incarnations.setdefault(address, incarnation) == incarnation or report.role != Role.AGENT:
            return False
        self._incarnations[address] = incarnation
        self._replica_restarted(report.replica)
        return True

    def _replica_restarted(self, replica: int) -> None:
        ledger = self._state.ledger
        lost = [
            s.rollout_id
            for g in ledger.groups.values()
            for s in g.siblings
            if s.current.state is AttemptState.DISPATCHED and s.current.replica == replica
        ]
        for rollout in lost:
            self._retirement.unfenced.append(
                AttemptRef(rollout_id=rollout, attempt=ledger.sibling(rollout).current.index)
            )
            ledger.restart_after_restore(rollout, continue_saved=False)
        self._counts["attempts_lost_with_replica"] += len(lost)
        self._history.record(ReplicaRestarted(replica=replica, lost=tuple(lost)))
        log.warning("agent_replica_restarted", replica=replica, rollouts_restarted=len(lost))
        self._wake()
