"""Run file names: one recording may write several files (``run.h5``, ``run.rank{R}.h5`` per
rank, ``run.pid{P}.h5`` per extra process), and a job's nodes one node summary each
(``run.node{R}.json``, named for the lowest rank it holds: ``runfile/nodes.py``). A node
summary is JSON, not HDF5, and ends in ``.json``: no reader that looks for run files (every
one globs ``run.rank*.h5``) can take it for one. Standard library only.

Example::

    paths.rank_path("out/run.h5", 1)    # "out/run.rank1.h5"
    paths.node_path("out/run.h5", 8)    # "out/run.node8.json"
    paths.resolve("out/run.h5")          # ["out/run.h5"], or its rank files when it is absent
"""

from __future__ import annotations

import os
import re

# What a recording adds to the output's name for the files it writes beside it: a second
# process's .pid4194304, then a file being built's leading '.' and .4194304.partial (pids
# reach 2**22), with room to spare.
DERIVED_BYTES = 32


def name_max(folder: str) -> int:
    """The longest file name ``folder`` takes, in bytes (NAME_MAX; 255 where not told)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def rank_path(path: str, rank: int) -> str:
    """The file of one rank: ``rank_path("out/run.h5", 1) == "out/run.rank1.h5"``."""
    stem, ext = os.path.splitext(os.fspath(path))
    return f"{stem}.rank{rank}{ext}"


def pid_path(path: str, pid: int) -> str:
    """Where a second training process of one recording writes: ``run.pid4242.h5``."""
    stem, ext = os.path.splitext(os.fspath(path))
    return f"{stem}.pid{pid}{ext}"


def node_path(path: str, rank: int) -> str:
    """The node summary holding ranks from ``rank`` on: ``node_path("out/run.h5", 8) ==
    "out/run.node8.json"``."""
    stem, _ = os.path.splitext(os.fspath(path))
    return f"{stem}.node{rank}{NODE_EXT}"


NODE_EXT = ".json"


def node_files(path: str) -> list[str]:
    """The ``run.node{R}.json`` files beside ``path``, ordered by their lowest rank."""
    stem, _ = os.path.splitext(os.fspath(path))
    return _siblings(stem + NODE_EXT, "node")


def rank_files(path: str) -> list[str]:
    """The ``run.rank{R}.h5`` files beside ``path``, ordered by rank."""
    return _siblings(path, "rank")


def related_files(path: str) -> list[str]:
    """Every file a recording into ``path`` may have written: itself, rank and pid files."""
    # lexists: a link there, even a dangling one, is the caller's to refuse, never to follow
    found = [os.fspath(path)] if os.path.lexists(path) else []
    return found + rank_files(path) + _siblings(path, "pid")


def _siblings(path: str, kind: str) -> list[str]:
    stem, ext = os.path.splitext(os.fspath(path))
    pattern = re.compile(re.escape(os.path.basename(stem)) + rf"\.{kind}(\d+)" + re.escape(ext)
                         + "$")
    folder = os.path.dirname(stem)
    found = []
    try:  # one listing, no stat per name (16 384 rank files are listed at every top refresh)
        with os.scandir(folder or ".") as listing:
            for entry in listing:
                match = pattern.match(entry.name)
                if match and entry.is_file():
                    found.append((int(match.group(1)), os.path.join(folder, entry.name)))
    except OSError:  # no such folder, or not one to list: no siblings
        return []
    return [p for _, p in sorted(found)]


def resolve(path: str) -> list[str]:
    """What ``diagnose path`` reads: the file itself, else its rank files, else ``[path]``
    (so that reading it raises the usual "no such file")."""
    path = os.fspath(path)
    if os.path.exists(path):
        return [path]
    return rank_files(path) or [path]


def run_name(path: str) -> str:
    """The output a rank file belongs to: ``run_name("out/run.rank1.h5") == "out/run.h5"``."""
    stem, ext = os.path.splitext(path)
    return re.sub(r"\.rank\d+$", "", stem) + ext
