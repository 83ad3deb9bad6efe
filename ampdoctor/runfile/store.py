"""The HDF5 run file: ``Writer`` on the recording side, ``load`` → ``Run`` on the analysis side.

This module is the run file's front door: the rest of ampdoctor imports these names from here,
and the modules beside it own the parts (each module's docstring says what it owns):

* ``writer``: ``Writer``, the crash-safe SWMR append path, and ``WriteError``;
* ``reader``: ``load``, ``load_steps``, ``opened`` and ``inspect``, the bounded,
  never-hanging read, and ``is_run_file``, what ``record --force`` may replace;
* ``guard`` and ``values``: a run file is untrusted input: nothing outside it is read, no
  table past what it stores, no value outside the schema's contract;
* ``summary``: ``/summary``, a run in a few numbers: the writer's ``Tally``, ``summary.read``;
* ``nodes``: node summaries, a node's ``/summary`` rows in one JSON file beside its rank files
  (``run.node{R}.json``), read in their place while fresh; ``nodes.index``;
* ``run``: ``Run`` and its ``Table``s and ``Blob``, and the decoding of text references;
* ``tail``: ``Tail``, a file followed while it is written (``ampdoctor top``, ``export``);
* ``attributes``: the root attributes, read without hanging, and the format check;
* ``liveness``: whether a file's writer is still running with the file open;
* ``hdf5``: the superblock, the SWMR reader's open, and what h5py's errors say.

runfile/ is h5py's only owner. It imports no torch.

Example::

    from ampdoctor.runfile import store
    w = store.Writer("run.h5")
    w.meta("status", "running"); w.flush(); w.close("finished")
    with store.load("run.h5") as run:
        run.status                          # 'finished'
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..errors import FormatTooNewError, RunFileError
from . import summary
from .hdf5 import reason
from .reader import inspect as _inspect
from .reader import is_run_file, load, load_steps, opened
from .run import TENSOR_VIEW, Blob, Run, Table, decoded
from .tail import Tail
from .writer import WriteError, Writer

__all__ = ["FormatTooNewError", "RunFileError", "TENSOR_VIEW", "Blob", "Run", "Table",
           "Tail", "WriteError", "Writer", "decoded", "inspect", "is_run_file", "load",
           "load_steps", "opened", "summary"]

_reason = reason  # record/recorder.py's name for it: the one line of an error a user reads


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """What a file holds, for ``ampdoctor dump``: attributes, meta, each table's rows, and
    what its ``/summary`` says (``summary``: None for a file of format 1, or one whose summary
    disagrees with its tables). See ``reader.inspect``.

    Example::

        store.inspect("run.h5")["summary"]["first_bad"]     # 9000
    """
    info = _inspect(path)
    try:
        found = summary.read(path)
    except RunFileError:
        found = None
    info["summary"] = dataclasses.asdict(found) if found is not None else None
    return info


def validate(path: str | os.PathLike) -> None:
    """Every value of the file checked against the schema's contract, as ``load`` and the
    analysis would meet it: ``RunFileError`` with the first that breaks it. ``dump`` shows a
    file as it is, then says this (the statistics are streamed: memory stays flat)."""
    with load(path) as run:
        for _chunk in run.stats.chunks(names=("tensor",)):
            pass
