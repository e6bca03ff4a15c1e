"""An agent's cut sent as what changed since its last one, as plain values with no I/O.

Between two snapshots most of an agent's rollouts do not pass a boundary, so its cut, each attempt it
holds at its saved boundary (``EpisodeRef``), is mostly the cut before. A ``Prepare`` names the last
cut the controller holds of that agent (``base``, a checkpoint id); an agent whose last answered cut
is that one answers with the refs that are new or moved since (``changes``) and the attempts that left
(``gone``), and the controller applies them to its copy (``applied``). Any other agent, or a controller
that holds none, sends and reads the whole cut. Applying what ``changes`` made to the same base gives
the cut back, exactly: the tests check it over random cuts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec
from parkway.protocol.errors import ErrorCode, ProtocolError
from parkway.protocol.messages import AttemptRef, EpisodeRef, Prepared

AttemptKey = tuple[str, int]
CutRefs = dict[AttemptKey, EpisodeRef]  # a cut: each attempt's ref, by attempt


class CutChangeError(ValueError):
    """Changes that do not apply to the cut they name: an attempt that left which the cut never held."""


def refs_of(episodes: Iterable[EpisodeRef]) -> CutRefs:
    return {(e.rollout_id, e.attempt): e for e in episodes}


def changes(
    base: Mapping[AttemptKey, EpisodeRef], cut: CutRefs
) -> tuple[tuple[EpisodeRef, ...], tuple[AttemptRef, ...]]:
    """What turns ``base`` into ``cut``: the refs new or changed (compared by value: a rollout that
    passed a boundary has other tool calls there), and the attempts ``base`` held that ``cut`` does not."""
    changed = tuple(ref for key, ref in cut.items() if (was := base.get(key)) is not ref and was != ref)
    gone = tuple(AttemptRef(rollout_id=r, attempt=a) for (r, a) in base if (r, a) not in cut)
    return changed, gone


def applied(
    base: Mapping[AttemptKey, EpisodeRef], changed: Iterable[EpisodeRef], gone: Iterable[AttemptRef]
) -> CutRefs:
    """``base`` with ``gone`` removed and ``changed`` put in: the whole cut. Raises CutChangeError when
    an attempt named gone is not in ``base`` (the changes were made against another cut)."""
    cut = dict(base)
    for left in gone:
        if cut.pop((left.rollout_id, left.attempt), None) is None:
            raise CutChangeError(f"{left.rollout_id} attempt {left.attempt} left a cut that never held it")
    for ref in changed:
        cut[(ref.rollout_id, ref.attempt)] = ref
    return cut


class LastCut:
    """The last cut a participant answered a Prepare with, by that Prepare's id: what its next answer
    may be made against."""

    def __init__(self) -> None:
        self._last: tuple[str, CutRefs] | None = None

    def check(self, base: str) -> None:
        """Refuse a Prepare whose scope was made against a cut this process did not answer last: it names
        only the Runs dispatched since that cut, and this process may lack the ones before (it is a new
        process, its rollouts lost with the old one). Retryable: the controller fails that snapshot
        (transient) and names every Run in the next."""
        if base and (self._last is None or self._last[0] != base):
            raise ProtocolError(
                ErrorCode.UNAVAILABLE,
                f"the Prepare names what came after cut {base}, which this process did not answer",
            )

    def answer(self, base: str, prepared: Prepared) -> Prepared:
        """``prepared`` (with the whole cut) as it is sent: what changed since the cut of ``base`` (the
        Prepare's) when that is the last one answered here and the changes are the smaller; else whole.
        Either way this cut is the last one from now on."""
        if not prepared.episodes and self._last is None:  # (no cut here: not an agent)
            return prepared
        cut = refs_of(prepared.episodes)
        last, self._last = self._last, (prepared.checkpoint_id, cut)
        if not base or last is None or last[0] != base:
            return prepared
        changed, gone = changes(last[1], cut)
        if len(changed) + len(gone) >= len(cut):  # most of it turned over: the whole cut is smaller
            return prepared
        return msgspec.structs.replace(prepared, episodes=changed, gone=gone, base=base)
