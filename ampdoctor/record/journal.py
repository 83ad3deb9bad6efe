"""What a recording writes and says: its run file, the rows every part adds to it (/events,
/tensors, /meta), and the warnings it gives the user, each once.

The file is named when it is created: at once, or (``lazy``) when training begins, once the
rank is known (``torch.distributed``'s, when a process group exists by then). Until then the
writer keeps rows in memory (``store.Writer(create=False)``).

Example::

    journal = Journal("run.h5", rank=0, world_size=1, strict=False)
    journal.open(lazy=False)
    journal.meta("roots", ["Net"])
    journal.event(Event.SKIPPED, step)       # an /events row, and the step's flag bit
    tid = journal.tensor_id(Kind.OUTPUT, "fc1", 0, t, "Linear")
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable, Optional, Union

import torch

from ..errors import RecorderFault
from ..runfile import schema, store
from ..runfile.schema import Event, Kind, flag
from . import stats
from .steps import Step

Naming = Union[str, "os.PathLike[str]", Callable[[int, int], str]]


class Journal:
    """The run file of one recorder, and its warnings.

    ``path``: the file, or a function of (rank, world_size) that names it when it is created.
    ``strict``: a tensor that cannot be measured raises ``RecorderFault`` instead of a warning.
    """

    def __init__(self, path: Naming, *, rank: int, world_size: int,
                 argv: Optional[list[str]] = None, strict: bool = False):
        if callable(path):
            self._name: Callable[[int, int], str] = path
        else:
            fixed = os.fspath(path)
            self._name = lambda rank, world: fixed
        # A function names the file only when it is created: the rank may not be known before.
        self.path = "" if callable(path) else os.fspath(path)
        self.rank, self.world_size = rank, world_size
        self.strict = strict
        self._argv = argv
        self.writer: Optional[store.Writer] = None
        self._tensor_ids: dict[tuple[int, str, int], int] = {}
        self._warned: set[str] = set()

    # -- the file ------------------------------------------------------------------------------

    def open(self, lazy: bool) -> None:
        """Make the writer; the file itself too unless ``lazy``."""
        if not lazy and not self.path:
            self.path = os.fspath(self._name(self.rank, self.world_size))
        self.writer = store.Writer(self.path, rank=self.rank, world_size=self.world_size,
                                   argv=self._argv, create=not lazy)

    @property
    def created(self) -> bool:
        """Has the file been created (for a lazy recorder: has training begun)?"""
        return self.writer is not None and self.writer.created

    @property
    def open_for_rows(self) -> bool:
        return self.writer is not None and not self.writer.closed

    def create(self) -> None:
        """Training begins (lazy mode): name the file now that the rank is known, create it."""
        w = self.file
        self.rank, self.world_size = _rank_and_world(self.rank, self.world_size)
        self.path = os.fspath(self._name(self.rank, self.world_size))
        w.create(self.path, rank=self.rank, world_size=self.world_size)
        w.flush()

    @property
    def file(self) -> store.Writer:
        """The writer, once the recorder has started."""
        if self.writer is None:
            raise RuntimeError("the recorder has not started: no run file yet")
        return self.writer

    # -- rows ----------------------------------------------------------------------------------

    def tensor_id(self, kind: Kind, name: str, index: int, t: Any, owner_type: str) -> int:
        """The /tensors id of (kind, name, index), its row written the first time."""
        key = (int(kind), name, index)
        tid = self._tensor_ids.get(key)
        if tid is None:
            w = self.file
            tid = self._tensor_ids[key] = len(self._tensor_ids)
            row = schema.empty("tensors", 1)
            row["id"] = tid
            row["kind"] = int(kind)
            row["index"] = index
            if isinstance(t, torch.Tensor):
                row["dtype"] = stats.dtype_code(t.dtype)
                row["numel"] = t.numel()
            row["name_off"], row["name_len"] = w.text(name)
            row["type_off"], row["type_len"] = w.text(owner_type)
            w.append("tensors", row)
        return tid

    def event(self, kind: Event, step: Optional[Step], *, tensor: int = -1,
              value: float = math.nan, text: str = "") -> None:
        """An /events row at ``step`` (step 0 when None). A step already ended (a skip decided
        at the next step's start) keeps its event rows; its /steps flags were written without
        these bits."""
        w = self.file
        row = schema.empty("events", 1)
        row["step"] = step.index if step is not None else 0
        row["kind"] = int(kind)
        row["tensor"] = tensor
        row["value"] = value
        if text:
            row["text_off"], row["text_len"] = w.text(text)
        w.append("events", row)
        if step is not None:
            step.flags |= flag(kind)

    def meta(self, key: str, value: Any, step: int = -1) -> None:
        self.file.meta(key, value, step)

    # -- what the user is told -----------------------------------------------------------------

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"ampdoctor: {message}", RuntimeWarning, stacklevel=3)

    def warn_tensor(self, what: str, exc: BaseException) -> None:
        """A tensor that could not be measured: skipped, reported once."""
        if self.strict:
            raise RecorderFault(f"{what}: {exc}") from exc
        self.warn_once(what, f"could not measure {what} ({type(exc).__name__}: {exc}); "
                             "it is left out of the sampled statistics")

    def lost(self, exc: BaseException, where: str) -> str:
        """The warning after a failure: what happened, and what the file does and does not
        hold."""
        what, kept = self.stopped(exc, where)
        if kept is None:
            return what
        held = f"steps 0-{kept - 1}" if kept else "no step"
        return f"{what}; recording stopped, {self.path} keeps {held}; training continues"

    def stopped(self, exc: BaseException, where: str) -> tuple[str, Optional[int]]:
        """Why the recording stopped ("could not write run.h5 (No space left on device)") and
        how many steps the file keeps (None: the file is gone)."""
        if isinstance(exc, FileNotFoundError) and "deleted" in str(exc):
            return (f"{self.path} was deleted while recording (its directory removed?): "
                    "recording stopped and what the file held is gone; training continues",
                    None)
        w = self.writer
        kept = w.committed["steps"] if w is not None else 0
        if isinstance(exc, OSError):
            return f"could not write {self.path} ({store._reason(exc)})", kept
        return f"internal error in {where} ({type(exc).__name__}: {exc})", kept


def _rank_and_world(rank: int, world_size: int) -> tuple[int, int]:
    """This process's rank: torch.distributed's once a process group exists (mp.spawn sets no
    RANK variable), else what the environment said (torchrun)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return rank, world_size
