"""Which run files the processes of one ``ampdoctor record`` wrote: a list the children append to.

In a multi-node job every node runs its own ``record`` around ``torchrun --nnodes=N``, all of
them writing rank files into one shared directory. At the end each ``record`` must speak for
its own node only: the files of its own child processes, not whatever the shared directory
holds (other nodes' files, maybe still being written). So ``record`` makes a small list file
in the node's own temporary directory (``create``) and names it in ``AMPDOCTOR_SESSION``;
each child process that creates a run file appends its path there (``note``: one short line,
``O_APPEND``, so concurrent children never mix their lines); ``record`` reads it back once the
command has exited (``read``) and removes it (``remove``). Nothing scans the shared directory.

A child whose recording stopped because its run file could not be written (a full disk, a
removed directory) says so in the same list (``note_fault``: one JSON line): the file cannot
hold that news itself, and without it ``record`` would read an unclosed file as a killed
process.

Standard library only: the ``record`` parent never imports torch.

Example::

    marker = written.create()             # /tmp/ampdoctor-....files
    written.note(marker, "/shared/run.rank2.h5")     # in a child
    written.read(marker)                  # ['/shared/run.rank2.h5']
    written.note_fault(marker, "/shared/run.rank2.h5", "could not write ... (No space left on "
                       "device)", kept=19)
    written.faults(marker)    # {'/shared/run.rank2.h5': {'what': 'could not ...', 'kept': 19}}
    written.remove(marker)
"""

from __future__ import annotations

import json
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
    _append(marker, os.path.abspath(path))


def note_fault(marker: Optional[str], path: str, what: str, kept: int) -> None:
    """Say that the recording into ``path`` stopped (``what``: "could not write run.h5 (No
    space left on device)"), the file keeping its first ``kept`` steps; never raises."""
    _append(marker, json.dumps({"path": os.path.abspath(path), "what": what, "kept": kept}))


def _append(marker: Optional[str], line: str) -> None:
    """One line (a path, or a JSON record) added with one ``O_APPEND`` write."""
    if not marker:
        return
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return  # the parent removed it, or it was never made: nothing to tell
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode("utf-8", "surrogateescape"))
    except OSError:
        pass
    finally:
        os.close(fd)


def read(marker: Optional[str]) -> Optional[list[str]]:
    """The files listed, in the order first noted, each once; None without a list file."""
    lines = _lines(marker)
    if lines is None:
        return None
    return list(dict.fromkeys(line for line in lines if line.startswith(os.sep)))


def faults(marker: Optional[str]) -> dict[str, dict]:
    """{path: {"what", "kept"}} of the recordings that stopped on a write error, as noted."""
    out: dict[str, dict] = {}
    for line in _lines(marker) or []:
        if line.startswith("{"):
            try:
                record = json.loads(line)
                out.setdefault(str(record["path"]), {"what": str(record["what"]),
                                                     "kept": int(record["kept"])})
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short: the closing line says less
    return out


def _lines(marker: Optional[str]) -> Optional[list[str]]:
    if not marker:
        return None
    try:
        with open(marker, encoding="utf-8", errors="surrogateescape") as fh:
            return [line.rstrip("\n") for line in fh]
    except OSError:
        return None


def remove(marker: Optional[str]) -> None:
    if marker:
        try:
            os.unlink(marker)
        except OSError:
            pass
