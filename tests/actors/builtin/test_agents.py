"""The built-in agents' helpers (the agents themselves run in the controller and dispatch tests)."""

from __future__ import annotations

from parkway.actors.builtin.agents import PROGRAMS, SubmitAgent, as_word
from parkway.actors.sdk.environments import MAX_WORD_LENGTH


def test_a_reply_becomes_one_word() -> None:
    assert as_word("a b\tc\x00d") == "abcd"
    assert as_word("   ") == "_"  # an empty reply still submits something to score
    assert len(as_word("a" * 200)) == MAX_WORD_LENGTH
    assert PROGRAMS["submit"] is SubmitAgent
