"""Following a recording while it is written: the files of one run, their new rows, their writer.

numpy only (h5py stays in ``store``, whose ``Tail`` reads the new rows). A ``Follower`` is
given the path a recording writes to (``run.h5``); each ``poll`` finds the files that exist
now (``run.h5``, else the ``run.rank{R}.h5`` of a torchrun job, which may appear one after
another), opens the new ones, reads what was added to each since the last poll, and returns
it as ``Delta``s. Every file also keeps a ``RankState``: what a live view needs of the run so
far (all of ``/steps``, the latest LR of each param group, tensors, events, snapshots,
configuration, the statistics rows of the latest sampled step only, and the delayed recipe's
/fp8 rows of the last ``FP8_STEPS`` sampled steps), so memory follows the run's steps, never
its statistics.

The writer is never slowed: a SWMR reader takes no lock, and a poll reads only new rows.

Whether the writer is still there: on the writer's own host, its pid (root attributes) is
checked, and whether that process still has the file open (``store.Tail.writer_alive``); from
another host that cannot be told, so a file that has not changed for ``stale`` seconds is
taken as abandoned. Either way the state says why (``RankState.gone``).

Example::

    f = Follower("run.h5")
    for delta in f.poll():          # again every second or so
        delta.rows["steps"]["loss"]
    f.states[0].status, f.states[0].steps["step"][-1]
    f.close()
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ..diagnosis.forecast import NEEDED
from ..errors import RunFileError, RunNotFoundError
from ..runfile import paths, schema
from ..runfile.columns import Columns
from ..runfile.schema import Source

# A file that does not change for this long, whose writer's host is not this one, is taken
# as abandoned (its writer killed with its node). A writer flushes at least every second while
# it trains; evaluation or checkpointing can pause it for minutes.
STALE_SECONDS = 600.0
# Reads that fail this many polls in a row are not a writer mid-flush: the file is damaged.
MAX_READ_FAILURES = 5
# On opening a long run, the latest sampled step is looked for in this many /stats rows at the
# end (a sampled step writes one row per recorded tensor: a few thousand at most).
STATS_WINDOW = 1 << 16
# Sampled steps kept for the layers' trends: what one judgement of the forecast reads.
TREND_STEPS = NEEDED
# Sampled steps of /fp8 rows kept for the fp8 early warning (``diagnosis.fp8watch``): its
# growth window and the step each layer at risk was first seen at risk, within them.
FP8_STEPS = 32
WAIT_POLL = 0.2  # seconds between looks for a run file that does not exist yet
FINAL_PREFIXES = (schema.STATUS_FINISHED, schema.STATUS_EXCEPTION, schema.STATUS_SIGNAL)


@dataclass
class Delta:
    """What one poll found new in one file."""

    path: str
    rank: int
    rows: dict  # table -> new rows (decoded like ``store.load``: "steps" a ``Columns``,
    # "groups" a ``Table`` read by range); "meta": new keys
    stats: Any  # store.Table over /stats as written so far
    stats_start: int  # first new /stats row
    reset: bool = False  # the file was replaced (a new recording): earlier rows are void


class _Grow:
    """An array that grows by appending, at amortized cost (a long run appends every second)."""

    def __init__(self, dtype: np.dtype):
        self._buf = np.zeros(64, dtype)
        self.n = 0

    def extend(self, rows: np.ndarray) -> None:
        if self.n + len(rows) > len(self._buf):
            bigger = np.zeros(max(2 * len(self._buf), self.n + len(rows)), self._buf.dtype)
            bigger[:self.n] = self._buf[:self.n]
            self._buf = bigger
        self._buf[self.n:self.n + len(rows)] = rows
        self.n += len(rows)

    @property
    def view(self) -> np.ndarray:
        return self._buf[:self.n]


class _GrowColumns:
    """/steps as followed so far, column by column (``columns.Columns``, as a loaded run holds
    it). The first read's columns are kept as read, not copied (a month-long run's first read
    is its whole /steps); later reads are appended, the room growing by a quarter at a time."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self._cols = {name: np.zeros(0, dtype[name]) for name in dtype.names or ()}
        self.n = 0

    def extend(self, rows: Any) -> None:
        if not len(rows):
            return
        room = len(next(iter(self._cols.values())))
        if self.n == 0 and isinstance(rows, Columns):
            self._cols = {name: rows[name] for name in self._cols}
            self.n = len(rows)
            return
        if self.n + len(rows) > room:
            room = max(self.n + len(rows), room + room // 4 + 64)
            for name, col in self._cols.items():
                bigger = np.zeros(room, col.dtype)
                bigger[:self.n] = col[:self.n]
                self._cols[name] = bigger
        for name, col in self._cols.items():
            col[self.n:self.n + len(rows)] = rows[name]
        self.n += len(rows)

    @property
    def view(self) -> Columns:
        return Columns({name: col[:self.n] for name, col in self._cols.items()}, self.dtype)


@dataclass
class RankState:
    """One file of the run as followed so far."""

    path: str
    attrs: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    lr: dict = field(default_factory=dict)  # param group -> its latest LR
    tensors: Any = None
    events: Any = None
    snapshots: Any = None
    layer_rows: np.ndarray = field(default_factory=lambda: schema.empty("stats"))
    layer_step: Optional[int] = None  # the sampled step ``layer_rows`` belong to
    # The sampled rows of the last few sampled steps: the early warning's window (``forecast``).
    trend_rows: np.ndarray = field(default_factory=lambda: schema.empty("stats"))
    # The delayed recipe's /fp8 rows of the last FP8_STEPS sampled steps (fp8 headroom).
    fp8_rows: np.ndarray = field(default_factory=lambda: schema.empty("fp8"))
    writer: Optional[bool] = None  # writer alive (None: cannot be told from this host)
    idle: float = 0.0  # seconds since the file last changed
    error: Optional[str] = None  # the last read failure, while it lasts
    stale: float = STALE_SECONDS  # seconds unchanged after which an unverifiable writer is gone
    _steps: Any = None

    def __post_init__(self) -> None:
        from ..runfile.store import TENSOR_VIEW, decoded

        self._steps = _GrowColumns(schema.STEPS)
        self._losses = _Grow(schema.LOSSES)  # each loss of a run that backwards several
        self.tensors = np.zeros(0, TENSOR_VIEW)
        self.events = decoded(schema.empty("events"), ["text"])
        self.snapshots = decoded(schema.empty("snapshots"), ["module", "module_type",
                                                               "detail"])

    @property
    def steps(self) -> Columns:
        return self._steps.view

    @property
    def rank(self) -> int:
        return int(self.attrs.get("rank", 0) or 0)

    @property
    def world_size(self) -> int:
        return int(self.attrs.get("world_size", 1) or 1)

    def apply(self, delta: Delta, layers: bool = True) -> None:
        """Fold one poll's new rows in (``layers``: also keep the latest sampled step's
        statistics rows and each param group's latest LR)."""
        rows = delta.rows
        self._steps.extend(rows["steps"])
        self._losses.extend(rows["losses"])
        self.meta.update(rows["meta"])
        for part in rows["groups"].chunks(names=("group", "lr")) if layers else ():
            groups, last = np.unique(part["group"][::-1], return_index=True)
            for g, i in zip(groups, len(part) - 1 - last):  # each group's last row
                self.lr[int(g)] = float(part["lr"][i])
        for name in ("tensors", "events", "snapshots"):
            if len(rows[name]):
                setattr(self, name, np.concatenate([getattr(self, name), rows[name]]))
        if layers:
            self._latest_layers(delta.stats, delta.stats_start)
            self._keep_fp8(rows.get("fp8"))

    def _keep_fp8(self, rows: Optional[np.ndarray]) -> None:
        """Keep the delayed recipe's /fp8 rows (one per operand: its amax, its delayed scale,
        its kurtosis) of the last ``FP8_STEPS`` sampled steps."""
        if rows is None or not len(rows):
            return
        rows = np.concatenate([self.fp8_rows, rows[rows["recipe"] == int(schema.Recipe.DELAYED)]])
        steps = np.unique(rows["step"])
        if len(steps) > FP8_STEPS:
            rows = rows[rows["step"] >= steps[-FP8_STEPS]]
        self.fp8_rows = rows

    def _latest_layers(self, stats: Any, start: int) -> None:
        """Keep the sampled tier's rows of the latest sampled step (never the whole table)."""
        stop = len(stats)
        start = max(start, stop - STATS_WINDOW)
        if stop <= start:
            return
        rows = stats.rows(start, stop)
        rows = rows[rows["source"] == int(Source.SAMPLED)]
        if not len(rows):
            return
        self._keep_trend(rows)
        latest = int(rows["step"].max())
        rows = rows[rows["step"] == latest]
        if self.layer_step == latest:
            self.layer_rows = np.concatenate([self.layer_rows, rows])
        elif self.layer_step is None or latest > self.layer_step:
            self.layer_rows, self.layer_step = rows, latest

    def _keep_trend(self, rows: np.ndarray) -> None:
        """Keep the rows of the last ``TREND_STEPS`` sampled steps (bounded, like the rest)."""
        rows = np.concatenate([self.trend_rows, rows])
        steps = np.unique(rows["step"])
        if len(steps) > TREND_STEPS:
            rows = rows[rows["step"] >= steps[-TREND_STEPS]]
        self.trend_rows = rows

    @property
    def status(self) -> str:
        """'finished', 'exception:<Type>', 'signal:<NAME>', 'running', or 'gone' (the writer
        stopped without finishing the file: killed, or it let go of the file)."""
        status = self.meta.get("status", schema.STATUS_RUNNING)
        if isinstance(status, str) and status.startswith(FINAL_PREFIXES):
            return status
        return "gone" if self.gone else "running"

    @property
    def final(self) -> bool:
        return self.status != "running"

    @property
    def gone(self) -> Optional[str]:
        """Why the writer is taken as gone, in a sentence; None while it is there."""
        status = self.meta.get("status", schema.STATUS_RUNNING)
        if isinstance(status, str) and status.startswith(FINAL_PREFIXES):
            return None
        pid, host = self.attrs.get("pid"), self.attrs.get("host") or "another host"
        if self.writer is False:
            if _running(pid):
                return (f"writer gone: process {pid} is running but no longer writes the file "
                        "(ampdoctor stopped recording in it)")
            return (f"writer gone: process {pid} on {host} ended without finishing the file "
                    "(killed?); it holds every step up to its last flush")
        if self.writer is None and self.idle >= self.stale:
            return (f"writer gone: the file has not changed for {_duration(self.idle)} and "
                    f"its writer (process {pid} on {host}) cannot be checked from here")
        return None

    def run(self) -> Any:
        """The run so far as a ``store.Run`` (statistics: the latest sampled step's rows),
        which the analysis side's functions take as they take a loaded run."""
        from ..runfile.store import Run, Table

        groups = np.zeros(len(self.lr), schema.GROUPS)
        groups["group"] = list(self.lr)
        groups["lr"] = list(self.lr.values())
        if len(self.steps):
            groups["step"] = self.steps["step"][-1]
        run = Run(path=self.path, attrs=self.attrs, meta=self.meta, steps=self.steps,
                  groups=Table(groups, name="groups"), tensors=self.tensors,
                  stats=Table(self.layer_rows), events=self.events, snapshots=self.snapshots,
                  losses=self._losses.view)
        run.live = not self.final
        return run


def _running(pid: Any) -> bool:
    try:
        pid = int(pid)
        if pid <= 0:
            return False
        os.kill(pid, 0)
        return True
    except PermissionError:
        return True
    except (OSError, TypeError, ValueError, OverflowError):
        return False


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _Source:
    """One file being followed: its open ``Tail``, its state, and when it last changed."""

    def __init__(self, path: str, stale: float, layers: bool):
        from ..runfile.store import Tail

        self.path = path
        self.layers = layers
        self.tail = Tail(path)
        self.state = RankState(path, attrs=dict(self.tail.attrs), stale=stale)
        self.stats_done = 0
        self.polls = 0
        self.failures = 0
        self._seen = _stamp(path)
        # Until a change is seen, the file's own modification time is the only evidence.
        self._changed = time.monotonic() - max(0.0, time.time() - self._seen[1])

    def poll(self) -> Optional[Delta]:
        try:
            rows = self.tail.read()
        except RunFileError as exc:
            self.failures += 1
            self.state.error = str(exc)
            # A file no writer has open reads the same each time: its first failure is final.
            if self.failures >= MAX_READ_FAILURES or not self.tail.live:
                raise
            return None
        self.failures, self.state.error = 0, None
        delta = Delta(self.path, self.state.rank, rows, self.tail.stats, self.stats_done)
        self.stats_done = len(self.tail.stats)
        first, self.polls = self.polls == 0, self.polls + 1
        self.state.apply(delta, self.layers)
        # What the first read finds was there before: growth is what later reads find.
        self._watch_writer(not first and any(len(v) for v in rows.values()))
        return delta

    def _watch_writer(self, grew: bool) -> None:
        stamp = _stamp(self.path)
        now = time.monotonic()
        if grew or stamp != self._seen:
            self._seen, self._changed = stamp, now
        self.state.idle = now - self._changed
        if not self.state.final:  # once finished or gone, it stays so
            self.state.writer = self.tail.writer_alive()

    def close(self) -> None:
        self.tail.close()


def _stamp(path: str) -> tuple[int, float]:
    try:
        info = os.stat(path)
        return info.st_size, info.st_mtime
    except OSError:
        return -1, 0.0


# A job with more rank files than this is followed in full for one rank only (the shown one);
# the others are read from their summaries (``Summaries``), so a refresh stays within a second.
FULL_RANKS = 8
# Seconds of summary reads per poll: the files changed since their last read, oldest first.
SUMMARY_BUDGET = 0.3


# The stamp of a file known only from a stale node summary: never a file's own, so it is due.
PROVISIONAL = (-2, 0.0)


@dataclass
class Summarized:
    """A rank file known from its summary: ``outline`` (``ranks.outline``'s keys), its last
    step, the time it was read, and the file's (size, mtime) then."""

    path: str
    outline: dict
    last_step: Optional[int]
    read_at: float
    stamp: tuple

    @property
    def rank(self) -> int:
        return int(self.outline["rank"])

    @property
    def final(self) -> bool:
        status = self.outline["status"]
        return status != "running"


class Summaries:
    """The rank files of a large job, each re-read from its ``/summary`` when it changed, at
    most ``budget`` seconds of reading per poll (the least recently read first), so a poll of
    a thousand files stays short and every file is seen again within a few polls."""

    def __init__(self, budget: float = SUMMARY_BUDGET):
        self.budget = budget
        self.known: dict[str, Summarized] = {}

    def poll(self, files: list[str]) -> None:
        """Read the summaries of files new or changed since their last read: every new one
        (the first poll reads them all), then the least recently read, within the budget."""
        present = set(files)
        for path in [p for p in self.known if p not in present]:
            del self.known[path]
        self._from_nodes([p for p in files if p not in self.known])
        due = []
        for path in files:
            stamp = _stamp(path)
            old = self.known.get(path)
            if old is None or old.stamp != stamp:
                due.append((old.read_at if old is not None else -1.0, path, stamp))
        deadline = time.monotonic() + self.budget
        for _, path, stamp in sorted(due):
            if time.monotonic() > deadline and path in self.known:
                break
            try:
                self.known[path] = Summarized(path, *_outline(path), time.time(), stamp)
            except RunFileError:
                if path not in self.known and os.path.exists(path):
                    raise

    def _from_nodes(self, new: list[str]) -> None:
        """New files known from the node summaries beside them, so that the first poll of a
        large job reads N/8 node summaries, not N rank files. A fresh entry is as good as a
        read; a stale one (a running job's rank files change between its node's writes) is
        shown as of its node's last write and stays due, read first, until read itself."""
        from ..diagnosis import job
        from ..runfile import nodes

        if len(new) < 2:
            return
        found = nodes.lookup(new, older=True)
        now = time.time()
        for path, s in found.summaries.items():
            self.known[path] = Summarized(path, job.from_summary(s).outline, s.last_step, now,
                                          _stamp(path))
        for path, s in found.older.items():
            written = _stamp(found.stale[path])[1]
            self.known[path] = Summarized(path, job.from_summary(s).outline, s.last_step,
                                          written, PROVISIONAL)

    @property
    def outlines(self) -> list[dict]:
        return sorted((s.outline for s in self.known.values()), key=lambda o: o["rank"])

    @property
    def oldest(self) -> Optional[float]:
        """When the least recently read summary was read (unix time)."""
        return min((s.read_at for s in self.known.values()), default=None)


def _outline(path: str) -> tuple[dict, Optional[int]]:
    """``ranks.outline`` of a file and its last step, from its summary (a file without one is
    read in full)."""
    from ..diagnosis import job, ranks
    from ..runfile.store import load, summary

    found = summary.read(path)
    if found is not None:
        return job.from_summary(found).outline, found.last_step
    with load(path) as run:
        return ranks.outline(run), int(run.steps["step"][-1]) if len(run.steps) else None


class Follower:
    """The files of one recording, followed poll by poll (see the module docstring).

    ``layers=False`` skips keeping the latest sampled step's statistics and each param group's
    latest LR (a caller that reads every new statistics and /groups row itself, like the
    TensorBoard export: a month-long run's /groups is 20 M rows, 1 s to read).
    ``full_ranks``: a job with more rank files than this follows only ``focus`` in full (by
    default the rank that went non-finite first, else the lowest) and reads the others'
    summaries (``summaries``), which ``ampdoctor top`` uses so that a thousand rank files
    refresh within a second.
    """

    def __init__(self, path: str | os.PathLike, *, stale: float = STALE_SECONDS,
                 layers: bool = True, full_ranks: Optional[int] = None):
        self.path = os.fspath(path)
        self.stale = stale
        self.layers = layers
        self.full_ranks = full_ranks
        self.focus: Optional[int] = None  # the rank followed in full (summary mode)
        self.summaries: Optional[Summaries] = None  # set once in summary mode
        self._sources: dict[str, _Source] = {}

    def files(self) -> list[str]:
        """The files of the recording that exist now: ``path``, else its rank files (what
        ``ampdoctor diagnose path`` reads)."""
        if os.path.exists(self.path):  # a FIFO or a directory too: the opener says what it is
            return [self.path]
        return paths.rank_files(self.path)

    def wait(self, limit: float, show: Optional[Callable[[float], Any]] = None) -> Any:
        """Wait up to ``limit`` seconds for a file of the run to exist. ``show(waited)`` is
        called about every ``WAIT_POLL`` seconds instead of sleeping (it should wait itself);
        whatever it returns other than None ends the wait and is returned.

        Raises ``RunNotFoundError`` (one sentence) when nothing appeared in time.
        """
        start = time.monotonic()
        while not self.files():
            waited = time.monotonic() - start
            if waited >= limit:
                stem, ext = os.path.splitext(self.path)
                raise RunNotFoundError(
                    f"{self.path} did not appear within {limit:g} s (nor {stem}.rank*{ext}): "
                    f"start the recording with ampdoctor record -o {self.path}, or wait "
                    "longer with --wait")
            answer = show(waited) if show is not None else time.sleep(
                min(WAIT_POLL, limit - waited))
            if answer is not None:
                return answer
        return None

    def poll(self) -> list[Delta]:
        """Open files that appeared, reopen replaced ones, and read what each added."""
        files = self.files()
        if self.full_ranks is not None and (len(files) > self.full_ranks or self.summaries):
            files = self._focused(files)
        deltas = []
        for path in files:
            source = self._sources.get(path)
            reset = source is not None and source.tail.replaced()
            if reset:
                source.close()
            if source is None or reset:
                try:
                    source = self._sources[path] = _Source(path, self.stale, self.layers)
                except RunFileError:
                    if os.path.exists(path):
                        raise
                    continue  # removed between the listing and the open
            delta = source.poll()
            if delta is not None:
                delta.reset = reset
                deltas.append(delta)
        return deltas

    def _focused(self, files: list[str]) -> list[str]:
        """Summary mode: read the summaries, and keep only the focus rank's file in full."""
        from ..diagnosis import ranks

        if self.summaries is None:
            self.summaries = Summaries()
        self.summaries.poll(files)
        outlines = self.summaries.outlines
        by_rank = {o["rank"]: o["path"] for o in outlines}
        focus = self.focus if self.focus in by_rank else ranks.first_rank(outlines)
        if focus not in by_rank:
            focus = min(by_rank) if by_rank else None
        keep = [by_rank[focus]] if focus is not None else []
        for path in [p for p in self._sources if p not in keep]:
            self._sources.pop(path).close()
        return keep

    def signature(self) -> tuple:
        """Changes whenever what a frame shows of the run does (new rows, status, writer),
        so that a caller rebuilds its frame only then."""
        others = tuple((o["rank"], o["steps"], o["status"], o["first_bad"])
                       for o in self.summaries.outlines) if self.summaries else ()
        return tuple((s.path, len(s.steps), len(s.events), len(s.snapshots), s.layer_step,
                      len(s.layer_rows), s.status, s.gone, s.error) for s in self.states) + \
            (self.final,) + others

    @property
    def states(self) -> list[RankState]:
        """Every followed file's state, by rank (in summary mode: the focus rank's)."""
        return sorted((s.state for s in self._sources.values()), key=lambda s: s.rank)

    @property
    def final(self) -> bool:
        """Every file of the run has its final status (or lost its writer), and every rank
        the run said it has was found."""
        states = self.states
        if not states:
            return False
        if self.summaries is not None:
            known = list(self.summaries.known.values())
            world = max([s.world_size for s in states] + [int(k.outline["world_size"])
                                                          for k in known])
            return all(s.final for s in states) and all(k.final for k in known) and \
                (len(known) >= world or all(s.idle >= 10.0 for s in states))
        world = max(s.world_size for s in states)
        return all(s.final for s in states) and (len(states) >= world or
                                                 all(s.idle >= 10.0 for s in states))

    def close(self) -> None:
        for source in self._sources.values():
            source.close()
        self._sources.clear()

    def __enter__(self) -> "Follower":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
