"""Templates: the directory or archive a workspace is seeded from, checked, then scanned into the store.

A directory is copied as a manifest (links kept as links, and refused when they lead outside the
template); an archive (``.tar``, ``.tar.gz``, ``.tgz``) is unpacked into a scratch directory first,
refusing any member that is absolute or names ``..``, a device or FIFO, a hard link to a path outside
it, or a symlink whose target leaves it. A template is scanned once per process and store.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tarfile
import tempfile
from pathlib import Path

from parkway.actors.builtin.workspace.store import BlobStore
from parkway.actors.builtin.workspace.tree import LINK, Entry, Index, SpecialFiles, scan

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")


class TemplateError(Exception):
    """A template that cannot seed a workspace; the message names it and what is wrong."""


def _member_problem(member: tarfile.TarInfo) -> str | None:
    name = member.name
    parts = name.split("/")
    if name.startswith("/") or ".." in parts:
        return f"member {name!r} escapes the archive"
    if member.isdev() or member.isfifo():
        return f"member {name!r} is a device or FIFO"
    if member.issym():
        target = posixpath.normpath(posixpath.join(posixpath.dirname(name), member.linkname))
        if member.linkname.startswith("/") or target == ".." or target.startswith("../"):
            return f"member {name!r} is a symlink to {member.linkname!r}, outside the archive"
    if member.islnk() and (member.linkname.startswith("/") or ".." in member.linkname.split("/")):
        return f"member {name!r} is a hard link to {member.linkname!r}, outside the archive"
    return None


def unpack(archive: Path, into: Path) -> None:
    """Unpack ``archive`` into the empty directory ``into``, or ``TemplateError`` for a bad member."""
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for member in members:
                problem = _member_problem(member)
                if problem is not None:
                    raise TemplateError(f"template {archive}: {problem}")
            # The data filter checks the same again as the members are written.
            tar.extractall(into, members=members, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise TemplateError(f"template {archive}: {exc}") from exc


def _check_links(root: Path, entries: list[Entry], template: str) -> None:
    base = os.path.realpath(root)
    for entry in entries:
        if entry.kind != LINK:
            continue
        target = os.path.normpath(os.path.join(base, os.path.dirname(entry.path), entry.target))
        if entry.target.startswith("/") or not (target == base or target.startswith(base + os.sep)):
            raise TemplateError(f"template {template}: {entry.path} is a symlink out of it ({entry.target})")


def load(template: str | None, store: BlobStore) -> list[Entry]:
    """The manifest of ``template`` (None: an empty workspace), its blobs in ``store``."""
    if template is None:
        return []
    path = Path(template)
    try:
        if path.is_dir():
            entries, _ = scan(path, store, Index())
            _check_links(path, entries, template)
            return entries
        if path.is_file() and path.name.endswith(ARCHIVE_SUFFIXES):
            scratch = Path(tempfile.mkdtemp(prefix="parkway-template-"))
            try:
                unpack(path, scratch)
                entries, _ = scan(scratch, store, Index())
                _check_links(scratch, entries, template)
                return entries
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    except SpecialFiles as exc:
        raise TemplateError(f"template {template}: holds devices, FIFOs or sockets: {exc}") from exc
    raise TemplateError(f"template {template}: not a directory or an archive ({', '.join(ARCHIVE_SUFFIXES)})")
