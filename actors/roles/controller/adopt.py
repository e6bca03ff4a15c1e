"""Taking over a restored ledger: which attempts continue, which start over, which stay fenced."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import structlog
from parkway.actors.roles.controller.fingerprints import live_topology
from parkway.actors.roles.controller.state import RunState
from parkway.actors.run.config import RunConfig
from parkway.protocol.anchor import ControllerAnchor
from parkway.protocol.ids import Role, actor_address
from parkway.protocol.ledger import AttemptState, Granularity, Ledger
from parkway.protocol.messages import AttemptRef, EpisodeRef
from parkway.protocol.placement import Placement, Topology, place, policy_of

log = structlog.get_logger("parkway.controller")


@dataclass(frozen=True)
class SavedWork:
    """What the snapshot a restore takes saved: the attempts its agents cut, and its agents and tool
    servers (None: a snapshot older than that record, restored onto its own topology)."""

    episodes: set[tuple[str, int]]
    topology: Topology | None = None


@dataclass(frozen=True)
class Continuation:
    """What a restore hands the participants after the controller took over its ledger."""

    continued: tuple[EpisodeRef, ...]  # attempts N+1 that continue a saved transcript (the scope)
    fenced: tuple[AttemptRef, ...]  # attempts refused everywhere: dead ones, and the running N
    epoch: int  # this controller's epoch, stamped on the restore
    # Which saved replica each restarted rollout comes from and where it runs now (None: nothing
    # was running). Onto another topology, agents and tool servers read others' directories.
    placement: Placement | None = None

    def scope_of(self, role: Role, replica: int) -> tuple[tuple[EpisodeRef, ...], tuple[int, ...] | None]:
        """What one agent, tool server or policy replica restores: the continued rollouts it serves
        now, and the saved replicas' directories it takes over (None, its own, when the topology did
        not change)."""
        placement = self.placement
        if placement is None or not placement.elastic:
            return self.continued, None
        if role == Role.AGENT:
            mine = tuple(e for e in self.continued if e.replica == replica)
            return mine, placement.agent_sources(replica)
        if role == Role.POLICY:
            mine = tuple(e for e in self.continued if placement.on_policy(e.rollout_id) == replica)
            return mine, placement.policy_sources(replica)
        mine = tuple(e for e in self.continued if placement.on_tool_server(e.rollout_id) == replica)
        return mine, placement.tool_server_sources(replica)


def dead_attempts(ledger: Ledger) -> list[AttemptRef]:
    """Attempts of a restored ledger that must stay refused: the failed, abandoned and retired ones. A
    restore replaces every participant's fences with these (and the running ones it restarts): the
    fences of the cluster that died may name attempt numbers the restored ledger gives out again."""
    dead = (AttemptState.FAILED, AttemptState.ABANDONED, AttemptState.RETIRED)
    return [
        AttemptRef(rollout_id=s.rollout_id, attempt=a.index) for s, a in ledger.attempts() if a.state in dead
    ]


def adopt_snapshot(
    state: RunState,
    ledger: Ledger,
    anchor: ControllerAnchor,
    *,
    config: RunConfig,
    task_count: int,
    counts: Counter[str],
    restart_only: set[str],
    saved: SavedWork,
) -> Continuation:
    """Every attempt that was running gets attempt N+1 on the same replica (placed on a live one when
    the snapshot had other numbers of agents: ``place``), continuing its saved transcript at ``turn``
    level, from its prompt otherwise."""
    saved_episodes = saved.episodes
    state.ledger = ledger
    state.take_anchor(anchor, task_count=task_count)
    for key, value in anchor.counts.items():
        counts[key] = value
    live = live_topology(config)
    if config.recovery.target_level == "prompt_group":
        return _redo_groups(ledger, state.epoch, counts, place(saved.topology or live, live, {}))
    keep_turns = config.recovery.target_level in ("turn", "prefix")
    continued = []
    fenced = dead_attempts(ledger)
    running = sorted(ledger.dispatched())
    currents = {rollout: ledger.sibling(rollout).current for rollout, _ in running}
    placement = place(
        saved.topology or live,
        live,
        {rollout: current.replica or 0 for rollout, current in currents.items()},
        policies={r: c.policy for r, c in currents.items() if c.policy is not None},
    )
    if placement.elastic:
        counts["rollouts_moved"] += sum(placement.agent[r] != placement.origin[r] for r in placement.agent)
    for rollout, attempt in running:
        fenced.append(AttemptRef(rollout_id=rollout, attempt=attempt))
        replica = placement.agent[rollout]
        depends_on = {
            actor_address(Role.AGENT, replica),
            actor_address(Role.RESOURCES, live.tool_server_of(replica)),
        }
        keeps_turns = keep_turns and not depends_on & restart_only  # restart-only: from the prompt
        fresh = ledger.restart_after_restore(
            rollout, continue_saved=keeps_turns and (rollout, attempt) in saved_episodes, replica=replica
        )
        counts["attempts_restarted"] += 1
        if fresh.continue_from is not None:
            assert fresh.replica is not None
            continued.append(EpisodeRef(rollout_id=rollout, attempt=fresh.index, replica=fresh.replica))
            policy = placement.on_policy(rollout)  # where its saved prefix went
            if policy != policy_of(rollout, live.policies):
                ledger.place_on_policy(rollout, policy)
    counts["restores"] += 1
    counts["rollouts_restored"] += len(continued)
    return Continuation(
        continued=tuple(continued), fenced=tuple(fenced), epoch=state.epoch, placement=placement
    )


def _redo_groups(ledger: Ledger, epoch: int, counts: Counter[str], placement: Placement) -> Continuation:
    """``prompt_group`` level: a group with any rollout unfinished at the snapshot starts over whole."""
    fenced = dead_attempts(ledger)
    fenced += [AttemptRef(rollout_id=r, attempt=a) for r, a in sorted(ledger.dispatched())]
    groups = sorted({ledger.group_of(r).group_id for r, _ in ledger.dispatched()})
    for group in groups:
        ledger.redo_group_after_restore(group, agents=placement.live.agents)
        counts["rollouts_redone"] += len(ledger.groups[group].siblings)
    counts["restores"] += 1
    return Continuation(continued=(), fenced=tuple(fenced), epoch=epoch, placement=placement)


def adopt_fallback(
    state: RunState, anchor: ControllerAnchor, *, config: RunConfig, task_count: int, counts: Counter[str]
) -> None:
    """A trainer checkpoint without its snapshot: groups the trainer consumed stay done, every other
    group starts over from its prompt (no turn of theirs can be trusted)."""
    adopt_snapshot(
        state,
        Ledger(max_attempts=config.rollout.max_attempts),
        anchor,
        config=config,
        task_count=task_count,
        counts=counts,
        restart_only=set(),
        saved=SavedWork(episodes=set()),
    )
    granularity = Granularity(config.recovery.default_granularity)
    trained = set(state.trained_groups)
    for index in range(state.first_in_play, state.next_task):  # the groups in play then; later
        if state.group_id(index) not in trained:  # ones are admitted from the cursor as usual
            state.ledger.add_group(state.group_id(index), index, config.rollout.group_size, granularity)
    counts["fallback_restores"] += 1


def begin_session(state: RunState, served: list[str]) -> str:
    """A session that restored nothing: ``new``, or ``afresh`` when live participants (``served``)
    did work of this run before: their cached replies and fences name its ids, so it runs under ids
    none of them has seen (a session tag) and never takes a replay for work."""
    if not served:
        return "new"
    state.session = time.time_ns() // 1_000_000
    # Past every epoch those agents saw (an earlier session's restores raised theirs): its Runs are
    # not refused as stale, and Runs still queued from before are.
    state.epoch = state.session
    log.warning(
        "session_afresh",
        session=state.session,
        served_before=served,
        detail="live actors served this run before; its ids are tagged with a new session",
    )
    return "afresh"
