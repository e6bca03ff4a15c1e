"""How a run of the controller ends when it cannot finish."""

from __future__ import annotations


class SetupError(Exception):
    """The cluster does not fit the configuration; the message names what does not."""


class SimulatedCrash(Exception):
    """A test's stand-in for a cluster dying at an exact moment (real crash tests use SIGKILL)."""
