"""Where ampdoctor writes into a user's directory: the rules every output path keeps.

A report, a parity result, a figure, a run file and the record lock are written only as

- a **new file**; or, with ``force``, over a file **of their own kind** (``ours(path)`` says
  which: a run file ampdoctor wrote, a report carrying ampdoctor's marker, a PNG it drew);
- **never through a symbolic link** (a link is refused, not followed: ``ln -s ~/.bashrc
  report.html`` must not turn into a report written over ``~/.bashrc``), and never over a
  directory, a device, a FIFO or a socket;
- **whole or not at all**: into a temporary file in the same directory, then renamed into
  place; a new file is linked into place, so that a file another process created there
  meanwhile is never replaced (``link`` fails where the name exists).

Each refusal is one sentence (``OutputError``, exit 2) said before any work is done. Standard
library only, below every stage, so that ``record``, ``report``, ``parity`` and ``export`` share
one set of rules.

Example::

    outputs.check("report.html", force=False, ours=is_report, kind="a report ampdoctor wrote")
    outputs.write_bytes("report.html", page, force=False, ours=is_report,
                        kind="a report ampdoctor wrote")
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional

from .errors import OutputError

# How much of a file ``head`` reads: every marker of ours sits in a file's first bytes.
HEAD_BYTES = 4096

_NOT_REGULAR = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


@dataclass(frozen=True)
class Rules:
    """What may be replaced at a path, and how a refusal reads.

    ``ours``: is an existing regular file one ``force`` may replace; ``kind``: what it says a
    replaceable file is ("an ampdoctor run file"); ``prefix``: put before each refusal
    ("cannot record into run.h5: "); ``fix``: the way out each refusal ends with.
    """

    ours: Callable[[str], bool]
    kind: str
    force: bool = False
    prefix: str = ""
    fix: str = "choose another file"


def check(path: str, rules: Rules, shown: Optional[str] = None) -> bool:
    """Raise ``OutputError`` (one sentence) unless ``path`` may be written under ``rules``;
    return whether a file is there (to be replaced). Nothing is changed on disk."""
    shown = path if shown is None else shown
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        check_folder(path, rules, shown)
        return False
    except OSError as exc:
        raise OutputError(f"{_cannot(rules, shown)}{exc.strerror or exc}") from None
    if stat.S_ISLNK(info.st_mode):
        raise OutputError(f"{rules.prefix}{shown} is a symbolic link: ampdoctor never writes "
                          f"through one; name the file itself, or {rules.fix}")
    if stat.S_ISDIR(info.st_mode):
        raise OutputError(f"{rules.prefix}{shown} is a directory: name a file to write")
    what = next((name for test, name in _NOT_REGULAR if test(info.st_mode)), None)
    if what is not None or not stat.S_ISREG(info.st_mode):
        raise OutputError(f"{rules.prefix}{shown} is {what or 'not a regular file'}: ampdoctor "
                          f"writes only regular files; {rules.fix}")
    if not rules.ours(path):
        raise OutputError(f"{rules.prefix}{shown} exists and is not {rules.kind} (--force "
                          f"replaces only such a file); {rules.fix}")
    if not rules.force:
        raise OutputError(f"{rules.prefix}{shown} already exists: pass --force to replace it, "
                          f"or {rules.fix}")
    return True


def check_folder(path: str, rules: Rules, shown: Optional[str] = None) -> None:
    """Raise ``OutputError`` unless a new file can be made beside ``path``."""
    shown = path if shown is None else shown
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OutputError(f"{_cannot(rules, shown)}there is no directory {folder}")
    # Create and remove a file there: the honest test of "can we write here" (access bits say
    # nothing about read-only mounts, quotas or root), said before any work is done.
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".ampdoctor-probe-")
    except OSError as exc:
        raise OutputError(f"{_cannot(rules, shown)}{folder} is not writable "
                          f"({exc.strerror or exc})") from None
    os.close(fd)
    _remove_quietly(probe)


def write_bytes(path: str, data: bytes, rules: Rules, shown: Optional[str] = None) -> None:
    """Write ``data`` to ``path`` under ``rules``: checked again just before (the check said
    before the work may be minutes old), whole or not at all."""
    shown = path if shown is None else shown
    replacing = check(path, rules, shown)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ampdoctor-", suffix=".tmp")
    except OSError as exc:
        raise OutputError(f"{_cannot(rules, shown)}{exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            os.fchmod(fh.fileno(), 0o666 & ~_umask())
        _put_in_place(tmp, path, replacing, rules, shown)
    except OSError as exc:
        raise OutputError(f"{_cannot(rules, shown)}{exc.strerror or exc}") from None
    finally:
        _remove_quietly(tmp)


def _put_in_place(tmp: str, path: str, replacing: bool, rules: Rules, shown: str) -> None:
    """A rename replaces the name, never what a link there points to; a new file is linked, so
    that one created there since the check is refused rather than replaced."""
    if replacing:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        check(path, rules, shown)  # what appeared: refused in its own words
        os.replace(tmp, path)  # ours, with force: replaced as above
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        os.replace(tmp, path)  # a filesystem without hard links (FAT, some FUSE)


def open_own(path: str, shown: str, prefix: str = "") -> int:
    """A read-write descriptor on a file of ampdoctor's own (a lock): created new, or an
    existing regular file with one name, opened without following a symbolic link. A link, a
    device or a second name of someone's file is refused: writing there would change theirs."""
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    try:
        # O_NONBLOCK: a FIFO planted there must not hang the open (it is refused just below)
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OutputError(f"{prefix}{shown} is a symbolic link: ampdoctor never writes "
                              "through one; remove it") from None
        raise OutputError(f"{prefix}cannot open {shown}: {exc.strerror or exc}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise OutputError(f"{prefix}{shown} is not a file of ampdoctor's own (a device, FIFO "
                          "or a second name of another file): remove it")
    return fd


def head(path: str, size: int = HEAD_BYTES) -> bytes:
    """The first bytes of a regular file, read without following a link or blocking on a
    FIFO; b"" for anything else. What the ``ours`` tests read their markers from."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        return os.pread(fd, size, 0)
    except OSError:
        return b""
    finally:
        os.close(fd)


def _cannot(rules: Rules, shown: str) -> str:
    """How a failure to write begins: the caller's own words, else "cannot write FILE: "."""
    return rules.prefix or f"cannot write {shown}: "


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
