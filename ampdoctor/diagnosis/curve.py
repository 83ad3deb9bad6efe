"""The loss curve: where it started, where it ended, how noisy it is, and whether it blew up.

numpy only (no torch). ``read(loss)`` takes the per-step losses of a run (NaN where none was
seen) and answers the questions the "failed without a NaN" rules ask: did the loss jump far
above everything before it (a spike), did it come back afterwards, and did the run end lower
than it began. Every decision is relative to the run's own noise, so a noisy but training loss
is not mistaken for a blow-up.

Example::

    c = curve.read(run.steps["loss"])
    if c.spike is not None and c.stuck:
        print(f"the loss jumped {c.spike.jump:.0f}x at index {c.spike.index} and stayed up")

Indices are positions in the array given (``run.steps`` rows), not step numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

# Fewer finite losses than this and nothing is judged: a spike needs steps before it to be
# measured against, and steps after it to show whether it recovered.
MIN_STEPS = 20
# The starting level is the median of the first few losses (fewer when a spike comes earlier):
# one step is as noisy as the batch it saw, five are not.
START_STEPS = 5
# A spike is measured against the median of the ten losses before it.
BEFORE_STEPS = 10
# A spike: the loss jumps to >= 10x the median of the steps before it AND >= 10x where the run
# started. The second half keeps a converged loss (0.002 -> 0.05, "25x") from counting: a
# blow-up goes far above where training began. 10x is an order of magnitude: healthy curves
# reach it only on a single freak batch, which the recovery test below then clears.
SPIKE = 10.0
# A spike the run came back from is told from 5x (on a healthy verdict: a note, a lower
# confidence, the LR fix as optional), when it rose above half where the run started (a
# converged loss's freak batch, 0.01 -> 0.06, is not one).
RECOVERED = 5.0
RECOVERED_OVER_START = 0.5
# ... and beyond the run's own noise: a jump of >= 5 robust standard deviations of the
# per-step log-loss (so a loss that varies 3x from batch to batch needs a far larger jump).
SPIKE_SIGMAS = 5.0
# A loss whose step-to-step change has a robust standard deviation of 1 (in log; batches that
# differ ~3x routinely: batch size 1, reinforcement learning) is too noisy to judge at all; on
# synthetic rising curves that noisy, a few in a hundred met the tests below.
NOISY = 1.0
# The end of the run is the median of its last tenth (at least five steps).
TAIL_SHARE = 0.1
MIN_TAIL = 5
# After a spike at least this many steps must follow before "it never recovered" is said.
MIN_AFTER = 10
# Not recovered: the end of the run sits >= 3x above the level before the spike, and that gap
# is >= 4 standard errors of the two medians compared (noisy curves need a wider gap). 3x, not
# 2x: a loss that rises over a run by design (KL annealing, a curriculum) plus one freak batch
# must not read as a blow-up (measured on synthetic curves: tests/diagnosis/rules/test_progress.py).
STUCK = 3.0
STUCK_SIGMAS = 4.0
# "Stayed up" is asked of 3 in 4 of the steps of a stretch (its 25th percentile), not of its
# median: a stretch of 10 that holds a 5-step freak jump has a median in the jump.
MOST = 0.25
# "Ended where it began": the end of the run is no lower than half the starting level. A
# training run that learns anything halves its loss; a dead or diverged one hovers at the
# level of its initial (or a constant) prediction.
NO_PROGRESS = 0.5
# Climbed: with no single jump, the end of the run sits >= 10x above where it began (and 4
# standard errors above it): the loss rose step by step and stayed up. Healthy curves that rise
# by design (KL annealing, a curriculum) rise 1.5-3x; a GAN's generator loss can climb further,
# which is the one known way for a healthy run to meet this.
CLIMB = 10.0
# Did it learn? The loss fell when it ended more than 10 % below where it began (FLAT_END)
# AND the fall is at least FALL_SIGMAS standard errors of the two medians compared (from the
# run's own step-to-step noise): a noisy loss must fall further before the fall counts. Three
# comparisons, any one enough: the start (first few steps) against the end (last tenth), which
# sees a loss that fell fast; the first third against the last third, whose medians of many
# steps see a steady fall through noise that hides it at the ends; and the first loss alone
# against the end, which sees one that converged within its first few steps (so that the
# first five are at its floor already). That last one asks for a real fall, below NO_PROGRESS
# of the first loss: one step is as noisy as its batch, and a loss that fell in its first steps
# and rose back to chance (a hidden overflow zeroing the model's output: 2.33 -> 1.29 -> 2.08,
# ln 8) ends 10 % below its first loss without having learned anything. Every
# recorded fixture of 50 steps or more that trains ends at 0.54 of its start or below (the
# slowest, masked_underflow's --fix; the rest at 0.30 or less), the runs that do not learn at
# 0.94 to 1.03 (docs/verdicts.md, "Did it learn?").
FLAT_END = 0.9
FALL_SIGMAS = 1.5
# ... or it fell steadily: each third's median below the one before, and from the first third
# to the last by STEADY_NOISE times its step-to-step noise or more (and by STEADY_MIN at
# least, past any rounding of the loss), however small the fall. A loss that falls on every
# step by 0.08 %, 9 % in 120 steps with no noise at all (a full-batch regression at a small
# LR), learned; a flat loss at 5 % noise would need a fall of 25 % to pass, and one of the
# runs that do not learn (0.94 to 1.03 of their start, at several % of noise) does not.
STEADY_NOISE = 5.0
STEADY_MIN = 0.005
# The rise that led into a spike began where the loss first passed 2x the level before it.
RISE = 2.0
# A long excursion: after a spike it came back from, the loss stood STUCK x or more above its
# level before the spike on half or more of the steps after it (and on MIN_AFTER steps at
# least). A freak batch, or a blow-up the run shakes off, lasts a few steps; a run that spends
# most of itself far above where it was trained nothing in that time (litgpt at LR 10: 20-300x
# its start for 30 of 40 steps, back to 1.5x only as the cosine schedule brought the LR down).
EXCURSION_SHARE = 0.5
# 1.4826 * MAD estimates a normal standard deviation; diffs of iid noise have sqrt(2) of it.
_MAD_TO_SIGMA = 1.4826 / math.sqrt(2.0)
# A median of k noisy values has ~1.25/sqrt(k) of their spread (normal efficiency).
_MEDIAN_SE = 1.2533


@dataclass
class Spike:
    """A jump of the loss far above what came before it."""

    index: int  # where the loss first stood >= SPIKE x the level before
    onset: int  # where the rise into it began (the loss passed RISE x the level before)
    before: float  # median of the losses before the rise
    value: float  # the loss at ``index``
    peak: float  # the largest loss from ``index`` on, over the next BEFORE_STEPS steps
    peak_index: int

    @property
    def jump(self) -> float:
        return self.value / self.before if self.before > 0 else math.inf


@dataclass
class Curve:
    """What the loss curve says. ``judged`` is False when it cannot say (``why``)."""

    n: int  # finite positive losses
    judged: bool = False
    why: str = ""
    start: float = math.nan  # median of the first losses (before any spike)
    end: float = math.nan  # median of the last TAIL_SHARE of the run
    tail_steps: int = 0
    noise: float = math.nan  # robust standard deviation of the per-step change of log(loss)
    spike: Optional[Spike] = None  # the first spike after which the loss stayed up, else
    # the first spike of all
    stuck: bool = False  # the loss never came back after ``spike``
    spikes: list = field(default_factory=list)  # every spike, in order
    climbed: bool = False  # no spike stayed up, but the loss rose >= CLIMB x and stayed there
    climb_onset: int = -1  # where the climb began (the loss last stood < RISE x its start)
    best_after: float = math.nan  # lowest 5-step median after the spike
    start_steps: int = 0  # losses the start level is the median of
    recovered: Optional[Spike] = None  # the largest jump of RECOVERED x or more it came back from
    excursion: Optional[Spike] = None  # a spike it came back from only after a long stretch up
    excursion_steps: int = 0  # steps after it at STUCK x or more its level before
    excursion_after: int = 0  # steps after it

    @property
    def flat(self) -> bool:
        """The run ended no lower than NO_PROGRESS x where it began."""
        return self.judged and self.end >= NO_PROGRESS * self.start

    first: float = math.nan  # the first finite loss
    early: float = math.nan  # median of the first third of the losses
    mid: float = math.nan  # ... of the middle third
    late: float = math.nan  # ... and of the last third
    third: int = 0  # losses in each third

    @property
    def fall_se(self) -> float:
        """Standard error of log(start / end), from the per-step noise and the number of
        losses each median is taken over."""
        return _fall_se(self.noise, self.start_steps, self.tail_steps)

    @property
    def fell(self) -> bool:
        """The loss fell: from its start to its end, or from its first third to its last,
        below FLAT_END x, or from its first loss to its end below NO_PROGRESS x (a loss that
        converged in its first steps), each by at least FALL_SIGMAS standard errors. False
        also when the curve is not judged (``judged`` says why)."""
        if not self.judged:
            return False
        return _fell(self.start, self.end, self.fall_se) or _fell(
            self.early, self.late, _fall_se(self.noise, self.third, self.third)) or _fell(
            self.first, self.end, _fall_se(self.noise, 1, self.tail_steps), NO_PROGRESS) \
            or self.steady

    @property
    def steady(self) -> bool:
        """The loss fell steadily: third after third, by STEADY_NOISE x its step-to-step noise
        (and STEADY_MIN) or more from the first third to the last, however small."""
        if not (self.judged and self.early > self.mid > self.late > 0):
            return False
        drop = math.log(self.early / self.late)
        return drop >= max(STEADY_NOISE * self.noise, -math.log(1.0 - STEADY_MIN),
                           FALL_SIGMAS * _fall_se(self.noise, self.third, self.third))


def _fall_se(sigma: float, a: int, b: int) -> float:
    """Standard error of the log ratio of two medians of ``a`` and ``b`` losses."""
    return _MEDIAN_SE * sigma * math.sqrt(1.0 / max(a, 1) + 1.0 / max(b, 1))


def _fell(before: float, after: float, se: float, below: float = FLAT_END) -> bool:
    """``after`` is under ``below`` x ``before``, by FALL_SIGMAS standard errors ``se``."""
    if not (before > 0 and after > 0) or not after < below * before:
        return False
    return math.log(before / after) >= FALL_SIGMAS * se


def noise(log_loss: np.ndarray) -> float:
    """Robust per-step noise of a log-loss curve: MAD of its first differences, as a normal
    standard deviation. A trend, a spike or a few outliers barely move it."""
    d = np.diff(log_loss)
    if len(d) < 5:
        return 0.0
    # (in place: a median is the same whatever the order its partition leaves behind, and a
    # month-long curve's differences are 80 MB a copy)
    d -= np.median(d, overwrite_input=True)
    return float(_MAD_TO_SIGMA * np.median(np.abs(d, out=d), overwrite_input=True))


def median(x: np.ndarray) -> float:
    """``np.median(x.astype(np.float64))`` for float32 ``x``, the same number, without a
    float64 copy of 10^7 values: the middle one or two found in ``x`` itself, widened."""
    k = len(x) // 2
    middle = [k - 1, k] if len(x) % 2 == 0 else [k]
    part = np.partition(x, middle)[middle[0]:k + 1].astype(np.float64)
    return float(np.mean(part))


def read(loss: np.ndarray) -> Curve:
    """Judge a per-step loss array (NaN where no loss was seen; those steps are left out)."""
    loss = np.asarray(loss)
    finite = np.isfinite(loss)
    # each finite loss's step position (every position where all are: no index array of a
    # month-long run), and the losses in float64 (a float32 loss widens exactly)
    where: Any = range(len(loss)) if finite.all() else np.flatnonzero(finite)
    del finite
    values = np.asarray(loss if isinstance(where, range) else loss[where], np.float64)
    c = Curve(n=len(values))
    if len(values) < MIN_STEPS:
        c.why = f"only {len(values)} finite losses (a verdict on the curve needs {MIN_STEPS})"
        return c
    if np.any(values <= 0):
        c.why = "the loss is not always positive, so its ratios mean nothing"
        return c
    c.noise = noise(np.log(values))
    if c.noise >= NOISY:
        c.why = (f"the loss changes by a factor of ~{math.exp(c.noise):.1f} from one step to the "
                 "next (one batch against another): too noisy to tell a blow-up from a batch")
        return c
    c.judged = True
    c.tail_steps = max(MIN_TAIL, int(len(values) * TAIL_SHARE))
    c.end = float(np.median(values[-c.tail_steps:]))
    spikes = _spikes(values, c.noise)
    first = spikes[0] if spikes else None
    for s in spikes:
        if _stuck(values, s, c.noise, c.tail_steps):
            first, c.stuck = s, True
            break
    head = min(START_STEPS, first.onset) if first is not None else START_STEPS
    c.start_steps = max(head, 1)
    c.start = float(np.median(values[:c.start_steps]))
    c.first = float(values[0])
    c.third = len(values) // 3
    c.early = float(np.median(values[:c.third]))
    c.mid = float(np.median(values[c.third:len(values) - c.third]))
    c.late = float(np.median(values[-c.third:]))
    if not c.stuck:
        onset = _climb(values, c.start, c.end, c.noise, c.tail_steps)
        if onset is not None:
            c.climbed, c.climb_onset = True, int(where[onset])
    c.spikes = [_positions(s, where) for s in spikes]
    back = [s for s in _spikes(values, c.noise, RECOVERED, RECOVERED_OVER_START)
            if not _stuck(values, s, c.noise, c.tail_steps)]
    if back and not (c.stuck or c.climbed):
        c.recovered = _positions(max(back, key=lambda s: s.jump), where)
    if not (c.stuck or c.climbed):
        _excursion(c, values, spikes, where)
    if first is not None:
        c.spike = _positions(first, where)
        after = values[first.index + 1:]
        if len(after) >= 5:
            c.best_after = float(np.min(_rolling_median(after, 5)))
    return c


def _spikes(v: np.ndarray, sigma: float, at_least: float = SPIKE,
            over_start: float = SPIKE) -> list[Spike]:
    """Every spike, in order: ``at_least`` x the level before it, ``over_start`` x where the
    run started. Candidates are found vectorised; the medians are taken only there, so a
    million steps take a fraction of a second."""
    n = len(v)
    need = max(at_least, math.exp(SPIKE_SIGMAS * sigma))
    prev_min = np.full(n, np.inf)
    for k in range(1, BEFORE_STEPS + 1):  # running min of the previous BEFORE_STEPS values
        prev_min[k:] = np.minimum(prev_min[k:], v[:-k])
    # Necessary conditions, vectorised: >= need x the smallest loss before it (its level is no
    # lower) and, from START_STEPS on, >= SPIKE x the starting level (a constant there).
    cand = v >= need * prev_min
    cand[START_STEPS:] &= v[START_STEPS:] >= over_start * float(np.median(v[:START_STEPS]))
    out: list[Spike] = []
    for candidate in np.flatnonzero(cand):
        i = int(candidate)
        if i < 1 or n - i <= MIN_AFTER or (out and i <= out[-1].peak_index):
            continue  # no steps before or after it, or the same blow-up still going
        if v[i] < need * _level(v, i) or v[i] < over_start * float(
                np.median(v[:min(START_STEPS, i)])):
            continue
        onset = i
        while onset > 1 and i - onset < BEFORE_STEPS and v[onset - 1] >= RISE * _level(
                v, onset - 1):
            onset -= 1  # the step before was already a jump of its own: the rise began there
        window = v[i:i + BEFORE_STEPS]
        peak = int(np.argmax(window))
        out.append(Spike(index=i, onset=onset, before=_level(v, onset), value=float(v[i]),
                         peak=float(window[peak]), peak_index=i + peak))
    return out


def _excursion(c: Curve, v: np.ndarray, spikes: list[Spike], where: np.ndarray) -> None:
    """The first spike after which the loss stood STUCK x its level before on
    EXCURSION_SHARE of the steps that follow (``Curve.excursion``)."""
    for s in spikes:
        after = v[s.index:]
        up = int(np.count_nonzero(after >= STUCK * s.before))
        if up >= MIN_AFTER and up >= EXCURSION_SHARE * len(after):
            c.excursion, c.excursion_steps, c.excursion_after = _positions(s, where), up, len(after)
            return


def _level(v: np.ndarray, i: int) -> float:
    """The loss level just before index ``i``: the median of up to BEFORE_STEPS losses."""
    return float(np.median(v[max(0, i - BEFORE_STEPS):i]))


def _stuck(v: np.ndarray, s: Spike, sigma: float, tail_steps: int) -> bool:
    """The loss stayed up: both right after the spike and at the end of the run it is >= STUCK
    x (and STUCK_SIGMAS standard errors above) the level before the spike. Right after: a loss
    that drifts up over the run by design, plus one freak batch, is not stuck. The error of
    each median comes from the whole run's noise (after a blow-up the curve is chaotic, which
    only makes this test stricter)."""
    tail = v[max(s.index + 1, len(v) - tail_steps):]
    after = v[s.peak_index + 1:s.peak_index + 1 + MIN_AFTER]
    if len(tail) < MIN_TAIL or len(after) < MIN_TAIL or s.before <= 0:
        return False
    pre = max(1, min(BEFORE_STEPS, s.onset))
    for part in (after, tail):
        se = _MEDIAN_SE * sigma * math.sqrt(1.0 / pre + 1.0 / len(part))
        if _most(part) < max(STUCK, math.exp(STUCK_SIGMAS * se)) * s.before:
            return False
    return True


def _most(part: np.ndarray) -> float:
    """A level that most (3 in 4) of the steps reach: a few steps of a second jump inside the
    stretch do not lift it, as they would lift a mean or even a median of 10."""
    return float(np.quantile(part, MOST))


def _climb(v: np.ndarray, start: float, end: float, sigma: float, tail_steps: int
           ) -> Optional[int]:
    """Where a climb to the end began, when the end is >= CLIMB x the start (noise-adjusted):
    the step after the 5-step median last stood below RISE x the start. Rolling medians are
    centred, so index i stands for the 5 steps i..i+4."""
    late = v[-max(2 * MIN_AFTER, tail_steps):]  # >= 20 steps: not a jump the run ended in
    se = _MEDIAN_SE * sigma * math.sqrt(1.0 / START_STEPS + 1.0 / len(late))
    if _most(late) < max(CLIMB, math.exp(STUCK_SIGMAS * se)) * start:
        return None
    low = np.flatnonzero(_rolling_median(v, 5) < RISE * start)
    onset = int(low[-1]) + 1 if len(low) else 0
    return onset if len(v) - onset >= max(MIN_AFTER, tail_steps) else None


def _rolling_median(v: np.ndarray, k: int) -> np.ndarray:
    if len(v) < k:
        return np.array([np.median(v)])
    return np.median(np.lib.stride_tricks.sliding_window_view(v, k), axis=1)


def _positions(s: Spike, where: np.ndarray) -> Spike:
    """Indices into the finite losses -> indices into the array given."""
    return Spike(index=int(where[s.index]), onset=int(where[s.onset]), before=s.before,
                 value=s.value, peak=s.peak, peak_index=int(where[s.peak_index]))
