"""``ampdoctor top``: a terminal view of a run while it is recorded, refreshed every second.

Drawn with the standard library alone (ANSI escapes, ``termios``, ``select``, ``SIGWINCH``),
not ``rich`` or ``curses``: the view is a page of text redrawn in place, which any terminal an
ssh session reaches understands (VT100 cursor-home and erase; no mouse, no colour needed, 80
columns), and a library would be one more dependency for what is some 40 lines here. curses
would add a terminfo lookup that fails on a terminal type the remote host does not know.

Three ways to run:

* on a terminal: the alternate screen, redrawn in place at each refresh and on a resize; ``q``
  quits, ``0``-``9`` shows that rank, Ctrl-C quits too; the terminal is always put back;
* ``once=True``: one frame as plain text (scripts, tests);
* output not a terminal (a pipe, a log file): a frame each time the run moved on.

The view ends by itself when the run is over: every file has its final status, or its writer
is gone (killed, or stepped aside; see ``follow``). ``top`` returns an ``Outcome`` and the
CLI then prints the diagnosis, the same text as ``ampdoctor diagnose``.

Example::

    outcome = top.top("run.h5")            # blocks until the run ends or q
    outcome.ended, outcome.frame.step
    print("\\n".join(top.render(frame, width=80)))
"""

from __future__ import annotations

import math
import os
import re
import select
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TextIO

import numpy as np

from .. import safe
from ..numfmt import fmt
from . import fp8top
from . import frame as _frame
from .follow import FULL_RANKS, STALE_SECONDS, WAIT_POLL, Follower

SPARK = "▁▂▃▄▅▆▇█"
SPARK_ASCII = "_.,-=+*#"
BAD_MARK = "!"  # a column of the curve that holds a non-finite value
MIN_WIDTH = 40
SITE_WIDTH = 24  # a loss's line (file:line) beside its curve, its end kept


@dataclass
class Outcome:
    """How ``top`` ended: 'final' (the run is over), 'quit' (q), 'interrupt' (Ctrl-C), or
    'once'; the last frame, and the files it followed (what ``diagnose`` should read)."""

    ended: str
    frame: Optional[_frame.Frame] = None
    paths: list = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Drawing a frame as text


def render(fr: _frame.Frame, width: int = 80, height: Optional[int] = None, *,
           unicode: bool = True, color: bool = False, now: Optional[float] = None) -> list[str]:
    """The frame as lines of at most ``width`` characters (and at most ``height`` lines: the
    layer table shrinks first)."""
    width = max(MIN_WIDTH, width)
    now = time.time() if now is None else now
    paint = _painter(color)
    head = _header(fr, now, paint)
    body = _curves(fr, width, unicode) + _skips(fr, paint) + _gradients(fr)
    layers = _layer_table(fr, width, paint) + fp8top.lines(fr, width, paint)
    tail = _event(fr, width) + _ranks(fr) + _reason(fr, width, paint)
    lines = head + [""] + body + [""] + layers + tail
    if height is not None and len(lines) > height:
        cut = len(lines) - height
        keep = max(2, len(layers) - cut)  # the table's title and first row stay longest
        lines = head + [""] + body + [""] + layers[:keep] + tail
    lines = [_finish(line, width, color) for line in lines]
    return lines[:height] if height is not None else lines


def _header(fr: _frame.Frame, now: float, paint: Callable) -> list[str]:
    status = {"gone": "writer gone", "running": "running"}.get(fr.status, fr.status)
    if fr.status.startswith("exception:"):
        status = "raised " + fr.status.split(":", 1)[1]
    elif fr.status.startswith("signal:"):
        status = "stopped by " + fr.status.split(":", 1)[1]
    bad = fr.status not in ("running", "finished")
    where = f"step {fr.step}" if fr.step is not None else "no step yet"
    rate = f"{fr.steps_per_s:.3g} steps/s" if fr.steps_per_s else ""
    age = f"last {_ago(now - fr.last_time)} ago" if fr.last_time and not fr.final else ""
    detail = ", ".join(x for x in (rate, age) if x)
    rank = f" · rank {fr.rank} of {fr.world_size}" if fr.world_size > 1 else ""
    return [paint("bold", f"ampdoctor top · {os.path.basename(fr.path)} · ") +
            paint("red" if bad else "bold", status) + paint("bold", f" · {where}") +
            (f" ({detail})" if detail else ""),
            (fr.precision or "precision not recorded yet") + rank + " · " +
            time.strftime("%H:%M:%S", time.localtime(now))]


def _curves(fr: _frame.Frame, width: int, unicode: bool) -> list[str]:
    if not fr.steps:
        return ["no step recorded yet"]
    s = fr.summary
    loss_note = f"lowest {fmt(s.min_loss)}" if s.min_loss is not None else ""
    scaled = s.init_scale is not None
    scale_note = f"lowest {fmt(s.min_scale)}" if scaled else ""
    each = [(_left_clip(site, SITE_WIDTH), values)
            for site, values in fr.series.get("losses", [])]  # each loss's own, by its line
    note_w = max([len(loss_note), len(scale_note)] + [len(site) for site, _ in each])
    spark_w = max(8, width - 20 - (note_w + 2 if note_w else 0))
    steps = fr.series["step"]
    loss_cols = _frame.buckets(fr.series["loss"], spark_w, "mean")
    lines = [f"{'loss':<8}{fmt(fr.loss):>10}  {sparkline(loss_cols, unicode):<{spark_w}}"
             + (f"  {loss_note}" if loss_note else "")]
    for k, (site, values) in enumerate(each):
        cols = _frame.buckets(values, spark_w, "mean")
        now = float(values[-1]) if len(values) else math.nan
        lines.append(f"{' loss ' + str(k):<8}{fmt(now):>10}  "
                     f"{sparkline(cols, unicode):<{spark_w}}  {site}")
    if scaled:
        # A scale that reached 0 is a value (the bottom of the curve), not a non-finite one.
        cols = _frame.buckets(fr.series["scale"], spark_w, "min",
                              of=lambda p: np.log2(np.maximum(p, 2.0 ** -150)))
        lines.append(f"{'scale':<8}{fmt(fr.scale):>10}  {sparkline(cols, unicode):<{spark_w}}"
                     + f"  {scale_note}")
    first, last = f"step {int(steps[0])}", f"step {int(steps[-1])}"
    span = len(loss_cols)
    axis = first + " " * max(1, span - len(first) - len(last)) + last if span > len(
        first) + len(last) else last
    lines.append(" " * 20 + axis)
    return lines


def sparkline(columns: np.ndarray, unicode: bool = True) -> str:
    """One character per column, scaled between its lowest and highest finite value; ``!``
    where a column held a non-finite value."""
    chars = SPARK if unicode else SPARK_ASCII
    ok = np.isfinite(columns)
    if not ok.any():
        return BAD_MARK * len(columns)
    lo, hi = float(columns[ok].min()), float(columns[ok].max())
    span = hi - lo
    out = []
    for v in columns:
        if not math.isfinite(v):
            out.append(BAD_MARK)
        elif span <= 0:
            out.append(chars[len(chars) // 2])
        else:
            out.append(chars[min(len(chars) - 1, int((v - lo) / span * len(chars)))])
    return "".join(out)


def _skips(fr: _frame.Frame, paint: Callable) -> list[str]:
    s = fr.summary
    if not fr.steps:
        return []
    if s.init_scale is None:
        line = f"{'skipped':<10}{s.skipped} (no GradScaler)"
    else:
        line = f"{'skipped':<10}{s.skipped}" + (
            f" ({s.calibration_skips} while GradScaler calibrated)" if s.calibration_skips
            else "")
        rest = s.steps - s.calibration_skips
        if rest:
            rate = f"{100 * (s.skip_rate or 0):.3g}%"
            over = s.probing_allowance is not None and s.skipped_after > s.probing_allowance
            line += "; after: " + paint("red" if over else "", rate) + \
                f" ({s.skipped_after} of {rest}), probing allows {s.probing_allowance}"
    out = [line]
    bad = []
    if s.nonfinite_loss:
        bad.append(f"loss on {_steps_n(s.nonfinite_loss)} (first {s.first_nonfinite_loss})")
    if s.nonfinite_grad:
        bad.append(f"gradients on {_steps_n(s.nonfinite_grad)} (first "
                   f"{s.first_nonfinite_grad})")
    if bad:
        out.append(paint("red", f"{'nonfinite':<10}" + "; ".join(bad)))
    return out


def _steps_n(n: int) -> str:
    return f"{n} step" + ("" if n == 1 else "s")


def _gradients(fr: _frame.Frame) -> list[str]:
    if not fr.steps:
        return []
    s = fr.summary
    peak = f" (peak {fmt(s.peak_grad_norm)} at step {s.peak_grad_norm_step})" \
        if s.peak_grad_norm is not None else ""
    lrs = fr.lr
    lr = fmt(max(lrs)) if lrs else "-"
    if len(lrs) > 1:
        lr = " ".join(fmt(x) for x in lrs[:4]) + (" ..." if len(lrs) > 4 else "") + \
            f" ({len(lrs)} groups)"
    return [f"{'grad norm':<10}{fmt(fr.grad_norm)}{peak}", f"{'lr':<10}{lr}"]


def _layer_table(fr: _frame.Frame, width: int, paint: Callable) -> list[str]:
    if fr.layer_step is None:
        if fr.every == 0:
            return ["fp16 headroom: no per-layer statistics (recorded with --every 0)"]
        nxt = f" (next at step {fr.next_sampled})" if fr.next_sampled is not None else ""
        return [f"fp16 headroom: no sampled step yet{nxt}"]
    every = f", every {fr.every} steps" if fr.every else ""
    lines = [f"fp16 headroom at step {fr.layer_step} (per-layer statistics{every}):"]
    name_w = max(12, width - 2 - 18 - 9 - 11 - 8 - 10)
    lines.append(f"  {'layer':<{name_w}}{'kind':<18}{'abs max':>9}{'headroom':>11}"
                 f"{'trend':>8}{'underflow':>10}")
    for x in fr.layers:
        room = "non-finite" if math.isnan(x.headroom) else (
            "overflow" if x.headroom <= 0 else f"2^{x.headroom:.1f}")
        under = f"{100 * x.underflow:.0f}%" if x.underflow else "-"
        kind = x.kind + (" *" if x.scaled else "")
        name = _left_clip(safe.terminal(x.name), name_w - 1)  # its escaped width is shown
        row = (f"  {name:<{name_w}}{kind:<18}{fmt(x.absmax):>9}"
               f"{room:>11}{_trend(x.trend):>8}{under:>10}")
        lines.append(paint("red", row) if (math.isnan(x.headroom) or x.headroom <= 1
                                            or x.underflow >= 0.5) else row)
    if fr.nonfinite_layers > 1:
        lines.append(f"  {fr.nonfinite_layers} layers hold NaN/inf on this step; the first "
                     "is shown")
    if any(x.scaled for x in fr.layers):
        lines.append("  * gradients as fp16 held them, multiplied by the loss scale")
    if any(x.trend is not None for x in fr.layers):
        lines.append("  trend: doublings per 100 steps over the last sampled steps")
    if fr.forecast:
        lines += [paint("red", x) for x in _wrap(f"warning: {fr.forecast}", width - 2, "  ")]
    return lines


def _trend(per_100: Optional[float]) -> str:
    """``+2.1``: doublings per 100 steps (the abs max x4.3 every 100 steps); ``-``: no fit
    yet (fewer sampled steps than the forecast needs)."""
    return "-" if per_100 is None else f"{per_100:+.1f}"


def _event(fr: _frame.Frame, width: int) -> list[str]:
    e = fr.event
    if e is None:
        return ["forensics: no replay yet (one runs when a step goes non-finite)"]
    many = f", {e.replays} so far" if e.replays > 1 else ""
    return [f"forensics (latest replay{many}):"] + _wrap(e.text, width - 2, "  ")


RANKS_LISTED = 8  # more rank files than this are shown as counts, not one by one


def _ranks(fr: _frame.Frame, now: Optional[float] = None) -> list[str]:
    if not fr.ranks:
        return []
    if len(fr.ranks) > RANKS_LISTED:
        return _many_ranks(fr, time.time() if now is None else now)
    parts = [f"{r.rank}: step {r.step if r.step is not None else '-'} {r.status}"
             + (f", non-finite from {r.first_bad}" if r.first_bad is not None else "")
             for r in fr.ranks]
    return ["ranks     " + " · ".join(parts)]


def _many_ranks(fr: _frame.Frame, now: float) -> list[str]:
    """A large job in two lines: how many ranks are where, and which went non-finite."""
    from ..diagnosis.ranks import ranks_text

    by_status: dict[str, list] = {}
    for r in fr.ranks:
        by_status.setdefault(r.status, []).append(r)
    parts = []
    for status, rs in sorted(by_status.items(), key=lambda kv: -len(kv[1])):
        steps = [r.step for r in rs if r.step is not None]
        at = "" if not steps else f" at step {min(steps)}" if min(steps) == max(steps) else \
            f" at steps {min(steps)}-{max(steps)}"
        parts.append(f"{len(rs)} {status}{at}")
    head = f"ranks     {len(fr.ranks)} of {fr.world_size}: " + ", ".join(parts)
    if fr.summarized is not None:
        head += f" (from their summaries, read within {_ago(now - fr.summarized)})"
    bad = sorted((r for r in fr.ranks if r.first_bad is not None),
                 key=lambda r: (r.first_bad, r.rank))
    if not bad:
        return [head]
    first = bad[0].first_bad
    at_first = [r.rank for r in bad if r.first_bad == first]
    return [head, f"{'':10}non-finite from step {first} on {ranks_text(at_first, 8)}"
            + (f"; {len(bad) - len(at_first)} more ranks later" if len(bad) > len(at_first)
               else "")]


def _reason(fr: _frame.Frame, width: int, paint: Callable) -> list[str]:
    return [paint("red", line) for line in _wrap(fr.reason, width, "")] if fr.reason else []


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"


def _wrap(text: str, width: int, indent: str) -> list[str]:
    words, lines, line = text.split(), [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            lines.append(indent + line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    return lines + ([indent + line] if line else [])


def _left_clip(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


_ESC = "\x1b["
_STYLES = {"bold": "1", "red": "31"}
# paint marks its styles with a Unicode noncharacter (U+FDD0, never in interchanged text) and
# _finish turns the marks into colour after every text between them has been escaped: an
# escape sequence in a name is written out like any other, whatever ``color`` says. A mark a
# name forges can only be one of these (bold, red, plain), never hide or move anything.
_MARK = re.compile("\ufdd0(0|1|31)\ufdd1")


def _painter(color: bool) -> Callable[[str, str], str]:
    def paint(style: str, text: str) -> str:
        if not color or style not in _STYLES or not text:
            return text
        return f"\ufdd0{_STYLES[style]}\ufdd1{text}\ufdd00\ufdd1"
    return paint


def _finish(line: str, width: int, color: bool = False) -> str:
    """The line as the terminal gets it: its text escaped (``safe.terminal``: names come from
    the run file), at most ``width`` visible characters of it, paint's marks made colour."""
    parts, out, seen = _MARK.split(line), [], 0
    for i, part in enumerate(parts):
        if i % 2:
            out.append(f"{_ESC}{part}m" if color else "")
            continue
        shown = safe.terminal(part)[:max(0, width - seen)]
        out.append(shown)
        seen += len(shown)
    tail = f"{_ESC}0m" if color and len(parts) > 1 else ""
    return "".join(out).rstrip() + tail


def waiting(path: str, waited: float, limit: float) -> list[str]:
    """The screen shown while no file of the run exists yet."""
    stem, ext = os.path.splitext(path)
    return [f"ampdoctor top · {path} · waiting for the file ({waited:.0f} s of {limit:g} s)",
            "",
            f"nothing at {path} or {stem}.rank*{ext} yet; a recording writes it once training "
            "starts:",
            f"  ampdoctor record -o {path} -- python train.py"]


# ---------------------------------------------------------------------------------------------
# The terminal


class Screen:
    """The terminal while the view is up: alternate screen, no cursor, keys read one by one
    without echo (cbreak: Ctrl-C still interrupts), and a wake-up on resize. Everything is
    put back on exit, whatever ended the view."""

    def __init__(self, out: TextIO, keys: Optional[TextIO]):
        self.out = out
        self.keys = keys if keys is not None and keys.isatty() else None
        self._saved: Any = None
        self._signals: dict = {}
        self._wake: Optional[tuple[int, int]] = None
        self._old_wakeup = -1

    def __enter__(self) -> "Screen":
        if self.keys is not None:
            import termios
            import tty

            fd = self.keys.fileno()
            self._saved = termios.tcgetattr(fd)
            tty.setcbreak(fd)
        self._catch_signals()
        self.out.write(f"{_ESC}?1049h{_ESC}?25l{_ESC}H{_ESC}2J")
        self.out.flush()
        return self

    def _catch_signals(self) -> None:
        if hasattr(signal, "SIGWINCH") and _main_thread():
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._wake = (r, w)
            self._old_wakeup = signal.set_wakeup_fd(w)
            self._signals[signal.SIGWINCH] = signal.signal(signal.SIGWINCH, lambda *a: None)
        if _main_thread():
            # A SIGTERM or a hang-up must still put the terminal back: end like Ctrl-C.
            for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
                if sig is not None:
                    self._signals[sig] = signal.signal(sig, _interrupt)

    def __exit__(self, *exc: Any) -> None:
        try:
            self.out.write(f"{_ESC}?25h{_ESC}?1049l")
            self.out.flush()
        except (OSError, ValueError):
            pass
        if self._saved is not None:
            import termios

            termios.tcsetattr(self.keys.fileno(), termios.TCSADRAIN, self._saved)
        for sig, old in self._signals.items():
            signal.signal(sig, old)
        if self._wake is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            for fd in self._wake:
                os.close(fd)

    def size(self) -> tuple[int, int]:
        try:
            cols, rows = os.get_terminal_size(self.out.fileno())
        except (OSError, ValueError):
            cols, rows = shutil.get_terminal_size()
        return cols, rows

    def draw(self, lines: list[str]) -> None:
        # Home, then each line over the old one and erased to its end; no full clear, so
        # nothing flickers over a slow link.
        text = f"{_ESC}H" + f"{_ESC}K\r\n".join(lines) + f"{_ESC}K{_ESC}J"
        self.out.write(text)
        self.out.flush()

    def wait(self, timeout: float) -> Optional[str]:
        """A key pressed, 'resize', or None when ``timeout`` passed."""
        fds = ([self.keys] if self.keys is not None else []) + \
            ([self._wake[0]] if self._wake else [])
        ready = select.select(fds, [], [], max(0.0, timeout))[0] if fds else \
            time.sleep(timeout) or []
        if self._wake and self._wake[0] in ready:
            try:
                os.read(self._wake[0], 512)
            except BlockingIOError:
                pass
            return "resize"
        if self.keys is not None and self.keys in ready:
            return os.read(self.keys.fileno(), 1).decode(errors="replace") or None
        return None


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# ---------------------------------------------------------------------------------------------
# The loop


@dataclass
class Options:
    interval: float = 1.0  # seconds between refreshes
    wait: float = 60.0  # seconds to wait for a file that does not exist yet
    stale: float = STALE_SECONDS  # see follow.STALE_SECONDS
    rank: Optional[int] = None  # the rank to show (default: the first to go non-finite)
    unicode: Optional[bool] = None  # sparkline blocks (default: when the output is UTF-8)


def top(path: str, *, once: bool = False, options: Optional[Options] = None,
        out: Optional[TextIO] = None, keys: Optional[TextIO] = None) -> Outcome:
    """Follow the run at ``path`` and show it until it ends (see the module docstring).

    Raises ``RunNotFoundError`` when no file of the run appears within ``options.wait``
    seconds, and ``RunFileError`` for a file that is not a readable run.
    """
    opts = options or Options()
    out = out or sys.stdout
    keys = keys if keys is not None else sys.stdin
    follower = Follower(path, stale=opts.stale, full_ranks=FULL_RANKS)
    interactive = not once and out.isatty() and os.environ.get("TERM") != "dumb"
    unicode = opts.unicode if opts.unicode is not None else \
        "utf" in (getattr(out, "encoding", "") or "").lower()
    try:
        if not interactive:
            return _plain(follower, path, opts, out, once, unicode)
        with Screen(out, keys) as screen:
            outcome = _interactive(follower, path, opts, screen, unicode)
        if outcome.ended == "final":  # the alternate screen is gone: leave the last frame
            width = shutil.get_terminal_size().columns
            out.write("\n".join(render(outcome.frame, width, unicode=unicode)) + "\n")
            out.flush()
        return outcome
    finally:
        follower.close()


def _build(follower: Follower, path: str, opts: Options,
           last: Optional[_frame.Frame]) -> Optional[_frame.Frame]:
    """Poll; a new frame when the run changed (or another rank is asked for), else ``last``."""
    follower.focus = opts.rank  # a large job follows the shown rank alone in full
    follower.poll()
    states = follower.states
    if not states:
        return None
    key = (follower.signature(), opts.rank)
    if last is not None and getattr(last, "_key", None) == key:
        return last
    fr = _frame.build(states, rank=opts.rank, path=path, final=follower.final,
                      summaries=follower.summaries)
    fr._key = key
    return fr


def _plain(follower: Follower, path: str, opts: Options, out: TextIO, once: bool,
           unicode: bool) -> Outcome:
    follower.wait(opts.wait)
    width = shutil.get_terminal_size().columns
    shown: Any = None
    fr = None
    try:
        while True:
            fr = _build(follower, path, opts, fr) or fr
            if fr is not None and (once or fr.final or (fr.steps, fr.status, fr.reason)
                                   != shown):
                shown = (fr.steps, fr.status, fr.reason)
                out.write("\n".join(render(fr, width, unicode=unicode)) + "\n")
                if not once and not fr.final:
                    out.write("\n")
                out.flush()
            if once:
                return Outcome("once", fr, follower.files())
            if fr is not None and fr.final:
                return Outcome("final", fr, follower.files())
            time.sleep(opts.interval)
    except KeyboardInterrupt:
        return Outcome("interrupt", fr, follower.files())


def _interactive(follower: Follower, path: str, opts: Options, screen: Screen,
                 unicode: bool) -> Outcome:
    fr = None
    try:
        def show(waited: float) -> Optional[str]:
            cols, rows = screen.size()
            screen.draw([_finish(x, cols) for x in waiting(path, waited, opts.wait)][:rows])
            key = screen.wait(WAIT_POLL)
            return key if key in ("q", "Q") else None

        if follower.wait(opts.wait, show) in ("q", "Q"):
            return Outcome("quit", None, [])
        while True:
            fr = _build(follower, path, opts, fr) or fr
            key = None
            while True:
                if fr is not None:
                    cols, rows = screen.size()
                    lines = render(fr, cols, rows - 1, unicode=unicode, color=True)
                    screen.draw(lines + [_footer(fr, opts, cols)])
                if fr is not None and fr.final:
                    return Outcome("final", fr, follower.files())
                key = screen.wait(opts.interval)
                if key in ("q", "Q"):
                    return Outcome("quit", fr, follower.files())
                if key is not None and key.isdigit():
                    opts.rank = int(key)
                    break
                if key != "resize":
                    break
    except KeyboardInterrupt:
        return Outcome("interrupt", fr, follower.files())


def _footer(fr: _frame.Frame, opts: Options, width: int) -> str:
    ranks = " · 0-9 rank" if fr.world_size > 1 else ""
    return _finish(f"q quit{ranks} · refresh {opts.interval:g} s", width)
