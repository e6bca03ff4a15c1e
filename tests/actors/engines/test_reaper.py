"""Engine processes die with the process that started them, even SIGKILLed (``engines/reaper.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from parkway.actors.engines.reaper import Reaper, descendants, start_time

from tests.support.waiting import until

pytestmark = [
    pytest.mark.slow,  # child processes
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)"),
]

PARENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from parkway.actors.engines.reaper import descendants, watch_new_children
    before = set(descendants(os.getpid()))
    engine = subprocess.Popen(["sleep", "300"])  # stands for vLLM's engine core
    reaper = watch_new_children(before)
    print(engine.pid, flush=True)
    time.sleep(300)
    """
)


def gone(pid: int) -> bool:
    """Ended: no such process, or a zombie nobody reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def test_the_engine_processes_die_when_their_parent_is_sigkilled() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        engine = int(parent.stdout.readline())
        assert engine in descendants(parent.pid) and not gone(engine)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        await until(lambda: gone(engine), timeout=10)  # the orphan was killed by the reaper
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_closed_reaper_kills_only_what_is_left_and_never_a_reused_pid() -> None:
    survivor = subprocess.Popen(["sleep", "300"])
    try:
        reaper = Reaper([survivor.pid])
        assert reaper.pids == [survivor.pid] and start_time(survivor.pid) is not None
        reaper.close()  # the engine "stopped" without ending this process: what is left is killed
        assert survivor.wait(10) == -signal.SIGKILL
        assert Reaper([999_999_999]).pids == []  # no such process: nothing to watch, no reaper started
    finally:
        if survivor.poll() is None:
            survivor.kill()


GUARDED = textwrap.dedent(
    """
    import subprocess, sys, time
    from parkway.actors.engines.reaper import guard
    reaper = guard()  # armed before the engine starts: nothing of it is known yet
    # An engine still starting: a process that starts another (vLLM's core and its worker), neither
    # of them ever handed to the reaper.
    core = subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                             "w = subprocess.Popen(['sleep', '300']); print(w.pid, flush=True); time.sleep(300)"],
                            stdout=subprocess.PIPE, text=True)
    print(core.pid, core.stdout.readline().strip(), flush=True)
    time.sleep(300)
    """
)


async def test_processes_started_after_the_guard_die_with_the_parent_even_unregistered() -> None:
    bystander = subprocess.Popen(["sleep", "300"])  # not started by the guarded process: spared
    parent = subprocess.Popen([sys.executable, "-c", GUARDED], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        core, worker = (int(pid) for pid in parent.stdout.readline().split())
        assert not gone(core) and not gone(worker)
        os.kill(parent.pid, signal.SIGKILL)  # "during start-up": the reaper was given no pid
        parent.wait(10)
        await until(lambda: gone(core) and gone(worker), timeout=10)
        assert not gone(bystander.pid)
    finally:
        for process in (parent, bystander):
            if process.poll() is None:
                process.kill()
