"""What each participant's commands of a snapshot name: the exact episode scopes, from the ledger."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import structlog
from parkway.protocol.cut_changes import CutChangeError, CutRefs, applied, refs_of
from parkway.protocol.ids import Role, actor_address, parse_address
from parkway.protocol.ledger import AttemptState, Ledger
from parkway.protocol.messages import EpisodeRef, Prepare, Prepared
from parkway.protocol.snapshot import SnapshotFailure

# Ledger states of an attempt the controller gave up on: a cut does not keep it.
GIVEN_UP = frozenset({AttemptState.FAILED, AttemptState.ABANDONED, AttemptState.RETIRED})
FOREIGN_NAMED = 10  # a warning names this many of the foreign attempts of one cut

log = structlog.get_logger("parkway.snapshots")


class DispatchedScopes:
    """Each agent's dispatched attempts whose Runs it is not known to have, and the last cut it answered
    with. Its Prepare waits until the Runs named arrived. An attempt its last cut held has arrived (that
    agent answered a Prepare holding it), so a Prepare names only the attempts dispatched to it since:
    a few per snapshot, not every one in flight (512 refs at 1024 in flight were a 23 KB command to
    make, sign, verify and decode inside the window). Named or not, an attempt the agent does not hold
    when it cuts is a mismatch the capture refuses (``episode_mismatch``): the scope only decides what
    the agent waits for. The agent's answer, the same way, names what changed in its cut since the last
    one (``protocol.cut_changes``), and ``cut_of`` makes the whole cut from it.

    The Prepares are made after a snapshot's instant, with admission open: they name the attempts
    dispatched by the instant's mark (``Ledger.dispatch_mark``), not any dispatched since. A ref is
    made only for each attempt named, a few per snapshot."""

    def __init__(self) -> None:
        self._cuts: dict[str, tuple[str, CutRefs]] = {}  # agent address: its last cut, that Prepare's id

    def of(self, ledger: Ledger, mark: int) -> dict[str, tuple[EpisodeRef, ...]]:
        running = ledger.running()
        held: set[tuple[str, int]] = set().union(*(cut.keys() for _, cut in self._cuts.values()))
        scope: dict[int, list[EpisodeRef]] = {}
        # (An attempt runs on the agent it was dispatched to: one another agent's cut held is not it.)
        for key in sorted(ledger.dispatched_by(mark) - held):
            replica = running[key][1].replica
            if replica is not None:
                ref = EpisodeRef(rollout_id=key[0], attempt=key[1], replica=replica)
                scope.setdefault(replica, []).append(ref)
        # (An agent that waits for no Run is left out: its Prepare names nothing.)
        return {actor_address(Role.AGENT, replica): tuple(named) for replica, named in scope.items()}

    def prepares(
        self, ledger: Ledger, mark: int, checkpoint_id: str, deadline: float
    ) -> Callable[[str], Prepare]:
        """Each agent's Prepare of this snapshot: the Runs dispatched by ``mark`` it waits for, and the
        cut its answer may change (any other participant's names neither)."""
        scopes = self.of(ledger, mark)
        return lambda address: Prepare(
            checkpoint_id=checkpoint_id,
            deadline=deadline,
            episodes=scopes.get(address, ()),
            base=self.base_of(address),
        )

    def forget(self) -> None:
        """A snapshot failed: an agent may not hold the cut kept of it (it restarted, or its answer was
        lost), so the next Prepares name every Run and no base."""
        self._cuts.clear()

    def base_of(self, address: str) -> str:
        """The id of the Prepare whose cut the controller holds of this agent ("": none)."""
        known = self._cuts.get(address)
        return known[0] if known is not None else ""

    def cut_of(self, address: str, reply: Prepared) -> CutRefs:
        """The whole cut ``reply`` stands for, kept as this agent's last: its episodes, or the changes
        it names applied to the cut they were made against. Changes against a cut the controller does
        not hold fail the snapshot (transient), and the one it held is forgotten: the next Prepare names
        no base, so the agent answers with its whole cut."""
        if not reply.base:
            cut = refs_of(reply.episodes)
        else:
            known = self._cuts.pop(address, None)
            try:
                if known is None or known[0] != reply.base:
                    raise CutChangeError(f"changes against the cut of {reply.base}, which it does not hold")
                cut = applied(known[1], reply.episodes, reply.gone)
            except CutChangeError as exc:
                raise SnapshotFailure("prepared", f"{address}: {exc}", transient=True) from None
        self._cuts[address] = (reply.checkpoint_id, cut)
        return cut


def given_up(ledger: Ledger, episode: EpisodeRef) -> bool:
    """Whether the ledger settled this attempt as given up on (failed, abandoned or retired)."""
    if not ledger.knows(episode.rollout_id):
        return False
    attempts = ledger.sibling(episode.rollout_id).attempts
    return episode.attempt < len(attempts) and attempts[episode.attempt].state in GIVEN_UP


def kept(
    cut: list[EpisodeRef], dispatched: set[tuple[str, int]], ledger: Ledger, counts: Counter[str]
) -> tuple[EpisodeRef, ...]:
    """The episodes of the agents' cuts a snapshot keeps: all but those the controller has given up on
    since they were cut (their group is redone: a sibling's failure was drained), and those of rollouts
    this controller never dispatched. A Run from elsewhere (an operator's, a script's) runs on its agent
    like any other, but no ledger awaits it and no restore would name it: it is left out of the
    snapshot, counted (``cut_foreign``) and named in a warning, not an invariant broken that would end
    the run's snapshots. A rollout the ledger knows is checked strictly (``episode_mismatch``)."""
    foreign = [e for e in cut if not ledger.knows(e.rollout_id)]
    if foreign:
        counts["cut_foreign"] += len(foreign)
        named = [f"{e.rollout_id}@{e.attempt} on agent/{e.replica}" for e in foreign[:FOREIGN_NAMED]]
        log.warning("foreign_attempts_in_cut", count=len(foreign), attempts=named)
    return tuple(
        e
        for e in cut
        if ledger.knows(e.rollout_id) and ((e.rollout_id, e.attempt) in dispatched or not given_up(ledger, e))
    )


def after_instant(
    dispatched_after: set[tuple[str, int]], saved: set[tuple[str, int]], counts: Counter[str]
) -> set[tuple[str, int]]:
    """The attempts dispatched after a snapshot's instant (its gate open again while its agents cut)
    that no agent's cut holds: their Run reached the agent after its Prepare. Nothing of them is saved
    and nothing waits for them; a restore starts each from its prompt (the snapshot's ``restarts``).
    One that reached its agent first is in that agent's cut, and saved like any other."""
    after = dispatched_after - saved
    if after:
        counts["dispatched_after_cut"] += len(after)
        log.info("dispatched_after_cut", count=len(after))
    return after


def commit_scope(address: str, cut: tuple[EpisodeRef, ...]) -> tuple[EpisodeRef, ...]:
    """What a participant's Commit names: an agent its own episodes of the cut, a tool server all of
    them (each at its boundary), the policy and TQ nothing."""
    role, replica = parse_address(address)
    if role == Role.AGENT:
        return tuple(e for e in cut if e.replica == replica)
    return cut if role == Role.RESOURCES else ()
