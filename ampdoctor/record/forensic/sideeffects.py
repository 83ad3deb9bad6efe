"""What a replay cannot put back, refused while it runs (``isolated.preserved``): a Python
audit hook, installed at the first replay and limited to the replay's own thread, raises
``SideEffect`` where the user's code opens a file for writing, removes or renames one, starts
a process or opens a connection; the step is then not replayed, and the diagnosis says which
write stopped it. ``writes_allowed`` lets ampdoctor's own work inside a replay write (the
compiler's cache, in a compiled replay's backend)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Iterator


class SideEffect(RuntimeError):
    """The user's code tried, during a replay, what a replay cannot put back."""


_REFUSED = {
    "os.remove": "remove a file", "os.rename": "rename a file", "os.rmdir": "remove a folder",
    "os.mkdir": "make a folder", "os.truncate": "truncate a file", "os.symlink": "make a link",
    "os.link": "make a link", "shutil.rmtree": "remove a folder", "os.system": "run a command",
    "subprocess.Popen": "start a process", "os.posix_spawn": "start a process",
    "os.exec": "replace the process", "os.fork": "fork the process",
    "socket.connect": "open a connection", "socket.sendto": "send over the network",
    "socket.sendmsg": "send over the network", "socket.bind": "listen on the network",
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_replaying: dict = {"thread": None}  # the thread a replay runs on, while it runs


@contextlib.contextmanager
def no_writes() -> Iterator[None]:
    _install_audit()
    outer = _replaying["thread"]
    _replaying["thread"] = threading.get_ident()
    try:
        yield
    finally:
        _replaying["thread"] = outer


@contextlib.contextmanager
def writes_allowed() -> Iterator[None]:
    """Inside a replay, ampdoctor's own work that writes (the compiler's cache and its C++
    compiler, in a compiled replay's backend): the user's code never runs in it."""
    outer = _replaying["thread"]
    _replaying["thread"] = None
    try:
        yield
    finally:
        _replaying["thread"] = outer


@functools.lru_cache(maxsize=None)
def _install_audit() -> None:
    """Once per process: an audit hook that costs one dict lookup when no replay runs (audit
    hooks cannot be removed)."""
    sys.addaudithook(_audit)


def _audit(event: str, args: tuple) -> None:
    if _replaying["thread"] is None or _replaying["thread"] != threading.get_ident():
        return
    what = _REFUSED.get(event)
    if event == "open" and _writes(args):
        what = f"open {args[0]!r} for writing"
    if what is not None:
        raise SideEffect(f"the model's code tried to {what} while ampdoctor replayed its step; "
                         "a replay never changes anything outside the run, so this step was "
                         "not replayed")


def _writes(args: tuple) -> bool:
    mode, flags = (args[1], args[2]) if len(args) >= 3 else (None, 0)
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)
