"""The moment a snapshot's gate closes (``controller/quiet.py``): the rule on plain numbers, and the
checks made on a clock the test moves."""

from __future__ import annotations

import pytest
from parkway.actors.roles.controller.quiet import FLOOR_S, RECENT, QuietMoment
from parkway.actors.run.config import ConfigError, from_dict


def test_a_check_is_quiet_within_twice_the_recent_median() -> None:
    moment = QuietMoment(checks=4, max_wait_s=1.0)
    assert moment.quiet(0.300)  # the first: nothing to compare it with
    for _ in range(9):
        moment.quiet(0.010)
    assert moment.quiet(0.019)  # the median is 10 ms
    assert not moment.quiet(0.021)
    assert not moment.quiet(0.300)


def test_a_check_under_the_floor_is_quiet_however_fast_the_others() -> None:
    moment = QuietMoment(checks=4, max_wait_s=1.0)
    for _ in range(5):
        moment.quiet(0.001)
    assert moment.quiet(FLOOR_S)
    assert not moment.quiet(FLOOR_S * 1.5)


def test_a_slower_run_moves_the_median_with_it() -> None:
    # Checks that are all slow (a busy machine) become the norm: the gate is not held back forever.
    moment = QuietMoment(checks=4, max_wait_s=1.0)
    for _ in range(RECENT):
        moment.quiet(0.010)
    assert not moment.quiet(0.100)
    for _ in range(RECENT):
        moment.quiet(0.100)
    assert moment.quiet(0.100)


class ScriptedChecks:
    """Checks whose round trips are given; the clock moves by each one."""

    def __init__(self, round_trips: list[float]) -> None:
        self.round_trips, self.now, self.made = list(round_trips), 0.0, 0

    def clock(self) -> float:
        return self.now

    async def check(self) -> int:
        self.now += self.round_trips[self.made]
        self.made += 1
        return self.made


async def settle(moment: QuietMoment, script: ScriptedChecks) -> tuple[int, int]:
    moment.clock = script.clock
    return await moment.settle(script.check)


async def test_the_gate_closes_after_the_first_quiet_check() -> None:
    moment = QuietMoment(checks=4, max_wait_s=1.0)
    for _ in range(8):
        moment.quiet(0.010)
    script = ScriptedChecks([0.300, 0.150, 0.012, 0.010])
    assert await settle(moment, script) == (3, 3)  # the third came back within 20 ms
    assert script.made == 3


async def test_the_checks_are_bounded_in_number_and_in_time() -> None:
    moment = QuietMoment(checks=3, max_wait_s=10.0)
    for _ in range(8):
        moment.quiet(0.010)
    assert await settle(moment, ScriptedChecks([0.3] * 10)) == (3, 3)  # at most three checks
    moment = QuietMoment(checks=10, max_wait_s=0.5)
    for _ in range(8):
        moment.quiet(0.010)
    assert await settle(moment, ScriptedChecks([0.3] * 10)) == (2, 2)  # 0.6 s in: over the bound


async def test_one_check_is_the_plain_behaviour() -> None:
    moment = QuietMoment(checks=1, max_wait_s=1.0)
    for _ in range(8):
        moment.quiet(0.010)
    assert await settle(moment, ScriptedChecks([0.5, 0.01])) == (1, 1)


def test_the_bounds_are_configured_and_checked() -> None:
    config = from_dict({"snapshots": {"quiet_checks": 2, "quiet_max_wait_s": 0.2}})
    assert (config.snapshots.quiet_checks, config.snapshots.quiet_max_wait_s) == (2, 0.2)
    with pytest.raises(ConfigError, match=r"snapshots\.quiet_checks: must be >= 1"):
        from_dict({"snapshots": {"quiet_checks": 0}})
    with pytest.raises(ConfigError, match=r"snapshots\.quiet_max_wait_s: must be >= 0"):
        from_dict({"snapshots": {"quiet_max_wait_s": -1}})
    with pytest.raises(ValueError):
        QuietMoment(checks=0, max_wait_s=1.0)
