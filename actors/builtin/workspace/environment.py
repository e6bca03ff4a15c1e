"""The ``workspace`` environment: a directory per rollout, file tools and a command tool.

Each session's workspace lives at ``<home>/live/<rollout>``, its blobs at ``<home>/blobs`` (the tool
server's own directory, ``locate``). Its exported state is the manifest (``tree.Entry`` rows, small); the
file contents are blobs in the store, which a snapshot refers to by digest. A ``run`` records the
workspace before it starts (``boundary_before``): the tool server keeps that export as what a snapshot
saves while the command runs, so a checkpoint does not wait for it (docs/workspace.md). A session that
ends while a command runs kills it (its whole process group) before its directory goes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import weakref
from pathlib import Path
from typing import Any, ClassVar

import msgspec
from parkway.actors.builtin.workspace import paths, tree
from parkway.actors.builtin.workspace.executor import Executor, Limits, LocalExecutor
from parkway.actors.builtin.workspace.paths import refuse
from parkway.actors.builtin.workspace.store import BlobStore, CorruptBlob
from parkway.actors.builtin.workspace.template import TemplateError, load
from parkway.actors.runtime.packs import UnreadablePacks, read_records
from parkway.actors.sdk.chat import ToolSpec
from parkway.actors.sdk.environments import Environment, Record, ToolError
from parkway.protocol import layout

TEMPLATE_ENV = "PARKWAY_WORKSPACE_TEMPLATE"
MUTATING = ("write_file", "delete", "run")

# Every live workspace of this process by its store, for the collection of unreferenced blobs.
_LIVE: weakref.WeakValueDictionary[int, Workspace] = weakref.WeakValueDictionary()
# Template manifests by (store root, template, its mtime): a template is scanned once per store.
_TEMPLATES: dict[tuple[str, str, int], list[tree.Entry]] = {}


def dir_name(rollout_id: str) -> str:
    """A rollout id as one safe directory name (the id may hold ':' and other characters)."""
    kept = "".join(c if c.isalnum() or c in "-_." else "_" for c in rollout_id)[:64]
    return f"{kept}-{hashlib.sha256(rollout_id.encode()).hexdigest()[:12]}"


class Workspace(Environment):
    """Files and commands in a directory of its own. Subclass it to name a template and limits::

    class MyRepo(Workspace):
        name = "myrepo"
        template = "/srv/templates/myrepo.tar.gz"
        limits = Limits(time_s=300)
    """

    name = "workspace"
    tools = (
        ToolSpec("read_file", (("path", "path"),), mutates=False),
        ToolSpec("write_file", (("path", "path"), ("content", "text"))),
        ToolSpec("list_files", (("path", "path"),), mutates=False),
        ToolSpec("delete", (("path", "path"),)),
        ToolSpec("run", (("command", "text"),)),
    )
    state_lives_in = "directory"
    async_tools = frozenset({"run"})
    boundary_before = frozenset({"run"})
    portable = False  # a saved manifest names blobs in its own tool server's store
    template: ClassVar[str | None] = None  # None: $PARKWAY_WORKSPACE_TEMPLATE, else an empty workspace
    limits: ClassVar[Limits] = Limits()
    executor: ClassVar[Executor] = LocalExecutor()

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.home: Path | None = None
        self.store: BlobStore | None = None
        self.root: Path | None = None
        self.index = tree.Index()
        self.pending: list[tree.Entry] | None = None  # a restored manifest, materialised at first use
        self.recorded: list[list[tree.Entry]] = []  # the last two manifests recorded (blobs kept live)
        self.used_bytes = 0
        self.used_files = 0
        self.mutations = 0  # mutations applied: ``verify`` compares them with the agent's record
        self.last_scan = tree.ScanStats()
        self.ended = False  # closed: a command still running when it was is answered as ended
        self.commands: set[Path] = set()  # the scratch directories of the commands running now

    # -- where it lives --------------------------------------------------------------------------
    def locate(self, home: Path) -> None:
        self.home = home
        self.store = BlobStore(home / "blobs")
        _LIVE[id(self)] = self

    def bind(self, rollout_id: str, attempt: int) -> None:
        super().bind(rollout_id, attempt)
        self.root = self._home() / "live" / dir_name(rollout_id)
        if self.pending is not None:
            self._root()  # a restored session is put back at once, while the restore holds the cluster

    def _home(self) -> Path:
        if self.home is None:
            raise ToolError("the workspace has no home: its tool server did not locate it", code="unlocated")
        return self.home

    def _store(self) -> BlobStore:
        self._home()
        assert self.store is not None  # set with the home
        return self.store

    def _root(self) -> Path:
        if self.root is None:
            raise ToolError("the workspace is not bound to a session", code="unbound")
        if self.pending is not None:
            entries, self.pending = self.pending, None
            self._materialise(entries)
        return self.root

    def _materialise(self, entries: list[tree.Entry]) -> None:
        assert self.root is not None
        try:
            tree.materialise(self.root, entries, self._store(), self.index)
        except CorruptBlob as exc:
            raise ToolError(f"the workspace cannot be restored: {exc}", code="corrupt_blob") from exc
        self._remember(entries)

    def _remember(self, entries: list[tree.Entry]) -> None:
        self.recorded = [*self.recorded[-1:], entries]
        self.used_bytes = sum(e.size for e in entries)
        self.used_files = len(entries)

    # -- the session's life ------------------------------------------------------------------------
    def reset(self) -> None:
        """A fresh session: the workspace becomes the template."""
        self.pending = None
        self.mutations = 0
        self._root()
        self._materialise(self._template_manifest())

    def _template_manifest(self) -> list[tree.Entry]:
        template = self.template if self.template is not None else os.environ.get(TEMPLATE_ENV) or None
        store = self._store()
        if template is None:
            return []
        try:
            stamp = os.stat(template).st_mtime_ns
        except OSError as exc:
            raise ToolError(f"template {template}: {exc}", code="template_refused") from exc
        key = (str(store.root), template, stamp)
        if key not in _TEMPLATES:
            try:
                _TEMPLATES[key] = load(template, store)
            except TemplateError as exc:
                raise ToolError(str(exc), code="template_refused") from exc
        return _TEMPLATES[key]

    def close(self) -> None:
        """The session ended: its commands still running are killed, its directory goes, and blobs
        nothing refers to any more are collected."""
        if self.ended:
            return
        self.ended = True
        killed = bool(self.commands)
        for scratch in list(self.commands):
            self.executor.kill(scratch)
        if self.root is not None and self.root.exists():
            _remove(self.root, tries=3 if killed else 1)
        self.recorded = []
        self.pending = None
        _LIVE.pop(id(self), None)
        if self.home is not None:
            collect_garbage(self.home)

    # -- the state at a boundary ---------------------------------------------------------------------
    def record(self) -> list[tree.Entry]:
        """The workspace now as a manifest, its changed files stored (what a boundary keeps)."""
        if self.pending is not None:
            return self.pending  # restored and not touched since: its manifest is its state
        root = self._root()
        try:
            entries, self.last_scan = tree.scan(root, self._store(), self.index)
        except tree.SpecialFiles as exc:
            raise refuse(paths.SPECIAL, f"the workspace holds devices, FIFOs or sockets: {exc}") from exc
        self._remember(entries)
        return entries

    def export(self, *, copy_state: bool = True) -> dict[str, Any]:
        entries = self.record()
        return {
            "env": self.name,
            "seed": self.seed,
            "state": {
                "manifest": msgspec.to_builtins(entries),
                "digest": tree.tree_digest(entries),
                "mutations": self.mutations,
            },
        }

    @classmethod
    def restore(cls, data: dict[str, Any]) -> Environment:
        if cls is Environment:
            return Environment.restore(data)
        if not isinstance(data, dict) or data.get("env") != cls.name:
            raise ValueError(
                f"cannot restore {data.get('env') if isinstance(data, dict) else data!r} as {cls.name}"
            )
        state = data.get("state")
        seed = data.get("seed")
        if not isinstance(state, dict) or not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"saved {cls.name} state is not a workspace's: {str(data)[:200]}")
        entries = msgspec.convert(state.get("manifest"), list[tree.Entry])
        if tree.tree_digest(entries) != state.get("digest"):
            raise ValueError(f"saved {cls.name} manifest does not match its digest")
        env = cls(seed)
        env.pending = entries
        mutations = state.get("mutations", 0)
        env.mutations = mutations if isinstance(mutations, int) else 0
        return env

    def references(self) -> set[str]:
        kept = {d for entries in self.recorded for d in tree.referenced(entries)}
        return kept | (tree.referenced(self.pending) if self.pending is not None else set())

    # -- tools ---------------------------------------------------------------------------------
    def apply(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        output = super().apply(tool, arguments)
        if tool in MUTATING:
            self.mutations += 1
        return output

    def tool_read_file(self, path: str) -> dict[str, Any]:
        target = paths.resolve(self._root(), path)
        if not target.exists():
            raise refuse(paths.NOT_FOUND, f"{path} does not exist")
        if not target.is_file():
            raise refuse(paths.NOT_A_FILE, f"{path} is a directory")
        size = target.stat().st_size
        if size > self.limits.output_bytes:
            raise refuse(
                "too_large", f"{path} is {size} bytes; read_file returns at most {self.limits.output_bytes}"
            )
        return {"path": path, "content": target.read_bytes().decode("utf-8", errors="replace")}

    def tool_write_file(self, path: str, content: str) -> dict[str, Any]:
        root = self._root()
        target = paths.resolve(root, path)
        data = content.encode("utf-8")
        old = target.stat().st_size if target.is_file() else 0
        if target.is_dir():
            raise refuse(paths.NOT_A_FILE, f"{path} is a directory")
        if self.used_bytes - old + len(data) > self.limits.quota_bytes:
            raise refuse(
                paths.QUOTA,
                f"writing {len(data)} bytes to {path} would take the workspace over its "
                f"quota of {self.limits.quota_bytes} bytes ({self.used_bytes} used)",
            )
        if not target.exists() and self.used_files >= self.limits.max_files:
            raise refuse(paths.QUOTA, f"the workspace holds {self.used_files} entries, its limit")
        target.parent.mkdir(parents=True, exist_ok=True)
        paths.resolve(root, path)  # the directories just made are plain ones, inside
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as writer:
            writer.write(data)
        self.used_bytes += len(data) - old
        self.used_files += 0 if old else 1
        return {"path": path, "bytes": len(data)}

    def tool_list_files(self, path: str) -> dict[str, Any]:
        root = self._root()
        target = paths.resolve(root, path, allow_root=True)
        if not target.is_dir():
            raise refuse(
                paths.NOT_FOUND if not target.exists() else paths.NOT_A_FILE, f"{path} is not a directory"
            )
        listing = []
        for child in sorted(os.scandir(target), key=lambda e: e.name):
            st = child.stat(follow_symlinks=False)
            kind = "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "file"
            listing.append({"name": child.name, "kind": kind, "size": st.st_size if kind == "file" else 0})
        return {"path": path, "entries": listing}

    def tool_delete(self, path: str) -> dict[str, Any]:
        root = self._root()
        pure = path.rstrip("/")
        link = root / pure
        if not path.startswith("/") and ".." not in pure.split("/") and os.path.islink(link):
            paths.resolve(root, os.path.dirname(pure) or ".", allow_root=True)
            link.unlink()  # a link itself is deleted, never what it points to
            return {"path": path, "deleted": True}
        target = paths.resolve(root, path)
        if not target.exists():
            raise refuse(paths.NOT_FOUND, f"{path} does not exist")
        if target.is_dir():
            tree.clear(target)
            target.rmdir()
        else:
            target.unlink()
        self.record()
        return {"path": path, "deleted": True}

    async def tool_run(self, command: str) -> dict[str, Any]:
        root = self._root()
        scratches = self._home() / "scratch"
        scratches.mkdir(parents=True, exist_ok=True)
        # One per run: two commands of a session, or a killed one and its successor, never share one.
        scratch = Path(tempfile.mkdtemp(prefix=f"{root.name}-", dir=scratches))
        self.commands.add(scratch)
        try:
            result = await self.executor.run(command, root, self.limits, scratch)
        finally:
            self.commands.discard(scratch)
            shutil.rmtree(scratch, ignore_errors=True)
        if self.ended:  # killed by ``close``: the directory is gone, there is nothing to record
            raise ToolError("the session ended while the command ran: it was killed", code="session_ended")
        entries = self.record()  # devices a command made are refused here, as a tool error
        if result.killed is not None:
            code = "timeout" if result.killed == "timeout" else "killed"
            raise ToolError(
                f"{code}: the command was killed ({result.killed}; limit {self.limits.time_s} s)\n"
                f"{result.stderr[-2000:]}",
                code=code,
            )
        total = sum(e.size for e in entries)
        if total > self.limits.quota_bytes or len(entries) > self.limits.max_files:
            raise refuse(
                paths.QUOTA,
                f"the command left {total} bytes in {len(entries)} entries; the quota is "
                f"{self.limits.quota_bytes} bytes and {self.limits.max_files} entries: further writes are refused",
            )
        self.mutations += 1
        return {"exit_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr}

    # -- scoring -------------------------------------------------------------------------------
    def verify(self, calls: Record) -> float:
        """1.0 when the agent's record holds exactly the mutations applied here (none twice, none lost)
        and its last command exited 0; else 0.0."""
        recorded = [(tool, output) for tool, _, output in calls if self.spec(tool).mutates]
        if len(recorded) != self.mutations:
            return 0.0
        runs = [output for tool, output in recorded if tool == "run"]
        return 1.0 if runs and runs[-1].get("exit_code") == 0 else 0.0


def _remove(root: Path, tries: int) -> None:
    """Remove the directory. After a kill, a process of the command may finish one last call (a file
    made) as it dies, so the directory is emptied again when it is not empty yet."""
    for left in range(tries - 1, -1, -1):
        try:
            tree.clear(root)
            root.rmdir()
            return
        except OSError:
            if not left:
                raise


def _snapshot_references(home: Path) -> set[str] | None:
    """Every blob the run's snapshots (published and being written) refer to for this home's replica;
    None when a snapshot moved while it was read (try again later). The home is
    ``<snapshots>/<run>/workspace/<replica>``."""
    run_dir, replica = home.parent.parent, home.name
    found: set[str] = set()
    directories = sorted(run_dir.glob(f"{layout.TMP_PREFIX}*")) + sorted(
        run_dir.glob(f"{layout.SNAPSHOT_PREFIX}*")
    )
    for directory in directories:
        sessions = directory / "participants" / "resources" / replica / "sessions.msgpack"
        try:
            records = read_records(sessions)  # (its packs are written before it)
        except FileNotFoundError:
            if not directory.exists():
                return None
            continue
        except (msgspec.DecodeError, msgspec.ValidationError, UnreadablePacks):
            continue
        _walk_manifests(records, found)
    return found


def _walk_manifests(value: object, found: set[str]) -> None:
    if isinstance(value, dict):
        manifest = value.get("manifest")
        if isinstance(manifest, list):
            found.update(
                row[4] for row in manifest if isinstance(row, list) and len(row) > 4 and row[1] == tree.FILE
            )
        for item in value.values():
            _walk_manifests(item, found)
    elif isinstance(value, list):
        for item in value:
            _walk_manifests(item, found)


def collect_garbage(home: Path) -> int:
    """Remove the blobs under ``home`` that no live workspace of this process and no snapshot refers to."""
    kept = _snapshot_references(home)
    if kept is None:
        return 0
    store = BlobStore(home / "blobs")
    for workspace in list(_LIVE.values()):
        if workspace.home == home:
            kept |= workspace.references()
    for entries in _templates_for(home):
        kept |= tree.referenced(entries)
    return store.collect(kept)


def _templates_for(home: Path) -> list[list[tree.Entry]]:
    root = str(home / "blobs")
    return [entries for (store, _, _), entries in _TEMPLATES.items() if store == root]
