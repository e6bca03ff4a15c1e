"""Markers that are true, checked while the tests run (a pytest plugin the root conftest loads).

A test that talks to the real RabbitMQ must be marked ``rabbitmq``; one that starts a separate OS
process must be marked ``slow`` (``-m "not rabbitmq"`` must pass on a machine without a broker, and
``-m "not slow"`` must be the quick suite). A test that does either without its marker fails, saying
what it did. What is watched in this process while a test runs (its set-up, call and tear-down):

- every connect to the AMQP port of ``PARKWAY_TEST_AMQP_URL``, through ``socket.socket.connect`` and
  ``connect_ex``, which asyncio, aio-pika and pika all end up calling;
- every child process: ``subprocess.Popen`` (asyncio's subprocesses and Ray's start through it) and
  ``os.fork`` (multiprocessing);
- asking for a fixture that did either while it was set up: a module's Ray cluster or cluster of
  processes is started by the first test that asks for it, and the later ones use those processes
  (and that broker connection) all the same.

The other direction (nothing marked that does not need it) cannot be decided from this process alone
(a child process may be the one that talks to the broker), so it is an audit to read rather than a
failure: with ``PARKWAY_TEST_MARKER_AUDIT=1`` the summary lists every marked test that did not do the
marked thing here.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Generator
from typing import Any

import pytest

from tests.support.rabbit import AMQP_PORT

RABBITMQ, SLOW = "rabbitmq", "slow"
AUDIT_ENV = "PARKWAY_TEST_MARKER_AUDIT"

FixtureKey = tuple[str, str]  # (where the fixture is defined: a nodeid prefix, its name)

_running: list[pytest.Item] = []  # the test whose phases run now (empty between tests)
_setting_up: list[FixtureKey] = []  # the shared fixtures being set up now, innermost last
_evidence: dict[str, dict[str, str]] = {}  # nodeid -> marker -> the first thing it did that needs it
_fixture_evidence: dict[FixtureKey, dict[str, str]] = {}  # the same, for what a fixture's set-up did
_reported: set[tuple[str, str]] = set()  # (nodeid, marker) already turned into a failure


def _note(marker: str, what: str) -> None:
    if _running:
        _evidence.setdefault(_running[-1].nodeid, {}).setdefault(marker, what)
    for baseid, name in _setting_up:
        _fixture_evidence.setdefault((baseid, name), {}).setdefault(
            marker, f"uses the fixture {name!r}, which {what}"
        )


def _is_amqp(address: object) -> bool:
    return isinstance(address, tuple) and len(address) >= 2 and address[1] == AMQP_PORT


def _watch_connect(original: Callable[..., Any]) -> Callable[..., Any]:
    def connect(self: socket.socket, address: Any) -> Any:
        if _is_amqp(address):
            _note(RABBITMQ, f"connected to the AMQP port at {address[0]}:{address[1]}")
        return original(self, address)

    return connect


def _describe(args: Any) -> str:
    words = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
    text = " ".join(os.path.basename(w) if i == 0 else w for i, w in enumerate(words))
    return text if len(text) <= 120 else text[:117] + "..."


def _install() -> None:
    socket.socket.connect = _watch_connect(socket.socket.connect)  # type: ignore[method-assign]
    socket.socket.connect_ex = _watch_connect(socket.socket.connect_ex)  # type: ignore[method-assign]

    popen_init = subprocess.Popen.__init__

    def watched_popen_init(self: subprocess.Popen[Any], args: Any, *more: Any, **options: Any) -> None:
        _note(SLOW, f"started the process `{_describe(args)}`")
        popen_init(self, args, *more, **options)

    subprocess.Popen.__init__ = watched_popen_init  # type: ignore[assignment,method-assign]

    fork = os.fork

    def watched_fork() -> int:
        _note(SLOW, "forked a process (os.fork)")
        return fork()

    os.fork = watched_fork


def pytest_configure(config: pytest.Config) -> None:
    _install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, None, None]:
    # A function-scoped fixture runs again for each test, which then does the thing itself; only a
    # wider one (module, session) is set up once for many tests.
    shared = fixturedef.scope != "function"
    if shared:
        _setting_up.append((fixturedef.baseid, fixturedef.argname))
    try:
        yield
    finally:
        if shared:
            _setting_up.pop()


def _did(item: pytest.Item) -> dict[str, str]:
    """What the test did itself, and what the fixtures it uses did when they were set up (maybe for an
    earlier test: a module-scoped cluster of processes serves every test that asks for it)."""
    did = dict(_evidence.get(item.nodeid, {}))
    info = getattr(item, "_fixtureinfo", None)
    for definitions in getattr(info, "name2fixturedefs", {}).values():
        for definition in definitions:
            for marker, what in _fixture_evidence.get((definition.baseid, definition.argname), {}).items():
                did.setdefault(marker, what)
    return did


def _missing(item: pytest.Item) -> list[str]:
    """What the test did that its markers do not say, not yet reported."""
    return [
        f"{item.nodeid} {what}, but it is not marked {marker!r} (pytest.mark.{marker})"
        for marker, what in _did(item).items()
        if item.get_closest_marker(marker) is None and (item.nodeid, marker) not in _reported
    ]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if call.when == "setup" and report.passed:
        return  # reported with the call, which set-up's evidence belongs to
    if report.skipped:
        return
    problems = _missing(item)
    if not problems:
        return
    _reported.update((item.nodeid, marker) for marker in _did(item))
    message = "markers that are not true:\n  " + "\n  ".join(problems)
    if report.passed:
        report.outcome = "failed"
        report.longrepr = message
    else:
        report.sections.append(("markers", message))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if os.environ.get(AUDIT_ENV, "") not in ("1", "true", "yes"):
        return
    unproven: list[str] = []
    for item in getattr(config, "_marker_audit_items", []):
        did = _did(item)
        for marker in (RABBITMQ, SLOW):
            if item.get_closest_marker(marker) is not None and marker not in did:
                unproven.append(f"{item.nodeid}: marked {marker!r}, did not do it in this process")
    terminalreporter.section("marker audit")
    terminalreporter.write_line(f"{len(unproven)} marked test(s) without evidence in this process")
    for line in unproven:
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config._marker_audit_items = list(items)  # type: ignore[attr-defined]
