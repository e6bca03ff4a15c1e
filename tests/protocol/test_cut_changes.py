"""An agent's cut sent as what changed since its last one (``protocol.cut_changes``): applying the
changes to the cut they were made against gives the new cut back, exactly, and changes made against
another cut are refused, not applied."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from parkway.protocol.cut_changes import CutChangeError, applied, changes, refs_of
from parkway.protocol.messages import AttemptRef, EpisodeRef

refs = st.builds(
    EpisodeRef,
    rollout_id=st.sampled_from([f"t{i:04d}_g0" for i in range(12)]),
    attempt=st.integers(0, 2),
    replica=st.just(0),
    tools=st.integers(0, 3),
)
cuts = st.lists(refs).map(refs_of)


@given(cuts, cuts)
def test_the_changes_applied_to_their_base_give_the_cut(base, cut) -> None:
    changed, gone = changes(base, cut)
    assert applied(base, changed, gone) == cut
    # Only what differs travels: a ref equal to the base's is not sent again.
    assert all(base.get((e.rollout_id, e.attempt)) != e for e in changed)
    assert {(g.rollout_id, g.attempt) for g in gone} == base.keys() - cut.keys()


def test_a_cut_that_did_not_move_is_sent_as_nothing() -> None:
    cut = refs_of(EpisodeRef(rollout_id=f"r{i}", attempt=0, replica=0, tools=i) for i in range(512))
    assert changes(cut, dict(cut)) == ((), ())


def test_changes_naming_an_attempt_the_base_never_held_are_refused() -> None:
    base = refs_of([EpisodeRef(rollout_id="a", attempt=0, replica=0)])
    with pytest.raises(CutChangeError, match="b attempt 0"):
        applied(base, (), (AttemptRef(rollout_id="b", attempt=0),))
    assert base == refs_of([EpisodeRef(rollout_id="a", attempt=0, replica=0)])  # left as it was
