"""The OS descriptor beneath an open run file: what the writer does with it when HDF5 cannot be
trusted (a file deleted while written, a write that failed half-way, a forked child's copy).

Plain OS calls only, so each is safe after a failed write and right after ``fork``.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from . import hdf5


def of(f: Any) -> int | None:
    """The OS descriptor under an HDF5 file (default sec2 driver), or None."""
    try:
        fd = int(f.id.get_vfd_handle())
        os.fstat(fd)
        return fd
    except Exception:  # noqa: BLE001 - another driver: no descriptor checks, nothing else
        return None


def check_still_there(fd: int | None, path: str) -> None:
    """A deleted file (its directory removed) still takes writes that nobody will read."""
    if fd is not None and os.fstat(fd).st_nlink == 0:
        raise FileNotFoundError(errno.ENOENT, f"{path} was deleted while being "
                                              "written (its directory removed?)")


def fit_superblock(fd: int | None) -> None:
    """After a failed write, make the superblock's end-of-file match the file's size.

    HDF5 writes the superblock (with the new end of file) before it extends the file; a
    write that fails in between (disk full) leaves a file shorter than its header says,
    which HDF5 refuses to open although everything up to the last good flush is there.
    Rewriting the 48 bytes in place needs no new disk space.
    """
    if fd is None:
        return
    try:
        head = os.pread(fd, hdf5.SUPERBLOCK_BYTES, 0)
        fixed = hdf5.superblock_with_eof(head, os.fstat(fd).st_size)
        if fixed is not None:
            os.pwrite(fd, fixed, 0)
    except OSError:
        pass


def retire(fd: int) -> None:
    """Point ``fd`` at /dev/null: nothing this process's HDF5 still writes reaches the file."""
    try:
        null = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)
    except OSError:
        pass
