"""Which run files the processes of one ``ampdoctor record`` wrote: a list the children append to.

In a multi-node job every node runs its own ``record`` around ``torchrun --nnodes=N``, all of
them writing rank files into one shared directory. At the end each ``record`` must speak for
its own node only: the files of its own child processes, not whatever the shared directory
holds (other nodes' files, maybe still being written). So ``record`` makes a small list file
in the node's own temporary directory (``create``) and names it in ``AMPDOCTOR_SESSION``;
each child process that creates a run file appends its path there (``note``: one short line,
``O_APPEND``, so concurrent children never mix their lines); ``record`` reads it back once the
command has exited (``read``) and removes it (``remove``). Nothing scans the shared directory.

Standard library only: the ``record`` parent never imports torch.

Example::

    marker = written.create()             # /tmp/ampdoctor-....files
    written.note(marker, "/shared/run.rank2.h5")     # in a child
    written.read(marker)                  # ['/shared/run.rank2.h5']
    written.remove(marker)
"""

from __future__ import annotations

import os
import tempfile
from typing import Optional


def create() -> Optional[str]:
    """A new, empty list file in this node's temporary directory; None where none can be made
    (then ``record`` falls back to the files beside its output)."""
    try:
        fd, path = tempfile.mkstemp(prefix="ampdoctor-", suffix=".files")
    except OSError:
        return None
    os.close(fd)
    return path


def note(marker: Optional[str], path: str) -> None:
    """Add ``path`` to the list (from a child process); never raises."""
    if not marker:
        return
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return  # the parent removed it, or it was never made: nothing to tell
    try:
        os.write(fd, (os.path.abspath(path) + "\n").encode("utf-8", "surrogateescape"))
    except OSError:
        pass
    finally:
        os.close(fd)


def read(marker: Optional[str]) -> Optional[list[str]]:
    """The files listed, in the order first noted, each once; None without a list file."""
    if not marker:
        return None
    try:
        with open(marker, encoding="utf-8", errors="surrogateescape") as fh:
            lines = [line.rstrip("\n") for line in fh]
    except OSError:
        return None
    return list(dict.fromkeys(line for line in lines if line))


def remove(marker: Optional[str]) -> None:
    if marker:
        try:
            os.unlink(marker)
        except OSError:
            pass
