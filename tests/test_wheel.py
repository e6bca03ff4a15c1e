"""What users install: the wheel, built and installed the way the image does it, then used.

The image's install step is the one ``RUN`` line of the Dockerfile that installs parkway; this test
assembles what the Dockerfile copies before it (minus what ``.dockerignore`` leaves out), runs that
line there with a fresh virtual environment first on PATH, and then runs ``parkway`` from the venv in
a directory outside the source tree with PYTHONPATH unset: the quick start (``parkway demo``), the
main job (``parkway run``), and ``parkway actor tq`` on RabbitMQ until it answers, then SIGTERM.
The venv sees the system's site-packages (the heavy dependencies such as Ray are not installed
again), but parkway itself must come from the wheel: ``parkway.actors.__file__`` is inside the venv.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("actors", "protocol", "brokers")
AMQP_URL = os.environ.get("PARKWAY_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")

pytestmark = pytest.mark.slow


# -- the Dockerfile, read --------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) per instruction, continuation lines joined, comments dropped."""
    joined, pending = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            joined.append(pending.strip())
            pending = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in joined]


def install_step() -> str:
    [run] = [args for op, args in dockerfile() if op == "RUN" and "install-wheel" in args]
    return run


def ignored(relative: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip()]
    parts = relative.split("/")
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        if fnmatch.fnmatch(relative, pattern) or any(fnmatch.fnmatch(part, bare) for part in parts):
            return True
    return False


def image_context(target: Path) -> Path:
    """What the Dockerfile copies before its install step, laid out as in the image's WORKDIR."""
    for op, args in dockerfile():
        if op == "RUN" and "install-wheel" in args:
            return target
        if op != "COPY":
            continue
        *sources, destination = shlex.split(args)
        for source in sources:
            path = ROOT / source
            into_directory = len(sources) > 1 or destination.endswith("/")
            dest = target / destination / path.name if into_directory else target / destination
            if path.is_file():
                files = [(path, dest)]
            else:  # a directory's contents go to the destination, as COPY does
                files = [(f, dest / f.relative_to(path)) for f in sorted(path.rglob("*")) if f.is_file()]
            for file, out in files:
                if not ignored(file.relative_to(ROOT).as_posix()):
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(file, out)
    raise AssertionError("the Dockerfile has no install step (RUN ... install-wheel ...)")


# -- the venv --------------------------------------------------------------------------------------


def venv_environment(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARKWAY_", "PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(venv, an empty working directory): the image's install step run in a fresh venv."""
    base = tmp_path_factory.mktemp("wheel")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    context = image_context(base / "app")
    result = subprocess.run(
        install_step(), shell=True, cwd=context, env=venv_environment(venv), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    work = base / "work"
    work.mkdir()
    yield venv, work


def in_venv(venv: Path, work: Path, *command: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(command), cwd=work, env=venv_environment(venv), capture_output=True, text=True, timeout=timeout
    )


# -- the wheel's contents ----------------------------------------------------------------------------


def source_packages() -> set[str]:
    """Every folder with Python files under the three source folders, as its installed name."""
    found = set()
    for top in SOURCES:
        for path in (ROOT / top).rglob("*.py"):
            if "__pycache__" not in path.parts:
                found.add("parkway." + ".".join(path.parent.relative_to(ROOT).parts))
    return found


def test_the_wheel_holds_every_package(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", str(tmp_path), "."],
        cwd=image_context(tmp_path / "app"),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [wheel] = tmp_path.glob("parkway-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {".".join(Path(n).parent.parts) for n in names if n.endswith(".py")}
    missing = source_packages() - in_wheel
    assert not missing, f"folders with Python files that the wheel leaves out: {sorted(missing)}"
    # Every module, not only every package: a file left out of a package would fail at import too.
    modules = {
        "parkway/" + p.relative_to(ROOT).as_posix()
        for top in SOURCES
        for p in (ROOT / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert modules <= set(names), sorted(modules - set(names))
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "parkway = parkway.actors.tools.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_a_package_without_init_would_be_found_missing() -> None:
    # The check above compares with folders holding .py files, not with what setup.py finds, so a new
    # folder that setup.py cannot see (no __init__.py) fails it instead of going missing silently.
    for package in source_packages():
        init = ROOT.joinpath(*package.split(".")[1:], "__init__.py")
        assert init.is_file(), f"{init.relative_to(ROOT)} is missing: setup.py would not find {package}"


# -- the image's install step --------------------------------------------------------------------------


def test_the_image_installs_the_wheel_with_the_shared_script() -> None:
    assert install_step() == "sh scripts/install-wheel ."
    script = (ROOT / "scripts" / "install-wheel").read_text()
    assert "pip wheel --no-deps" in script and "pip install" in script and " -e " not in script
    copied = [shlex.split(args)[:-1] for op, args in dockerfile() if op == "COPY"]
    for needed in ("pyproject.toml", "setup.py", "README.md", "scripts/install-wheel", *SOURCES):
        assert any(needed in sources for sources in copied), f"the Dockerfile does not copy {needed}"


def test_the_image_user_owns_the_state_directory() -> None:
    steps = dockerfile()
    [user] = [args for op, args in steps if op == "USER"]
    assert user not in ("root", "0", "nobody"), user
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    actor = compose["x-actor"]
    state = actor["environment"]["PARKWAY_STATE_DIR"]
    assert [v.split(":")[1] for v in actor["volumes"]] == [state]
    runs = " ".join(args for op, args in steps if op == "RUN")
    assert "useradd --create-home" in runs and f" {user}" in runs
    assert f"mkdir -p {state}" in runs and f"chown {user}:{user} {state}" in runs
    assert ("ENV", f"PARKWAY_STATE_DIR={state}") in steps
    # USER comes after the directory is made, so the image's own steps run as root.
    positions = [i for i, (op, _) in enumerate(steps) if op in ("RUN", "USER")]
    assert steps[positions[-1]][0] == "USER"


# -- parkway from the installed wheel ------------------------------------------------------------------


def test_parkway_comes_from_the_wheel(installed: tuple[Path, Path]) -> None:
    venv, work = installed
    result = in_venv(venv, work, "python", "-c", "import parkway.actors as a; print(a.__file__)")
    assert result.returncode == 0, result.stderr
    location = Path(result.stdout.strip())
    assert location.is_relative_to(venv) and "site-packages" in location.parts, location
    assert shutil.which("parkway", path=str(venv / "bin")), "the wheel installs the parkway command"


def test_the_quick_start_runs_from_the_wheel(installed: tuple[Path, Path]) -> None:
    venv, work = installed
    result = in_venv(venv, work, "parkway", "demo", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    levels = {row["level"]: row for row in json.loads(result.stdout)}
    assert levels["sibling"]["turns_thrown_away"] == 6 and levels["turn"]["turns_thrown_away"] == 0


def test_the_main_job_runs_from_the_wheel(installed: tuple[Path, Path]) -> None:
    venv, work = installed
    config = work / "quickstart.yaml"
    shutil.copy(ROOT / "examples" / "quickstart.yaml", config)
    result = in_venv(venv, work, "parkway", "run", "--config", str(config), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 36


@pytest.mark.rabbitmq
def test_an_actor_runs_from_the_wheel(installed: tuple[Path, Path]) -> None:
    venv, work = installed
    run = f"wheel{uuid.uuid4().hex[:8]}"
    env = {
        **venv_environment(venv),
        "PARKWAY_BROKER_URL": AMQP_URL,
        "PARKWAY_RUN": run,
    }
    generated = in_venv(venv, work, "parkway", "keys", "generate", "--env")
    assert generated.returncode == 0, generated.stderr
    keys = dict(
        line.partition("=")[::2] for line in generated.stdout.splitlines() if not line.startswith("#")
    )
    env["PARKWAY_PUBLIC_KEYS"] = keys["PARKWAY_PUBLIC_KEYS"]
    operator = {**env, "PARKWAY_SIGNING_KEY": keys["PARKWAY_KEY_CONTROLLER"]}
    env["PARKWAY_SIGNING_KEY"] = keys["PARKWAY_KEY_TQ"]  # the actor holds its own role's key only
    actor = subprocess.Popen(
        ["parkway", "actor", "tq", "--replica", "0", "--log-level", "warning"],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            probe = subprocess.run(
                ["parkway", "publish", "probe", "--to", "tq/0", "--timeout", "2"],
                cwd=work,
                env=operator,
                capture_output=True,
                text=True,
                timeout=30,
            )
            if probe.returncode == 0:
                break
            assert actor.poll() is None, actor.communicate()[1][-3000:]
            assert time.monotonic() < deadline, probe.stdout + probe.stderr
            time.sleep(0.5)
        assert json.loads(probe.stdout)["type"] == "ProbeResult"
        actor.send_signal(signal.SIGTERM)
        _, stderr = actor.communicate(timeout=30)
        assert actor.returncode == 0, stderr[-3000:]
    finally:
        if actor.poll() is None:
            actor.kill()
            actor.communicate()
        delete_run(run)


def delete_run(run: str) -> None:
    """Remove what the actor declared on RabbitMQ (names as ``brokers/rabbitmq.py`` makes them)."""
    import pika
    from parkway.brokers.rabbitmq_layout import run_exchanges, run_queues

    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    try:
        channel = connection.channel()
        for name in run_queues(run, ["tq/0"]):
            channel.queue_delete(name)
        for name in run_exchanges(run):
            channel.exchange_delete(name)
    finally:
        connection.close()
