"""How a run of the controller ends when it cannot finish."""

from __future__ import annotations


class SetupError(Exception):
    """The cluster does not fit the configuration; the message names what does not."""


class SimulatedCrash(Exception):
    """A test's stand-in for a cluster dying at an exact moment (real crash tests use SIGKILL)."""


class ClusterUnavailable(TimeoutError):
    """Participants the configuration names did not answer before the run could start; the message
    names them. Starting again later may work (they may still be starting), so it is not a setup error."""
