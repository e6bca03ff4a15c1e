"""What each participant's commands of a snapshot name: the exact episode scopes, from the ledger."""

from __future__ import annotations

from parkway.protocol.ids import Role, actor_address, parse_address
from parkway.protocol.ledger import AttemptState, Ledger
from parkway.protocol.messages import EpisodeRef

# Ledger states of an attempt the controller gave up on: a cut does not keep it.
GIVEN_UP = frozenset({AttemptState.FAILED, AttemptState.ABANDONED, AttemptState.RETIRED})


class DispatchedScopes:
    """Each agent's dispatched attempts whose Runs it is not known to have: its Prepare waits until
    they arrived. An attempt its last cut held has arrived (that agent answered a Prepare holding it),
    so a Prepare names only the attempts dispatched to it since: a few per snapshot, not every one in
    flight (512 refs each way at 1024 in flight were a 23 KB Prepare to make, sign, verify and decode
    inside the window). Named or not, an attempt the agent does not hold when it cuts is a mismatch the
    capture refuses (``episode_mismatch``): the scope only decides what the agent waits for.

    A running attempt's ref is made at the first snapshot that names it and kept while it runs, so a
    snapshot does not make one per attempt in flight inside its window."""

    def __init__(self) -> None:
        self._refs: dict[tuple[str, int, int], EpisodeRef] = {}
        self._held: dict[str, frozenset[tuple[str, int]]] = {}  # agent address: what its last cut held

    def of(self, ledger: Ledger) -> dict[str, tuple[EpisodeRef, ...]]:
        refs: dict[tuple[str, int, int], EpisodeRef] = {}
        scope: dict[int, list[EpisodeRef]] = {}
        held: dict[int, frozenset[tuple[str, int]]] = {}
        for sibling, attempt in ledger.dispatched_attempts():
            replica = attempt.replica
            if replica is None:
                continue
            key = (sibling.rollout_id, attempt.index, replica)
            ref = self._refs.get(key)
            if ref is None:
                ref = EpisodeRef(rollout_id=sibling.rollout_id, attempt=attempt.index, replica=replica)
            refs[key] = ref
            if replica not in held:
                held[replica] = self._held.get(actor_address(Role.AGENT, replica), frozenset())
            named = scope.setdefault(replica, [])
            if (sibling.rollout_id, attempt.index) not in held[replica]:
                named.append(ref)
        self._refs = refs  # only the attempts still running: the ones that ended are let go
        return {actor_address(Role.AGENT, replica): tuple(named) for replica, named in scope.items()}

    def held(self, address: str, attempts: frozenset[tuple[str, int]]) -> None:
        """``address`` answered a Prepare with a cut holding ``attempts``: it has each one's Run. (Its
        next cut replaces this one: an attempt it no longer holds has ended there, or its agent
        restarted and the controller gave it a new attempt, a key no cut held.)"""
        self._held[address] = attempts


def given_up(ledger: Ledger, episode: EpisodeRef) -> bool:
    """Whether the ledger settled this attempt as given up on (failed, abandoned or retired)."""
    if not ledger.knows(episode.rollout_id):
        return False
    attempts = ledger.sibling(episode.rollout_id).attempts
    return episode.attempt < len(attempts) and attempts[episode.attempt].state in GIVEN_UP


def kept(cut: list[EpisodeRef], dispatched: set[tuple[str, int]], ledger: Ledger) -> tuple[EpisodeRef, ...]:
    """The episodes of the agents' cuts a snapshot keeps: all but those the controller has given up on
    since they were cut (their group is redone: a sibling's failure was drained)."""
    return tuple(e for e in cut if (e.rollout_id, e.attempt) in dispatched or not given_up(ledger, e))


def commit_scope(address: str, cut: tuple[EpisodeRef, ...]) -> tuple[EpisodeRef, ...]:
    """What a participant's Commit names: an agent its own episodes of the cut, a tool server all of
    them (each at its boundary), the policy and TQ nothing."""
    role, replica = parse_address(address)
    if role == Role.AGENT:
        return tuple(e for e in cut if e.replica == replica)
    return cut if role == Role.RESOURCES else ()
