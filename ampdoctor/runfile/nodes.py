"""Node summaries: the ``/summary`` rows of one node's rank files, in one small file.

``diagnose`` over the N rank files of a job reads each file's ``/summary`` (``summary.read``:
1 to 5 ms a file, most of it opening the HDF5 file), so 16 384 ranks would take over a
minute. Each node's ``ampdoctor record`` already knows its own ranks' files, so it writes
what their summaries say into one node summary, ``run.node{R}.json`` beside them (R: the
lowest rank it holds), whenever it sees one of them flushed and once the command has exited
(``record/command/keeper.py``). ``diagnose`` then reads N/8 small files instead of N HDF5
files (``lookup``), and ``ampdoctor index`` writes them where a node left none (``index``).

A node summary is JSON, format ``ampdoctor-node-summary`` version 1, written whole to a
temporary name and renamed, so a reader sees the old file or the new one, never half of one.
It holds, per rank file (named without its directory: the shared filesystem may be mounted
elsewhere on the reading host), the file's size and modification time when its summary was
read (taken before the read, so a flush in between only makes the entry look older) and the
decoded summary. An entry is used only while its rank file still has that size and time
(``fresh``); any other entry, a file the JSON cannot be read from, or a node summary of
another format, is passed over and the rank file read itself: a node summary can make a
diagnosis faster, never different. A rank whose writer had not finished when the entry was
written keeps the writer's host, process id and creation time, so that whether it is still
running is asked again when the entry is read, as ``summary.read`` asks it.

Example::

    nodes.write("out/run.node8.json", ["out/run.rank8.h5", "out/run.rank9.h5"])
    found = nodes.lookup(paths.rank_files("out/run.h5"))
    found.summaries["out/run.rank9.h5"].first_bad     # as summary.read would say
    nodes.index("out/run.h5")                         # Indexed(written=[...], ...)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Optional

from ..errors import FormatTooNewError, RunFileError
from . import liveness, paths, summary
from .schema import Phase

FORMAT = "ampdoctor-node-summary"
VERSION = 1
# The ranks of one node summary that ``index`` writes for files no node summary holds: a
# node of 8 GPUs, as most are.
RANKS_PER_NODE = 8
# A node summary is a few kilobytes a rank; anything far larger is not one of ours.
MAX_BYTES = 64 << 20
UNSETTLED = ("running", "interrupted")  # statuses that depend on the writer being alive

Key = tuple[int, int]  # a rank file's size and modification time (ns)


def key(path: str) -> Optional[Key]:
    """What says that a rank file changed: its size and modification time; None: no file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


# ---------------------------------------------------------------------------------------------
# Writing


def entry(path: str) -> Optional[dict]:
    """One rank file's entry: its key and its decoded summary; None where the file has no
    summary to trust (``summary.read``: format 1, a flush cut short) or cannot be read."""
    before = key(path)
    try:
        found = summary.read(path)
    except RunFileError:
        return None
    if found is None or before is None:
        return None
    out = dataclasses.asdict(found)
    out["path"] = os.path.basename(path)
    if found.located is not None:
        out["located"]["phase"] = int(found.located["phase"])
    return {"file": os.path.basename(path), "size": before[0], "mtime_ns": before[1],
            "summary": out}


def write(node: str, rank_paths: list[str]) -> int:
    """Write the node summary ``node`` for ``rank_paths`` (each summary read now); returns how
    many entries it holds. Raises ``OSError`` where the file cannot be written."""
    entries = [e for e in (entry(p) for p in rank_paths) if e is not None]
    dump(node, entries)
    return len(entries)


def dump(node: str, entries: list[dict]) -> None:
    """Write ``entries`` as the node summary ``node``: whole, to a temporary name, renamed."""
    doc = {"format": FORMAT, "format_version": VERSION, "ranks": entries}
    folder = os.path.dirname(os.path.abspath(node))
    fd, tmp = tempfile.mkstemp(prefix=".ampdoctor-node-", suffix=".tmp", dir=folder)
    try:
        # mkstemp's 0600 would hide it from the other users who read the job's rank files
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, separators=(",", ":"))
        os.replace(tmp, node)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """This process's umask, read without setting it (``os.umask`` sets it, and the keeper
    writes from a thread)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return 0o022


# ---------------------------------------------------------------------------------------------
# Reading


def read(node: str) -> list[dict]:
    """The entries of one node summary. ``RunFileError`` for a file that is not one
    (``FormatTooNewError``: written by a newer ampdoctor)."""
    try:
        if os.path.getsize(node) > MAX_BYTES:
            raise RunFileError(f"{node} is not an ampdoctor node summary (too large)")
        with open(node, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as exc:
        raise RunFileError(f"{node} could not be read as a node summary ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RunFileError(f"{node} is not an ampdoctor node summary")
    version = doc.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise RunFileError(f"{node} is not an ampdoctor node summary (no format version)")
    if version > VERSION:
        raise FormatTooNewError(f"{node} was written by node summary format {version}; this "
                                f"ampdoctor reads up to {VERSION}: upgrade ampdoctor")
    ranks = doc.get("ranks")
    return [e for e in ranks if isinstance(e, dict)] if isinstance(ranks, list) else []


def is_node_summary(path: str) -> bool:
    """Is ``path`` a node summary (of any version): what ``record --force`` may remove."""
    try:
        read(path)
    except FormatTooNewError:
        return True
    except RunFileError:
        return False
    return True


def decode(e: dict, path: str) -> Optional[summary.RankSummary]:
    """An entry's summary, as ``summary.read(path)`` would give it; None if malformed."""
    try:
        s = dict(e["summary"], path=path)
        if s.get("located") is not None:
            s["located"] = dict(s["located"], phase=Phase(int(s["located"]["phase"])))
        if s.get("scale_points") is not None:
            s["scale_points"] = [(int(a), float(b)) for a, b in s["scale_points"]]
        out = summary.RankSummary(**s)
    except (KeyError, TypeError, ValueError):
        return None
    if out.status in UNSETTLED and out.writer is not None:
        out.status = "running" if liveness.writer_alive(out.writer, path) else "interrupted"
    return out


def fresh(e: dict, path: str) -> bool:
    """Is the entry's rank file still as it was when the entry was written?"""
    return key(path) == (e.get("size"), e.get("mtime_ns"))


@dataclass
class Found:
    """What the node summaries beside some rank files say (``lookup``)."""

    summaries: dict[str, summary.RankSummary] = field(default_factory=dict)  # path -> fresh
    nodes: list[str] = field(default_factory=list)  # the node summaries read
    stale: dict[str, str] = field(default_factory=dict)  # rank file newer than its entry -> node
    missing: dict[str, str] = field(default_factory=dict)  # listed rank file gone -> node
    unreadable: list[str] = field(default_factory=list)  # node summaries passed over: why
    # stale rank file -> its entry's summary, as of when the node wrote it (``older=True``)
    older: dict[str, summary.RankSummary] = field(default_factory=dict)


def lookup(rank_paths: list[str], older: bool = False) -> Found:
    """The fresh summaries the node summaries beside ``rank_paths`` hold for them; with
    ``older``, also the summaries of stale entries (a running job's: seconds old), which a
    live view shows until it reads the rank file itself."""
    out = Found()
    wanted = {os.path.abspath(p): p for p in rank_paths}
    for base in dict.fromkeys(paths.run_name(p) for p in wanted):
        for node in paths.node_files(base):
            _take(node, wanted, out, older)
    for p in [p for p in out.stale if p in out.summaries]:  # fresh in another node summary
        del out.stale[p]
        out.older.pop(p, None)
    return out


def _take(node: str, wanted: dict[str, str], out: Found, older: bool) -> None:
    try:
        entries = read(node)
    except RunFileError as exc:
        out.unreadable.append(str(exc))
        return
    out.nodes.append(node)
    folder = os.path.dirname(os.path.abspath(node))
    for e in entries:
        name = e.get("file")
        if not isinstance(name, str) or os.sep in name or name in ("", ".", ".."):
            continue
        full = os.path.join(folder, name)
        path = wanted.get(full)
        if path is None:
            if not os.path.exists(full):
                out.missing[full] = node
            continue
        if path in out.summaries:
            continue
        if not fresh(e, path):
            out.stale.setdefault(path, node)
            if older and path not in out.older and (old := decode(e, path)) is not None:
                out.older[path] = old
            continue
        s = decode(e, path)
        if s is not None:
            out.summaries[path] = s


# ---------------------------------------------------------------------------------------------
# ampdoctor index


@dataclass
class Indexed:
    """What ``index`` did: the node summaries it wrote, and of how many rank files."""

    path: str
    ranks: int  # rank files found
    covered: int  # already held, fresh, by a node summary
    written: list[str] = field(default_factory=list)
    entries: int = 0  # rank files the written node summaries hold
    unreadable: int = 0  # rank files with no summary to hold (diagnose reads them itself)


def index(path: str) -> Indexed:
    """Write node summaries for the rank files of ``path`` that no fresh one holds: a node
    summary older than some of its ranks' files is written again, and the ranks none holds get
    new ones, up to ``RANKS_PER_NODE`` a file, each named for its lowest rank (one of that
    name already there keeps its own ranks too). Running it again writes nothing.

    Raises ``RunFileError`` when ``path`` has no rank files or a node summary cannot be
    written.

    Example::

        nodes.index("out/run.h5").written      # ['out/run.node0.json', ...]
    """
    files = paths.rank_files(path)
    if not files:
        shown = path if not os.path.exists(path) else f"{path} is one file: it"
        raise RunFileError(f"{shown} has no rank files (run.rank{{R}}.h5) to index")
    found = lookup(files)
    todo = [p for p in files if p not in found.summaries]
    out = Indexed(path=path, ranks=len(files), covered=len(files) - len(todo))
    # A node summary older than some of its ranks' files is written again, whole ...
    for node in dict.fromkeys(found.stale.values()):
        group = [p for p in todo if found.stale.get(p) == node]
        _index(out, node, group)
    # ... and the ranks no node summary holds get new ones, RANKS_PER_NODE a file.
    todo = [p for p in todo if p not in found.stale]
    for i in range(0, len(todo), RANKS_PER_NODE):
        group = todo[i:i + RANKS_PER_NODE]
        _index(out, paths.node_path(path, _rank(group[0])), group)
    return out


def _index(out: Indexed, node: str, group: list[str]) -> None:
    """Write ``node`` with ``group``'s entries and those it already holds for other files."""
    mine = [e for e in (entry(p) for p in group) if e is not None]
    kept = [e for e in (entry(p) for p in _kept(node, group)) if e is not None]
    out.unreadable += len(group) - len(mine)
    if not mine:
        return
    try:
        dump(node, kept + mine)
    except OSError as exc:
        raise RunFileError(f"cannot write {node}: {exc.strerror or exc}") from None
    out.written.append(node)
    out.entries += len(mine)


def _rank(path: str) -> int:
    return int(os.path.basename(path).rsplit(".rank", 1)[1].split(".", 1)[0])


def _kept(node: str, group: list[str]) -> list[str]:
    """The rank files an existing node summary of this name holds beyond ``group``."""
    if not os.path.exists(node):
        return []
    try:
        entries = read(node)
    except RunFileError:
        return []
    folder = os.path.dirname(os.path.abspath(node))
    held = [os.path.join(folder, e["file"]) for e in entries if isinstance(e.get("file"), str)]
    mine = {os.path.abspath(p) for p in group}
    return [p for p in held if p not in mine and os.path.exists(p)]
