"""The workspace environment: paths refused, limits enforced, incremental manifests, byte-for-byte
restore, templates checked, blobs collected."""

from __future__ import annotations

import asyncio
import io
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest
from parkway.actors.builtin.workspace import tree
from parkway.actors.builtin.workspace.environment import Workspace, collect_garbage
from parkway.actors.builtin.workspace.executor import Limits, LocalExecutor, network_isolation
from parkway.actors.builtin.workspace.store import BlobStore
from parkway.actors.builtin.workspace.template import TemplateError, load
from parkway.actors.sdk.environments import ToolError

from tests.support.workspace import command_started, gone, walk_digest

pytestmark = pytest.mark.slow  # the command tool starts processes


def open_workspace(home: Path, cls: type[Workspace] = Workspace, rollout: str = "t0:s0") -> Workspace:
    env = cls(0)
    env.locate(home)
    env.bind(rollout, 0)
    env.reset()
    return env


def run(env: Workspace, command: str) -> dict[str, Any]:
    return asyncio.run(env.tool_run(command))


def refused(code: str, call: Any, *args: Any) -> ToolError:
    with pytest.raises(ToolError) as info:
        call(*args)
    assert info.value.code == code, info.value.message
    return info.value


# -- paths --------------------------------------------------------------------------------------
def test_dot_dot_is_refused(tmp_path: Path) -> None:
    env = open_workspace(tmp_path)
    refused("path_escapes", env.apply, "write_file", {"path": "../x", "content": "no"})
    refused("path_escapes", env.apply, "read_file", {"path": "a/../../etc/passwd"})
    assert not (tmp_path / "live" / "x").exists()


def test_absolute_paths_are_refused(tmp_path: Path) -> None:
    env = open_workspace(tmp_path)
    refused("path_absolute", env.apply, "read_file", {"path": "/etc/passwd"})
    refused("path_absolute", env.apply, "write_file", {"path": str(tmp_path / "out"), "content": "no"})
    assert not (tmp_path / "out").exists()


def test_symlinks_out_are_refused_and_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("secret")
    env = open_workspace(tmp_path / "home")
    assert env.root is not None
    os.symlink(outside, env.root / "out")
    os.symlink(outside / "secret", env.root / "leak")
    refused("path_escapes", env.apply, "read_file", {"path": "leak"})
    refused("path_escapes", env.apply, "write_file", {"path": "out/new", "content": "x"})
    refused("path_escapes", env.apply, "list_files", {"path": "out"})
    env.apply("delete", {"path": "leak"})  # the link goes, never its target
    assert (outside / "secret").read_text() == "secret" and not (outside / "new").exists()


def test_device_and_fifo_files_are_refused(tmp_path: Path) -> None:
    env = open_workspace(tmp_path)
    assert env.root is not None
    os.mkfifo(env.root / "pipe")
    refused("special_file", env.apply, "read_file", {"path": "pipe"})
    refused("special_file", env.apply, "write_file", {"path": "pipe", "content": "x"})
    refused("special_file", env.export)  # a boundary never records one
    if os.geteuid() == 0:  # only root may make a device node
        os.unlink(env.root / "pipe")
        os.mknod(env.root / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        refused("special_file", env.apply, "read_file", {"path": "null"})
        assert run_error(env, "true").code == "special_file"


def run_error(env: Workspace, command: str) -> ToolError:
    with pytest.raises(ToolError) as info:
        run(env, command)
    return info.value


def test_bad_path_values_are_tool_errors(tmp_path: Path) -> None:
    env = open_workspace(tmp_path)
    for value in ("", "a\x00b", 7, "x" * 2000):
        with pytest.raises(ToolError):
            env.apply("read_file", {"path": value})


# -- limits ---------------------------------------------------------------------------------------
class Tight(Workspace):
    name = "tight"
    limits = Limits(time_s=1.0, memory_bytes=256 << 20, quota_bytes=1000, max_files=5, output_bytes=100)


def test_a_command_past_its_time_limit_is_killed_with_its_group(tmp_path: Path) -> None:
    env = open_workspace(tmp_path, Tight)
    error = run_error(env, "(sleep 30; touch late) & sleep 30")
    assert error.code == "timeout"
    assert env.root is not None and not (env.root / "late").exists()


async def test_closing_a_session_kills_its_running_command(tmp_path: Path) -> None:
    env = open_workspace(tmp_path / "home")
    root = env.root
    assert root is not None
    running = asyncio.ensure_future(env.tool_run("exec sleep 30"))
    pid = await command_started(env)
    env.close()
    with pytest.raises(ToolError) as info:
        await running
    assert info.value.code == "session_ended"
    assert gone(pid) and not root.exists()
    assert list((tmp_path / "home" / "scratch").iterdir()) == []


async def test_a_kill_while_the_command_starts_is_not_lost(tmp_path: Path) -> None:
    executor = LocalExecutor()
    scratch = tmp_path / "scratch"
    running = asyncio.ensure_future(executor.run("exec sleep 30", tmp_path, Limits(), scratch))
    await asyncio.sleep(0)  # its first step: registered, and its process started or starting
    executor.kill(scratch)
    result = await running
    assert result.killed == "SIGKILL" and result.exit_code is None
    assert executor.pid(scratch) is None  # the run is over: nothing of it is left to kill


def test_a_command_past_its_memory_limit_fails(tmp_path: Path) -> None:
    env = open_workspace(tmp_path, Tight)
    out = run(env, '"$PYTHON" -c "x = bytearray(1 << 30)"')
    assert out["exit_code"] != 0 and "MemoryError" in out["stderr"]


@pytest.mark.skipif(os.geteuid() == 0, reason="Linux does not apply RLIMIT_NPROC to root")
def test_a_command_past_its_process_limit_fails(tmp_path: Path) -> None:
    class Few(Workspace):
        name = "few"
        limits = Limits(processes=1)

    env = open_workspace(tmp_path, Few)
    out = run(env, "sh -c true && echo forked")
    assert "forked" not in out["stdout"]


def test_the_quota_refuses_writes_and_commands_that_pass_it(tmp_path: Path) -> None:
    env = open_workspace(tmp_path, Tight)
    env.apply("write_file", {"path": "a", "content": "x" * 900})
    refused("quota_exceeded", env.apply, "write_file", {"path": "b", "content": "x" * 200})
    assert run_error(env, "head -c 500 /dev/zero > c").code == "quota_exceeded"
    refused("quota_exceeded", env.apply, "write_file", {"path": "d", "content": "x"})
    env.apply("delete", {"path": "c"})
    env.apply("write_file", {"path": "d", "content": "x"})  # under the quota again


def test_the_file_count_limit(tmp_path: Path) -> None:
    env = open_workspace(tmp_path, Tight)
    for i in range(5):
        env.apply("write_file", {"path": f"f{i}", "content": "x"})
    refused("quota_exceeded", env.apply, "write_file", {"path": "f5", "content": "x"})


def test_output_is_truncated_at_its_limit(tmp_path: Path) -> None:
    env = open_workspace(tmp_path, Tight)
    out = run(env, "head -c 5000 /dev/zero | tr '\\0' a")
    assert out["stdout"].startswith("a" * 100) and out["stdout"].endswith("[output truncated]")


@pytest.mark.skipif(not network_isolation(), reason="this machine allows no network namespace")
def test_commands_have_no_network(tmp_path: Path) -> None:
    env = open_workspace(tmp_path)
    out = run(env, "cat /proc/net/dev | wc -l")
    assert out["stdout"].strip() == "3"  # two header lines and the loopback alone


# -- state at a boundary, and restore ---------------------------------------------------------------
def test_only_changed_files_are_read_and_stored(tmp_path: Path) -> None:
    env = open_workspace(tmp_path)
    for i in range(20):
        env.apply("write_file", {"path": f"d/f{i}", "content": f"file {i}\n" * 100})
    env.record()
    env.index.stats = {k: (v[0], v[1]) for k, v in env.index.stats.items()}
    os.utime(env.root / "d", ns=(1, 1))  # type: ignore[operator]  # root is set
    # Age every file past the racy window, as the next boundary a while later would see them.
    for path in (env.root / "d").iterdir():  # type: ignore[operator]
        os.utime(path, ns=(10**18, 10**9))
    env.record()
    store = env.store
    assert store is not None
    before = store.bytes_written
    env.apply("write_file", {"path": "d/f3", "content": "changed\n"})
    entries = env.record()
    assert env.last_scan.hashed == 1 and env.last_scan.bytes_hashed == len("changed\n")
    assert store.bytes_written - before == len("changed\n")
    assert tree.tree_digest(entries) == walk_digest(env.root)  # type: ignore[arg-type]


def test_restore_is_byte_for_byte(tmp_path: Path) -> None:
    env = open_workspace(tmp_path)
    root = env.root
    assert root is not None
    run(
        env, "mkdir -p empty/inner src && printf 'x\\0y' > src/bin && chmod 750 src/bin && ln -s src/bin link"
    )
    run(env, "chmod 700 empty && echo hi > src/a.txt")
    saved = env.export()
    expected = walk_digest(root)
    assert saved["state"]["digest"] == expected
    run(env, "rm -rf src && echo after > later")  # a dead timeline's command after the boundary
    restored = Workspace.restore(saved)
    assert isinstance(restored, Workspace)
    restored.locate(tmp_path)  # live from here: its manifest's blobs are kept
    env.close()
    restored.bind("t0:s0", 1)
    assert restored.apply("read_file", {"path": "src/a.txt"})["content"] == "hi\n"
    assert walk_digest(root) == expected
    assert os.readlink(root / "link") == "src/bin" and stat.S_IMODE(os.lstat(root / "empty").st_mode) == 0o700


def test_a_corrupt_blob_is_found_not_restored(tmp_path: Path) -> None:
    env = open_workspace(tmp_path)
    env.apply("write_file", {"path": "a", "content": "data"})
    saved = env.export()
    digest = saved["state"]["manifest"][0][4]
    env.close()
    store = BlobStore(tmp_path / "blobs")
    store.path(digest).parent.mkdir(parents=True, exist_ok=True)
    store.path(digest).write_text("tampered")
    restored = Workspace.restore(saved)
    restored.locate(tmp_path)
    refused("corrupt_blob", restored.bind, "t0:s0", 1)  # found as it is put back, never restored


def test_a_manifest_off_its_digest_is_refused(tmp_path: Path) -> None:
    env = open_workspace(tmp_path)
    env.apply("write_file", {"path": "a", "content": "data"})
    saved = env.export()
    saved["state"]["manifest"][0][0] = "b"
    with pytest.raises(ValueError, match="digest"):
        Workspace.restore(saved)


def test_closing_removes_the_directory_and_collects_unreferenced_blobs(tmp_path: Path) -> None:
    home = tmp_path / "run" / "workspace" / "0"
    keep = open_workspace(home, rollout="keep")
    keep.apply("write_file", {"path": "k", "content": "kept"})
    keep.record()
    gone = open_workspace(home, rollout="gone")
    gone.apply("write_file", {"path": "g", "content": "dropped"})
    gone.record()
    store = BlobStore(home / "blobs")
    assert len(set(store.digests())) == 2
    gone.close()
    assert gone.root is not None and not gone.root.exists()
    assert set(store.digests()) == keep.references()
    assert collect_garbage(home) == 0


# -- templates --------------------------------------------------------------------------------------
def tar_with(path: Path, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        tar.addfile(member, io.BytesIO(data) if data else None)
    return path


@pytest.mark.parametrize(
    ("name", "kind", "link"),
    [
        ("../evil", tarfile.REGTYPE, ""),
        ("/abs", tarfile.REGTYPE, ""),
        ("dev", tarfile.CHRTYPE, ""),
        ("fifo", tarfile.FIFOTYPE, ""),
        ("out", tarfile.SYMTYPE, "../../etc/passwd"),
        ("hard", tarfile.LNKTYPE, "/etc/passwd"),
    ],
)
def test_archive_members_that_escape_are_refused(tmp_path: Path, name: str, kind: bytes, link: str) -> None:
    member = tarfile.TarInfo(name)
    member.type = kind
    member.linkname = link
    archive = tar_with(tmp_path / "t.tar.gz", member)
    with pytest.raises(TemplateError):
        load(str(archive), BlobStore(tmp_path / "blobs"))


def test_a_template_archive_seeds_every_workspace(tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "mod.py").write_text("X = 1\n")
    with tarfile.open(tmp_path / "t.tar.gz", "w:gz") as tar:
        tar.add(source / "pkg", arcname="pkg")

    class Seeded(Workspace):
        name = "seeded"
        template = str(tmp_path / "t.tar.gz")

    env = open_workspace(tmp_path / "home", Seeded)
    assert env.apply("read_file", {"path": "pkg/mod.py"})["content"] == "X = 1\n"
    assert run(env, "cat pkg/mod.py")["stdout"] == "X = 1\n"


def test_verify_counts_mutations_against_the_record(tmp_path: Path) -> None:
    env = open_workspace(tmp_path)
    out = env.apply("write_file", {"path": "a", "content": "1"})
    ran = run(env, "true")
    record = [("write_file", {"path": "a", "content": "1"}, out), ("run", {"command": "true"}, ran)]
    assert env.verify(record) == 1.0
    assert env.verify(record[1:]) == 0.0  # a mutation the record lacks (applied twice, or lost)
