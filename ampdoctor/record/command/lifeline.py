"""The command dies with its launcher: a SIGKILL to ``ampdoctor record`` stops the training.

A scheduler that kills the job's main pid, or ``timeout -s KILL``, kills ``record`` outright:
no handler runs, nothing is forwarded, and the training would go on unattended, its file
saying "running" for ever. So each process of the command is told to stop when ``record`` is
gone, by the SIGTERM it already knows how to take (``record/exits.py`` finishes the file as
``signal:SIGTERM``, then the process ends as SIGTERM ends it):

- **the command itself** (``python train.py``, torchrun) gets Linux's parent-death signal,
  set in the child between fork and exec (``preexec``); if ``record`` died before that, the
  child stops at once. torchrun passes a SIGTERM on to its workers itself.
- **the Python processes below it** that import torch (torchrun's workers, a script a wrapper
  starts) watch ``record``'s pid (``watch``: a pidfd, a daemon thread blocked on it, no
  polling). When ``record`` is gone while its session list (``written.py``) still exists, it
  was killed, and they stop; after a normal end ``record`` has removed that list, so a process
  the command detached on purpose lives on.

Elsewhere (no ``prctl``, no ``pidfd_open``: macOS, an old kernel) nothing is set, quietly:
the run is as it was without this.

Example::

    subprocess.Popen(command, preexec_fn=lifeline.preexec(os.getpid()))   # record's side
    lifeline.watch(launcher_pid, session)                                 # a torch process
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
from typing import Callable, Optional

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP = signal.SIGTERM  # what exits.py finishes the file on


def _prctl() -> Optional[Callable[..., int]]:
    """libc's ``prctl``, loaded in ``record`` before any fork (ctypes after fork is no place
    to load a library); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def preexec(launcher: int) -> Optional[Callable[[], None]]:
    """What runs in the command's process between fork and exec: the parent-death signal on,
    then a check that the launcher is still its parent (it may have died before the signal was
    set, which then never comes). None where there is no such signal."""
    prctl = _prctl()
    if prctl is None:
        return None

    def stop_with_launcher() -> None:
        if prctl(PR_SET_PDEATHSIG, int(STOP), 0, 0, 0) != 0:
            return  # refused (a sandbox): the command runs as it would have
        if os.getppid() != launcher:
            os.kill(os.getpid(), STOP)

    return stop_with_launcher


def watch(launcher: int, session: Optional[str]) -> bool:
    """In a process below the command: stop (``STOP``) when ``launcher`` dies while
    ``session`` still exists (it was killed); return whether a watch was set up. Costs one
    blocked daemon thread and no wake-ups until then."""
    if not session or launcher == os.getppid() or not hasattr(os, "pidfd_open"):
        return False  # the command itself has the parent-death signal
    try:
        fd = os.pidfd_open(launcher)
    except OSError:  # already gone (or no pidfd here)
        return False
    threading.Thread(target=_wait, args=(fd, session), name="ampdoctor-lifeline",
                     daemon=True).start()
    return True


def _wait(fd: int, session: str) -> None:
    try:
        select.select([fd], [], [])
    except (OSError, ValueError):
        return
    finally:
        os.close(fd)
    if os.path.exists(session):  # record removes it on every way out but a kill
        os.kill(os.getpid(), STOP)
