"""Device values read on the host without a sync of our own; step time as the device sees it.

**Host mirrors.** A ``HostMirror`` is two floats of host memory that a non-blocking copy fills
from the device: pinned memory and a CUDA event on CUDA, so the copy is queued on the stream
like any kernel and lands when the device gets there. ``ready()`` asks the event without
waiting; ``read()`` returns the floats once it has landed. Reading a mirror whose copy has
landed is a read of host memory, not a device sync. The recorder stages GradScaler's
found_inf and the loss in a mirror each step (``skips.Skips.stage_found``)::

    m = pool.take()
    m.stage(torch.stack([found_inf, loss]))    # queued, no wait
    ...                                        # GradScaler's own .item() lands it (foreach)
    if m.ready():                              # else decide at the next step's start
        found, loss = m.read()

On CPU the copy is an ordinary synchronous copy between host tensors, and ``ready()`` is always
true. On devices other than CPU and CUDA (no pinned memory or events here) the copy is a
blocking one: there staging is a sync, and it is the only place that says so.

**Step clock.** ``StepClock`` times step boundaries: ``time.perf_counter`` on CPU; on CUDA an
event recorded on the current stream at each boundary, resolved to seconds at the flush (which
is the recorder's sync point anyway). ``perf_counter`` around asynchronous work measures how
fast the host launched it; the events measure the step as the device ran it, idle gaps
included.

**One copy per device.** A ``HostRead`` gathers the device values of one drain from
several owners (a sampled step: the statistics, the parameter probe, the op probe) and reads
them in one copy per device: each owner ``add``s its tensors and gets back a ``Pending``,
whose ``value`` (a float64 numpy array of the same shape) is there once ``run`` has read
them all::

    read = HostRead()
    counts = read.add(device_counts)   # nothing read yet
    read.run()                         # one torch.cat and one copy per device: the sync
    counts.value                       # host values, float64

Every value travels as float64: exact for float16/bfloat16/float32/float64 and for counts
below 2**53, so an owner gets the bits it would have read on its own.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Optional, Union

import numpy as np
import torch

_MIRRORS: "weakref.WeakValueDictionary[int, HostMirror]" = weakref.WeakValueDictionary()


class HostMirror:
    """Two floats on the host, filled from the device by a copy that no one waits for."""

    SIZE = 2

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.host = torch.empty(self.SIZE, dtype=torch.float32, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.landed = False
        self.values: Optional[list[float]] = None  # read once per staging (host memory)
        self.blocked = 0  # waits that found the copy still in flight (see ``wait``)
        _MIRRORS[id(self.host)] = self

    def stage(self, values: torch.Tensor) -> None:
        """Queue the copy of ``values`` (SIZE float32 elements on ``device``); never waits
        on CPU and CUDA."""
        self.host.copy_(values, non_blocking=self.cuda)
        self.values = None
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(values.device))
        self.landed = self.event is None

    def ready(self) -> bool:
        """Has the copy landed? Asks the event; never waits."""
        if not self.landed and self.event is not None and self.event.query():
            self.landed = True
        return self.landed

    def wait(self) -> None:
        """Block until the copy has landed: the recorder's one deliberate wait on the
        deferred path (the next step's start, see ``skips.Skips.settle``). It waits for this
        copy, queued a step earlier, not for the whole device: work queued after it (the
        optimizer step, the next forward) keeps the device busy."""
        if not self.ready():
            self.blocked += 1
            self.event.synchronize()
            self.landed = True

    def read(self) -> list[float]:
        """The staged values, from host memory the copy has finished writing (read once: a
        second ``read`` of the same staging returns them without touching the buffer)."""
        if not self.landed:
            raise RuntimeError("HostMirror.read before its copy landed (call ready or wait)")
        if self.values is None:
            self.values = self.host.tolist()
        return self.values


class MirrorPool:
    """Mirrors of one device, reused: a step takes one per staged optimizer and gives it back
    once the value is read (a deferred step holds its own until the next step's start)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: list[HostMirror] = []
        self._made: list[HostMirror] = []

    def take(self) -> HostMirror:
        if self._free:
            return self._free.pop()
        self._made.append(HostMirror(self.device))
        return self._made[-1]

    def give(self, mirror: HostMirror) -> None:
        self._free.append(mirror)

    @property
    def blocked(self) -> int:
        """Waits, over every mirror of this pool, that found a copy still in flight."""
        return sum(m.blocked for m in self._made)


def mirror_of(t: Any) -> Optional[HostMirror]:
    """The mirror whose host buffer ``t`` is, or None (the host-read tests tell a read of a
    landed mirror from a device read with it)."""
    if not isinstance(t, torch.Tensor):
        return None
    m = _MIRRORS.get(id(t))
    return m if m is not None and m.host is t else None


class _Span:
    """One step on the device: from the previous boundary's event to this one's."""

    __slots__ = ("start", "end")

    def __init__(self, start: Any, end: Any):
        self.start, self.end = start, end


class StepClock:
    """Step boundaries: ``mark()`` at each, ``seconds(marks)`` at the flush.

    CPU: ``mark`` returns the seconds since the previous boundary (``perf_counter``).
    CUDA: ``mark`` records an event on the current stream and returns the span from the
    previous one; ``seconds`` reads each span's elapsed time, after making sure its events have
    completed (the flush has just synced the stream, so they normally have).
    """

    def __init__(self, device: Optional[torch.device]):
        self.cuda = device is not None and device.type == "cuda"
        self.device = device
        self._last: Any = self._now()

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark(self) -> Union[float, _Span]:
        now = self._now()
        last, self._last = self._last, now
        return now - last if not self.cuda else _Span(last, now)

    @staticmethod
    def seconds(marks: list) -> list[float]:
        for m in marks:
            if isinstance(m, _Span):  # complete already after the flush's fetch: no wait
                m.start.synchronize()
                m.end.synchronize()
        return [m.start.elapsed_time(m.end) / 1e3 if isinstance(m, _Span) else float(m)
                for m in marks]


class Pending:
    """One owner's tensor in a ``HostRead``: ``value`` is its host copy once the read ran."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: np.ndarray = np.empty(0)


class HostRead:
    """Device tensors of one drain, read on the host in one copy per device (see above)."""

    def __init__(self) -> None:
        self._parts: list[tuple[torch.Tensor, Pending]] = []

    def add(self, t: torch.Tensor) -> Pending:
        pending = Pending()
        self._parts.append((t.detach(), pending))
        return pending

    def run(self) -> None:
        """The drain's sync: per device, one concatenation of every tensor (as float64) and
        one device-to-host copy; each ``Pending`` then holds its part."""
        by_dev: dict[torch.device, list[tuple[torch.Tensor, Pending]]] = {}
        for t, pending in self._parts:
            by_dev.setdefault(t.device, []).append((t, pending))
        self._parts = []
        for parts in by_dev.values():
            flat = torch.cat([t.reshape(-1).double() for t, _ in parts])
            host = flat.numpy(force=True)  # the one copy of this device's values
            at = 0
            for t, pending in parts:
                pending.value = host[at:at + t.numel()].reshape(tuple(t.shape))
                at += t.numel()
