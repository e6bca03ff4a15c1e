"""Every ```bash block of README.md and docs/*.md runs as written, and shown output is what it prints.

What a reader with a fresh checkout has, as closely as this machine allows: a fresh virtual environment
(with the system's site-packages, so the heavy dependencies such as Ray are not installed again), a
copy of the repository, and the README's own set-up block run in it as written. Each page's blocks then
run in order in a copy of the repository of its own (each block stands alone: it makes the files it reads),
each in a fresh ``bash`` with ``set -eo pipefail``, the venv first on PATH, PYTHONPATH unset and no
``PARKWAY_*`` variable from the outside. Whatever a block leaves running is stopped after it.

Markers, an HTML comment on the line before a fence (invisible on a rendered page):

- ``<!-- docs-test: skip REASON -->`` before a bash block: not run here (it needs Docker, a GPU, or it is
  a benchmark of minutes); the page says why in words too, and the reason is the test's skip reason.
- ``<!-- docs-test: rabbitmq RUN -->`` before a bash block: it uses the local RabbitMQ under run ``RUN``;
  that run's queues and exchanges are deleted before and after it, and such blocks take a lock, so two
  copies of this test on one machine never share a run.
- ``<!-- docs-test: copy-of PAGE -->`` before a bash block: it is the same text as a block of ``PAGE``
  (checked), which runs there.
- ``<!-- docs-test: output -->`` before a ```text block: the bash block before it printed exactly this on
  stdout (blocks whose output varies say "for example" in words and carry no marker).

A ```python block runs too (in the venv, on its own): the examples of agent programs and environments
must at least import and define what they show. Other fences (```text, ```yaml) are never run. The
README's links into docs/ (which the site does not build) are checked to land on a heading, and the
site itself is built with ``mkdocs build --strict``.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"  # the URL the pages use
BLOCK_TIMEOUT_S = 240
LOCK = Path("/tmp/parkway-docs-test.lock")

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*docs-test:\s*(\S+)\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None = None  # skip, rabbitmq, copy-of, output
    argument: str = ""
    output: str | None = None  # the ```text block after it, when marked ``output``

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def read_blocks(page: str) -> list[Block]:
    """The fenced blocks of a page, each with the marker on the line before it; an ``output`` text block
    is attached to the bash block before it."""
    lines = (ROOT / page).read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        start, lang = i, fence[1]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{page}:{start + 1}: a fence that is never closed"
        marker = _MARKER.match(lines[start - 1]) if start > 0 else None
        block = Block(
            page,
            start + 1,
            lang,
            "\n".join(lines[start + 1 : end]) + "\n",
            marker[1] if marker else None,
            marker[2] if marker else "",
        )
        if block.marker == "output":
            runnable = [b for b in blocks if b.lang == "bash"]
            assert lang == "text" and runnable, f"{block.id}: an output marker needs a text block after bash"
            previous = runnable[-1]
            blocks[blocks.index(previous)] = Block(**{**previous.__dict__, "output": block.text})
        else:
            blocks.append(block)
        i = end + 1
    return blocks


def bash_blocks() -> list[Block]:
    return [b for page in PAGES for b in read_blocks(page) if b.lang == "bash"]


SETUP = next(b for b in read_blocks("README.md") if b.lang == "bash")  # the README's first command


def test_the_readme_starts_with_the_set_up_command() -> None:
    assert SETUP.text.startswith("python3 -m pip install"), SETUP.text
    assert SETUP.output, "the set-up block shows what it prints"


def test_markers_are_known_and_say_why() -> None:
    for page in PAGES:
        for block in read_blocks(page):
            if block.marker is None:
                continue
            assert block.marker in ("skip", "rabbitmq", "copy-of"), f"{block.id}: marker {block.marker}"
            assert block.lang in ("bash", "python"), (
                f"{block.id}: a {block.marker} marker on a {block.lang} block"
            )
            assert block.argument, f"{block.id}: {block.marker} needs its argument (a reason, a run, a page)"


def test_copies_are_the_same_text() -> None:
    for block in bash_blocks():
        if block.marker == "copy-of":
            originals = [b.text for b in read_blocks(block.argument) if b.lang == "bash"]
            assert block.text in originals, (
                f"{block.id} is no longer the same as its block in {block.argument}"
            )


# -- the sandbox -----------------------------------------------------------------------------------


def copy_repository(target: Path) -> Path:
    """The files git knows (tracked, and new ones it does not ignore): what a fresh checkout holds."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, names):
        source = ROOT / os.fsdecode(name)
        if source.is_file():
            destination = target / os.fsdecode(name)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)
    return target


def clean_environment(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARKWAY_", "PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The block in a fresh bash (its own process group, stopped whole afterwards)."""
    script = f"set -eo pipefail\n{block.text}"
    process = subprocess.Popen(
        ["bash", "-c", script],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_group(process.pid)
        stdout, stderr = process.communicate()
        pytest.fail(f"{block.id} ran past {BLOCK_TIMEOUT_S} s\n{tail(stdout, stderr)}")
    finally:
        stop_group(process.pid)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def stop_group(pgid: int) -> None:
    """SIGTERM whatever the block left running in its process group, then SIGKILL what stays."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def tail(stdout: str, stderr: str, lines: int = 40) -> str:
    def last(text: str) -> str:
        return "\n".join(text.splitlines()[-lines:])

    return f"--- stdout (last {lines} lines)\n{last(stdout)}\n--- stderr (last {lines} lines)\n{last(stderr)}"


def check(block: Block, result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, (
        f"{block.id} exited {result.returncode}\n{tail(result.stdout, result.stderr)}"
    )
    if block.output is not None:
        assert result.stdout == block.output, (
            f"{block.id} printed something else than the page shows\n--- the page\n{block.output}"
            f"--- the command\n{result.stdout}\n--- stderr\n{tail('', result.stderr)}"
        )


@pytest.fixture(scope="session")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv where the README's set-up block ran as written, in a copy of the repository."""
    base = tmp_path_factory.mktemp("docs")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    checkout = copy_repository(base / "checkout")
    result = run_block(SETUP, checkout, clean_environment(venv))
    check(SETUP, result)
    located = subprocess.run(
        ["python3", "-c", "import parkway.actors as a; print(a.__file__)"],
        cwd=base,
        env=clean_environment(venv),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(located).is_relative_to(checkout), f"the venv imports parkway from {located}"
    yield venv


class Checkouts(dict[str, Path]):
    """One copy of the repository per page, made when the page's first block runs."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory

    def __missing__(self, page: str) -> Path:
        self[page] = copy_repository(self.factory.mktemp(page.replace("/", "-")))
        return self[page]


@pytest.fixture(scope="session")
def checkouts(tmp_path_factory: pytest.TempPathFactory) -> Checkouts:
    return Checkouts(tmp_path_factory)


@pytest.fixture
def rabbitmq_run(request: pytest.FixtureRequest) -> Iterator[None]:
    """For a block marked ``rabbitmq RUN``: one such block at a time on this machine, its run clean."""
    block: Block = request.node.callspec.params["block"]
    if block.marker != "rabbitmq":
        yield
        return
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        delete_run(block.argument)
        try:
            yield
        finally:
            delete_run(block.argument)


def delete_run(run: str) -> None:
    """Remove a run's queues and exchanges from the local RabbitMQ (names as ``brokers/rabbitmq.py``
    declares them: ``run_queues``, both lanes of each address, and ``run_exchanges``)."""
    import pika
    from parkway.brokers.rabbitmq_layout import run_exchanges, run_queues

    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    try:
        channel = connection.channel()
        roles = {"tq": 1, "policy": 1, "resources": 2, "agent": 2, "controller": 1}
        for name in run_queues(run, [f"{role}/{i}" for role, n in roles.items() for i in range(n)]):
            channel.queue_delete(name)
        for name in run_exchanges(run):
            channel.exchange_delete(name)
    finally:
        connection.close()


def _param(block: Block) -> object:
    marks = [pytest.mark.slow]
    if block.marker == "rabbitmq":
        marks.append(pytest.mark.rabbitmq)
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 120)
@pytest.mark.parametrize("block", [_param(b) for b in bash_blocks()])
def test_block_runs_as_written(block: Block, venv: Path, checkouts: Checkouts, rabbitmq_run: None) -> None:
    if block.marker == "skip":
        pytest.skip(f"not run here: {block.argument}")
    if block.marker == "copy-of":
        pytest.skip(f"the same block runs in {block.argument}")
    if block is SETUP or block.id == SETUP.id:
        return  # ran (and was checked) when the venv was made
    check(block, run_block(block, checkouts[block.page], clean_environment(venv)))


# -- Python examples, links, the site ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "block", [pytest.param(b, id=b.id) for page in PAGES for b in read_blocks(page) if b.lang == "python"]
)
def test_python_example_runs(block: Block, venv: Path, tmp_path: Path) -> None:
    """A page's Python example (an agent program, an environment) imports and defines what it shows."""
    if block.marker == "skip":
        pytest.skip(f"not run here: {block.argument}")
    script = tmp_path / "example.py"
    script.write_text(block.text)
    result = subprocess.run(
        ["python3", str(script)], cwd=tmp_path, env=clean_environment(venv), capture_output=True, text=True
    )
    assert result.returncode == 0, f"{block.id}\n{tail(result.stdout, result.stderr)}"


_LINK = re.compile(r"\]\(((?:docs/)?[\w-]+\.md)(?:#([\w-]+))?\)")


def anchors(page: str) -> set[str]:
    """The heading anchors of a page, as mkdocs and GitHub both make them for plain headings."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"^```.*?^```", "", (ROOT / page).read_text(), flags=re.M | re.S)
    headings = re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M)
    return {slugify(re.sub(r"[`*]", "", heading), "-") for heading in headings}


def test_links_between_pages_land() -> None:
    """Every link from a page to a page (and its heading) exists: the README's too, which the site does
    not build."""
    for page in PAGES:
        folder = Path(page).parent
        for target, anchor in _LINK.findall((ROOT / page).read_text()):
            path = (folder / target).as_posix()
            assert (ROOT / path).is_file(), f"{page} links to {target}, which does not exist"
            if anchor:
                assert anchor in anchors(path), f"{page} links to {target}#{anchor}: no such heading"


@pytest.mark.slow  # runs mkdocs as a process
def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs")
    assert mkdocs, "mkdocs is not installed: it is in the dev extra (pip install -e '.[dev]')"
    result = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for page in read_nav():
        assert (ROOT / "docs" / page).is_file(), page
    assert sorted(read_nav()) == sorted(Path(p).name for p in PAGES if p.startswith("docs/"))


def read_nav() -> list[str]:
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [next(iter(item.values())) for item in nav]
