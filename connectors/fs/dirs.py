"""The ``file://`` connector's directory tree, reached without following a symlink inside it.

The root itself may be a symlink: the user chose that path. Below it nothing is followed:

- ``.lock``, ``objects/``, ``tmp/`` and ``quarantine/`` are opened once with O_NOFOLLOW and
  kept open; a symlink in place of one of them refuses the directory at start
  (``ConfigError``), before anything is read, created or removed;
- every other path is reached one component at a time from those fds (``dir_fd``): each
  fan-out directory is opened with O_DIRECTORY | O_NOFOLLOW and each object file with
  O_NOFOLLOW, so a link is refused by the open itself, with no check-then-use race;
- renames and unlinks act in directories opened that way and never follow their last
  component (rename(2) and unlink(2) act on a link, not its target).

So no link inside the root leads a read, write, move or delete outside it. What remains are
two races, neither of which reaches past the root: an object file that turns into a link
between the ``lstat`` that refuses links and the rename (a put) or unlink (a delete, an
eviction) that follows may itself be replaced or removed (the link goes, its target is never
touched); and a directory that someone moves out of the root while an operation holds it
open takes that operation's file with it.

All of this blocks; the connector calls it from worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Callable, Iterator

from gateway.errors import ConfigError

Name = tuple[str, str, str]
"""(fan-out dir, sub dir, file name) of an object under objects/: ``record.object_name``."""

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NOFOLLOW on a link fails with ELOOP, or with ENOTDIR when O_DIRECTORY is given too.
_LINK_ERRNOS = (errno.ELOOP, errno.ENOTDIR)


class Symlink(Exception):
    """A symlink where the tree holds a directory or a file of its own: never followed."""

    def __init__(self, kind: str, path: str) -> None:
        super().__init__(f"{path} is a symlink")
        self.kind = kind
        self.path = path


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def _open(dir_fd: int, name: str, flags: int, kind: str, where: str) -> int:
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS and _is_link(dir_fd, name):
            raise Symlink(kind, where) from None
        raise


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


class Tree:
    """Open fds of a root, its ``objects/``, ``tmp/`` and ``quarantine/``, and of its ``.lock``
    (flock'ed: closing it, in ``close``, releases the root)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._fds: list[int] = []
        try:
            os.makedirs(root, exist_ok=True)
            # Followed if it is a link: the root's path is the user's choice.
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(f"cannot use {root} for file://: {exc}") from exc
        self._fds.append(root_fd)
        self.root_fd = root_fd  # for the index snapshot (snapshot.py), the root's only file
        try:
            self._lock(root_fd)
            self.objects = self._fixed_dir(root_fd, "objects")
            self.tmp = self._fixed_dir(root_fd, "tmp")
            self.quarantine = self._fixed_dir(root_fd, "quarantine")
        except BaseException:
            self.close()
            raise

    def removed(self) -> str | None:
        """The directory of the tree removed while open (``rm -rf`` of the data directory, or
        of ``objects/`` or ``tmp/``), or None. Its fds still work, but name nothing: writes
        fail with ENOENT on bare fan-out names, and a directory made again at the path is
        another one, which this tree never uses."""
        for fd, name in ((self.root_fd, ""), (self.objects, "objects"), (self.tmp, "tmp")):
            try:
                if os.fstat(fd).st_nlink == 0:
                    return os.path.join(self.root, name) if name else self.root
            except OSError:
                return self.root  # closed: treated as gone
        return None

    def close(self) -> None:
        """Close every fd, which also drops the lock. Idempotent."""
        _close_all(self._fds)

    def _refuse(self, name: str, exc: BaseException) -> ConfigError:
        path = os.path.join(self.root, name)
        if isinstance(exc, Symlink):
            return ConfigError(
                f"{path} is a symlink: file:// never follows links inside its directory "
                "(only the directory itself may be one); replace it with a real "
                f"{'file' if name == '.lock' else 'directory'}, or remove it"
            )
        return ConfigError(f"cannot use {self.root} for file://: {exc}")

    def _lock(self, root_fd: int) -> None:
        try:
            fd = _open(root_fd, ".lock", os.O_RDWR | os.O_CREAT, "lock", ".lock")
        except (OSError, Symlink) as exc:
            raise self._refuse(".lock", exc) from exc
        self._fds.append(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"directory {self.root} is in use by another file:// connector (in this or "
                "another process); close it first"
            ) from None
        # The holder's pid, for a human wondering who has the directory.
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())

    def _fixed_dir(self, root_fd: int, name: str) -> int:
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=root_fd)  # never follows a link in its place
            fd = _open(root_fd, name, _DIR, name, name)
        except (OSError, Symlink) as exc:
            raise self._refuse(name, exc) from exc
        self._fds.append(fd)
        return fd

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, "objects", *parts)

    # -- objects ---------------------------------------------------------------------------

    def open_leaf(self, a: str, b: str, *, create: bool = False, fsync: bool = False) -> int | None:
        """An fd of objects/a/b, made (with objects/a) when ``create``; None when it does not
        exist. ``fsync``: a directory made here is fsynced into its parent. Raises Symlink."""
        parent = self.objects
        fds = []
        try:
            for name, where in ((a, self.path(a)), (b, self.path(a, b))):
                if create:
                    try:
                        os.mkdir(name, 0o755, dir_fd=parent)
                    except FileExistsError:
                        pass
                    else:
                        if fsync:  # the new directory's own entry must survive a crash too
                            os.fsync(parent)
                try:
                    parent = _open(parent, name, _DIR, "fan-out directory", where)
                except FileNotFoundError:
                    if create:
                        raise
                    return None
                fds.append(parent)
            return fds.pop()
        finally:
            _close_all(fds)

    def open_object(self, name: Name) -> int:
        """Open objects/a/b/file for reading, with no link anywhere on the way (else Symlink);
        FileNotFoundError when it is missing."""
        leaf = self.open_leaf(name[0], name[1])
        if leaf is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", self.path(*name))
        try:
            return self.open_file(leaf, name)
        finally:
            os.close(leaf)

    def open_file(self, leaf: int, name: Name) -> int:
        """Open ``name``'s file in its directory, open as ``leaf``, for reading (not a link)."""
        return _open(leaf, name[2], os.O_RDONLY, "object file", self.path(*name))

    def check_not_link(self, leaf: int, name: Name) -> None:
        """Raise Symlink if objects/a/b/file is one (so that a rename does not replace it).
        Racy: see the module's docstring."""
        if _is_link(leaf, name[2]):
            raise Symlink("object file", self.path(*name))

    def remove_object(self, name: Name) -> None:
        """Unlink objects/a/b/file if it exists; a link there stays (Symlink is raised)."""
        leaf = self.open_leaf(name[0], name[1])
        if leaf is None:
            return
        try:
            self.check_not_link(leaf, name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name[2], dir_fd=leaf)  # never follows: at worst a new link goes
        finally:
            os.close(leaf)

    def quarantine_file(self, leaf: int, name: Name) -> str | None:
        """Move objects/a/b/file (open as ``leaf``'s entry) into quarantine/; its new path, or
        None if it is gone. Only called on a file just opened with O_NOFOLLOW (racy: see the
        module's docstring; a link that took its place moves, never its target)."""
        dest = f"{name[2]}.{secrets.token_hex(4)}"
        try:
            os.replace(name[2], dest, src_dir_fd=leaf, dst_dir_fd=self.quarantine)
        except FileNotFoundError:
            return None
        return os.path.join(self.root, "quarantine", dest)

    def walk(self, on_link: Callable[[Symlink], None]) -> Iterator[tuple[int, Name]]:
        """(fd of its directory, name) of every regular file two levels below objects/.

        Links on the way are reported to ``on_link`` and skipped; anything else that a put
        does not make (a file among the fan-out dirs, a directory among the objects) is
        skipped. The fd is valid until the next item is asked for.
        """
        for a in self._subdirs(self.objects, (), on_link):
            try:
                top = _open(self.objects, a, _DIR, "fan-out directory", self.path(a))
            except Symlink as link:  # became one since the listing
                on_link(link)
                continue
            except FileNotFoundError:
                continue
            try:
                for b in self._subdirs(top, (a,), on_link):
                    try:
                        leaf = _open(top, b, _DIR, "fan-out directory", self.path(a, b))
                    except Symlink as link:
                        on_link(link)
                        continue
                    except FileNotFoundError:
                        continue
                    try:
                        for file in self._files(leaf, (a, b), on_link):
                            yield leaf, (a, b, file)
                    finally:
                        os.close(leaf)
            finally:
                os.close(top)

    def _subdirs(
        self, fd: int, where: tuple[str, ...], on_link: Callable[[Symlink], None]
    ) -> list[str]:
        found = []
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_symlink():
                    on_link(Symlink("fan-out directory", self.path(*where, entry.name)))
                elif entry.is_dir(follow_symlinks=False):
                    found.append(entry.name)
        return found

    def _files(
        self, fd: int, where: tuple[str, str], on_link: Callable[[Symlink], None]
    ) -> list[str]:
        found = []
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_symlink():
                    on_link(Symlink("object file", self.path(*where, entry.name)))
                elif entry.is_file(follow_symlinks=False):
                    found.append(entry.name)
        return found

    # -- temp files ------------------------------------------------------------------------

    def clear_tmp(self, on_link: Callable[[Symlink], None]) -> None:
        """Remove the regular files in tmp/ (puts that never completed); leave the rest."""
        with os.scandir(self.tmp) as entries:
            names = []
            for entry in entries:
                if entry.is_symlink():
                    on_link(Symlink("temp file", os.path.join(self.root, "tmp", entry.name)))
                elif entry.is_file(follow_symlinks=False):
                    names.append(entry.name)
        for name in names:  # unlink never follows: a file that became a link, the link goes
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self.tmp)

    def open_tmp(self, name: str, flags: int) -> int:
        """Create tmp/``name`` (O_EXCL: a link in its place is refused too)."""
        return os.open(
            name,
            flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=self.tmp,
        )

    def unlink_tmp(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.tmp)

    def commit_tmp(self, name: str, leaf: int, dest: Name) -> None:
        """Rename tmp/``name`` over objects/a/b/file (open as ``leaf``); refuses to replace a
        link there (racy: see the module's docstring)."""
        self.check_not_link(leaf, dest)
        os.replace(name, dest[2], src_dir_fd=self.tmp, dst_dir_fd=leaf)
