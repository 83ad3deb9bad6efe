"""How the process ends while a recorder records: SIGTERM, the interpreter's exit, a fork.

One recorder records in a process at a time (``active()``); ``ExitGuard`` makes sure its file
is finished however the process ends, without changing how it ends:

* **SIGTERM** (``STOP_SIGNALS``): flush, record ``signal:SIGTERM`` and close, then do what was
  set before (by default, end the process by that same signal); a handler the script set
  itself is called instead, after a flush. A signal that lands while ampdoctor's own code
  changes the recorder's or the writer's state (``RECORDING_CODE``) is held back until that
  code has returned (``_Retake``), so the file is never finished from half-made state.
* **The interpreter exits** with the recorder still open (no ``with``, no ``close``): closed by
  ``atexit``, with the uncaught exception Python printed, if any.
* **A fork** (a DataLoader worker): the child inherits the recorder; there it records nothing
  and can never write into the parent's file (``store.Writer.disown``).

Example (what ``Recorder.start`` and ``close`` do)::

    guard = ExitGuard(recorder)
    guard.catch()          # SIGTERM handler, atexit
    ...
    guard.release()        # the handlers as they were
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional, Protocol

from ..runfile import schema

STOP_SIGNALS = ("SIGTERM",)  # finish the file, then let the signal do what it did before
SIGNAL_PATIENCE = 10.0  # seconds a stop signal may wait for a write in progress to end
RESEND_SECONDS = 0.05  # a held signal is sent again this often while it waits (_wait_for_signal)


class Recording(Protocol):
    """What the guard needs of a recorder."""

    closed: bool

    def flush(self) -> None: ...
    def close(self, status: str = schema.STATUS_FINISHED, *, keep_empty: bool = False) -> None: ...
    def record_exception(self, exc_type: Any, exc: Any) -> None: ...
    def disown(self) -> None: ...


_ACTIVE: Optional[Recording] = None


def active() -> Optional[Any]:
    """The recorder currently recording in this process, if any."""
    return _ACTIVE


def hold(rec: Recording) -> None:
    """``rec`` is the recorder of this process from now on."""
    global _ACTIVE
    _ACTIVE = rec


def let_go(rec: Recording) -> None:
    """``rec`` has stopped recording (no other recorder is forgotten)."""
    global _ACTIVE
    if _ACTIVE is rec:
        _ACTIVE = None


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) inherits the active recorder: there it records
    nothing and can never write into the parent's file (see ``store.Writer.disown``)."""
    global _ACTIVE
    rec, _ACTIVE = _ACTIVE, None
    if rec is not None and not rec.closed:
        rec.disown()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ExitGuard:
    """Finishes ``rec``'s file however the process ends (see the module docstring)."""

    def __init__(self, rec: Recording):
        self.rec = rec
        self.pid = os.getpid()
        self._previous: dict[int, Any] = {}
        self._deadline = 0.0
        self._pending: Optional[int] = None  # a stop signal waiting to be taken again
        self._last_value_at_start: Any = None
        self._caught = False

    def catch(self) -> None:
        """Finish the file however the process ends, without changing how it ends."""
        self.pid = os.getpid()
        self._caught = True
        self._previous, self._deadline, self._pending = {}, 0.0, None
        self._last_value_at_start = getattr(sys, "last_value", None)
        atexit.register(self._at_exit)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for name in STOP_SIGNALS:
            signum: Optional[int] = getattr(signal, name, None)
            if signum is None:
                continue
            try:
                previous = signal.getsignal(signum)
                if previous is None or previous == signal.SIG_IGN:
                    continue  # ignored, or a handler set outside Python: left alone
                signal.signal(signum, self._on_stop_signal)
            except (ValueError, OSError):
                continue
            self._previous[signum] = previous

    def release(self) -> None:
        if not self._caught:
            return
        try:
            atexit.unregister(self._at_exit)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            pass
        for signum, previous in self._previous.items():
            try:
                if signal.getsignal(signum) == self._on_stop_signal:  # not replaced since
                    signal.signal(signum, previous)
            except (ValueError, OSError):
                pass  # closed from another thread: the handler passes signals on
        held, self._pending = self._pending, None
        if held is not None and os.getpid() == self.pid:
            # A stop signal still held back (the file was closed before the re-send came: a
            # short run ends within RESEND_SECONDS) is taken now, by the handler put back.
            _resend(self.pid, held)

    def status(self, status: str) -> str:
        """The status to close with: a stop signal waiting to be taken again means the process
        is ending by it."""
        signum = self._pending
        if signum is None or status != schema.STATUS_FINISHED or \
                callable(self._previous.get(signum)):
            return status
        return schema.STATUS_SIGNAL + signal.Signals(signum).name

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        """SIGTERM: flush, record ``signal:SIGTERM`` and close, then do what was set before
        (by default, end the process by that same signal). A handler the script set itself
        is called instead, after a flush: the script decides what SIGTERM means."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        mine = os.getpid() == self.pid  # not a forked child (a DataLoader worker)
        if mine and _inside_recorder(frame) and self._wait_for_signal(signum, frame):
            return  # half-way through a write, or through close: back when that is done
        self._pending = None
        if sys.gettrace() is _untraced:  # a _Retake that never fired: tracing off again
            sys.settrace(None)
        if mine and not self.rec.closed:
            if callable(previous):
                self.rec.flush()
            else:
                self.rec.close(schema.STATUS_SIGNAL + signal.Signals(signum).name)
        _pass_on(signum, frame, previous)

    def _wait_for_signal(self, signum: int, frame: Any) -> bool:
        """Take ``signum`` again as soon as ampdoctor's code on the stack has returned.

        The outermost such frame gets a local trace function (``_Retake``) that re-sends the
        signal once that frame has returned (not under a debugger or coverage, which own the
        trace function); a timer re-sends it every RESEND_SECONDS as well, while it is still
        held (a frame the signal landed in at its call event, inside a profile function's
        callback, gets no return event). Either way it waits SIGNAL_PATIENCE seconds at most.
        """
        self._pending = signum
        now = time.monotonic()
        if not self._deadline:
            self._deadline = now + SIGNAL_PATIENCE
        if now > self._deadline:
            return False
        outer = _outermost_recorder_frame(frame)
        if sys.gettrace() is None and outer is not None:
            _Retake(outer, self.pid, signum, self._still_pending)
        # and a timer beside it: a return event never comes to a frame the signal landed in
        # at its call event, inside a profile function's callback (seen under sys.setprofile)
        timer = threading.Timer(RESEND_SECONDS, self._resend_if_pending, (signum,))
        timer.daemon = True
        timer.start()
        return True

    def _still_pending(self, signum: int) -> bool:
        return self._pending == signum

    def _resend_if_pending(self, signum: int) -> None:
        if self._pending == signum:
            _resend(self.pid, signum)

    def _at_exit(self) -> None:
        """The interpreter is exiting with the recorder still open (no ``with``, no close)."""
        if os.getpid() != self.pid or self.rec.closed:
            return
        exc = getattr(sys, "last_value", None)  # set when Python printed an uncaught one
        if exc is not None and exc is not self._last_value_at_start and \
                not isinstance(exc, SystemExit):  # an exit, not a failure
            self.rec.record_exception(type(exc), exc)
            self.rec.close(schema.STATUS_EXCEPTION + type(exc).__name__)
        else:
            self.rec.close()


# Code that changes the recorder's or the writer's state. A signal that lands in it is held
# back until that code is done, so the file is never finished from half-made state.
# That is record/ (the recorder and its helpers, its forensic/ and command/ rooms), runfile/
# (the writer) and what they call: the package's own modules, its numpy side; not live/ or
# preflight/, which run around training code.
_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(_HERE)
_RECORDING_DIRS = (_PACKAGE, _HERE) + tuple(
    os.path.join(_HERE, room) for room in ("forensic", "command")) + tuple(
    os.path.join(_PACKAGE, sub) for sub in ("runfile", "diagnosis", "diagnosis/rules", "release",
                                            "render"))
RECORDING_CODE = frozenset(
    os.path.join(folder, name) for folder in _RECORDING_DIRS for name in os.listdir(folder)
    if name.endswith(".py")
    # patches.py and the doors beside it only hold the wrappers that call into the recorder and
    # then the original (user-facing) function; the launcher and the CLI never run around
    # training code.
    and name not in ("patches.py", "patching.py", "clipdoors.py", "moduledoors.py", "launch.py",
                     "cli.py", "__init__.py", "__main__.py"))


def _inside_recorder(frame: Any) -> bool:
    return _outermost_recorder_frame(frame) is not None


def _outermost_recorder_frame(frame: Any) -> Any:
    outer = None
    while frame is not None:
        if frame.f_code not in _RETAKE_CODE and \
                os.path.abspath(frame.f_code.co_filename) in RECORDING_CODE:
            outer = frame
        frame = frame.f_back
    return outer


class _Retake:
    """Sends a held-back signal again once ``outer`` has returned, as a debugger stops at a
    return: a local trace function on ``outer``, then one on its caller, whose first event
    comes after ``outer`` is off the stack. Tracing is on only until then."""

    def __init__(self, outer: Any, pid: int, signum: int, pending: Callable[[int], bool]):
        self.outer, self.pid, self.signum, self.pending = outer, pid, signum, pending
        outer.f_trace_lines = False
        outer.f_trace = self.on_outer
        sys.settrace(_untraced)

    def on_outer(self, frame: Any, event: str, arg: Any) -> Any:
        if frame is self.outer and event == "return":
            caller = frame.f_back
            if caller is None:
                self.fire()
                return None
            caller.f_trace_lines = True
            caller.f_trace = self.on_caller
        return self.on_outer

    def on_caller(self, frame: Any, event: str, arg: Any) -> None:
        frame.f_trace = None
        self.fire()

    def fire(self) -> None:
        sys.settrace(None)
        if self.pending(self.signum):  # (not taken already, on the timer's resend)
            _resend(self.pid, self.signum)


def _untraced(frame: Any, event: str, arg: Any) -> None:
    return None  # a global trace function that traces no new frame


def _resend(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


# The signal machinery's own frames do not count as "inside the recorder".
_RETAKE_CODE = frozenset(f.__code__ for f in (_Retake.on_outer, _Retake.on_caller, _Retake.fire,
                                              _resend, _untraced))


def _pass_on(signum: int, frame: Any, previous: Any) -> None:
    """Do with a signal what would have been done without ampdoctor."""
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
