"""A workspace's state as a manifest: one entry per file, directory and symlink, over blobs in a store.

``scan`` walks the directory without following a link and stores only what changed since the last scan,
told the way git's index tells it: an entry whose size, mtime, ctime, inode and mode match the index is
taken from it unread; any other file is read once (hashed while it is copied into the store). A file
modified within ``RACY_NS`` of a scan is hashed again at the next one, since a change in the same clock
tick leaves its stat unchanged. ``materialise`` puts a directory back from a manifest, byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from parkway.actors.builtin.workspace.store import BlobStore

FILE, DIR, LINK = "file", "dir", "link"
RACY_NS = 100_000_000  # 0.1 s: coarser than any Linux file system's timestamps


class Entry(msgspec.Struct, frozen=True, array_like=True):
    """One path of a manifest: relative, '/'-separated; ``digest`` for a file, ``target`` for a link."""

    path: str
    kind: str
    mode: int
    size: int = 0
    digest: str = ""
    target: str = ""


class SpecialFiles(Exception):
    """The workspace holds devices, FIFOs or sockets (a manifest records none)."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__(", ".join(paths))
        self.paths = paths


@dataclass
class ScanStats:
    files: int = 0
    hashed: int = 0  # files read this scan
    bytes_hashed: int = 0
    total_bytes: int = 0


@dataclass
class Index:
    """Per path: (size, mtime_ns, ctime_ns, inode, mode) -> digest, as of the last scan."""

    stats: dict[str, tuple[tuple[int, int, int, int, int], str]] = field(default_factory=dict)


def _key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_mode)


def scan(root: Path, store: BlobStore, index: Index) -> tuple[list[Entry], ScanStats]:
    """The manifest of ``root`` now, its changed files stored; ``index`` is brought up to date."""
    entries: list[Entry] = []
    special: list[str] = []
    stats = ScanStats()
    seen: dict[str, tuple[tuple[int, int, int, int, int], str]] = {}
    started = time.time_ns()
    pending = [("", root)]
    while pending:
        prefix, directory = pending.pop()
        with os.scandir(directory) as listing:
            children = sorted(listing, key=lambda e: e.name)
        for child in children:
            rel = f"{prefix}{child.name}"
            st = child.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                entries.append(Entry(rel, LINK, 0, target=os.readlink(child.path)))
            elif stat.S_ISDIR(st.st_mode):
                entries.append(Entry(rel, DIR, stat.S_IMODE(st.st_mode)))
                pending.append((f"{rel}/", Path(child.path)))
            elif stat.S_ISREG(st.st_mode):
                key = _key(st)
                known = index.stats.get(rel)
                if known is not None and known[0] == key and st.st_mtime_ns < started - RACY_NS:
                    digest, size = known[1], st.st_size
                else:
                    digest, size = store.put_file(Path(child.path))
                    stats.hashed += 1
                    stats.bytes_hashed += size
                    key = _key(os.lstat(child.path))
                seen[rel] = (key, digest)
                stats.files += 1
                stats.total_bytes += size
                entries.append(Entry(rel, FILE, stat.S_IMODE(st.st_mode), size, digest))
            else:
                special.append(rel)
    if special:
        raise SpecialFiles(sorted(special))
    index.stats = seen
    entries.sort(key=lambda e: e.path)
    return entries, stats


def clear(root: Path) -> None:
    """Empty ``root`` (made when missing), never following a link out of it."""
    root.mkdir(parents=True, exist_ok=True)
    for child in os.scandir(root):
        if child.is_dir(follow_symlinks=False):
            os.chmod(child.path, 0o700)  # a read-only directory must still be emptied
            for sub, dirs, _ in os.walk(child.path):
                for name in dirs:
                    path = os.path.join(sub, name)
                    if not os.path.islink(path):
                        os.chmod(path, 0o700)
            shutil.rmtree(child.path)
        else:
            os.unlink(child.path)


def materialise(root: Path, entries: list[Entry], store: BlobStore, index: Index) -> None:
    """Make ``root`` exactly ``entries``: files (checked against their digests), modes, empty
    directories and symlinks; ``index`` then describes it."""
    clear(root)
    seen: dict[str, tuple[tuple[int, int, int, int, int], str]] = {}
    dirs = []
    for entry in sorted(entries, key=lambda e: e.path):
        parts = entry.path.split("/")
        if not entry.path or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"manifest path {entry.path!r} is not a relative path inside the workspace")
        target = root.joinpath(*parts)
        if entry.kind == DIR:
            target.mkdir()
            dirs.append(entry)
        elif entry.kind == LINK:
            os.symlink(entry.target, target)
        elif entry.kind == FILE:
            store.copy_to(entry.digest, target)
            os.chmod(target, entry.mode)
            seen[entry.path] = (_key(os.lstat(target)), entry.digest)
        else:
            raise ValueError(f"manifest entry {entry.path!r} has an unknown kind {entry.kind!r}")
    for entry in sorted(dirs, key=lambda e: e.path.count("/"), reverse=True):
        os.chmod(root.joinpath(*entry.path.split("/")), entry.mode)
    # Files written just now are racy by their mtime, so the next scan hashes them once more.
    index.stats = seen


def tree_digest(entries: list[Entry]) -> str:
    """One digest of a manifest: sha256 over ``kind mode size digest-or-target path`` lines, sorted by
    path (docs/workspace.md spells the format, so anyone can compute it from a directory)."""
    hasher = hashlib.sha256()
    for e in sorted(entries, key=lambda e: e.path):
        value = e.digest if e.kind == FILE else e.target
        hasher.update(f"{e.kind} {e.mode:o} {e.size} {value} {e.path}\n".encode())
    return hasher.hexdigest()


def referenced(entries: list[Entry]) -> set[str]:
    return {e.digest for e in entries if e.kind == FILE}
