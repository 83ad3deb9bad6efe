"""HDF5 beneath h5py: the file's signature and superblock, the SWMR reader's open, h5py's errors.

This module owns what ampdoctor knows of the HDF5 file format itself and of the library under
h5py, which the writer and the reader both lean on:

* ``Superblock``, parsed by ``parse_superblock`` (the only parser of it): the end-of-file
  address a reader checks a file's size against, the flag saying a writer has the file open,
  and ``Superblock.with_eof``, the 48-byte rewrite (checksum included) by which a writer whose
  write failed leaves a file HDF5 still opens;
* ``open_swmr``: a SWMR reader whose metadata retries are bounded (a setting h5py does not
  expose, set through the HDF5 library itself);
* ``reason``: the one useful line of an h5py (or OS) error, for the sentences users read.

Example::

    sb = read_superblock("run.h5")
    sb.being_written, sb.end       # (True, 1048576): a writer has it open, and its size
"""

from __future__ import annotations

import ctypes
import errno
import functools
import glob
import os
import re
import stat
import struct
from dataclasses import dataclass
from typing import Any

import h5py

SIGNATURE = b"\x89HDF\r\n\x1a\n"  # the first 8 bytes of every HDF5 file


def is_hdf5(path: str) -> bool:
    """Does the file at ``path`` begin with the HDF5 signature (a run file, or another HDF5
    file that a report must not overwrite)?"""
    try:
        return head(path, len(SIGNATURE)) == SIGNATURE
    except OSError:
        return False


def head(path: str, nbytes: int) -> bytes:
    """The first ``nbytes`` of a regular file; OSError for anything else. A FIFO is opened
    without blocking and refused, so that no look at a path named by a user can hang."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return os.pread(fd, nbytes, 0)
    finally:
        os.close(fd)
SUPERBLOCK_BYTES = 48  # a version 2/3 superblock with 8-byte addresses, checksum included

H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)  # what h5py raises

# HDF5 gives a SWMR reader 100 attempts, with back-off, at each metadata block whose checksum
# fails, because a live writer may be half-way through a flush. On a damaged file that is
# minutes of retrying. A few attempts cover a live writer; `load` retries the whole read.
SWMR_READ_ATTEMPTS = 4

_WRITE_ACCESS = 0x01 | 0x04  # file consistency flags: write access, SWMR write access


@dataclass(frozen=True)
class Superblock:
    """The start of a version 2 or 3 superblock (the versions ``libver="latest"`` writes).

    Layout: signature (8 bytes), version, size of offsets, size of lengths, consistency flags,
    then four addresses (base, superblock extension, end of file, root group) and a lookup3
    checksum of everything before it. ``base`` and ``eof`` are None when addresses are not
    8 bytes wide or the bytes read stop short of them.
    """

    head: bytes  # the bytes parsed, up to SUPERBLOCK_BYTES
    version: int
    offset_size: int
    flags: int
    base: int | None = None
    eof: int | None = None  # end-of-file address, relative to ``base``
    checksum_ok: bool = False  # all 48 bytes read, and their checksum holds

    @property
    def being_written(self) -> bool:
        """A writer has the file open (it is being written, or its writer was killed)."""
        return bool(self.flags & _WRITE_ACCESS)

    @property
    def end(self) -> int:
        """The file's size as the superblock records it; 0 where it does not tell."""
        return 0 if self.base is None or self.eof is None else self.base + self.eof

    def with_eof(self, size: int) -> bytes | None:
        """These 48 bytes with the end of file clamped to ``size``, checksum recomputed; None
        if the end is within ``size`` already, or this is not a superblock known whole."""
        if not self.checksum_ok or self.base is None or self.eof is None:
            return None
        if self.base + self.eof <= size or size < self.base:
            return None
        body = self.head[:28] + struct.pack("<Q", size - self.base) + self.head[36:44]
        return body + struct.pack("<I", lookup3(body))


def parse_superblock(head: bytes) -> Superblock | None:
    """The superblock at the start of ``head`` (a file's first bytes); None if ``head`` does
    not start with a version 2 or 3 superblock."""
    if len(head) < 12 or head[:8] != SIGNATURE or head[8] not in (2, 3):
        return None
    head = head[:SUPERBLOCK_BYTES]
    version, offset_size, flags = head[8], head[9], head[11]
    if offset_size != 8 or len(head) < 44:
        return Superblock(head, version, offset_size, flags)
    base, _ext, eof, _root = struct.unpack("<4Q", head[12:44])
    checksum_ok = len(head) == SUPERBLOCK_BYTES and \
        struct.unpack("<I", head[44:48])[0] == lookup3(head[:44])
    return Superblock(head, version, offset_size, flags, base, eof, checksum_ok)


def read_superblock(path: str) -> Superblock | None:
    """The superblock of the file at ``path`` (OSError where it cannot be read)."""
    return parse_superblock(head(path, SUPERBLOCK_BYTES))


def superblock_with_eof(head: bytes, size: int) -> bytes | None:
    """``Superblock.with_eof`` for raw bytes: None where ``head`` is no superblock known whole.

    Example::

        fixed = superblock_with_eof(os.pread(fd, SUPERBLOCK_BYTES, 0), os.fstat(fd).st_size)
    """
    sb = parse_superblock(head)
    return None if sb is None else sb.with_eof(size)


def flagged_as_written(path: str) -> bool:
    """The superblock says a writer has the file open (it is being written, or was killed)."""
    try:
        sb = read_superblock(path)
    except OSError:
        return False
    return sb is not None and sb.being_written


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 hash ("hashlittle"): HDF5's checksum of metadata blocks."""
    mask = 0xFFFFFFFF

    def rot(x: int, k: int) -> int:
        return ((x << k) | (x >> (32 - k))) & mask

    n = len(data)
    v = [(0xDEADBEEF + n + initval) & mask] * 3  # a, b, c
    i = 0
    while n - i > 12:
        for j in range(3):
            v[j] = (v[j] + int.from_bytes(data[i + 4 * j:i + 4 * j + 4], "little")) & mask
        # mix(a, b, c): x -= y; x ^= rot(y, k); y += z
        for x, y, z, k in ((0, 2, 1, 4), (1, 0, 2, 6), (2, 1, 0, 8), (0, 2, 1, 16),
                           (1, 0, 2, 19), (2, 1, 0, 4)):
            v[x] = ((v[x] - v[y]) & mask) ^ rot(v[y], k)
            v[y] = (v[y] + v[z]) & mask
        i += 12
    if n == i:
        return v[2]
    tail = data[i:] + bytes(12 - (n - i))
    for j in range(3):
        v[j] = (v[j] + int.from_bytes(tail[4 * j:4 * j + 4], "little")) & mask
    # final(a, b, c): x ^= y; x -= rot(y, k)
    for x, y, k in ((2, 1, 14), (0, 2, 11), (1, 0, 25), (2, 1, 16), (0, 2, 4), (1, 0, 14),
                    (2, 1, 24)):
        v[x] = ((v[x] ^ v[y]) - rot(v[y], k)) & mask
    return v[2]


# -- the SWMR reader ----------------------------------------------------------------------------


def open_swmr(path: str) -> h5py.File:
    """``path`` opened read-only as a SWMR reader, its metadata retries bounded where the HDF5
    library can be reached (``SWMR_READ_ATTEMPTS``)."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    lib = _hdf5_library()
    if lib is not None:
        lib.H5Pset_metadata_read_attempts(fapl.id, SWMR_READ_ATTEMPTS)
    fid = h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ,
                        fapl=fapl)
    return h5py.File(fid)


@functools.lru_cache(maxsize=None)
def _hdf5_library() -> Any:
    """The HDF5 library h5py runs on, for the one setting h5py does not expose (the SWMR
    reader's metadata read attempts). None when it cannot be told for sure which library
    that is; readers then keep HDF5's default."""
    paths = set()
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "libhdf5" in line}
    except OSError:
        pass
    here = os.path.dirname(os.path.dirname(h5py.__file__))
    paths |= set(glob.glob(os.path.join(os.path.dirname(h5py.__file__), ".dylibs", "libhdf5*")))
    paths = {p for p in paths if re.match(r"libhdf5([-.]|$)", os.path.basename(p))}
    if len(paths) > 1:
        paths = {p for p in paths if p.startswith(here)}
    if len(paths) != 1:
        return None
    try:
        lib = ctypes.CDLL(paths.pop())
        major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        lib.H5get_libversion(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        if (major.value, minor.value, release.value) != h5py.version.hdf5_version_tuple[:3]:
            return None
        lib.H5Pset_metadata_read_attempts.argtypes = [ctypes.c_int64, ctypes.c_uint]
        lib.H5Pset_metadata_read_attempts.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None


# -- what h5py's errors say ---------------------------------------------------------------------


def reason(exc: BaseException) -> str:
    """The useful part of an exception's message, on one line.

    h5py nests the cause in parentheses ("Unable to open file (file signature not found)")
    and a failed write names the OS error inside ("... error message = 'No space left ...'").

    Example::

        reason(OSError(28, "No space left on device"))   # 'No space left on device'
    """
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    os_error = re.search(r"error message = '([^']*)'", str(exc))
    if os_error:
        return os_error.group(1)
    text = (str(exc).strip().splitlines() or [""])[0]
    _head, paren, rest = text.partition("(")
    if paren and rest.endswith(")"):
        text = rest[:-1]
    return text.strip() or type(exc).__name__


def errno_in(exc: BaseException) -> int | None:
    """The OS error number inside an h5py message ("errno = 28"), if any."""
    found = re.search(r"errno = (\d+)", str(exc))
    return int(found.group(1)) if found else None
