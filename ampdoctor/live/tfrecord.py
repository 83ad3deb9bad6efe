"""TensorBoard's event file, written here: TFRecord framing with a CRC-32C computed by numpy.

numpy and the standard library only (the events themselves are the ``tensorboard`` package's
protocol buffers, serialized by ``live/tensorboard.py``). The file is what tensorboard's own
``EventFileWriter`` writes (``events.out.tfevents.<time>.<host>.<pid>.<n><suffix>``, a first
``file_version`` event, then one record per event: its length, the length's masked CRC-32C,
the event, the event's masked CRC-32C). tensorboard computes the CRC-32C in pure Python, one
byte at a time (about 8 MB/s: 3 s of a month-long run's export); here a batch of records is
checksummed together, one numpy step per byte position across the batch
(``masked_crc32c``), and written from the caller's thread (no queue, no second thread). The
file is created with ``O_EXCL`` and ``O_NOFOLLOW``: never through a link planted at its name.

Example::

    f = EventFile("runs/exp1", suffix=".ampdoctor")
    f.add_event(event)     # an event_pb2.Event
    f.close()
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from typing import Any

import numpy as np

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _table() -> np.ndarray:
    crc = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        crc = np.where(crc & 1, (crc >> 1) ^ np.uint32(_POLY), crc >> 1).astype(np.uint32)
    return crc


TABLE = _table()
BATCH = 2048  # records checksummed and written at a time
_FILES = itertools.count()  # the <n> of the file name, as tensorboard's writer numbers them


def masked_crc32c(records: list[bytes]) -> np.ndarray:
    """Each record's CRC-32C, masked as TFRecord masks it (uint32), all records at once: the
    records sorted longest first, so the ones still being read at byte ``j`` are a prefix."""
    n = len(records)
    if not n:
        return np.zeros(0, np.uint32)
    lens = np.fromiter(map(len, records), np.int64, n)
    order = np.argsort(-lens, kind="stable")
    lens = lens[order]
    data = np.frombuffer(b"".join(records[i] for i in order), np.uint8)
    buf = np.zeros((int(lens[0]), n), np.uint8)  # byte j of every record: one row
    starts = np.cumsum(lens) - lens
    buf[np.arange(len(data)) - np.repeat(starts, lens), np.repeat(np.arange(n), lens)] = data
    active = np.searchsorted(-lens, -np.arange(buf.shape[0]), side="left")  # lens > j
    crc = np.full(n, 0xFFFFFFFF, np.uint32)
    index = np.empty(n, np.uint32)
    for j, k in enumerate(active.tolist()):
        c, i = crc[:k], index[:k]
        np.bitwise_xor(c, buf[j, :k], out=i)
        np.bitwise_and(i, 0xFF, out=i)
        np.right_shift(c, 8, out=c)
        np.bitwise_xor(c, TABLE[i], out=c)
    crc ^= np.uint32(0xFFFFFFFF)
    masked = ((crc >> 15) | (crc << 17)) + np.uint32(0xA282EAD8)  # (uint32: wraps)
    out = np.empty(n, np.uint32)
    out[order] = masked
    return out


class EventFile:
    """One event file in ``logdir``: events added, written a batch at a time (``flush``)."""

    def __init__(self, logdir: str, suffix: str = "", event_pb2: Any = None):
        name = "events.out.tfevents.%010d.%s.%s.%s" % (time.time(), socket.gethostname(),
                                                       os.getpid(), next(_FILES))
        self.path = os.path.join(logdir, name + suffix)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL |
                     getattr(os, "O_NOFOLLOW", 0), 0o644)
        self._file = os.fdopen(fd, "wb")
        self._pending: list[bytes] = []
        if event_pb2 is not None:
            self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
            self.flush()

    def add_event(self, event: Any) -> None:
        """An ``event_pb2.Event``, written at the next ``flush`` (or ``BATCH`` events on)."""
        self._pending.append(event.SerializeToString())
        if len(self._pending) >= BATCH:
            self._write()

    def _write(self) -> None:
        records, self._pending = self._pending, []
        if not records:
            return
        heads = [struct.pack("<Q", len(r)) for r in records]
        head_crc, data_crc = masked_crc32c(heads), masked_crc32c(records)
        self._file.write(b"".join(h + struct.pack("<I", hc) + r + struct.pack("<I", dc)
                                  for h, hc, r, dc in zip(heads, head_crc.tolist(), records,
                                                          data_crc.tolist())))

    def flush(self) -> None:
        self._write()
        self._file.flush()

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            self.flush()
        finally:
            self._file.close()
