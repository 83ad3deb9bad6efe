"""Is a run file's writer still at work? The process named in the file, asked through /proc.

A file's root attributes name the host, process id and creation time of its writer. On the
same host, that writer is alive when the process exists, is not a later process reusing its
id, and still holds the file open (a writer that stepped aside after a failure has let go of
it). In this process, the open ``Writer``s say which files they write (``writing``), because
this process's own readers hold the file open too. Elsewhere a live writer and a killed one
look alike, and the answer is no.

Example::

    writer_alive(run.attrs, "run.h5")   # True while the training that writes it runs
"""

from __future__ import annotations

import os
import socket
from typing import Any

Identity = tuple[int, int]  # (device, inode): one file, whatever name it goes by

_WRITING: set[Identity | None] = set()  # files this process's open writers are writing


def identity(path: str) -> Identity | None:
    """The file at ``path`` (device, inode); None where there is none."""
    try:
        info = os.stat(path)
        return info.st_dev, info.st_ino
    except OSError:
        return None


def writing(file: Identity | None) -> None:
    """A writer of this process has begun writing ``file``."""
    _WRITING.add(file)


def done_writing(file: Identity | None) -> None:
    """A writer of this process no longer writes ``file`` (closed, failed or disowned)."""
    _WRITING.discard(file)


def writer_alive(attrs: dict[str, Any], path: str) -> bool:
    """Is the process that wrote this file still running, with the file open? (Same host
    only: elsewhere a live writer and a killed one look alike.)"""
    if attrs.get("host") != socket.gethostname():
        return False
    pid_attr: Any = attrs.get("pid")
    created_attr: Any = attrs.get("created")
    try:
        pid = int(pid_attr)
        created = float(created_attr)
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except PermissionError:
        return True  # someone else's process, alive
    except (OSError, TypeError, ValueError, OverflowError):
        return False
    started = process_start(pid)
    if started is not None and started > created + 1.0:
        return False  # a later process reusing the pid
    if pid == os.getpid():  # this process's own readers hold the file too: ask its writers
        return identity(path) in _WRITING
    return has_open(pid, path) is not False


def has_open(pid: int, path: str) -> bool | None:
    """Does process ``pid`` hold ``path`` open? None where /proc cannot tell. (A writer that
    stepped aside after a failure, in a process still training, has let go of it.)"""
    try:
        target = os.stat(path)
        folder = f"/proc/{pid}/fd"
        for name in os.listdir(folder):
            try:
                held = os.stat(os.path.join(folder, name))
            except OSError:
                continue
            if (held.st_dev, held.st_ino) == (target.st_dev, target.st_ino):
                return True
        return False
    except OSError:
        return None


def process_start(pid: int) -> float | None:
    """When process ``pid`` started (unix time), where /proc tells; else None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
