"""``parkway report RUN``: a picture of a run, drawn from the actors' structured log lines.

The lines come from saved log files (``parkway run ... 2> run.log``, each actor's stderr) and/or the
run's log stream on the broker. ``build_timeline`` turns them into a typed ``Timeline``: rollouts with
their attempts and turns as intervals, the snapshot pauses (the controller's admission gate closed) with
their checkpoint ids, crashes, restores and process starts. ``render_png`` and ``render_html`` draw it;
matplotlib is imported only there (``pip install 'parkway[report]'``).

What the lines may hold, and what happens to it:

- a line that is not a JSON object with ``ts`` and ``event`` is skipped and counted (``malformed``);
- a line of another run, or of no run, is dropped and counted; the same line seen twice (a file and the
  broker both hold it) counts once;
- the same run started afresh after it completed (a new *session*): only the newest session is drawn;
- a crash: an interval a process left open ends at that process's last line when it starts again; the
  controller starting again without ``run_finished`` is a crash at its last line (``run_aborted`` gives
  the exact moment and the reason); whatever is still open at the end ends at its owner's last line and
  is flagged ``cut``.

The events read (all ``info`` unless noted): ``actor_started``; the controller's ``run_started``
(``restored``), ``run_finished``, ``run_aborted`` (error), ``rollout_dispatched``, ``sealed``,
``attempt_failed`` (warning), ``gate_closed``/``gate_opened`` and ``snapshot_published``/
``snapshot_aborted`` (by checkpoint id), ``restore_started``/``restore_done``/``restore_failed``,
``agent_replica_restarted`` (warning); the agents' ``rollout_started``, ``turn_started``/
``turn_finished`` (turn index, ``replayed``), ``rollout_completed``/``rollout_failed``/
``rollout_stopped``. Other warnings and errors are listed in the HTML page.

The modules, in the order the lines go through them: ``sources`` (files, the broker), ``records``
(decoded, one run, one session), ``builder`` (the ``Timeline`` of ``model``), ``figure`` (the picture,
PNG), ``page`` (the HTML page), ``command`` (``parkway report``); ``layout`` is what the last three share.
"""

from parkway.actors.tools.report.builder import MAX_EVENTS, build_timeline
from parkway.actors.tools.report.command import add_arguments, command, write_report
from parkway.actors.tools.report.figure import (
    ATTEMPT_COLORS,
    CRASH_COLOR,
    INSTALL_HINT,
    PAUSE_COLOR,
    REPLICA_RESTART_COLOR,
    RESTORE_COLOR,
    Drawing,
    ReportError,
    draw,
    render_png,
)
from parkway.actors.tools.report.model import (
    CONTROLLER,
    Attempt,
    Crash,
    Event,
    LineCounts,
    Pause,
    ProcessStart,
    Restore,
    Rollout,
    Timeline,
    Turn,
)
from parkway.actors.tools.report.page import render_html
from parkway.actors.tools.report.records import parse_lines
from parkway.actors.tools.report.sources import read_broker, read_files

__all__ = [
    "ATTEMPT_COLORS",
    "CONTROLLER",
    "CRASH_COLOR",
    "INSTALL_HINT",
    "MAX_EVENTS",
    "PAUSE_COLOR",
    "REPLICA_RESTART_COLOR",
    "RESTORE_COLOR",
    "Attempt",
    "Crash",
    "Drawing",
    "Event",
    "LineCounts",
    "Pause",
    "ProcessStart",
    "ReportError",
    "Restore",
    "Rollout",
    "Timeline",
    "Turn",
    "add_arguments",
    "build_timeline",
    "command",
    "draw",
    "parse_lines",
    "read_broker",
    "read_files",
    "render_html",
    "render_png",
    "write_report",
]
