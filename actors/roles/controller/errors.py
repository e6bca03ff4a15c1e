"""How a run of the controller ends when it cannot finish."""

from __future__ import annotations


class SetupError(Exception):
    """The cluster does not fit the configuration; the message names what does not."""


class Unauthorized(SetupError):
    """A participant answered with a reply that does not verify here: the driver's secret is not the
    actors' (they refuse every message of ours). No wait fixes that, so the run stops at once."""


class SimulatedCrash(Exception):
    """A test's stand-in for a cluster dying at an exact moment (real crash tests use SIGKILL)."""


class ClusterUnavailable(TimeoutError):
    """Participants the configuration names did not answer before the run could start; the message
    names them. Starting again later may work (they may still be starting), so it is not a setup error."""


class SnapshotsEnded(RuntimeError):
    """Snapshots can no longer protect the run, so it stops: an invariant broke (the message names
    it), or failures went on as long as ``snapshots.end_after_failures`` or ``end_after_failing_s``
    allow (by default they never end a run). Starting the run again restores the newest snapshot that
    verifies."""
